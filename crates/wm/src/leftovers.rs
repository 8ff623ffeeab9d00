//! What wm leaves on disk while it runs (a temporary folder, a socket
//! file): each owner removes its own when it is dropped, and when wm is
//! stopped by SIGINT, SIGTERM or SIGHUP a thread that waits for those
//! signals removes every one still listed, then ends wm as the signal
//! would have (a shell sees 128 + the signal's number).
//!
//! The signals are blocked in every thread ([`watch`] runs at start-up,
//! before any thread exists, and threads inherit the mask) and taken by
//! `sigwait` on the watching thread: a signal handler could neither take
//! the list's lock nor free memory. Programs wm starts get a clean mask
//! (Rust's `Command` resets it in the child). SIGKILL leaves what was
//! listed: nothing can run then.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static LISTED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Block the signals and start the thread that waits for them. Where
/// either fails, the signals keep their default action (wm ends, leaving
/// what is listed), as before. A signal wm was started ignoring (`nohup`
/// ignores SIGHUP, a shell's background job SIGINT) stays ignored: a
/// blocked signal is queued for `sigwait`, not ignored, so taking it would
/// end a wm that was meant to go on.
pub fn watch() {
    // SAFETY: a signal set and a sigaction on the stack, filled and used
    // by the calls below (the sigaction only read: a NULL new action).
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            let mut now: libc::sigaction = std::mem::zeroed();
            let ignored = libc::sigaction(s, std::ptr::null(), &mut now) == 0
                && now.sa_sigaction == libc::SIG_IGN;
            if !ignored {
                libc::sigaddset(&mut set, s);
            }
        }
        set
    };
    // SAFETY: blocks the signals in this (the only) thread.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) } != 0 {
        return;
    }
    let waiting = std::thread::Builder::new()
        .name("wm-signals".into())
        .spawn(move || wait(set));
    if waiting.is_err() {
        // SAFETY: as above: the default action again.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

fn wait(set: libc::sigset_t) {
    let mut signal = 0;
    // SAFETY: `set` holds the blocked signals; sigwait writes `signal`.
    while unsafe { libc::sigwait(&set, &mut signal) } != 0 {}
    let listed = LISTED.lock().unwrap_or_else(|p| p.into_inner());
    for path in listed.iter() {
        remove(path);
    }
    // SAFETY: the signal's default action, unblocked in this thread, then
    // the signal itself: wm ends as it would have without this thread.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(signal);
    }
    std::process::exit(128 + signal);
}

fn remove(path: &Path) {
    match path.is_dir() {
        true => _ = std::fs::remove_dir_all(path),
        false => _ = std::fs::remove_file(path),
    }
}

/// A path removed on a stopping signal while this lives; its owner removes
/// it on the way out otherwise.
pub struct Listed(PathBuf);

impl Listed {
    pub fn new(path: &Path) -> Listed {
        let mut listed = LISTED.lock().unwrap_or_else(|p| p.into_inner());
        listed.push(path.to_path_buf());
        Listed(path.to_path_buf())
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        let mut listed = LISTED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = listed.iter().position(|p| *p == self.0) {
            listed.swap_remove(i);
        }
    }
}
