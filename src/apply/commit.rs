//! The end of an update: check that every planned byte arrived, then make
//! the bytes the engine's weights. Atomic: copy the arena into host params,
//! upload device params, hand callback tensors out. In place: only callback
//! tensors not yet delivered (empty ones) are left. Either way, wait for
//! the uploads.

use super::receive::Arena;
use super::upload::UploadFrom;
use super::{Applied, Applier, Dest};
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::result::{Error, Result};
use std::time::Instant;

impl Applier<'_, '_> {
    pub(super) fn commit(&mut self) -> Result<Applied> {
        let receive = self.started.elapsed();
        self.check_complete()?;
        self.check_deadline()?;
        let commit_start = Instant::now();
        if let Some(arena) = self.arena.take() {
            self.commit_arena(&arena)?;
            // The arena is freed here; `upload` copied its bytes into
            // pinned buffers before returning.
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

    /// Every planned tensor arrived whole.
    fn check_complete(&self) -> Result<()> {
        let incomplete: Vec<String> = self
            .plan
            .entries
            .iter()
            .zip(&self.received)
            .filter(|(e, r)| e.target != Target::Skip && **r < e.bytes)
            .map(|(e, r)| format!("'{}' ({r} of {} bytes)", e.meta.name, e.bytes))
            .collect();
        if incomplete.is_empty() {
            return Ok(());
        }
        Err(Error::format(format!(
            "the source ended before {} tensor(s) were complete: {}",
            incomplete.len(),
            incomplete
                .into_iter()
                .take(5)
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    /// Atomic: every run into its host param in parallel, then device
    /// params and callback tensors from their slots.
    fn commit_arena(&mut self, arena: &Arena) -> Result<()> {
        let mut jobs: Vec<CopyJob> = Vec::new();
        for (t, segs) in self.segments.iter().enumerate() {
            let Some(Dest::Host(param)) = self.params[t] else {
                continue;
            };
            if !matches!(self.plan.entries[t].target, Target::Param(_)) {
                continue;
            }
            jobs.extend(segs.iter().filter(|s| s.len > 0).map(|s| CopyJob {
                src: CopySource::Memory(SendPtr(arena.slot(t).wrapping_add(s.wanted as usize))),
                dst: SendPtr(param.0.wrapping_add(s.param as usize)),
                len: s.len as usize,
                tag: t,
            }));
        }
        self.wrote_params = !jobs.is_empty();
        // SAFETY: arena slots and param memory are disjoint, both sized by the plan.
        unsafe { copy_all(&jobs, self.opts.threads) }.map_err(|e| e.error)?;
        for t in 0..self.plan.entries.len() {
            let device = self.params[t];
            let callback = self.plan.entries[t].target == Target::Callback;
            if !callback && !matches!(device, Some(Dest::Device { .. })) {
                continue;
            }
            let n = self.plan.entries[t].bytes as usize;
            // SAFETY: slot t holds n verified bytes; the arena outlives this call.
            let data = unsafe { std::slice::from_raw_parts(arena.slot(t), n) };
            match device {
                Some(Dest::Device { ptr, ordinal }) => self.upload(
                    "the staging arena",
                    t,
                    (ptr, ordinal),
                    UploadFrom::Host(data),
                )?,
                _ => self.deliver(t, data)?,
            }
        }
        Ok(())
    }
}
