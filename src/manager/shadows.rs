//! The next atomic update's shadows for library-owned host params, faulted
//! in between updates.
//!
//! A shadow swapped into a param takes the param's place, and the kernel
//! frees the old pages, so every atomic update needs fresh pages, and the
//! kernel zeroes fresh pages as they are faulted in: on the test machine
//! 0.45-0.75 s per GiB, several times what reading the update costs. With
//! `keep_atomic_staging` the manager faults in the next update's shadows
//! on one thread of its own once an update is done, while the engine runs;
//! the next atomic update takes them ready (waiting for the thread if it is
//! still at work: it only faults in memory, nothing it waits on can hang)
//! and reads straight into them. Memory: one more copy of the
//! library-owned params while the engine runs, the same as the staging the
//! update itself needs; a clear or the manager's end frees it.

use crate::memory::host::{populate_all, HostRegion};
use crate::result::Result;
use std::collections::HashMap;
use std::thread::JoinHandle;

/// Shadows per param number.
pub(crate) type Shadows = HashMap<usize, HostRegion>;

#[derive(Default)]
pub(crate) struct NextShadows {
    preparing: Option<JoinHandle<Result<Shadows>>>,
}

impl NextShadows {
    /// Start faulting in a shadow of `len` bytes for each (param, len).
    pub fn prepare(&mut self, params: Vec<(usize, usize)>) {
        self.take();
        if params.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("wm-shadows".into())
            .spawn(move || {
                let mut shadows = Shadows::new();
                for (i, len) in params {
                    shadows.insert(i, HostRegion::new("atomic shadow", len)?);
                }
                // Huge pages: slow to fault in, but this is off the update's
                // path, and the swap that replaces them frees them fast.
                populate_all(&shadows.values().collect::<Vec<_>>(), 1, true)?;
                Ok(shadows)
            });
        // Without a thread the next update faults in its own shadows.
        self.preparing = spawned.ok();
    }

    /// The shadows prepared since the last update (waiting for them if
    /// they are still being faulted in); empty when none were, or when
    /// preparing them failed (the update then makes its own).
    pub fn take(&mut self) -> Shadows {
        match self.preparing.take().map(JoinHandle::join) {
            Some(Ok(Ok(shadows))) => shadows,
            _ => Shadows::new(),
        }
    }
}

impl Drop for NextShadows {
    fn drop(&mut self) {
        self.take();
    }
}
