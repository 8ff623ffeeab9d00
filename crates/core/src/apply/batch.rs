//! One batch of chunks. Each chunk is checked against the plan (a source
//! can never make the applier write outside a planned tensor or write a
//! byte twice), routed once, and handled by its route's function; then the
//! batch's copies run in parallel, the tensors it completed are verified
//! and passed on (to device params, to the callback), and progress is
//! reported.

use super::route::Route;
use super::spans::SegmentWalk;
use super::upload::UploadFrom;
use super::{Applier, Chunk, Dest, DeviceBytes};
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::strided;
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::result::{Error, Result};

/// What a batch does once its chunks are routed.
#[derive(Default)]
struct BatchWork<'c> {
    /// Route::Copy: jobs for the parallel copier.
    copies: Vec<CopyJob<'c>>,
    /// Chunks that are part of a tensor (verifying): (tensor, bytes, len),
    /// hashed as soon as they are in memory.
    hash_chunks: Vec<(usize, SendPtr, usize)>,
    /// Route::Copy from memory, verifying: (tensor, src, dst, len), each
    /// tensor's in the order its bytes come, hashed as they are copied
    /// (before `hash_chunks`).
    hashed_copies: Vec<(usize, SendPtr, SendPtr, usize)>,
    /// Tensors with bytes in `hash_chunks`: their later chunks in the batch
    /// go there too, so that every tensor's bytes are hashed in order.
    hashed_apart: std::collections::HashSet<usize>,
    /// Route::DeviceToDevice: (GPU, dst, src, len).
    device_copies: Vec<(i32, u64, u64, usize)>,
    /// Tensors the device-to-device copies complete.
    completed_on_device: u64,
    device_views: Vec<(usize, DeviceBytes)>,
    host_views: Vec<(usize, SendPtr)>,
    /// Tensors whose last byte is received in this batch (Copy, Landed,
    /// OnDevice).
    completed: Vec<usize>,
}

impl Applier<'_, '_> {
    /// Apply `chunks`; `landed`: the source wrote them itself.
    pub(super) fn batch<'c>(
        &mut self,
        origin: &str,
        chunks: &[Chunk<'c>],
        landed: bool,
    ) -> Result<()> {
        self.check_deadline()?;
        let mut work = BatchWork::default();
        let mut rest = chunks;
        while !rest.is_empty() {
            let (run, tail) = rest.split_at(run_length(rest));
            rest = tail;
            self.take_run(origin, run, landed, &mut work)?;
        }
        self.run_batch(origin, work)
    }

    /// Check, route and take the chunks of `run` (one tensor, following
    /// on, one kind of source) as one: a tensor's many small blocks cost
    /// one check and one route, and their spans come from one walk of its
    /// segments.
    fn take_run<'c>(
        &mut self,
        origin: &str,
        run: &[Chunk<'c>],
        landed: bool,
        work: &mut BatchWork<'c>,
    ) -> Result<()> {
        let bytes = run
            .iter()
            .try_fold(0u64, |n, c| n.checked_add(c.len as u64))
            .unwrap_or(u64::MAX); // refused by `accept` as running past
        let all = Chunk {
            len: bytes as usize,
            ..run[0]
        };
        let Some(end) = self.accept(origin, &all)? else {
            return Ok(());
        };
        let t = all.tensor;
        let complete = end == self.plan.entries[t].bytes;
        let whole = run.len() == 1 && all.offset == 0 && complete && self.plan.moves_whole(t);
        match self.landing.route(&all, whole, landed, self.verifier.on) {
            Route::Copy | Route::Landed => {
                self.receive_in_memory(run, whole, complete, landed, work)?
            }
            Route::HostView { src } => work.host_views.push((t, src)),
            Route::DeviceView(bytes) => work.device_views.push((t, bytes)),
            Route::DeviceToDevice { param } => {
                self.copy_device_to_device(run, param, complete, work)?
            }
            Route::OnDevice { param } => {
                self.account_on_device(origin, run, param, landed, complete, work)?
            }
        }
        self.tally.now.bytes_done += bytes;
        Ok(())
    }

    /// Check chunk `c` against the plan and what was received before;
    /// returns where it ends, or None when there is nothing to do.
    fn accept(&mut self, origin: &str, c: &Chunk) -> Result<Option<u64>> {
        let Some(entry) = self.plan.entries.get(c.tensor) else {
            return Err(Error::format(format!(
                "{origin}: chunk names tensor #{} but the plan has {}",
                c.tensor,
                self.plan.entries.len()
            )));
        };
        if entry.target == Target::Skip || c.len == 0 {
            return Ok(None);
        }
        // What the entry receives: its segments back to back.
        let what = (c.tensor, entry.meta.name.as_str(), entry.bytes);
        let end = self.tally.accept(origin, what, c.offset, c.len)?;
        Ok(Some(end))
    }

    /// Route::Copy and Route::Landed: the run's bytes are (copied) where
    /// its tensor is received in host memory, a copy job per span.
    fn receive_in_memory<'c>(
        &mut self,
        run: &[Chunk<'c>],
        whole: bool,
        complete: bool,
        landed: bool,
        work: &mut BatchWork<'c>,
    ) -> Result<()> {
        let t = run[0].tensor;
        let mut spans = self.landing.spans_from(t, run[0].offset)?;
        let hashing = self.verifier.on && !whole;
        for c in run {
            // Memory copied here is hashed as it lands (read once,
            // `Verifier::copy_hashing`), whole tensors too; bytes a source
            // landed are hashed where they are (just landed, so still in
            // cache); a file's once copied, span by span in the order
            // received.
            let fused = match (self.verifier.on, landed, c.src) {
                (true, false, CopySource::Memory(src)) if !work.hashed_apart.contains(&t) => {
                    Some(src)
                }
                _ => None,
            };
            if hashing && fused.is_none() {
                work.hashed_apart.insert(t);
            }
            let work = &mut *work;
            spans
                .map(c.offset, c.len as u64, |s| match fused {
                    Some(src) => {
                        let from = SendPtr(src.0.wrapping_add(s.at as usize));
                        work.hashed_copies.push((t, from, s.dst, s.len as usize));
                    }
                    None => {
                        if hashing {
                            work.hash_chunks.push((t, s.dst, s.len as usize));
                        }
                        if !landed {
                            work.copies.push(CopyJob {
                                src: c.src.advanced(s.at),
                                dst: s.dst,
                                len: s.len as usize,
                                tag: t,
                            });
                        }
                    }
                })
                .map_err(|at| self.landing.no_run(t, at))?;
        }
        // In place, the batch's copies (or the source) wrote the param.
        if matches!(self.plan.entries[t].target, Target::Param(_)) && self.landing.in_place() {
            self.landing.writes_params();
        }
        if complete {
            work.completed.push(t);
        }
        Ok(())
    }

    /// Route::DeviceToDevice: queued once the batch is checked.
    fn copy_device_to_device(
        &mut self,
        run: &[Chunk],
        (ptr, ordinal): (u64, i32),
        complete: bool,
        work: &mut BatchWork,
    ) -> Result<()> {
        let t = run[0].tensor;
        let mut walk = SegmentWalk::at(self.plan.segments(t), run[0].offset);
        for c in run {
            // The run's chunks are all GPU memory (`run_length`).
            let CopySource::Device { ptr: src, .. } = c.src else {
                continue;
            };
            let copies = &mut work.device_copies;
            walk.map(c.offset, c.len as u64, |at, p, len| {
                copies.push((ordinal, ptr + p, src + at, len as usize))
            })
            .map_err(|at| self.landing.no_run(t, at))?;
        }
        // The queued copies write the param itself.
        self.landing.writes_params();
        work.completed_on_device += u64::from(complete);
        Ok(())
    }

    /// Route::OnDevice: the bytes are in the device param already (gdr);
    /// verifying, they are hashed there once the tensor is complete.
    fn account_on_device(
        &mut self,
        origin: &str,
        run: &[Chunk],
        (ptr, ordinal): (u64, i32),
        landed: bool,
        complete: bool,
        work: &mut BatchWork,
    ) -> Result<()> {
        let t = run[0].tensor;
        if !landed {
            return Err(Error::format(format!(
                "{origin}: tensor '{}' must land in its GPU param (gdr), not be copied",
                self.name(t)
            )));
        }
        if self.verifier.on {
            for c in run {
                let at = ptr + self.landing.param_offset(t, c.offset, c.len as u64)?;
                (self.verifier).landed_on_device(t, (at, ordinal), c.len);
            }
        }
        if complete {
            work.completed.push(t);
        }
        Ok(())
    }

    /// Copy, hash, verify and pass on what the batch's chunks completed.
    fn run_batch(&mut self, origin: &str, work: BatchWork) -> Result<()> {
        let threads = self.opts.threads;
        // SAFETY: every destination is inside a planned tensor's memory
        // (range checked against its byte size), each byte is written once
        // (offsets must follow on exactly), and sources are valid per the
        // Chunk contract.
        let copied = unsafe { copy_all(&work.copies, threads) };
        let verifier = &mut self.verifier;
        copied
            .and_then(|()| {
                // SAFETY: as for the copies above.
                unsafe { verifier.copy_hashing(&work.hashed_copies, threads) }
            })
            .map_err(|e| {
                e.error
                    .context(format!("tensor '{}' from {origin}", self.name(e.tag)))
            })?;
        for &t in &work.completed {
            let n = self.plan.entries[t].bytes as usize;
            // SAFETY: every byte up to n was just written, into a buffer
            // allocated for n.
            unsafe { self.landing.loose.filled(t, n) };
        }
        self.verifier.hash_chunks(&work.hash_chunks);
        (self.verifier).verify(origin, &work.completed, &mut self.landing)?;
        self.tally.now.tensors_done += work.completed.len() as u64 + work.completed_on_device;
        // Equally spaced blocks (a strided part's rows) go as one 2D copy.
        let blocks = work
            .device_copies
            .iter()
            .map(|&(g, dst, src, n)| (g, (dst, src, n)));
        for run in strided::runs(blocks) {
            self.landing.copy_on_device(origin, run)?;
        }
        for &(t, bytes) in &work.device_views {
            self.deliver_view(t, &[], Some(bytes))?;
            self.tally.now.tensors_done += 1;
        }
        for &(t, src) in &work.host_views {
            self.deliver_host_view(origin, t, src)?;
            self.tally.now.tensors_done += 1;
        }
        if self.landing.in_place() {
            for &t in &work.completed {
                self.pass_on(origin, t)?;
            }
        } else {
            self.upload_early(origin, &work.completed)?;
        }
        self.tally.report(self.hooks.progress.as_deref_mut())
    }

    /// Route::HostView: verify the tensor where it is and hand it out.
    fn deliver_host_view(&mut self, origin: &str, t: usize, src: SendPtr) -> Result<()> {
        let n = self.plan.entries[t].meta.nbytes as usize;
        // SAFETY: the source promises the bytes stay put during the batch;
        // the callback sees them only during its call.
        let data = unsafe { std::slice::from_raw_parts(src.0, n) };
        if self.verifier.on {
            (self.verifier).check_checksum(origin, t, crate::checksum::of(data))?;
        }
        self.deliver_streaming(t, data)
    }

    /// Atomic: completed tensors of device params with a device shadow go
    /// up into the shadow now, while the rest still arrives (and, staged,
    /// while the engine serves): the commit is left the swap alone.
    fn upload_early(&mut self, origin: &str, completed: &[usize]) -> Result<()> {
        let Some(arena) = self.landing.arena.take() else {
            return Ok(());
        };
        let r = completed.iter().try_for_each(|&t| {
            match (self.plan.entries[t].target, self.landing.params[t]) {
                (Target::Param(i), Some(Dest::Device { ptr, ordinal }))
                    if self.landing.uploads_early(i) =>
                {
                    (self.landing).upload_staged(origin, t, (i, (ptr, ordinal)), &arena)
                }
                _ => Ok(()),
            }
        });
        self.landing.arena = Some(arena);
        r
    }

    /// In place: a tensor received whole in a buffer of the applier's goes
    /// on to its device param or the callback.
    fn pass_on(&mut self, origin: &str, t: usize) -> Result<()> {
        let landing = &mut self.landing;
        let device = match landing.params[t] {
            Some(Dest::Device { ptr, ordinal }) => Some((ptr, ordinal)),
            _ => None,
        };
        if let (Some(param), Some(buf)) = (device, landing.pinned.remove(&t)) {
            return landing.upload(origin, t, param, UploadFrom::Pinned(buf));
        }
        if landing.gdr_param(t).is_some() {
            return Ok(()); // already in the param
        }
        if self.plan.entries[t].target == Target::Callback || device.is_some() {
            let data = landing.loose.take(t);
            match device {
                Some(param) => landing.upload(origin, t, param, UploadFrom::Host(&data))?,
                None => self.deliver_streaming(t, &data)?,
            }
            self.landing.loose.recycle(data);
        }
        Ok(())
    }
}

/// How many chunks from the first are one run: of one tensor, each
/// starting where the one before it ended, all from the same kind of
/// source (memory, a file, GPU memory), so they take one route.
fn run_length(chunks: &[Chunk]) -> usize {
    let first = &chunks[0];
    let kind = std::mem::discriminant(&first.src);
    let mut end = first.offset.checked_add(first.len as u64);
    1 + chunks[1..]
        .iter()
        .take_while(|c| {
            let follows = c.tensor == first.tensor
                && Some(c.offset) == end
                && std::mem::discriminant(&c.src) == kind;
            end = end.and_then(|e| e.checked_add(c.len as u64));
            follows
        })
        .count()
}
