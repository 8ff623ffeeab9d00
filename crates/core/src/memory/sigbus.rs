//! Surviving a shared-memory object or a file that shrinks under us.
//!
//! A peer of the same uid can truncate `/dev/shm/<cell>` (or a tmpfs can run
//! out of pages) while a rank has it mapped, and a trainer can truncate a
//! snapshot file while an update reads it through a mapping; the next
//! access then raises SIGBUS, which by default kills the engine. Reading
//! through the descriptor instead would cost a syscall on every NORMAL step
//! (and a copy per snapshot byte), so the mappings stay and this module
//! makes such a fault survivable:
//!
//! - every [`crate::signal::shm::SharedMapping`] and every mapped window of a
//!   file ([`super::mapped_file`]) registers its address
//!   range here;
//! - a process-wide SIGBUS handler (installed once, chaining to the handler
//!   it replaced) looks the faulting address up; for one of ours it maps
//!   private zeroed pages over the whole range (so the faulting access and
//!   every later one reads zeros, writes go nowhere) and marks the range
//!   faulted; any other address goes to the previous handler as before;
//! - users of a mapping check [`faulted`] after touching it (a plain load of
//!   a process-local flag, no syscall) and turn a fault into an error naming
//!   the object.
//!
//! What remains possible: the access that faulted reads zero (NORMAL for a
//! control cell) and is then discarded as an error; a write that faulted is
//! lost (the object is gone anyway). The handler's only system call is
//! `mmap`, which is not on POSIX's async-signal-safe list but is a plain
//! system call on Linux. A host that later installs its own SIGBUS handler
//! without chaining to the previous one takes this protection away, and
//! mappings beyond `SLOTS` at once are unguarded (snapshot windows are then
//! read with `pread` instead; for the others a SIGBUS there ends the
//! process as before). Recovery means reopening: the handle (controller,
//! manager) stays in error for that object.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// Registered ranges at once; each manager uses three, a controller one,
/// a snapshot update up to ten while a batch is pending.
const SLOTS: usize = 1024;

struct Range {
    /// 0: not claimed, 1: being filled or emptied, 2: live.
    claim: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[expect(
    clippy::declare_interior_mutable_const,
    reason = "only used to initialize RANGES, each element its own atomic"
)]
const EMPTY: Range = Range {
    claim: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};

static RANGES: [Range; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();
/// The SIGBUS action in place before ours, for addresses that are not ours.
static mut PREVIOUS: Option<libc::sigaction> = None;

/// Guard `[start, start + len)`; returns its slot, or `None` when every slot
/// is taken (the mapping then works unguarded).
pub fn register(start: usize, len: usize) -> Option<usize> {
    INSTALL.call_once(install);
    let slot = RANGES.iter().position(|r| {
        r.claim
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    })?;
    let r = &RANGES[slot];
    r.len.store(len, Ordering::Relaxed);
    r.faulted.store(false, Ordering::Relaxed);
    r.start.store(start, Ordering::Release);
    r.claim.store(2, Ordering::Release);
    Some(slot)
}

/// Stop guarding a slot (before its range is unmapped).
pub fn unregister(slot: usize) {
    let r = &RANGES[slot];
    r.claim.store(1, Ordering::Release);
    r.start.store(0, Ordering::Release);
    r.claim.store(0, Ordering::Release);
}

/// Whether an access to the slot's range faulted since it was registered.
pub fn faulted(slot: usize) -> bool {
    RANGES[slot].faulted.load(Ordering::SeqCst)
}

fn install() {
    // SAFETY: sigaction with a fully initialized action; PREVIOUS is written
    // once here, before our handler can run (it is installed by this call).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut action.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) == 0 {
            PREVIOUS = Some(old);
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    }
}

/// Replace a faulted range with zeroed private pages. Only async-signal-safe
/// work: atomics and one mmap system call.
fn rescue(addr: usize) -> bool {
    for r in RANGES.iter() {
        let start = r.start.load(Ordering::Acquire);
        let len = r.len.load(Ordering::Relaxed);
        if start != 0 && addr >= start && addr < start + len {
            // SAFETY: the range is a mapping we own; MAP_FIXED replaces it in place.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            r.faulted.store(true, Ordering::SeqCst);
            return p != libc::MAP_FAILED;
        }
    }
    false
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    if rescue(addr) {
        return;
    }
    // SAFETY: PREVIOUS was set before this handler was installed.
    let previous = unsafe { *std::ptr::addr_of!(PREVIOUS) };
    let Some(prev) = previous else { return };
    match prev.sa_sigaction {
        libc::SIG_DFL | libc::SIG_IGN => {
            // Restore the default and return: the access faults again and the
            // process ends with SIGBUS as it would have without us.
            // SAFETY: plain sigaction with the saved action.
            unsafe { libc::sigaction(sig, &prev, std::ptr::null_mut()) };
        }
        h if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous handler was installed for SIGBUS with this signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        }
        h => {
            // SAFETY: the previous handler was installed for SIGBUS with this signature.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
    }
}
