//! Waiting on a 32-bit word in shared memory: a bounded spin first (the
//! common case is that the value arrives within microseconds), then futex
//! sleeps in short slices, so a waiter never burns a core for long and notices
//! a dead peer or its deadline between slices.

use crate::result::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Spin iterations before sleeping (a few tens of microseconds) when every
/// waiting process has a core of its own.
pub(crate) const SPIN: u32 = 4000;
/// When there are more processes in the group than cores, a spinning waiter
/// takes the core the publisher needs: wait briefly, then sleep.
pub(crate) const SPIN_OVERSUBSCRIBED: u32 = 50;
/// Longest single sleep: how often a waiter checks liveness and its deadline.
const SLICE: Duration = Duration::from_millis(5);

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a live, aligned u32 with a valid timespec. Not
    // FUTEX_PRIVATE: the word is shared between processes.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Wake every process sleeping on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Publish a change of `word` (already stored) to sleepers, paying the wake
/// syscall only when somebody sleeps.
pub fn notify(word: &AtomicU32, waiters: &AtomicU32) {
    if waiters.load(Ordering::SeqCst) > 0 {
        wake_all(word);
    }
}

/// Wait until `ready()` holds. `word` is the futex word a writer changes (and
/// then calls [`notify`]) when `ready` may have become true; `waiters` counts
/// sleepers. `check` runs between sleeps (liveness of the peer waited for);
/// past `deadline`, `on_timeout` makes the error.
pub fn wait_until(
    spin: u32,
    word: &AtomicU32,
    waiters: &AtomicU32,
    deadline: Instant,
    mut ready: impl FnMut() -> bool,
    mut check: impl FnMut() -> Result<()>,
    on_timeout: impl FnOnce() -> Error,
) -> Result<()> {
    for _ in 0..spin {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    loop {
        waiters.fetch_add(1, Ordering::SeqCst);
        let seen = word.load(Ordering::SeqCst);
        if ready() {
            waiters.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            waiters.fetch_sub(1, Ordering::SeqCst);
            return Err(on_timeout());
        }
        futex_wait(word, seen, SLICE.min(deadline - now));
        waiters.fetch_sub(1, Ordering::SeqCst);
        if ready() {
            return Ok(());
        }
        check()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn wakes_on_change_and_times_out() {
        let word = Arc::new(AtomicU32::new(0));
        let waiters = Arc::new(AtomicU32::new(0));
        let (w2, n2) = (word.clone(), waiters.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            w2.store(7, Ordering::SeqCst);
            notify(&w2, &n2);
        });
        let start = Instant::now();
        wait_until(
            SPIN,
            &word,
            &waiters,
            Instant::now() + Duration::from_secs(5),
            || word.load(Ordering::SeqCst) == 7,
            || Ok(()),
            || Error::timeout("never"),
        )
        .unwrap();
        assert!(start.elapsed() < Duration::from_secs(2));
        t.join().unwrap();
        let e = wait_until(
            SPIN,
            &word,
            &waiters,
            Instant::now() + Duration::from_millis(20),
            || false,
            || Ok(()),
            || Error::timeout("gave up"),
        )
        .unwrap_err();
        assert_eq!(e.message, "gave up");
    }
}
