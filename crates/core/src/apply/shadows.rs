//! Atomic mode's commit, the landing's side: the shadows become the
//! params. Runs into host params without a shadow of their own are copied
//! in parallel; each own shadow is swapped in (one `mremap` per param, no
//! copy); once the uploads settled, device shadows are swapped in
//! (`device_swap.rs`). Each records its write first.

use super::arena::Arena;
use super::device_swap::param_name;
use super::landing::Landing;
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::host::HostRegion;
use crate::memory::swap::{swap_in, swap_in_deferring};
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::result::Result;

impl<'p> Landing<'p> {
    /// Copy every segment into a host param whose shadow is packed.
    pub fn copy_shadows(&mut self, arena: &Arena) -> Result<()> {
        let jobs = self.shadow_copies(arena);
        if !jobs.is_empty() {
            self.writes_params();
        }
        // SAFETY: shadows and param memory are disjoint, both sized by the plan.
        unsafe { copy_all(&jobs, self.threads) }.map_err(|e| e.error)
    }

    /// Copy jobs for every segment into a host param whose shadow is packed.
    fn shadow_copies(&self, arena: &Arena) -> Vec<CopyJob<'static>> {
        let mut jobs = Vec::new();
        for t in 0..self.plan.entries.len() {
            let segs = self.plan.segments(t);
            let (Target::Param(i), Some(crate::registry::Dest::Host(param))) =
                (self.plan.entries[t].target, self.params[t])
            else {
                continue;
            };
            // Quantized from the shadow (`quantize.rs`), not copied.
            if (self.swappable_region(i).is_some() && arena.has_own_shadow(i))
                || self.plan.quantized_from(i).is_some()
            {
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

    /// Swap every own shadow into its library-owned param. A staged
    /// commit's old pages are kept out of the pause (`swapped_out`).
    pub fn swap_shadows(&mut self, arena: &mut Arena) -> Result<()> {
        for i in 0..self.swappable.len() {
            let (Some(param), Some(shadow)) = (self.swappable_region(i), arena.take_own_shadow(i))
            else {
                continue;
            };
            self.writes_params();
            let swap = match self.swapped_out {
                Some(out) => swap_in_deferring(param, shadow)
                    .map(|old| out.lock().extend(old.map(|old| (i, old)))),
                None => swap_in(param, shadow),
            };
            swap.map_err(|e| e.context(param_name(self.plan, i)))?;
        }
        Ok(())
    }

    fn swappable_region(&self, i: usize) -> Option<&'p HostRegion> {
        self.swappable.get(i).copied().flatten()
    }

    /// After the uploads settled: swap the device shadows in. A failure
    /// that left a param changed counts as written.
    pub fn swap_device_shadows(&mut self) -> Result<()> {
        let plan = self.plan;
        let name = |i: usize| param_name(plan, i);
        let swapped = self.device_shadows.swap_all(name);
        swapped.map_err(|(e, changed)| {
            if changed {
                self.writes_params();
            }
            e
        })
    }

    /// The arena's packed region goes where the manager keeps it, if it
    /// keeps one; otherwise it is freed here.
    pub fn keep_packed(&mut self, arena: Arena) {
        if let (Some(slot), Some(packed)) = (self.keep.as_deref_mut(), arena.into_kept()) {
            *slot = Some(packed);
        }
    }
}
