//! Atomic mode's device page swap (`ManagerConfig::swap_device_pages`):
//! which library-owned device params an update swaps, their shadows, and
//! the commit that swaps them all or none.
//!
//! A library-owned device param whose runs write every byte of it gets a
//! shadow (`memory::device_swap`) when the applier is made, before any
//! byte moves, so an update that cannot get the device memory fails
//! before it reads anything. Its bytes are staged in host memory as for
//! every device param and uploaded into the shadow instead of the param as
//! soon as each tensor is complete and verified (`batch.rs`,
//! `upload_early`: the param is left as it was, and a staged update's
//! commit is left the swap alone). After the uploads
//! are settled the shadows are swapped in, in param order; if one swap
//! fails, those already made are swapped back, so the old weights stay
//! whole. Only when a swap back fails too (or the failed swap could not
//! map the old memory again) does the update count as having written
//! params, and the manager reports FAILED. The old memory of every swapped
//! param is freed once all swaps went through: right there in a one-call
//! update, on a thread of its own after a staged commit (the engine's
//! pause is then the remaps alone).
//!
//! The swap itself runs from the landing's commit (`shadows.rs`).
//!
//! Memory: the device memory of the swapped params doubles for the update
//! (the shadows are freed, or become the params, when it ends); the host
//! staging is the same as without the swap.

use crate::memory::deferred::DeferredRelease;
use crate::memory::device::DeviceRegion;
use crate::memory::device_swap::DevicePages;
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use std::collections::BTreeMap;

/// The params `plan` swaps: every param `i` with a region (`sizes[i]`, its
/// bytes) whose runs cover all of it, in param order. Runs never overlap
/// (the plan checked), so bytes covered = size and last byte = size mean
/// every byte is written. Quantized params are not swapped: their bytes
/// land in their source's dtype elsewhere and the quantizer writes the
/// param at the commit (`quantize.rs`).
pub(super) fn swapped_params(plan: &Plan, sizes: &[Option<u64>]) -> Vec<usize> {
    let mut swapped: Vec<usize> = plan
        .param_cover()
        .into_iter()
        .filter(|&(i, _, _)| plan.quantized_from(i).is_none())
        .filter(|&(i, end, covered)| {
            sizes
                .get(i)
                .copied()
                .flatten()
                .is_some_and(|n| covered == n && end == n)
        })
        .map(|(i, _, _)| i)
        .collect();
    swapped.sort_unstable();
    swapped
}

/// An update's device shadows, per param number, and where the memory
/// the commit takes out goes: freed off the pause (a staged commit,
/// `memory::deferred::DeferredRelease`), or here.
#[derive(Default)]
pub(super) struct DeviceShadows<'p> {
    shadows: BTreeMap<usize, (&'p DeviceRegion, DevicePages)>,
    release: Option<&'p DeferredRelease>,
}

impl<'p> DeviceShadows<'p> {
    /// Shadows for every param of `plan` with a region in `regions` (per
    /// param number; empty when the swap is off) that the plan writes
    /// whole.
    pub fn for_plan(
        plan: &Plan,
        (regions, release): (&[Option<&'p DeviceRegion>], Option<&'p DeferredRelease>),
    ) -> Result<DeviceShadows<'p>> {
        let sizes: Vec<Option<u64>> = regions.iter().map(|r| r.map(|r| r.len() as u64)).collect();
        let mut shadows = BTreeMap::new();
        for i in swapped_params(plan, &sizes) {
            let region = regions[i].expect("a region");
            let pages = region.shadow(region.len(), &param_name(plan, i))?;
            shadows.insert(i, (region, pages));
        }
        Ok(DeviceShadows { shadows, release })
    }

    /// Where param `i`'s bytes go instead of the param: its shadow.
    pub fn target(&self, i: usize) -> Option<u64> {
        self.shadows.get(&i).and_then(|(_, p)| p.ptr())
    }

    /// Whether param `i` has a shadow (its view dropped or not).
    pub fn has(&self, i: usize) -> bool {
        self.shadows.contains_key(&i)
    }

    /// A staged update, every upload settled: wait (until `deadline`) for
    /// what else wrote the shadows (the zeroing of their tails, queued on
    /// the default stream when they were made), then unmap their views, so
    /// the commit's swaps map each shadow's memory at one place (the
    /// param's). Nothing may be uploaded after this.
    pub fn drop_views(&mut self, deadline: std::time::Instant) -> Result<()> {
        let gpus: std::collections::BTreeSet<i32> =
            self.shadows.values().map(|(r, _)| r.ordinal()).collect();
        for gpu in gpus {
            let what = "the shadows' zeroing";
            crate::memory::cuda_ipc::wait_default_stream(gpu, deadline, what)?;
        }
        for (_, pages) in self.shadows.values_mut() {
            pages.drop_view();
        }
        Ok(())
    }

    /// Swap every shadow in, all or none (module docs). On error, the
    /// bool says whether a param was left changed.
    pub fn swap_all(
        &mut self,
        name: impl Fn(usize) -> String,
    ) -> std::result::Result<(), (Error, bool)> {
        let mut done: Vec<(usize, &DeviceRegion, Option<DevicePages>)> = Vec::new();
        // One wait per GPU for the engine's queued kernels and the
        // uploads, not one per param: the pause is the swaps.
        let gpus: std::collections::BTreeSet<i32> =
            self.shadows.values().map(|(r, _)| r.ordinal()).collect();
        for gpu in gpus {
            crate::memory::cuda_ipc::synchronize(gpu).map_err(|e| (e, false))?;
        }
        // One thread: on an H200 (32 params of 64 MiB) the swaps took
        // 1.8 ms in a row and 2.7, 2.9 and 3.3 ms spread over 2, 4 and 8
        // threads (the driver serializes its mapping calls).
        for (i, (region, pages)) in std::mem::take(&mut self.shadows) {
            match region.swap_in_synchronized(pages) {
                Ok(old) => done.push((i, region, old)),
                Err(e) => {
                    let mut error = e.context(name(i));
                    let mut changed = !region.is_mapped();
                    for (j, back, old) in done.into_iter().rev() {
                        let undone = old.map(|o| back.swap_in(o).map(drop));
                        match undone {
                            Some(Ok(())) => {}
                            Some(Err(e)) => {
                                changed = true;
                                error = error.context(format!(
                                    "swapping {} back failed ({e}), it holds the new weights or none",
                                    name(j)
                                ));
                            }
                            None => changed = true,
                        }
                    }
                    return Err((error, changed));
                }
            }
        }
        let taken_out = done.into_iter().filter_map(|(_, _, old)| old).collect();
        match self.release {
            Some(release) => release.later(taken_out),
            None => drop(taken_out),
        }
        Ok(())
    }
}

/// "param 'NAME'" for param `i`, from the first plan entry that targets it.
pub(super) fn param_name(plan: &Plan, i: usize) -> String {
    let e = plan.entries.iter().find(|e| e.target == Target::Param(i));
    format!("param '{}'", e.map_or("?", |e| e.meta.name.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::TensorMeta;
    use crate::plan::PlanEntry;
    use crate::tensor::DType;

    fn entry(name: &str, n: u64, target: Target) -> PlanEntry {
        PlanEntry::new(TensorMeta::whole(name, DType::U8, &[n]), 0, target)
    }

    #[test]
    fn only_params_with_a_region_written_whole_swap() {
        let plan = Plan::new(vec![
            entry("a", 100, Target::Param(0)),
            entry("b", 50, Target::Param(1)),
            entry("c", 10, Target::Param(2)),
            entry("cb", 10, Target::Callback),
            entry("skipped", 10, Target::Skip),
        ]);
        // a: whole; b: its region is larger (half written); c: no region.
        let sizes = [Some(100), Some(100), None];
        assert_eq!(swapped_params(&plan, &sizes), vec![0]);
        // Without regions (the swap off) nothing swaps.
        assert!(swapped_params(&plan, &[]).is_empty());
    }

    #[test]
    fn a_param_written_whole_by_several_runs_swaps_a_gap_does_not() {
        let halves = || {
            let mut plan = Plan::new(vec![
                entry("a.0", 50, Target::Param(0)),
                entry("a.1", 50, Target::Param(0)),
            ]);
            plan.runs[1].param = 50..100;
            plan
        };
        assert_eq!(swapped_params(&halves(), &[Some(100)]), vec![0]);
        // The second half lands one byte late: byte 50 is never written.
        let mut gap = halves();
        gap.runs[1].param = 51..101;
        assert!(swapped_params(&gap, &[Some(101)]).is_empty());
        // Strided rows: 4 rows of 10 bytes every 25 write 40 of the 85
        // bytes they span.
        let mut rows = Plan::new(vec![entry("r", 40, Target::Param(0))]);
        rows.runs[0].source = 0..10;
        rows.runs[0].param = 0..10;
        (
            rows.runs[0].rows,
            rows.runs[0].source_stride,
            rows.runs[0].param_stride,
        ) = (4, 10, 25);
        assert!(swapped_params(&rows, &[Some(85)]).is_empty());
    }
}
