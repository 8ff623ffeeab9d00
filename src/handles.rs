//! C handles: keys into tables of live library objects.
//!
//! - A handle value is never reused: values come from one process-wide
//!   counter (not from addresses, which the allocator hands out again), so a
//!   destroyed handle stays `WM_ERR_INVALID_HANDLE` forever, and a handle of
//!   one kind is never a valid handle of another.
//! - Every call holds a [`Live`] guard for its duration; the object is freed
//!   when the table and the last guard let go of it.
//! - [`HandleTable::destroy`] takes the handle out of the table (new calls
//!   are refused at once), asks the object to cancel what it is doing, and
//!   waits until no call on another thread holds it: after it returns,
//!   nothing the caller handed the object (engine-owned params, trainer
//!   tensors) is touched again. Called from inside one of the object's own
//!   calls on this thread (a callback), it cannot wait for that call, which
//!   is below it on the stack: it cancels and returns, and the object is
//!   freed when that call returns.

use crate::result::wm_result;
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Handle values start far above small integers a caller might make up,
/// and step by 16 so they look like (aligned) pointers to C code.
const FIRST_HANDLE: usize = 0x1000_0000;
const HANDLE_STEP: usize = 16;
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Handles this thread is inside a call on (nested through callbacks).
    static IN_CALL: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// A live object and the number of calls holding it.
struct Slot<T> {
    value: T,
    calls: Mutex<usize>,
    idle: Condvar,
    /// Being destroyed: refused to new calls; stays in the table until the
    /// calls in flight returned, so a second destroy waits for them too.
    dying: AtomicBool,
}

/// A call's hold on a live object (see the module docs).
pub(crate) struct Live<T> {
    slot: Arc<Slot<T>>,
    key: usize,
}

impl<T> std::ops::Deref for Live<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.slot.value
    }
}

impl<T> Drop for Live<T> {
    fn drop(&mut self) {
        IN_CALL.with(|c| {
            let mut c = c.borrow_mut();
            if let Some(i) = c.iter().rposition(|k| *k == self.key) {
                c.swap_remove(i);
            }
        });
        let mut calls = self.slot.calls.lock();
        *calls -= 1;
        if *calls == 0 {
            self.slot.idle.notify_all();
        }
    }
}

/// Live objects of type `T`, by handle value.
pub(crate) struct HandleTable<T>(RwLock<BTreeMap<usize, Arc<Slot<T>>>>);

impl<T> HandleTable<T> {
    pub(crate) const fn new() -> HandleTable<T> {
        HandleTable(parking_lot::const_rwlock(BTreeMap::new()))
    }

    /// Keep `value` and return its new, never-used handle.
    pub(crate) fn publish(&self, value: T) -> *mut c_void {
        let n = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        let key = FIRST_HANDLE + n * HANDLE_STEP;
        let slot = Arc::new(Slot {
            value,
            calls: Mutex::new(0),
            idle: Condvar::new(),
            dying: AtomicBool::new(false),
        });
        self.0.write().insert(key, slot);
        key as *mut c_void
    }

    /// The object behind `p`, held for the caller's call, or NULL_ARGUMENT
    /// / INVALID_HANDLE.
    pub(crate) fn get(&self, p: *const c_void) -> std::result::Result<Live<T>, wm_result> {
        if p.is_null() {
            return Err(wm_result::WM_ERR_NULL_ARGUMENT);
        }
        let key = p as usize;
        let live = self.0.read();
        let slot = live
            .get(&key)
            .filter(|s| !s.dying.load(Ordering::Acquire))
            .cloned()
            .ok_or(wm_result::WM_ERR_INVALID_HANDLE)?;
        // Counted under the table's read lock, which destroy's marking of
        // `dying` excludes.
        *slot.calls.lock() += 1;
        drop(live);
        IN_CALL.with(|c| c.borrow_mut().push(key));
        Ok(Live { slot, key })
    }

    /// Refuse handle `p` to new calls (NULL or unknown: nothing), `cancel`
    /// what the object is doing, wait until no other thread's call holds it,
    /// and forget it. Returns at once when this thread is inside a call on
    /// it (the object is freed when that call returns).
    pub(crate) fn destroy(&self, p: *const c_void, cancel: impl FnOnce(&T)) {
        self.destroy_inside(p, cancel, |_| false)
    }

    /// [`HandleTable::destroy`], for an object whose own threads run the
    /// caller's callbacks too: `inside` says whether this thread is one of
    /// them, running a call's work (then, as inside a call on this thread,
    /// it cancels and returns at once).
    pub(crate) fn destroy_inside(
        &self,
        p: *const c_void,
        cancel: impl FnOnce(&T),
        inside: impl Fn(&T) -> bool,
    ) {
        let key = p as usize;
        let (slot, first) = {
            let table = self.0.write();
            let Some(slot) = table.get(&key).cloned() else {
                return;
            };
            // Marked under the write lock: a call either counted itself
            // before (and is waited for) or sees the mark.
            let first = !slot.dying.swap(true, Ordering::AcqRel);
            (slot, first)
        };
        if first {
            cancel(&slot.value);
        }
        if IN_CALL.with(|c| c.borrow().contains(&key)) || inside(&slot.value) {
            self.0.write().remove(&key);
            return;
        }
        {
            let mut calls = slot.calls.lock();
            while *calls > 0 {
                slot.idle.wait(&mut calls);
            }
        }
        self.0.write().remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static TABLE: HandleTable<u32> = HandleTable::new();

    #[test]
    fn destroyed_handles_are_never_handed_out_again() {
        let a = TABLE.publish(1);
        TABLE.destroy(a, |_| {});
        let b = TABLE.publish(2);
        assert_ne!(a, b);
        assert_eq!(TABLE.get(a).err(), Some(wm_result::WM_ERR_INVALID_HANDLE));
        assert_eq!(*TABLE.get(b).unwrap(), 2);
        TABLE.destroy(b, |_| {});
    }

    #[test]
    fn every_destroy_waits_for_the_calls_in_flight() {
        let h = TABLE.publish(4) as usize;
        let call = TABLE.get(h as *const c_void).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let cancels = Arc::new(AtomicUsize::new(0));
        let destroyers: Vec<_> = (0..2)
            .map(|_| {
                let (done, cancels) = (done.clone(), cancels.clone());
                std::thread::spawn(move || {
                    TABLE.destroy(h as *const c_void, |_| {
                        cancels.fetch_add(1, Ordering::SeqCst);
                    });
                    done.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(done.load(Ordering::SeqCst), 0, "a destroy did not wait");
        assert_eq!(
            TABLE.get(h as *const c_void).err(),
            Some(wm_result::WM_ERR_INVALID_HANDLE)
        );
        drop(call);
        destroyers.into_iter().for_each(|d| d.join().unwrap());
        assert_eq!(done.load(Ordering::SeqCst), 2);
        assert_eq!(cancels.load(Ordering::SeqCst), 1, "cancelled once");
    }

    #[test]
    fn destroy_inside_a_call_on_the_same_thread_does_not_wait() {
        let h = TABLE.publish(3);
        let live = TABLE.get(h).unwrap();
        let mut cancelled = false;
        TABLE.destroy(h, |_| cancelled = true);
        assert!(cancelled);
        assert_eq!(*live, 3, "the call in flight still holds the object");
        drop(live);
        assert!(TABLE.get(h).is_err());
    }
}
