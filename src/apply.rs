//! The applier: the one place where bytes from any source land.
//!
//! Sources hand it batches of [`Chunk`]s (tensor, byte range, where the bytes
//! are). For every chunk it checks the range against the plan, so a source can
//! never make it write outside a planned tensor or write a byte twice; it then
//! copies all chunks of the batch in parallel, verifies the checksum of every
//! tensor the batch completed, hands finished tensors to the engine's callback
//! and reports progress.
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

use crate::checksum::Checksum;
use crate::memory::copy::{copy_all, hash_all, CopyJob, CopySource};
use crate::memory::host::HostRegion;
use crate::memory::loose::{check_callback_staging, LooseBuffers};
use crate::memory::staging::{DeviceStaging, PinnedBuffer, PINNED_TENSOR_MAX, SMALL_TENSOR};
use crate::memory::{aligned_offsets, SendPtr};
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use crate::tensor::DType;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Atomic,
    InPlace,
}

/// Progress of an update, reported after every batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: u64,
    pub tensors_total: u64,
}

/// One whole tensor handed to the engine's per-tensor callback. `data` is
/// valid only during the call.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// The bytes in host memory; empty when they are GPU memory (`device`).
    pub data: &'a [u8],
    /// Zero-copy from a CUDA IPC bucket: the bytes are GPU memory, not host.
    pub device: Option<DeviceBytes>,
}

/// A tensor's bytes in GPU memory: `len` bytes at device address `ptr`,
/// valid in the context of GPU `ordinal` during the callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBytes {
    pub ptr: u64,
    pub len: usize,
    pub ordinal: i32,
}

/// Returns false to cancel the update.
pub type ProgressHook<'h> = &'h mut dyn FnMut(&Progress) -> bool;
/// Returns an error text to fail the update.
pub type TensorHook<'h> = &'h mut dyn FnMut(&TensorView) -> std::result::Result<(), String>;

#[derive(Default)]
pub struct Hooks<'h> {
    pub progress: Option<ProgressHook<'h>>,
    pub tensor: Option<TensorHook<'h>>,
}

#[derive(Clone, Copy, Debug)]
pub struct ApplyOptions {
    pub mode: Mode,
    pub verify: bool,
    pub threads: usize,
    pub timeout: Duration,
    /// The most bytes of tensors for the per-tensor callback the applier
    /// holds (the manager's `callback_staging_limit`): all of them in
    /// atomic mode, any one of them (and those received at once) in place.
    pub callback_staging_limit: u64,
}

/// Bytes `[offset, offset + len)` of plan entry `tensor`, found at `src`.
#[derive(Clone, Copy)]
pub struct Chunk<'a> {
    pub tensor: usize,
    pub offset: u64,
    pub len: usize,
    pub src: CopySource<'a>,
}

/// What an update moved and how long it took.
#[derive(Clone, Copy, Debug, Default)]
pub struct Applied {
    pub tensors: usize,
    pub bytes: u64,
    pub receive: Duration,
    pub commit: Duration,
}

/// Where a param's bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// Host memory: written by the parallel copier.
    Host(SendPtr),
    /// CUDA device memory of GPU `ordinal`: bytes land in host memory first
    /// (the atomic arena; in place, a pinned buffer of the tensor's own, or
    /// ordinary memory for tensors over `PINNED_TENSOR_MAX`) and go up with
    /// an asynchronous copy once the tensor is whole and verified (atomic:
    /// at commit). [`Applier::finish`] waits for the copies.
    Device { ptr: u64, ordinal: i32 },
}

pub struct Applier<'p, 'h> {
    plan: &'p Plan,
    opts: ApplyOptions,
    hooks: Hooks<'h>,
    /// Per plan entry: the param's memory, for `Target::Param`.
    params: Vec<Option<Dest>>,
    /// Atomic mode: every moving tensor's staging slot.
    arena: Option<(HostRegion, Vec<usize>)>,
    /// In-place mode: callback and device tensors being received (and a
    /// spare buffer kept for the next one).
    loose: LooseBuffers,
    /// In-place mode: device tensors landing in pinned memory.
    pinned: HashMap<usize, PinnedBuffer>,
    /// Pinned buffers and upload streams for device params (the manager's,
    /// kept across updates).
    staging: Option<&'p mut DeviceStaging>,
    /// gdr, in place: a source writes device params' bytes straight into
    /// them (`landing_for` gives device addresses); verification reads
    /// each chunk back to the host to hash it.
    on_device: bool,
    /// Host copy of a chunk that landed on the GPU, for its hash.
    readback: Vec<u8>,
    /// Tensors arriving in several chunks, hashed chunk by chunk right after
    /// each one lands (while its bytes are still in cache) instead of read
    /// again from memory once whole.
    hashing: HashMap<usize, Box<Checksum>>,
    received: Vec<u64>,
    delivered: Vec<bool>,
    progress: Progress,
    wrote_params: bool,
    started: Instant,
    deadline: Instant,
}

impl<'p, 'h> Applier<'p, 'h> {
    /// `params[i]` is the destination of plan entry `i` when it targets a param.
    pub fn new(
        plan: &'p Plan,
        params: Vec<Option<Dest>>,
        opts: ApplyOptions,
        hooks: Hooks<'h>,
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
        let arena = if opts.mode == Mode::Atomic {
            // Skipped tensors get an empty slot.
            let (offsets, size) = aligned_offsets(plan.entries.iter().map(|e| match e.target {
                Target::Skip => 0,
                _ => e.meta.nbytes,
            }))
            .ok_or_else(|| Error::out_of_memory("staging size overflows"))?;
            let region = HostRegion::staging("atomic staging", size, opts.threads).map_err(|e| {
                e.context(format!(
                    "atomic mode stages the whole update ({size} bytes); use in-place mode to update without extra memory"
                ))
            })?;
            Some((region, offsets))
        } else {
            None
        };
        let started = Instant::now();
        Ok(Applier {
            plan,
            hooks,
            params,
            arena,
            loose: LooseBuffers::new(opts.callback_staging_limit),
            pinned: HashMap::new(),
            staging: None,
            on_device: false,
            readback: Vec::new(),
            hashing: HashMap::new(),
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

    /// Upload device params through `staging` (required when any param is
    /// device memory).
    pub fn with_staging(mut self, staging: &'p mut DeviceStaging) -> Self {
        self.staging = Some(staging);
        self
    }

    /// gdr: let sources land device params' bytes in the params themselves
    /// (in place only; atomic mode stages in host memory as always).
    pub fn land_on_device(mut self, yes: bool) -> Self {
        self.on_device = yes;
        self
    }

    /// The device param of entry `t` when bytes land in it directly (gdr).
    fn landed_on_device(&self, t: usize) -> Option<(u64, i32)> {
        match (
            self.on_device,
            &self.arena,
            self.plan.entries[t].target,
            self.params[t],
        ) {
            (true, None, Target::Param(_), Some(Dest::Device { ptr, ordinal })) => {
                Some((ptr, ordinal))
            }
            _ => None,
        }
    }

    fn staging(&mut self) -> Result<&mut DeviceStaging> {
        self.staging.as_deref_mut().ok_or_else(|| {
            Error::unsupported("device params need the manager's pinned staging (internal)")
        })
    }

    /// True once any param byte may have changed (the manager then reports
    /// FAILED if the update does not complete).
    pub fn wrote_params(&self) -> bool {
        self.wrote_params
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

    /// Where bytes of entry `t` land while being received.
    fn landing(&mut self, t: usize) -> Result<SendPtr> {
        if let Some((region, offsets)) = &self.arena {
            return Ok(SendPtr(region.ptr().wrapping_add(offsets[t])));
        }
        let n = self.plan.entries[t].meta.nbytes as usize;
        if let Some((ptr, _)) = self.landed_on_device(t) {
            return Ok(SendPtr(ptr as *mut u8));
        }
        match (self.plan.entries[t].target, self.params[t]) {
            (Target::Param(_), Some(Dest::Host(p))) => Ok(p),
            (Target::Param(_), Some(Dest::Device { ordinal, .. }))
                if (SMALL_TENSOR + 1..=PINNED_TENSOR_MAX).contains(&n) =>
            {
                if let Some(b) = self.pinned.get(&t) {
                    return Ok(SendPtr(b.ptr()));
                }
                if self.loose.contains(t) {
                    return self.loose_landing(t, n); // fell back earlier
                }
                let deadline = self.deadline;
                match self.staging()?.take(ordinal, n, deadline)? {
                    Some(buf) => {
                        let at = SendPtr(buf.ptr());
                        self.pinned.insert(t, buf);
                        Ok(at)
                    }
                    // Every pinned buffer is held by tensors of this batch:
                    // this one lands in ordinary memory and is uploaded.
                    None => self.loose_landing(t, n),
                }
            }
            _ => self.loose_landing(t, n),
        }
    }

    /// A library buffer for entry `t` (`n` bytes): bounded by the callback
    /// staging limit for callback tensors, fallible for all.
    fn loose_landing(&mut self, t: usize, n: usize) -> Result<SendPtr> {
        let entry = &self.plan.entries[t];
        let bounded = entry.target == Target::Callback;
        let at = self.loose.landing(t, &entry.meta.name, n, bounded)?;
        Ok(SendPtr(at))
    }

    /// Copy one batch of chunks. `origin` names where they came from (a file,
    /// a bucket) in error messages.
    pub fn apply_batch(&mut self, origin: &str, chunks: &[Chunk]) -> Result<()> {
        self.batch(origin, chunks, false)
    }

    /// Where bytes `[offset, offset + len)` of plan entry `t` must land for a
    /// source that writes them itself (a network receive straight into param
    /// memory, or into the atomic staging arena). Range-checked; in place,
    /// the params count as written from now on. Report the bytes with
    /// [`Applier::landed_batch`] once they are there.
    pub fn landing_for(&mut self, t: usize, offset: u64, len: usize) -> Result<SendPtr> {
        let Some(entry) = self.plan.entries.get(t) else {
            return Err(Error::format(format!(
                "chunk names tensor #{t} but the plan has {}",
                self.plan.entries.len()
            )));
        };
        let n = entry.meta.nbytes;
        if entry.target == Target::Skip || offset.checked_add(len as u64).is_none_or(|end| end > n)
        {
            return Err(Error::format(format!(
                "tensor '{}': {len} bytes at byte {offset} do not fit its {n} bytes (or it is skipped)",
                entry.meta.name
            )));
        }
        if (matches!(self.params[t], Some(Dest::Host(_))) || self.landed_on_device(t).is_some())
            && self.arena.is_none()
        {
            self.wrote_params = true;
        }
        let base = self.landing(t)?;
        Ok(SendPtr(base.0.wrapping_add(offset as usize)))
    }

    /// Account for chunks a source already wrote where [`Applier::landing_for`]
    /// said (their `src` is ignored): the same checks, verification and
    /// delivery as [`Applier::apply_batch`], without the copy.
    pub fn landed_batch(&mut self, origin: &str, chunks: &[Chunk]) -> Result<()> {
        self.batch(origin, chunks, true)
    }

    fn batch(&mut self, origin: &str, chunks: &[Chunk], landed: bool) -> Result<()> {
        self.check_deadline()?;
        let mut jobs = Vec::with_capacity(chunks.len());
        let mut completed = Vec::new();
        // Zero copy: whole tensors in memory, for the callback, in place.
        let mut direct: Vec<(usize, SendPtr)> = Vec::new();
        // Verified chunks that are part of a tensor: hashed as they land.
        let mut streamed: Vec<(usize, SendPtr, usize)> = Vec::new();
        // GPU sources (CUDA IPC), unverified, in place: copied device to
        // device into device params (GPU, dst, src, len), or handed to the
        // callback as device pointers. Everything else with a GPU source
        // is copied to host memory by the copier and handled as any chunk.
        let mut on_device: Vec<(i32, u64, u64, usize)> = Vec::new();
        let mut finished_on_device = 0u64;
        let mut device_direct: Vec<(usize, DeviceBytes)> = Vec::new();
        for c in chunks {
            let Some(entry) = self.plan.entries.get(c.tensor) else {
                return Err(Error::format(format!(
                    "{origin}: chunk names tensor #{} but the plan has {}",
                    c.tensor,
                    self.plan.entries.len()
                )));
            };
            if entry.target == Target::Skip || c.len == 0 {
                continue;
            }
            let t = c.tensor;
            let n = entry.meta.nbytes;
            if c.offset != self.received[t] {
                return Err(Error::format(format!(
                    "{origin}: chunk of tensor '{}' starts at byte {} but byte {} was expected next",
                    self.name(t),
                    c.offset,
                    self.received[t]
                )));
            }
            let end = c.offset.checked_add(c.len as u64).filter(|e| *e <= n).ok_or_else(|| {
                Error::format(format!(
                    "{origin}: chunk of tensor '{}' covers {} bytes from byte {}, past its {} bytes",
                    self.name(t),
                    c.len,
                    c.offset,
                    n
                ))
            })?;
            self.received[t] = end;
            if let (CopySource::Device { ptr: from, ordinal }, false, None, false) =
                (c.src, landed, &self.arena, self.opts.verify)
            {
                match (entry.target, self.params[t]) {
                    (Target::Param(_), Some(Dest::Device { ptr, ordinal: to })) => {
                        on_device.push((to, ptr + c.offset, from, c.len));
                        self.wrote_params = true;
                        finished_on_device += u64::from(end == n);
                        self.progress.bytes_done += c.len as u64;
                        continue;
                    }
                    (Target::Callback, _) if c.offset == 0 && end == n => {
                        let bytes = DeviceBytes {
                            ptr: from,
                            len: c.len,
                            ordinal,
                        };
                        device_direct.push((t, bytes));
                        self.progress.bytes_done += c.len as u64;
                        continue;
                    }
                    _ => {}
                }
            }
            if let (None, Target::Callback, 0, CopySource::Memory(src), false) =
                (&self.arena, entry.target, c.offset, c.src, landed)
            {
                if end == n {
                    direct.push((t, src));
                    self.progress.bytes_done += c.len as u64;
                    continue;
                }
            }
            let base = self.landing(t)?;
            let dst = SendPtr(base.0.wrapping_add(c.offset as usize));
            if let Some((_, ordinal)) = self.landed_on_device(t) {
                if !landed {
                    return Err(Error::format(format!(
                        "{origin}: tensor '{}' must land in its GPU param (gdr), not be copied",
                        self.name(t)
                    )));
                }
                // gdr: the bytes are in GPU memory; hash a host copy.
                if self.opts.verify {
                    self.readback.resize(c.len, 0);
                    // SAFETY: the chunk's device range was range-checked by
                    // landing_for and the source wrote it; readback holds len.
                    unsafe {
                        crate::memory::cuda_ipc::download(
                            ordinal,
                            self.readback.as_mut_ptr(),
                            dst.0 as u64,
                            c.len,
                        )
                    }
                    .map_err(|e| {
                        e.context(format!("{origin}: reading tensor '{}' back", self.name(t)))
                    })?;
                    self.hashing.entry(t).or_default().update(&self.readback);
                }
                if end == n {
                    completed.push(t);
                }
                self.progress.bytes_done += c.len as u64;
                continue;
            }
            if self.opts.verify && (c.offset != 0 || end != n) {
                // Bytes in memory are hashed where they already are (just
                // landed, so still in cache); a file's once copied.
                let at = match (landed, c.src) {
                    (false, CopySource::Memory(src)) => src,
                    _ => dst,
                };
                streamed.push((t, at, c.len));
            }
            if !landed {
                jobs.push(CopyJob {
                    src: c.src,
                    dst,
                    len: c.len,
                    tag: t,
                });
            }
            if matches!(entry.target, Target::Param(_)) && self.arena.is_none() {
                self.wrote_params = true;
            }
            if end == n {
                completed.push(t);
            }
            self.progress.bytes_done += c.len as u64;
        }
        // SAFETY: every destination is inside a planned tensor's memory (range
        // checked above against its byte size), each byte is written once
        // (offsets must follow on exactly), and sources are valid per the
        // Chunk contract.
        unsafe { copy_all(&jobs, self.opts.threads) }.map_err(|e| {
            e.error
                .context(format!("tensor '{}' from {origin}", self.name(e.tag)))
        })?;
        for &t in &completed {
            // SAFETY: every byte up to nbytes was just written by the copies,
            // into a buffer allocated for nbytes.
            unsafe {
                self.loose
                    .filled(t, self.plan.entries[t].meta.nbytes as usize)
            };
        }
        for &(t, at, len) in &streamed {
            // SAFETY: the chunk's bytes are in place (landed or just copied)
            // and nothing writes them during the batch.
            let bytes = unsafe { std::slice::from_raw_parts(at.0, len) };
            self.hashing.entry(t).or_default().update(bytes);
        }
        self.verify(origin, &completed)?;
        self.progress.tensors_done += completed.len() as u64 + finished_on_device;
        for (to, dst, src, len) in on_device {
            let staging = self.staging()?;
            // SAFETY: dst..dst+len lies in a device param (range checked
            // above, the param's range at registration); the source's GPU
            // memory stays put until the source waits for these copies.
            unsafe { staging.copy_device(to, dst, src, len) }
                .map_err(|e| e.context(format!("{origin} to GPU {to}")))?;
        }
        for (t, bytes) in device_direct {
            self.deliver_view(t, &[], Some(bytes))?;
            self.progress.tensors_done += 1;
        }
        for (t, src) in direct {
            let n = self.plan.entries[t].meta.nbytes as usize;
            if self.opts.verify {
                // SAFETY: the source promises the bytes stay put during the batch.
                let got = crate::checksum::of(unsafe { std::slice::from_raw_parts(src.0, n) });
                self.check_checksum(origin, t, got)?;
            }
            // SAFETY: as above; the callback sees them only during its call.
            self.deliver(t, unsafe { std::slice::from_raw_parts(src.0, n) })?;
            self.progress.tensors_done += 1;
        }
        if self.arena.is_none() {
            for &t in &completed {
                let device = match self.params[t] {
                    Some(Dest::Device { ptr, ordinal }) => Some((ptr, ordinal)),
                    _ => None,
                };
                if let (Some((ptr, ordinal)), Some(buf)) = (device, self.pinned.remove(&t)) {
                    self.send(origin, t, ptr, ordinal, buf)?;
                    continue;
                }
                if self.landed_on_device(t).is_some() {
                    continue; // already in the param (gdr)
                }
                if self.plan.entries[t].target == Target::Callback || device.is_some() {
                    let data = self.loose.take(t);
                    match device {
                        Some((ptr, ordinal)) => self.upload(origin, t, ptr, ordinal, &data)?,
                        None => self.deliver(t, &data)?,
                    }
                    self.loose.recycle(data);
                }
            }
        }
        if let Some(progress) = self.hooks.progress.as_mut() {
            if !progress(&self.progress) {
                return Err(Error::cancelled(format!(
                    "update cancelled by the progress callback after {} of {} bytes",
                    self.progress.bytes_done, self.progress.bytes_total
                )));
            }
        }
        Ok(())
    }

    fn verify(&mut self, origin: &str, tensors: &[usize]) -> Result<()> {
        if !self.opts.verify || tensors.is_empty() {
            return Ok(());
        }
        // Tensors that came in several chunks were hashed as they landed;
        // whole ones are hashed now, in parallel.
        let mut whole = Vec::with_capacity(tensors.len());
        for &t in tensors {
            match self.hashing.remove(&t) {
                Some(h) => self.check_checksum(origin, t, h.digest())?,
                None => whole.push(t),
            }
        }
        let regions: Vec<(SendPtr, usize)> = whole
            .iter()
            .map(|&t| Ok((self.landing(t)?, self.plan.entries[t].meta.nbytes as usize)))
            .collect::<Result<_>>()?;
        // SAFETY: the regions were fully written above and nothing writes them now.
        let got = unsafe { hash_all(&regions, self.opts.threads) };
        for (&t, got) in whole.iter().zip(got) {
            self.check_checksum(origin, t, got)?;
        }
        Ok(())
    }

    fn check_checksum(&self, origin: &str, t: usize, got: u128) -> Result<()> {
        let want = self.plan.entries[t].meta.checksum;
        if want != Some(got) {
            return Err(Error::checksum(format!(
                "tensor '{}' from {origin}: checksum mismatch (expected {}, got {})",
                self.name(t),
                want.map_or("none".into(), crate::manifest::checksum_hex),
                crate::manifest::checksum_hex(got)
            )));
        }
        Ok(())
    }

    /// Queue the copy of a whole, verified tensor from host memory to its
    /// device param (through pinned buffers; [`Applier::finish`] waits).
    fn upload(
        &mut self,
        origin: &str,
        t: usize,
        ptr: u64,
        ordinal: i32,
        data: &[u8],
    ) -> Result<()> {
        self.wrote_params = true;
        let (threads, deadline, plan) = (self.opts.threads, self.deadline, self.plan);
        let name = &plan.entries[t].meta.name;
        let staging = self.staging()?;
        // SAFETY: the device range was checked at registration to hold the
        // param's bytes, and only this update writes it.
        unsafe { staging.upload(ordinal, ptr, data, threads, deadline) }
            .map_err(|e| e.context(format!("tensor '{name}' from {origin} to GPU {ordinal}")))
    }

    /// Queue the copy of a whole, verified tensor that landed in `buf`.
    fn send(
        &mut self,
        origin: &str,
        t: usize,
        ptr: u64,
        ordinal: i32,
        buf: PinnedBuffer,
    ) -> Result<()> {
        self.wrote_params = true;
        let meta = &self.plan.entries[t].meta;
        let (n, name) = (meta.nbytes as usize, &meta.name);
        let staging = self.staging()?;
        // SAFETY: as for `upload`; the buffer holds the tensor's n bytes.
        unsafe { staging.send(ordinal, buf, ptr, n) }
            .map_err(|e| e.context(format!("tensor '{name}' from {origin} to GPU {ordinal}")))
    }

    /// Wait for every queued copy to the GPUs (uploads, and device to
    /// device copies out of a source's GPU memory): the bytes are then in
    /// the params, and the source's memory is no longer read.
    pub fn settle_uploads(&mut self) -> Result<()> {
        let deadline = self.deadline;
        match self.staging.as_deref_mut() {
            Some(s) => s
                .wait(deadline)
                .map_err(|e| e.context("uploading to the GPU")),
            None => Ok(()),
        }
    }

    fn deliver(&mut self, t: usize, data: &[u8]) -> Result<()> {
        self.deliver_view(t, data, None)
    }

    fn deliver_view(&mut self, t: usize, data: &[u8], device: Option<DeviceBytes>) -> Result<()> {
        self.delivered[t] = true;
        let meta = &self.plan.entries[t].meta;
        let Some(hook) = self.hooks.tensor.as_mut() else {
            return Err(Error::callback(format!(
                "tensor '{}' is meant for the per-tensor callback but none is set",
                meta.name
            )));
        };
        let view = TensorView {
            name: &meta.name,
            dtype: meta.dtype,
            shape: &meta.shape,
            data,
            device,
        };
        hook(&view).map_err(|why| {
            Error::callback(format!(
                "per-tensor callback failed for tensor '{}': {why}",
                meta.name
            ))
        })
    }

    /// Check that every planned tensor arrived, then commit (atomic) and hand
    /// out what is left for the callback. On error, the flag says whether
    /// params may have been written.
    pub fn finish(mut self) -> std::result::Result<Applied, (Error, bool)> {
        let r = self.commit();
        r.map_err(|e| (e, self.wrote_params))
    }

    fn commit(&mut self) -> Result<Applied> {
        let receive = self.started.elapsed();
        let incomplete: Vec<String> = self
            .plan
            .entries
            .iter()
            .zip(&self.received)
            .filter(|(e, r)| e.target != Target::Skip && **r < e.meta.nbytes)
            .map(|(e, r)| format!("'{}' ({r} of {} bytes)", e.meta.name, e.meta.nbytes))
            .collect();
        if !incomplete.is_empty() {
            return Err(Error::format(format!(
                "the source ended before {} tensor(s) were complete: {}",
                incomplete.len(),
                incomplete
                    .into_iter()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.check_deadline()?;
        let commit_start = Instant::now();
        if let Some((region, offsets)) = self.arena.take() {
            let jobs: Vec<CopyJob> = self
                .plan
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| matches!(e.target, Target::Param(_)) && e.meta.nbytes > 0)
                .filter_map(|(t, e)| match self.params[t] {
                    Some(Dest::Host(dst)) => Some(CopyJob {
                        src: CopySource::Memory(SendPtr(region.ptr().wrapping_add(offsets[t]))),
                        dst,
                        len: e.meta.nbytes as usize,
                        tag: t,
                    }),
                    _ => None,
                })
                .collect();
            self.wrote_params = !jobs.is_empty();
            // SAFETY: arena slots and param memory are disjoint, both sized by the plan.
            unsafe { copy_all(&jobs, self.opts.threads) }.map_err(|e| e.error)?;
            // Device params and callback tensors, from their arena slots.
            for (t, &offset) in offsets.iter().enumerate() {
                let device = self.params[t];
                let callback = self.plan.entries[t].target == Target::Callback;
                if !callback && !matches!(device, Some(Dest::Device { .. })) {
                    continue;
                }
                let n = self.plan.entries[t].meta.nbytes as usize;
                // SAFETY: slot t holds n verified bytes; the arena lives until the end of this block.
                let data = unsafe { std::slice::from_raw_parts(region.ptr().add(offset), n) };
                match device {
                    Some(Dest::Device { ptr, ordinal }) => {
                        self.upload("the staging arena", t, ptr, ordinal, data)?
                    }
                    _ => self.deliver(t, data)?,
                }
            }
            // The arena is freed at the end of this block; `upload` copied
            // its bytes into pinned buffers before returning.
        } else {
            for t in 0..self.plan.entries.len() {
                if self.plan.entries[t].target == Target::Callback && !self.delivered[t] {
                    self.deliver(t, &[])?;
                }
            }
        }
        self.settle_uploads()?;
        Ok(Applied {
            tensors: self.plan.tensors,
            bytes: self.plan.bytes,
            receive,
            commit: commit_start.elapsed(),
        })
    }
}

impl Drop for Applier<'_, '_> {
    /// Pinned buffers of tensors that never completed go back to the staging.
    fn drop(&mut self) {
        for (t, buf) in self.pinned.drain() {
            if let (Some(Dest::Device { ordinal, .. }), Some(s)) =
                (self.params[t], self.staging.as_deref_mut())
            {
                s.give_back(ordinal, buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::TensorMeta;
    use crate::plan::PlanEntry;

    fn plan_of(bytes: &[u8]) -> Plan {
        Plan {
            entries: vec![PlanEntry {
                meta: TensorMeta {
                    name: "w".into(),
                    dtype: DType::U8,
                    shape: vec![bytes.len() as u64],
                    nbytes: bytes.len() as u64,
                    checksum: Some(crate::checksum::of(bytes)),
                },
                target: Target::Param(0),
            }],
            tensors: 1,
            bytes: bytes.len() as u64,
        }
    }

    /// Feed `src` to an in-place applier in chunks of `piece` bytes; the
    /// chunks are copied (`landed` false) or already in the param (true).
    fn apply_in_pieces(plan: &Plan, src: &[u8], piece: usize, landed: bool) -> Result<Vec<u8>> {
        let mut param = vec![0u8; src.len()];
        let opts = ApplyOptions {
            mode: Mode::InPlace,
            verify: true,
            threads: 2,
            timeout: Duration::from_secs(10),
            callback_staging_limit: crate::memory::loose::DEFAULT_CALLBACK_STAGING_LIMIT,
        };
        let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
        let mut a = Applier::new(plan, vec![dest], opts, Hooks::default())?;
        for at in (0..src.len()).step_by(piece) {
            let len = piece.min(src.len() - at);
            if landed {
                let to = a.landing_for(0, at as u64, len)?;
                // SAFETY: the landing range is the param's, `len` bytes long.
                unsafe { std::ptr::copy_nonoverlapping(src[at..].as_ptr(), to.0, len) };
            }
            let chunk = Chunk {
                tensor: 0,
                offset: at as u64,
                len,
                src: CopySource::Memory(SendPtr(src[at..].as_ptr().cast_mut())),
            };
            if landed {
                a.landed_batch("test", &[chunk])?;
            } else {
                a.apply_batch("test", &[chunk])?;
            }
        }
        a.finish().map_err(|(e, _)| e)?;
        Ok(param)
    }

    fn callback_plan(sizes: &[(&str, u64)]) -> Plan {
        let entries: Vec<PlanEntry> = sizes
            .iter()
            .map(|&(name, n)| PlanEntry {
                meta: TensorMeta {
                    name: name.into(),
                    dtype: DType::U8,
                    shape: vec![n],
                    nbytes: n,
                    checksum: None,
                },
                target: Target::Callback,
            })
            .collect();
        let bytes = sizes.iter().map(|s| s.1).sum();
        Plan {
            tensors: entries.len(),
            entries,
            bytes,
        }
    }

    fn callback_opts(mode: Mode, limit: u64) -> ApplyOptions {
        ApplyOptions {
            mode,
            verify: false,
            threads: 2,
            timeout: Duration::from_secs(10),
            callback_staging_limit: limit,
        }
    }

    /// The manifest of a hostile peer (a 1 TiB callback tensor) is refused
    /// before anything is allocated, in both modes, by the applier every
    /// source shares (rdma included).
    #[test]
    fn a_callback_tensor_past_the_limit_is_refused_before_allocating() {
        let plan = callback_plan(&[("huge", 1 << 40)]);
        let limit = crate::memory::loose::DEFAULT_CALLBACK_STAGING_LIMIT;
        for mode in [Mode::InPlace, Mode::Atomic] {
            let Err(e) = Applier::new(
                &plan,
                vec![None],
                callback_opts(mode, limit),
                Hooks::default(),
            ) else {
                panic!("{mode:?}: a 1 TiB callback tensor was accepted");
            };
            assert_eq!(e.code, crate::wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
            assert!(e.message.contains("tensor 'huge'"), "{e}");
            assert!(e.message.contains("callback_staging_limit"), "{e}");
        }
    }

    /// rdma lands callback tensors through `landing_for`: tensors received
    /// at once count together against the limit, each one alone fits.
    #[test]
    fn callback_tensors_received_at_once_share_the_limit() {
        let plan = callback_plan(&[("a", 3000), ("b", 3000)]);
        let opts = callback_opts(Mode::InPlace, 4096);
        let mut delivered = Vec::new();
        let mut hook = |v: &TensorView| {
            delivered.push(v.name.to_string());
            Ok(())
        };
        let hooks = Hooks {
            progress: None,
            tensor: Some(&mut hook),
        };
        let mut a = Applier::new(&plan, vec![None, None], opts, hooks).unwrap();
        a.landing_for(0, 0, 1000).unwrap();
        let e = a.landing_for(1, 0, 1000).unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
        assert!(
            e.message.contains("tensor 'b'") && e.message.contains("3000 bytes"),
            "{e}"
        );
        // Once 'a' is whole and delivered, 'b' fits.
        let whole = |t| Chunk {
            tensor: t,
            offset: 0,
            len: 3000,
            src: CopySource::Memory(SendPtr(std::ptr::null_mut())),
        };
        for t in 0..2 {
            let at = a.landing_for(t, 0, 3000).unwrap();
            // SAFETY: the landing holds the tensor's 3000 bytes.
            unsafe { std::ptr::write_bytes(at.0, 1, 3000) };
            a.landed_batch("test", &[whole(t)]).unwrap();
        }
        a.finish().map_err(|(e, _)| e).unwrap();
        assert_eq!(delivered, ["a", "b"]);
    }

    /// A tensor that arrives in several chunks is verified chunk by chunk
    /// as they land; the result must be the whole tensor's xxh3-128, and a
    /// flipped bit in any chunk must fail naming the tensor.
    #[test]
    fn tensors_in_chunks_are_verified_as_they_land() {
        let good: Vec<u8> = (0..3_000_001u32).map(|i| (i * 31 + 7) as u8).collect();
        let plan = plan_of(&good);
        for landed in [false, true] {
            for piece in [1usize << 20, 4096 + 3, good.len()] {
                let got = apply_in_pieces(&plan, &good, piece, landed).unwrap();
                assert!(got == good, "piece {piece}, landed {landed}");
                let mut bad = good.clone();
                bad[2_500_000] ^= 0x10;
                let e = apply_in_pieces(&plan, &bad, piece, landed).unwrap_err();
                assert_eq!(e.code, crate::wm_result::WM_ERR_CHECKSUM, "{e}");
                assert!(e.message.contains("tensor 'w'"), "{e}");
            }
        }
    }
}
