//! A flag another thread sets to end an update's waits: the engine's
//! destroy, or a clear of the version it stages, while the update waits
//! for a publisher that sends nothing (its connection looks at the flag
//! while it waits for a frame, the sources and the applier between
//! steps).

/// Set once: the update stops at its next look (`WM_ERR_CANCELLED`).
pub type StopFlag = std::sync::Arc<std::sync::atomic::AtomicBool>;

/// Whether `flag` (if any) is set.
pub fn stopped(flag: Option<&StopFlag>) -> bool {
    flag.is_some_and(|f| f.load(std::sync::atomic::Ordering::Acquire))
}
