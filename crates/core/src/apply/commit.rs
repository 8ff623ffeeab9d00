//! The end of an update: check that every planned byte arrived, then make
//! the bytes the engine's weights. Atomic: swap shadows into library-owned
//! host params, copy the rest into engine-owned ones, upload device params,
//! hand callback tensors out, and once the uploads settled swap device
//! shadows in (`device_swap.rs`). In place: only callback
//! tensors not yet delivered (empty ones) are left. Either way, wait for
//! the uploads.

use super::arena::Arena;
use super::upload::UploadFrom;
use super::{Applied, Applier, Dest};
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::host::HostRegion;
use crate::memory::swap::swap_in;
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::result::{Error, Result};
use std::time::Instant;

impl<'p> Applier<'p, '_> {
    pub(super) fn commit(&mut self) -> Result<Applied> {
        let receive = self.started.elapsed();
        self.check_complete()?;
        self.check_deadline()?;
        let commit_start = Instant::now();
        if let Some(arena) = self.arena.take() {
            // `upload` copies the arena's bytes into pinned buffers before
            // it returns, so the arena may be reused or freed after this.
            self.commit_arena(arena)?;
        } else {
            for t in 0..self.plan.entries.len() {
                if self.plan.entries[t].target == Target::Callback && !self.delivered[t] {
                    self.deliver(t, &[])?;
                }
            }
        }
        self.settle_uploads()?;
        self.swap_device_shadows()?;
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

    /// Atomic: runs into host params without a shadow of their own are
    /// copied in parallel, device params are uploaded from their shadows,
    /// callback tensors handed out from their slots; last, each own shadow
    /// is swapped in (one `mremap` per param, no copy).
    fn commit_arena(&mut self, mut arena: Arena) -> Result<()> {
        let jobs = self.shadow_copies(&arena);
        self.wrote_params |= !jobs.is_empty();
        // SAFETY: shadows and param memory are disjoint, both sized by the plan.
        unsafe { copy_all(&jobs, self.opts.threads) }.map_err(|e| e.error)?;
        for t in 0..self.plan.entries.len() {
            match (self.plan.entries[t].target, self.params[t]) {
                (Target::Param(i), Some(Dest::Device { ptr, ordinal })) => {
                    let end = self.plan.segments(t).iter().map(|s| s.param + s.len).max();
                    // SAFETY: the shadow holds the param's verified bytes up
                    // to its last run's end; the arena outlives this call.
                    let shadow = unsafe {
                        std::slice::from_raw_parts(arena.param_shadow(i), end.unwrap_or(0) as usize)
                    };
                    let from = UploadFrom::ParamShadow(shadow);
                    self.upload("the staging arena", t, (ptr, ordinal), from)?
                }
                (Target::Callback, _) => {
                    let n = self.plan.entries[t].meta.nbytes as usize;
                    // SAFETY: slot t holds n verified bytes; the arena outlives this call.
                    let data = unsafe { std::slice::from_raw_parts(arena.callback_slot(t), n) };
                    self.deliver(t, data)?
                }
                _ => {}
            }
        }
        self.swap_shadows(&mut arena)?;
        self.keep_packed(arena);
        Ok(())
    }

    /// Copy jobs for every segment into a host param whose shadow is packed.
    fn shadow_copies(&self, arena: &Arena) -> Vec<CopyJob<'static>> {
        let mut jobs = Vec::new();
        for t in 0..self.plan.entries.len() {
            let segs = self.plan.segments(t);
            let (Target::Param(i), Some(Dest::Host(param))) =
                (self.plan.entries[t].target, self.params[t])
            else {
                continue;
            };
            if self.swappable_region(i).is_some() && arena.has_own_shadow(i) {
                continue;
            }
            jobs.extend(segs.iter().filter(|s| s.len > 0).map(|s| {
                let at = s.param as usize;
                CopyJob {
                    src: CopySource::Memory(SendPtr(arena.param_shadow(i).wrapping_add(at))),
                    dst: SendPtr(param.0.wrapping_add(at)),
                    len: s.len as usize,
                    tag: t,
                }
            }));
        }
        jobs
    }

    /// Swap every own shadow into its library-owned param.
    fn swap_shadows(&mut self, arena: &mut Arena) -> Result<()> {
        for i in 0..self.swappable.len() {
            let (Some(param), Some(shadow)) = (self.swappable_region(i), arena.take_own_shadow(i))
            else {
                continue;
            };
            self.wrote_params = true;
            swap_in(param, shadow)
                .map_err(|e| e.context(format!("param '{}'", self.param_name(i).unwrap_or("?"))))?;
        }
        Ok(())
    }

    fn swappable_region(&self, i: usize) -> Option<&'p HostRegion> {
        self.swappable.get(i).copied().flatten()
    }

    /// The name of param `i`, from the first plan entry that targets it.
    fn param_name(&self, i: usize) -> Option<&str> {
        let e = self
            .plan
            .entries
            .iter()
            .find(|e| e.target == Target::Param(i))?;
        Some(&e.meta.name)
    }

    /// The arena's packed region goes where the manager keeps it, if it
    /// keeps one; otherwise it is freed here.
    pub(super) fn keep_packed(&mut self, arena: Arena) {
        if let (Some(slot), Some(packed)) = (self.keep.as_deref_mut(), arena.into_kept()) {
            *slot = Some(packed);
        }
    }
}
