//! The next atomic update's shadows for library-owned host params, faulted
//! in between updates.
//!
//! A shadow swapped into a param takes the param's place, and the kernel
//! frees the old pages, so every atomic update needs fresh pages, and the
//! kernel zeroes fresh pages as they are faulted in: on the test machine
//! 0.45-0.75 s per GiB on one core, several times what reading the update
//! costs. With `keep_atomic_staging` the manager faults in the next
//! update's shadows on one thread of its own once an update is done, while
//! the engine runs (one core, huge pages: the engine keeps the others).
//!
//! An update that comes before that thread is done (back to back) does not
//! wait for it at one core's pace: it stops the thread (which ends after
//! the piece it is faulting in) and faults in what is left on every core
//! the copier uses, then reads straight into the shadows. The huge-page
//! hint stays: a shadow advised against huge pages carries that flag into
//! the param it replaces, whose 4 KiB pages the next swap frees about 15
//! times slower, and each next update reads into them slower too (measured
//! here: back to back 0.25 of in-place without the hint, 0.63 with it; two
//! seconds apart 0.7 without, 1.08 with). Memory: one more copy of the library-owned
//! params while the engine runs, the same as the staging the update itself
//! needs; a clear or the manager's end frees it.
//!
//! Why a one-call commit does not hand its old pages on as the next
//! shadows, as a staged commit does (`atomic_staging.rs`): keeping them
//! takes two `mremap` calls (old pages out, new ones in), and a reader
//! between the two sees no pages (zeros), where one call replaces them in
//! one instant and frees the old ones. Tried: back to back 0.41 -> 1.00 of
//! in place, and `atomic_commit`'s concurrent reader caught the gap.
//! Private anonymous pages cannot be kept across that one instant;
//! memfd-backed params could, but shared memory gets no transparent huge
//! pages where `shmem_enabled` is `never` (the default).

use crate::memory::host::{populate_ranges, HostRegion};
use crate::memory::SendPtr;
use crate::result::Result;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Shadows per param number.
pub(crate) type Shadows = HashMap<usize, HostRegion>;

/// The thread faults in this much at a time between looks at its stop
/// flag: what an update that stops it may wait for (a few ms at worst).
const STEP: usize = 16 << 20;

/// What the thread made: every shadow (mapped), and per shadow the bytes
/// from its start that are faulted in.
struct Made {
    shadows: Shadows,
    done: HashMap<usize, usize>,
}

enum Preparing {
    /// Faulting in on a thread of its own.
    Thread {
        stop: Arc<AtomicBool>,
        thread: JoinHandle<Result<Made>>,
    },
    /// Every shadow was there already.
    Ready(Made),
}

#[derive(Default)]
pub(crate) struct NextShadows {
    preparing: Option<Preparing>,
}

impl NextShadows {
    /// Start faulting in a shadow of `len` bytes for each (param, len),
    /// taking the regions in `ready` (faulted in already: the pages a
    /// staged commit moved out of the params) for the params whose size
    /// they have; the others are freed.
    pub fn prepare(&mut self, params: Vec<(usize, usize)>, mut ready: Shadows) {
        self.discard();
        let mut made = Made {
            shadows: Shadows::new(),
            done: HashMap::new(),
        };
        let mut left = Vec::new();
        for (i, len) in params {
            match ready.remove(&i) {
                Some(r) if r.len() == len => {
                    made.done.insert(i, r.mapped());
                    made.shadows.insert(i, r);
                }
                _ => left.push((i, len)),
            }
        }
        drop(ready);
        if left.is_empty() {
            self.preparing = (!made.shadows.is_empty()).then_some(Preparing::Ready(made));
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("wm-shadows".into())
            .spawn(move || fault_in(left, made, &stopped));
        // Without a thread the next update faults in its own shadows.
        self.preparing = spawned
            .ok()
            .map(|thread| Preparing::Thread { stop, thread });
    }

    /// The shadows prepared since the last update, every byte faulted in:
    /// what the thread has not done yet is done now on `threads` threads.
    /// Empty when none were prepared, or when preparing them failed (the
    /// update then makes its own).
    pub fn take(&mut self, threads: usize) -> Shadows {
        let Some(made) = self.stop() else {
            return Shadows::new();
        };
        let mut left = Vec::new();
        for (i, r) in &made.shadows {
            let done = made.done.get(i).copied().unwrap_or(0);
            if done < r.mapped() {
                left.push((SendPtr(r.ptr().wrapping_add(done)), r.mapped() - done));
            }
        }
        match populate_ranges(&left, threads) {
            Ok(()) => made.shadows,
            Err(_) => Shadows::new(),
        }
    }

    /// Stop preparing and free whatever was prepared.
    pub fn discard(&mut self) {
        self.stop();
    }

    /// Stop the thread (it ends after its current piece) and take what it
    /// made.
    fn stop(&mut self) -> Option<Made> {
        match self.preparing.take()? {
            Preparing::Thread { stop, thread } => {
                stop.store(true, Ordering::Relaxed);
                thread.join().ok()?.ok()
            }
            Preparing::Ready(made) => Some(made),
        }
    }
}

/// The thread's work: map every shadow, then fault them in piece by piece
/// with the huge-page hint (slow to fault in, but this is off the update's
/// path, and the swap that replaces them frees them fast) until done or
/// told to stop.
fn fault_in(params: Vec<(usize, usize)>, mut made: Made, stop: &AtomicBool) -> Result<Made> {
    for &(i, len) in &params {
        let r = HostRegion::new("atomic shadow", len)?;
        r.advise_huge(true);
        made.shadows.insert(i, r);
    }
    for (i, _) in params {
        let r = &made.shadows[&i];
        let mut done = 0;
        while done < r.mapped() && !stop.load(Ordering::Relaxed) {
            let n = STEP.min(r.mapped() - done);
            populate_ranges(&[(SendPtr(r.ptr().wrapping_add(done)), n)], 1)?;
            done += n;
        }
        made.done.insert(i, done);
    }
    Ok(made)
}

impl Drop for NextShadows {
    fn drop(&mut self) {
        self.discard();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn taken_right_away_every_shadow_is_faulted_in() {
        let mut next = NextShadows::default();
        // Far more than the thread does before it is stopped.
        let sizes = [(0, 96 * MIB), (3, 40 * MIB + 4096), (7, 8)];
        next.prepare(sizes.to_vec(), Shadows::new());
        let shadows = next.take(2);
        assert_eq!(shadows.len(), sizes.len());
        for (i, len) in sizes {
            let r = &shadows[&i];
            assert_eq!(r.len(), len);
            assert_eq!(r.resident_bytes().unwrap(), r.mapped(), "shadow {i}");
        }
        // Nothing is prepared twice.
        assert!(next.take(2).is_empty());
    }

    /// Regions given ready (a staged commit's old pages) are taken as they
    /// are for params of their size, the rest made; one of another size is
    /// not used.
    #[test]
    fn ready_regions_are_taken_for_params_of_their_size() {
        let mut next = NextShadows::default();
        let region = |len| {
            let r = HostRegion::new("old pages", len).unwrap();
            unsafe { std::ptr::write_bytes(r.ptr(), 7, len) };
            r
        };
        let ready: Shadows = [(0, region(4 * MIB)), (2, region(MIB))].into();
        let kept = ready[&0].ptr();
        next.prepare(vec![(0, 4 * MIB), (1, 2 * MIB), (2, 3 * MIB)], ready);
        let shadows = next.take(1);
        assert_eq!(shadows[&0].ptr(), kept);
        assert_eq!(shadows[&1].resident_bytes().unwrap(), 2 * MIB);
        assert_eq!(shadows[&2].len(), 3 * MIB);
        assert_eq!(shadows[&2].resident_bytes().unwrap(), 3 * MIB);
        // All ready: nothing to fault in, no thread.
        let ready: Shadows = [(5, region(MIB))].into();
        next.prepare(vec![(5, MIB)], ready);
        assert!(matches!(next.preparing, Some(Preparing::Ready(_))));
        assert_eq!(next.take(1).len(), 1);
    }

    #[test]
    fn discarded_shadows_are_freed_and_a_later_prepare_starts_afresh() {
        let mut next = NextShadows::default();
        next.prepare(vec![(0, 64 * MIB)], Shadows::new());
        next.discard();
        assert!(next.take(2).is_empty());
        next.prepare(vec![(1, 4 * MIB)], Shadows::new());
        let shadows = next.take(1);
        assert_eq!(shadows[&1].resident_bytes().unwrap(), 4 * MIB);
    }
}
