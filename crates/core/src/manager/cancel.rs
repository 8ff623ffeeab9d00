//! Stopping for good while an update runs (the handle is shut down or
//! being destroyed).

use super::Manager;
use crate::result::{Error, Result};
use crate::stop::StopFlag;
use std::sync::atomic::Ordering;

impl Manager {
    /// Stop for good: an update in flight fails with `WM_ERR_CANCELLED` at
    /// its next batch boundary (before anything more is committed), and
    /// later updates are refused; a staged version is aborted, and this
    /// waits (bounded) until the staging thread let go of it. For
    /// destroying the manager while another thread's update runs
    /// (`wm_destroy`, which waits for every call anyway).
    pub fn cancel(&self) {
        self.stop_for_good();
        // A staged version waits for a decision, not at a batch boundary.
        // From the staging's own callback: it stops after the callback.
        if self.on_stage_thread() {
            return;
        }
        if let Err(e) = self.abort_staged("the manager's destruction") {
            self.config.logger.warn(&format!("cancel: {e}"));
        }
    }

    /// [`Manager::cancel`] without waiting for anything (`wm_shutdown`,
    /// Python's `close()`): a staging stops at its next batch, or when the
    /// wait it is in ends, on its own thread.
    pub fn shut_down(&self) {
        self.stop_for_good();
        self.drop_staged("the manager's shutdown");
    }

    fn stop_for_good(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.stop_waiting();
    }

    /// A cancellation seen through the progress hook, or a tensor callback
    /// stopped after it destroyed the handle, while the handle is being
    /// destroyed is the destroy's doing, not the engine callback's.
    pub(super) fn cancel_cause(&self, e: Error) -> Error {
        use crate::result::wm_result::{WM_ERR_CALLBACK, WM_ERR_CANCELLED};
        // (A refusal that says so already stays as it is.)
        let says_so = e.code == WM_ERR_CANCELLED && e.message.contains("the manager was shut down");
        if (e.code == WM_ERR_CANCELLED || e.code == WM_ERR_CALLBACK)
            && self.cancelled.load(Ordering::Acquire)
            && !says_so
        {
            return Error::cancelled(format!(
                "rank {}: the manager was shut down ({})",
                self.config.rank, e.message
            ));
        }
        e
    }

    pub(super) fn check_cancelled(&self) -> Result<()> {
        if self.cancelled.load(Ordering::Acquire) {
            return Err(Error::cancelled(format!(
                "rank {}: the manager was shut down (wm_shutdown or wm_destroy)",
                self.config.rank
            )));
        }
        Ok(())
    }

    /// The flag that ends the waits of the update that starts now on this
    /// thread for its publishers; set already when the manager is being
    /// destroyed (a destroy sets `cancelled` before it looks for the flag,
    /// and this registers the flag before it looks at `cancelled`).
    pub(super) fn watch_stops(&self) {
        let flag = StopFlag::default();
        *self.stop_waits.lock() = Some((std::thread::current().id(), flag.clone()));
        if self.cancelled.load(Ordering::SeqCst) {
            flag.store(true, Ordering::SeqCst);
        }
    }

    /// The running update's stop flag (`watch_stops`).
    pub(super) fn stop_flag(&self) -> Option<StopFlag> {
        self.stop_waits
            .lock()
            .as_ref()
            .map(|(_, flag)| flag.clone())
    }

    /// End the running update's waits for its publishers (`watch_stops`).
    pub(super) fn stop_waiting(&self) {
        if let Some((_, flag)) = self.stop_waits.lock().as_ref() {
            flag.store(true, Ordering::SeqCst);
        }
    }

    /// End the staging thread's update's waits, and no other update's (one
    /// that another thread starts once the staging ended).
    pub(super) fn stop_staging(&self) {
        let staging = *self.stage_thread.lock();
        if let Some((thread, flag)) = self.stop_waits.lock().as_ref() {
            if Some(*thread) == staging {
                flag.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Whether [`Manager::cancel`] or [`Manager::shut_down`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}
