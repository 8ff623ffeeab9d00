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
//! Owners: [`Applier`] (here, `batch.rs`, `callback.rs`, `commit.rs`)
//! coordinates; `landing.rs` owns the memory bytes land in and every write
//! to a param, with the record of whether one happened (which decides
//! FAILED against old weights kept; `upload.rs`, `shadows.rs` and
//! `route.rs` are its too); `verify.rs` owns checksums; `progress.rs`
//! counts what arrived and keeps the clock. Below them: `arena.rs`,
//! `spans.rs`, `device_swap.rs`, `types.rs`, `failure.rs`.
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
mod base;
mod batch;
mod callback;
mod commit;
mod device_swap;
mod failure;
mod landing;
mod patch;
mod progress;
mod quant_agree;
mod quantize;
mod route;
mod shadows;
mod spans;
mod types;
mod upload;
mod verify;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod verify_tests;

pub use crate::registry::Dest;
pub use arena::AtomicStaging;
pub use base::{delta_element_size, DeltaJob, DeltaTally};
pub use failure::ApplyFailure;
pub use progress::Progress;
pub use quant_agree::QuantRequest;
pub use quantize::{FileCheck, QuantTarget};
#[cfg(test)]
pub(crate) use types::ProgressHook;
pub use types::{Applied, ApplyOptions, Chunk, DeviceBytes, Hooks, Mode, TensorView};

use crate::memory::loose::check_callback_staging;
use crate::memory::staging::DeviceStaging;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use landing::Landing;
use progress::Tally;
use std::time::Instant;
use verify::Verifier;

/// Coordinates an update: takes batches from sources, has the landing
/// place them, the verifier check them and the tally count them, and
/// commits at the end.
pub struct Applier<'p, 'h> {
    plan: &'p Plan,
    opts: ApplyOptions,
    hooks: Hooks<'h>,
    landing: Landing<'p>,
    verifier: Verifier<'p>,
    tally: Tally,
    /// What deltas did (`base.rs`).
    deltas: DeltaTally,
    /// Params quantized at the end (`quantize.rs`).
    quant: quantize::Quantizing,
    /// Set by another thread to stop the update at its next look
    /// (`check_deadline`, which every source calls while it waits).
    stop: Option<crate::stop::StopFlag>,
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
        staging: AtomicStaging<'p>,
    ) -> Result<Applier<'p, 'h>> {
        assert_eq!(params.len(), plan.entries.len());
        // A callback tensor's size is the peer's word: bounded before the
        // arena (or any loose buffer) is allocated or faulted in.
        let callback = plan.entries.iter().filter(|e| e.target == Target::Callback);
        check_callback_staging(
            callback.map(|e| (e.meta.name.as_str(), e.meta.nbytes)),
            opts.mode == Mode::Atomic,
            opts.callback_staging_limit,
        )?;
        let tally = Tally::new(plan, opts.begun, opts.timeout);
        let landing = Landing::new(plan, params, &opts, staging, tally.deadline)?;
        Ok(Applier {
            plan,
            hooks,
            landing,
            verifier: Verifier::new(plan, opts.verify, opts.threads),
            tally,
            opts,
            deltas: DeltaTally::default(),
            quant: Default::default(),
            stop: None,
        })
    }

    /// Whether this update verifies checksums (a source that checks slices
    /// reads more when it does).
    pub fn verifies(&self) -> bool {
        self.verifier.on
    }

    /// The bytes entry `entry` receives must hash to `sum` (see
    /// `Verifier::expect_checksum` in `verify.rs`).
    pub fn expect_checksum(&mut self, entry: usize, sum: u128) -> Result<()> {
        self.verifier.expect_checksum(entry, sum)
    }

    /// Upload device params through `staging` (required when any param is
    /// device memory).
    pub fn with_staging(mut self, staging: &'p mut DeviceStaging) -> Self {
        self.landing.staging = Some(staging);
        self
    }

    /// gdr: let sources land device params' bytes in the params themselves
    /// (in place only; atomic mode stages in host memory as always).
    pub fn with_gdr(mut self, yes: bool) -> Self {
        self.landing.gdr = yes;
        self
    }

    /// True once any param byte may have changed (the manager then reports
    /// FAILED if the update does not complete).
    pub fn wrote_params(&self) -> bool {
        self.landing.wrote_params()
    }

    /// `error` as a failure of this update, with what it left in the params.
    pub fn failure(&self, error: Error) -> ApplyFailure {
        ApplyFailure::new(error, self.landing.wrote_params())
    }

    pub fn progress(&self) -> Progress {
        self.tally.now
    }

    /// When the whole update must be done.
    pub fn deadline(&self) -> Instant {
        self.tally.deadline
    }

    /// Atomic: where param `i`'s new bytes are staged, in host memory (all
    /// of the param; read only once [`Applier::check_received`] passed),
    /// for a fan-out root that passes a staged version on before its
    /// commit. None in place, or for a param the plan does not write.
    pub fn staged_param(&self, i: usize) -> Option<SendPtr> {
        let arena = self.landing.arena.as_ref()?;
        arena.shadow_of(i).map(SendPtr)
    }

    /// Check that every byte planned from source `me` (named `name` in the
    /// error) arrived, when it says it sent all.
    pub fn check_received_from(&self, me: usize, name: &str) -> Result<()> {
        self.tally.check_complete_from(self.plan, Some((me, name)))
    }

    /// Check that every planned byte arrived (and so was verified: each
    /// tensor is checked as it completes), before a staged update reports
    /// itself staged. The commit checks again.
    pub fn check_received(&mut self) -> Result<()> {
        self.tally.check_complete(self.plan)?;
        self.check_deadline()?;
        let arena = self.landing.arena.take();
        let checked = self.check_quantized(arena.as_ref());
        self.landing.arena = arena;
        checked?;
        self.tally.received_in = Some(self.tally.started.elapsed());
        Ok(())
    }

    /// A new deadline, `timeout` from now, for what is left (a staged
    /// update's commit, however long the engine took to decide).
    pub fn renew_deadline(&mut self, timeout: std::time::Duration) {
        let deadline = Instant::now() + timeout;
        self.tally.deadline = deadline;
        self.landing.deadline = deadline;
    }

    /// Stop when `stop` is set (see [`crate::stop`]).
    pub fn with_stop(mut self, stop: Option<crate::stop::StopFlag>) -> Self {
        self.stop = stop;
        self
    }

    /// Fail with a timeout if the update's deadline has passed, or as
    /// cancelled once the update was stopped. Sources that wait call this
    /// between their steps.
    pub fn check_deadline(&self) -> Result<()> {
        if crate::stop::stopped(self.stop.as_ref()) {
            return Err(crate::result::Error::cancelled(format!(
                "the update was stopped after {} of {} bytes (a destroy, or a clear of the version it stages)",
                self.tally.now.bytes_done, self.tally.now.bytes_total
            )));
        }
        self.tally.check_deadline()
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

    /// The one landing call for a source that writes bytes itself: where
    /// bytes `[offset, offset + len)` of plan entry `t` land, in at most
    /// `most` pieces (see `Landing::receive_scatter`; None: receive them
    /// elsewhere and hand them over with [`Applier::apply_batch`]). Report
    /// the bytes with [`Applier::account_landed`] once they are there.
    pub fn receive_scatter(
        &mut self,
        t: usize,
        offset: u64,
        len: usize,
        most: usize,
    ) -> Result<Option<Vec<(SendPtr, usize)>>> {
        self.landing.receive_scatter(t, offset, len, most)
    }

    /// Account for chunks a source already wrote where
    /// [`Applier::receive_scatter`] said (their `src` is ignored): the same
    /// checks, verification and delivery as [`Applier::apply_batch`],
    /// without the copy.
    pub fn account_landed(&mut self, origin: &str, chunks: &[Chunk]) -> Result<()> {
        self.batch(origin, chunks, true)
    }

    /// Wait for every queued copy to the GPUs (see `upload.rs`): a source
    /// whose GPU memory they read may reuse it after this.
    pub fn settle_uploads(&mut self) -> Result<()> {
        self.landing.settle_uploads()
    }

    /// A staged update before its gate: every upload settled and the
    /// device shadows' views dropped, so the commit is the swaps alone.
    pub fn ready_to_commit(&mut self) -> Result<()> {
        self.landing.settle_uploads()?;
        let deadline = self.deadline();
        self.landing.device_shadows.drop_views(deadline)
    }

    /// Check that every planned tensor arrived, then commit (atomic) and hand
    /// out what is left for the callback. A failure says whether params may
    /// have been written.
    pub fn finish(mut self) -> std::result::Result<Applied, ApplyFailure> {
        let r = self.commit();
        r.map_err(|e| self.failure(e))
    }
}
