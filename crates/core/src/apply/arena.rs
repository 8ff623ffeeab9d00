//! Atomic mode's staging: a shadow per target param and a slot per
//! callback tensor. Sources write a param's bytes into its shadow at the
//! plan's `run.param` offsets; the commit makes the shadows the params.
//!
//! - A library-owned host param whose runs cover it whole gets a shadow of
//!   its own (a [`HostRegion`] of the param's size), swapped in at commit
//!   (`memory::swap`): no copy, the address kept, the old pages freed
//!   (unless the process cannot swap: `memory::swap::swaps_here`).
//! - Every other param (engine-owned host memory, device params) and every
//!   callback tensor gets a slot in one packed region, copied (or uploaded,
//!   or handed to the callback) at commit. That region can be kept for the
//!   next update (`ManagerConfig::keep_atomic_staging`), so only the first
//!   update faults it in.
//!
//! Everything is mapped and faulted in (on every core) when the arena is
//! made, before any byte moves, except what the manager kept or faulted in
//! ahead (`AtomicStaging`); the sizes are the registry's params' and the
//! plan's callback tensors' (bounded by the callback staging limit before
//! this runs). An arena dropped without a commit (a failed update) frees
//! its own shadows, so the new pages go and the old ones stay.

use crate::memory::aligned_offsets;
use crate::memory::deferred::DeferredRelease;
use crate::memory::host::{populate_all, HostRegion};
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use std::collections::HashMap;

/// What an atomic update's arena may use besides fresh memory (the
/// manager's; [`Default`]: nothing, every shadow packed and freed after).
#[derive(Default)]
pub struct AtomicStaging<'p> {
    /// Per param number: the library-owned host region of the param, when
    /// it has one; its shadow is swapped in at commit.
    pub swappable: Vec<Option<&'p HostRegion>>,
    /// Where the packed region is kept between updates: taken when the
    /// arena is made, put back when the update ends (done or failed).
    /// None: it is freed when the update ends.
    pub keep: Option<&'p mut Option<HostRegion>>,
    /// Shadows faulted in ahead, per param number: used for the params
    /// that get a shadow of their own when the size matches.
    pub ready: HashMap<usize, HostRegion>,
    /// Per param number: the library-owned device region of the param,
    /// when the manager swaps device pages (`apply::device_swap`); empty
    /// otherwise.
    pub device: Vec<Option<&'p crate::memory::device::DeviceRegion>>,
    /// A staged commit: where the device memory it takes out of params
    /// goes to be freed after the commit returned (None: freed at once).
    pub device_release_later: Option<&'p DeferredRelease>,
    /// A staged commit: where the old pages of library-owned host params
    /// go, by param number, kept out of the pause (`memory::swap`'s
    /// `swap_in_deferring`: the manager reuses them as the next update's
    /// shadows, or frees them after the commit returned); None: the swap
    /// frees them.
    pub swapped_out: Option<&'p parking_lot::Mutex<Vec<(usize, HostRegion)>>>,
}

/// Where a param's shadow is.
enum Shadow {
    /// A mapping of its own, to be swapped in.
    Own(HostRegion),
    /// At this offset of the packed region, to be copied.
    Packed(usize),
}

pub struct Arena {
    /// Per target param number.
    shadows: HashMap<usize, Shadow>,
    /// Per callback plan entry: its slot's offset in `packed`.
    callback: HashMap<usize, usize>,
    packed: Option<HostRegion>,
}

impl Arena {
    /// The arena for `plan`, using what `staging` offers: the packed region
    /// it keeps (reused when large enough) and shadows faulted in ahead.
    pub fn for_plan(plan: &Plan, staging: &mut AtomicStaging, threads: usize) -> Result<Arena> {
        let swappable = &staging.swappable;
        let kept = staging.keep.as_deref_mut().and_then(Option::take);
        let Layout {
            own,
            packed: packed_sizes,
        } = layout(plan, swappable);
        let (offsets, size) = aligned_offsets(packed_sizes.iter().map(|(_, n)| *n))
            .ok_or_else(|| Error::out_of_memory("staging size overflows"))?;
        let fresh = |what: &str, n: usize| {
            HostRegion::new(what, n).map_err(|e| {
                e.context(format!(
                    "atomic mode stages the whole update ({n} bytes here); use in-place mode to update without extra memory"
                ))
            })
        };
        let packed = match kept {
            Some(k) if k.len() >= size && size > 0 => Some((k, false)),
            _ if size > 0 => Some((fresh("atomic staging", size)?, true)),
            _ => None,
        };
        let mut shadows = HashMap::new();
        let mut callback = HashMap::new();
        for ((key, _), at) in packed_sizes.iter().zip(offsets) {
            match key {
                Slot::Param(i) => {
                    shadows.insert(*i, Shadow::Packed(at));
                }
                Slot::Callback(t) => {
                    callback.insert(*t, at);
                }
            }
        }
        let mut made = Vec::new();
        for (i, n) in own {
            match staging.ready.remove(&i) {
                Some(r) if r.len() == n => shadows.insert(i, Shadow::Own(r)),
                _ => {
                    made.push(i);
                    shadows.insert(i, Shadow::Own(fresh("atomic shadow", n)?))
                }
            };
        }
        let mut to_fault: Vec<&HostRegion> = Vec::new();
        for i in &made {
            if let Some(Shadow::Own(r)) = shadows.get(i) {
                to_fault.push(r);
            }
        }
        if let Some((r, true)) = &packed {
            to_fault.push(r);
        }
        populate_all(&to_fault, threads, false).map_err(|e| e.context("atomic staging"))?;
        Ok(Arena {
            shadows,
            callback,
            packed: packed.map(|(r, _)| r),
        })
    }

    /// The start of param `i`'s shadow (the param's byte 0).
    pub fn param_shadow(&self, i: usize) -> *mut u8 {
        self.shadow_of(i).expect("a target param has a shadow")
    }

    /// The start of param `i`'s shadow, if it is a target param.
    pub fn shadow_of(&self, i: usize) -> Option<*mut u8> {
        Some(match self.shadows.get(&i)? {
            Shadow::Own(r) => r.ptr(),
            Shadow::Packed(at) => self.packed_at(*at),
        })
    }

    /// The start of callback tensor `t`'s slot (plan entry `t`).
    pub fn callback_slot(&self, t: usize) -> *mut u8 {
        self.packed_at(self.callback[&t])
    }

    /// Param `i`'s own shadow, to be swapped in (None: it is copied from
    /// [`Arena::param_shadow`]). Taken once.
    pub fn take_own_shadow(&mut self, i: usize) -> Option<HostRegion> {
        match self.shadows.remove(&i)? {
            Shadow::Own(r) => Some(r),
            packed => {
                self.shadows.insert(i, packed);
                None
            }
        }
    }

    /// True when param `i` has a shadow of its own (not yet taken).
    pub fn has_own_shadow(&self, i: usize) -> bool {
        matches!(self.shadows.get(&i), Some(Shadow::Own(_)))
    }

    /// The packed region, to keep for the next update.
    pub fn into_kept(self) -> Option<HostRegion> {
        self.packed
    }

    fn packed_at(&self, at: usize) -> *mut u8 {
        let base = self
            .packed
            .as_ref()
            .map_or(std::ptr::null_mut(), |r| r.ptr());
        base.wrapping_add(at)
    }
}

#[derive(Clone, Copy)]
enum Slot {
    Param(usize),
    Callback(usize),
}

/// How an arena is laid out: params with a shadow of their own (number,
/// bytes), and the slots of the packed region (what, bytes).
struct Layout {
    own: Vec<(usize, usize)>,
    packed: Vec<(Slot, u64)>,
}

/// The arena's layout for `plan`, in plan order.
fn layout(plan: &Plan, swappable: &[Option<&HostRegion>]) -> Layout {
    let mut packed: Vec<(Slot, u64)> = plan
        .runs
        .iter()
        .filter(|run| run.target == Target::Callback && run.source.start == 0)
        .map(|run| {
            (
                Slot::Callback(run.entry),
                plan.entries[run.entry].meta.nbytes,
            )
        })
        .collect();
    let mut own = Vec::new();
    let swaps = crate::memory::swap::swaps_here();
    for (i, end, covered) in plan.param_cover() {
        // A quantized param's shadow holds its source's dtype (`end`
        // bytes), quantized at commit, never swapped.
        let swappable = swappable.get(i).copied().flatten();
        match swappable.filter(|_| plan.quantized_from(i).is_none()) {
            // Swapped whole, so every byte of the param must be written.
            Some(r) if swaps && covered == r.len() as u64 && end == r.len() as u64 => {
                own.push((i, r.len()))
            }
            Some(r) => packed.push((Slot::Param(i), r.len() as u64)),
            None => packed.push((Slot::Param(i), end)),
        }
    }
    Layout { own, packed }
}
