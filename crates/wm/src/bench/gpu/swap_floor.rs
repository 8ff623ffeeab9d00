//! The floor of a device page swap: the driver calls that put new
//! physical memory under `count` ranges of `len` bytes, timed alone (no
//! update around them), two ways:
//!
//! - per range, as the library swaps each param today: `cuMemUnmap`,
//!   `cuMemMap`, `cuMemSetAccess` on every range;
//! - the ranges back to back in one reservation: one `cuMemUnmap` over all
//!   of them, a `cuMemMap` per range, one `cuMemSetAccess` over all.
//!
//! What the staged commit's pause is made of, and what laying a manager's
//! device params out back to back would save.

use super::ok;
use cudarc::driver::sys;
use std::time::{Duration, Instant};

/// The two ways' best times over `runs` alternating swaps, and the best
/// per-range run's time in each call (unmap, map, access).
pub(super) fn swap_floors(
    count: usize,
    len: usize,
    runs: usize,
) -> Result<(Duration, Duration, [Duration; 3]), String> {
    let l = Layouts::new(count, len)?;
    let (mut apart, mut together, mut calls) = (Duration::MAX, Duration::MAX, [Duration::ZERO; 3]);
    // Each swap trades the two sets of allocations between the layouts.
    for run in 0..runs {
        let t = Instant::now();
        // Sets 0 and 2 take turns under the ranges apart, 1 and 3 under
        // the one reservation: each swap maps memory mapped nowhere else.
        let c = l.swap_apart(2 - 2 * (run % 2))?;
        if t.elapsed() < apart {
            (apart, calls) = (t.elapsed(), c);
        }
        let t = Instant::now();
        l.swap_together(3 - 2 * (run % 2))?;
        together = together.min(t.elapsed());
    }
    Ok((apart, together, calls))
}

/// Four sets of `count` allocations of `len` bytes: set 0 mapped at ranges
/// reserved apart, set 1 back to back in one reservation, sets 2 and 3
/// mapped nowhere (what the swaps put in).
struct Layouts {
    len: usize,
    handles: [Vec<sys::CUmemGenericAllocationHandle>; 4],
    apart: Vec<u64>,
    together: u64,
    access: sys::CUmemAccessDesc,
}

impl Layouts {
    fn new(count: usize, len: usize) -> Result<Layouts, String> {
        // SAFETY: a plain C struct; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut l = Layouts {
            len,
            handles: Default::default(),
            apart: Vec::new(),
            together: 0,
            access,
        };
        // SAFETY: plain driver calls with valid out-pointers; each range is
        // a reservation of ours mapped once (Drop frees everything).
        unsafe {
            for set in l.handles.iter_mut() {
                for _ in 0..count {
                    let mut h = 0;
                    ok(sys::cuMemCreate(&mut h, len, &prop, 0), "cuMemCreate")?;
                    set.push(h);
                }
            }
            for _ in 0..count {
                let mut p = 0;
                ok(
                    sys::cuMemAddressReserve(&mut p, len, 0, 0, 0),
                    "cuMemAddressReserve",
                )?;
                l.apart.push(p);
            }
            let total = count * len;
            ok(
                sys::cuMemAddressReserve(&mut l.together, total, 0, 0, 0),
                "cuMemAddressReserve",
            )?;
            for (i, &p) in l.apart.iter().enumerate() {
                ok(sys::cuMemMap(p, len, 0, l.handles[0][i], 0), "cuMemMap")?;
                ok(sys::cuMemSetAccess(p, len, &access, 1), "cuMemSetAccess")?;
                ok(
                    sys::cuMemMap(l.at(i), len, 0, l.handles[1][i], 0),
                    "cuMemMap",
                )?;
            }
            ok(
                sys::cuMemSetAccess(l.together, total, &access, 1),
                "cuMemSetAccess",
            )?;
            ok(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        Ok(l)
    }

    fn at(&self, i: usize) -> u64 {
        self.together + (i * self.len) as u64
    }

    /// Put allocation set `set` under the ranges reserved apart, one range
    /// at a time; the time in each of the three calls.
    fn swap_apart(&self, set: usize) -> Result<[Duration; 3], String> {
        let len = self.len;
        let mut took = [Duration::ZERO; 3];
        for (&p, &h) in self.apart.iter().zip(&self.handles[set]) {
            // SAFETY: `p` is mapped (to the set taking turns with this
            // one); `h` is mapped nowhere and `len` bytes.
            unsafe {
                let t = Instant::now();
                ok(sys::cuMemUnmap(p, len), "cuMemUnmap")?;
                let u = Instant::now();
                ok(sys::cuMemMap(p, len, 0, h, 0), "cuMemMap")?;
                let m = Instant::now();
                ok(
                    sys::cuMemSetAccess(p, len, &self.access, 1),
                    "cuMemSetAccess",
                )?;
                took[0] += u - t;
                took[1] += m - u;
                took[2] += m.elapsed();
            }
        }
        Ok(took)
    }

    /// Put allocation set `set` under the one reservation: one unmap, a
    /// map per range, one access.
    fn swap_together(&self, set: usize) -> Result<(), String> {
        let total = self.apart.len() * self.len;
        // SAFETY: the reservation is mapped whole (to the set taking turns
        // with this one); the set's allocations are mapped nowhere, `len`
        // bytes each.
        unsafe {
            ok(
                sys::cuMemUnmap(self.together, total),
                "cuMemUnmap (all at once)",
            )?;
            for (i, &h) in self.handles[set].iter().enumerate() {
                ok(sys::cuMemMap(self.at(i), self.len, 0, h, 0), "cuMemMap")?;
            }
            ok(
                sys::cuMemSetAccess(self.together, total, &self.access, 1),
                "cuMemSetAccess (all at once)",
            )
        }
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        let total = self.apart.len() * self.len;
        // SAFETY: our reservations and allocations, released once.
        unsafe {
            for &p in &self.apart {
                sys::cuMemUnmap(p, self.len);
                sys::cuMemAddressFree(p, self.len);
            }
            sys::cuMemUnmap(self.together, total);
            sys::cuMemAddressFree(self.together, total);
            for h in self.handles.iter().flatten() {
                sys::cuMemRelease(*h);
            }
        }
    }
}
