//! Memory a staged commit took out of params, freed on a thread of its
//! own so that the engine's pause does not include freeing it: the old
//! pages of library-owned host params when the manager does not keep them
//! as the next update's shadows (`swap.rs`), and the old allocations of
//! library-owned device params (`device_swap.rs`). The next update, a
//! clear or the manager's end waits for that thread first.

/// One batch at a time: a new one, [`DeferredRelease::wait`] and drop wait
/// for the last.
pub struct DeferredRelease {
    freeing: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The freeing thread's name (the fake CUDA driver of the tests
    /// recognises the device one by it).
    thread_name: &'static str,
}

impl DeferredRelease {
    /// Freeing on threads named `thread_name`.
    pub fn new(thread_name: &'static str) -> DeferredRelease {
        DeferredRelease {
            freeing: parking_lot::Mutex::default(),
            thread_name,
        }
    }

    /// Free `garbage` (by dropping it) on a thread of its own (here, when
    /// none can start).
    pub fn later<T: Send + 'static>(&self, garbage: Vec<T>) {
        self.wait();
        if garbage.is_empty() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(self.thread_name.into())
            .spawn(move || drop(rx.recv()));
        match spawned {
            Ok(thread) => {
                let _ = tx.send(garbage);
                *self.freeing.lock() = Some(thread);
            }
            Err(_) => drop(garbage),
        }
    }

    /// Wait until what [`DeferredRelease::later`] was given is freed.
    pub fn wait(&self) {
        if let Some(thread) = self.freeing.lock().take() {
            let _ = thread.join();
        }
    }
}

impl Drop for DeferredRelease {
    fn drop(&mut self) {
        self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn garbage_is_dropped_by_the_time_wait_returns() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let release = DeferredRelease::new("wm-test-free");
        release.later(vec![Counted(dropped.clone()), Counted(dropped.clone())]);
        release.wait();
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
        // A second batch waits for the first; drop waits for the last.
        release.later(vec![Counted(dropped.clone())]);
        release.later(vec![Counted(dropped.clone())]);
        drop(release);
        assert_eq!(dropped.load(Ordering::SeqCst), 4);
    }
}
