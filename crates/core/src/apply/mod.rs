//! The applier: the one place where bytes from any source land.
//!
//! Sources hand it batches of [`Chunk`]s (source tensor, byte range, where
//! the bytes are). For every chunk it checks the range against the plan, so
//! a source can never make it write outside a planned tensor or write a byte
//! twice, and classifies it once into a route (`route.rs`): copied where the
//! tensor is received, already landed there by the source, a zero-copy view
//! for the callback (host or GPU memory), a device-to-device copy, or bytes
//! a source wrote into a GPU param itself (gdr). Then it copies the batch's
//! chunks in parallel, verifies the checksum of every tensor the batch
//! completed (`verify.rs`), passes finished tensors on to device params
//! (`upload.rs`) or the engine's callback (`callback.rs`) and reports
//! progress. The plan's [`Run`](crate::plan::Run)s map a tensor's bytes to
//! its param's.
//!
//! Files: `batch.rs` (one batch, a function per route), `receive.rs` (where
//! a tensor's bytes are received), `spans.rs` (received bytes to param
//! bytes, walking an entry's segments once per batch), `commit.rs` (the end of an update),
//! `failure.rs` (what a failed update left), `types.rs`, `progress.rs`.
//!
//! Modes:
//! - **atomic**: every tensor is staged in one library arena (memory = the
//!   update's size) and params are written only in [`Applier::finish`], after
//!   every tensor arrived and verified. Any failure before that leaves the old
//!   weights untouched.
//! - **in-place**: bytes go straight into params (no extra memory); a failure
//!   after the first byte moved leaves params half-written, which the manager
//!   reports as FAILED.
//!
//! Bounds: a tensor's size is the source's word (a peer's manifest). For a
//! param the plan checked it against the registered param; a tensor for
//! the per-tensor callback has no param behind it, so before anything is
//! allocated it is checked against `ApplyOptions::callback_staging_limit`
//! (`memory::loose`): over it, `WM_ERR_OUT_OF_MEMORY` naming the tensor.
//!
//! Timings: `receive` is the time to bring every byte into library-visible
//! memory (the params themselves in-place, the arena when atomic), including
//! checksums; `commit` is the time to make them the engine's weights (arena to
//! params, callbacks).

mod arena;
mod batch;
mod callback;
mod commit;
mod device_swap;
mod failure;
mod progress;
mod receive;
mod route;
mod spans;
mod types;
mod upload;
mod verify;

#[cfg(test)]
mod tests;

pub use crate::registry::Dest;
pub use arena::AtomicStaging;
pub use failure::{ApplyFailure, Weights};
pub use progress::Progress;
pub use types::{
    Applied, ApplyOptions, Chunk, DeviceBytes, Hooks, Mode, ProgressHook, TensorHook, TensorView,
};

use crate::checksum::Checksum;
use crate::memory::host::HostRegion;
use crate::memory::loose::{check_callback_staging, LooseBuffers};
use crate::memory::pinned::PinnedBuffer;
use crate::memory::staging::DeviceStaging;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use arena::Arena;
use device_swap::DeviceShadows;
use std::collections::HashMap;
use std::time::Instant;

pub struct Applier<'p, 'h> {
    plan: &'p Plan,
    opts: ApplyOptions,
    hooks: Hooks<'h>,
    /// Per plan entry: the param's memory, for `Target::Param`.
    params: Vec<Option<Dest>>,
    /// Atomic mode: a shadow per target param, a slot per callback tensor.
    arena: Option<Arena>,
    /// Atomic mode: per param number, the library-owned region its shadow
    /// is swapped into at commit.
    swappable: Vec<Option<&'p HostRegion>>,
    /// Atomic mode: shadows of library-owned device params, swapped in at
    /// commit (`device_swap.rs`).
    device_shadows: DeviceShadows<'p>,
    /// Atomic mode: where the arena's packed region is kept for the next
    /// update (None: freed).
    keep: Option<&'p mut Option<HostRegion>>,
    /// In-place mode: callback and device tensors being received (and a
    /// spare buffer kept for the next one).
    loose: LooseBuffers,
    /// In-place mode: device tensors landing in pinned memory.
    pinned: HashMap<usize, PinnedBuffer>,
    /// Pinned buffers and upload streams for device params (the manager's,
    /// kept across updates).
    staging: Option<&'p mut DeviceStaging>,
    /// gdr, in place: a source writes device params' bytes straight into
    /// them (`receive_buffer_for` gives device addresses); verification reads
    /// each chunk back to the host to hash it.
    gdr: bool,
    /// Host copy of a chunk that landed on the GPU, for its hash.
    readback: Vec<u8>,
    /// Running hashes of tensors arriving in several chunks.
    hashing: HashMap<usize, Box<Checksum>>,
    /// Per entry that moves part of its tensor: the checksum of the bytes
    /// it receives, as its source computed them (`expect_checksum`).
    slice_sums: HashMap<usize, u128>,
    received: Vec<u64>,
    delivered: Vec<bool>,
    progress: Progress,
    wrote_params: bool,
    started: Instant,
    deadline: Instant,
}

impl<'p, 'h> Applier<'p, 'h> {
    /// `params[i]` is the destination of plan entry `i` when it targets a
    /// param. Atomic mode stages in fresh memory, freed when it ends.
    pub fn new(
        plan: &'p Plan,
        params: Vec<Option<Dest>>,
        opts: ApplyOptions,
        hooks: Hooks<'h>,
    ) -> Result<Applier<'p, 'h>> {
        Applier::with_atomic_staging(plan, params, opts, hooks, AtomicStaging::default())
    }

    /// [`Applier::new`], atomic mode swapping shadows into library-owned
    /// params and keeping its packed staging as `staging` says.
    pub fn with_atomic_staging(
        plan: &'p Plan,
        params: Vec<Option<Dest>>,
        opts: ApplyOptions,
        hooks: Hooks<'h>,
        mut staging: AtomicStaging<'p>,
    ) -> Result<Applier<'p, 'h>> {
        assert_eq!(params.len(), plan.entries.len());
        // A callback tensor's size is the peer's word: bounded before the
        // arena below (or any loose buffer) is allocated or faulted in.
        let callback = plan.entries.iter().filter(|e| e.target == Target::Callback);
        check_callback_staging(
            callback.map(|e| (e.meta.name.as_str(), e.meta.nbytes)),
            opts.mode == Mode::Atomic,
            opts.callback_staging_limit,
        )?;
        // Device memory first: it fails fast, before host staging is faulted in.
        let (device_shadows, arena) = match opts.mode {
            Mode::Atomic => (
                DeviceShadows::for_plan(plan, &staging.device)?,
                Some(Arena::for_plan(plan, &mut staging, opts.threads)?),
            ),
            Mode::InPlace => (DeviceShadows::default(), None),
        };
        let started = Instant::now();
        Ok(Applier {
            plan,
            hooks,
            params,
            arena,
            device_shadows,
            swappable: staging.swappable,
            keep: staging.keep,
            loose: LooseBuffers::new(opts.callback_staging_limit),
            pinned: HashMap::new(),
            staging: None,
            gdr: false,
            readback: Vec::new(),
            hashing: HashMap::new(),
            slice_sums: HashMap::new(),
            received: vec![0; plan.entries.len()],
            delivered: vec![false; plan.entries.len()],
            progress: Progress {
                bytes_total: plan.bytes,
                tensors_total: plan.tensors as u64,
                ..Default::default()
            },
            wrote_params: false,
            started,
            deadline: started + opts.timeout,
            opts,
        })
    }

    /// Whether this update verifies checksums (a source that checks slices
    /// reads more when it does).
    pub fn verifies(&self) -> bool {
        self.opts.verify
    }

    /// Upload device params through `staging` (required when any param is
    /// device memory).
    pub fn with_staging(mut self, staging: &'p mut DeviceStaging) -> Self {
        self.staging = Some(staging);
        self
    }

    /// gdr: let sources land device params' bytes in the params themselves
    /// (in place only; atomic mode stages in host memory as always).
    pub fn with_gdr(mut self, yes: bool) -> Self {
        self.gdr = yes;
        self
    }

    /// True once any param byte may have changed (the manager then reports
    /// FAILED if the update does not complete).
    pub fn wrote_params(&self) -> bool {
        self.wrote_params
    }

    /// `error` as a failure of this update, with what it left in the params.
    pub fn failure(&self, error: Error) -> ApplyFailure {
        ApplyFailure::new(error, self.wrote_params)
    }

    pub fn progress(&self) -> Progress {
        self.progress
    }

    /// When the whole update must be done.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Fail with a timeout if the update's deadline has passed. Sources that
    /// wait call this too.
    pub fn check_deadline(&self) -> Result<()> {
        if Instant::now() > self.deadline {
            return Err(Error::timeout(format!(
                "update did not finish within {:?} ({} of {} bytes received)",
                self.opts.timeout, self.progress.bytes_done, self.progress.bytes_total
            )));
        }
        Ok(())
    }

    fn name(&self, t: usize) -> &str {
        &self.plan.entries[t].meta.name
    }

    /// Copy one batch of chunks. `origin` names where they came from (a file,
    /// a bucket) in error messages. Consecutive chunks of one tensor, each
    /// starting where the one before ended, from the same kind of source,
    /// are checked and routed as one run (`batch.rs`), so a source hands
    /// many small blocks (a strided request's rows) as they are, at about
    /// the cost of copying them.
    pub fn apply_batch(&mut self, origin: &str, chunks: &[Chunk]) -> Result<()> {
        self.batch(origin, chunks, false)
    }

    /// Where bytes `[offset, offset + len)` of plan entry `t` must land for a
    /// source that writes them itself (a network receive straight into param
    /// memory, or into the atomic staging arena). Range-checked; in place,
    /// the params count as written from now on. Report the bytes with
    /// [`Applier::account_landed`] once they are there.
    pub fn receive_buffer_for(&mut self, t: usize, offset: u64, len: usize) -> Result<SendPtr> {
        self.contiguous_receive_buffer(t, offset, len)?
            .ok_or_else(|| {
                Error::format(format!(
                "tensor '{}': {len} bytes from byte {offset} are not contiguous where they land",
                self.name(t)
            ))
            })
    }

    /// [`Applier::receive_buffer_for`], or None when the bytes would not
    /// lie in one piece where they land (several blocks of a strided
    /// request): the source then receives them elsewhere and hands them
    /// over with [`Applier::apply_batch`], which scatters them, or lands
    /// them in pieces ([`Applier::receive_pieces`]).
    pub fn contiguous_receive_buffer(
        &mut self,
        t: usize,
        offset: u64,
        len: usize,
    ) -> Result<Option<SendPtr>> {
        let [span] = self.landing_spans(t, offset, len)?[..] else {
            return Ok(None);
        };
        if self.received_in_param(t) {
            self.wrote_params = true;
        }
        Ok(Some(span.dst))
    }

    /// Where bytes `[offset, offset + len)` of plan entry `t` land, in
    /// order, for a source that scatters them there itself (a network
    /// receive into several blocks of a strided request): one (address,
    /// length) per piece, pieces that follow each other joined (a column
    /// split's rows are strided at the source but back to back in the
    /// param: one piece). Range-checked; in place, the params count as
    /// written from now on. None, with nothing counted as written, when
    /// they would land in more than `max_pieces` pieces, or in GPU memory
    /// in more than one (the source then receives them elsewhere, as for
    /// [`Applier::contiguous_receive_buffer`]). Report the bytes with
    /// [`Applier::account_landed`] once they are there.
    pub fn receive_pieces(
        &mut self,
        t: usize,
        offset: u64,
        len: usize,
        max_pieces: usize,
    ) -> Result<Option<Vec<(SendPtr, usize)>>> {
        let pieces = receive::joined(&self.landing_spans(t, offset, len)?);
        let one = pieces.len() <= 1;
        if !one && (pieces.len() > max_pieces || self.gdr_param(t).is_some()) {
            return Ok(None);
        }
        if self.received_in_param(t) {
            self.wrote_params = true;
        }
        Ok(Some(pieces))
    }

    /// Where bytes `[offset, offset + len)` of entry `t` land, cut at
    /// segment edges, once checked against the entry.
    fn landing_spans(&mut self, t: usize, offset: u64, len: usize) -> Result<Vec<receive::Span>> {
        let Some(entry) = self.plan.entries.get(t) else {
            return Err(Error::format(format!(
                "chunk names tensor #{t} but the plan has {}",
                self.plan.entries.len()
            )));
        };
        let n = entry.bytes;
        if entry.target == Target::Skip || offset.checked_add(len as u64).is_none_or(|end| end > n)
        {
            return Err(Error::format(format!(
                "tensor '{}': {len} bytes at byte {offset} do not fit its {n} bytes (or it is skipped)",
                entry.meta.name
            )));
        }
        self.receive_spans(t, offset, len as u64)
    }

    /// Account for chunks a source already wrote where [`Applier::receive_buffer_for`]
    /// said (their `src` is ignored): the same checks, verification and
    /// delivery as [`Applier::apply_batch`], without the copy.
    pub fn account_landed(&mut self, origin: &str, chunks: &[Chunk]) -> Result<()> {
        self.batch(origin, chunks, true)
    }

    /// Check that every planned tensor arrived, then commit (atomic) and hand
    /// out what is left for the callback. A failure says whether params may
    /// have been written.
    pub fn finish(mut self) -> std::result::Result<Applied, ApplyFailure> {
        let r = self.commit();
        r.map_err(|e| self.failure(e))
    }
}

impl Drop for Applier<'_, '_> {
    /// Pinned buffers of tensors that never completed go back to the
    /// staging; an arena left by a failure frees its own shadows (the new
    /// pages) and keeps its packed region when asked to.
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            self.keep_packed(arena);
        }
        for (t, buf) in self.pinned.drain() {
            if let (Some(Dest::Device { ordinal, .. }), Some(s)) =
                (self.params[t], self.staging.as_deref_mut())
            {
                s.give_back(ordinal, buf);
            }
        }
    }
}
