//! The pump thread: take the caller's commands, make progress, report
//! completions, and sleep on the worker's event descriptor (or a command's
//! wakeup) when nothing moves.

use super::worker::start_worker;
use super::{Cmd, Completion};
use crate::result::Result;
use crate::transport::ucx::{sys, Ucx};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;

pub(super) fn run(
    ucx: &'static Ucx,
    cmds: Receiver<Cmd>,
    done: Sender<Completion>,
    ready: SyncSender<Result<Vec<u8>>>,
    wake: Arc<OwnedFd>,
    closing: Arc<AtomicBool>,
) {
    let (mut w, efd, address) = match start_worker(ucx) {
        Ok(started) => started,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if ready.send(Ok(address)).is_err() {
        return;
    }
    let api = &ucx.lib().api;
    loop {
        if !w.take_commands(&cmds, &done, &closing) {
            break;
        }
        let mut moved = false;
        // SAFETY: our own worker, on its own thread.
        while unsafe { (api.ucp_worker_progress)(w.worker) } != 0 {
            moved = true;
        }
        moved |= w.reap(&done);
        if moved {
            continue;
        }
        // SAFETY: as above.
        if unsafe { (api.ucp_worker_arm)(w.worker) } == sys::UCS_ERR_BUSY {
            continue;
        }
        sleep_until_event(efd, &wake);
    }
    w.shutdown();
}

/// Sleep until the worker has an event or a command arrives (the eventfd
/// `wake`), at most 100 ms in case a wakeup is missed.
fn sleep_until_event(efd: i32, wake: &OwnedFd) {
    let mut fds = [
        libc::pollfd {
            fd: efd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two pollfds, a bounded sleep.
    unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
    let mut sink = [0u8; 8];
    // SAFETY: draining our nonblocking eventfd.
    unsafe { libc::read(wake.as_raw_fd(), sink.as_mut_ptr().cast(), 8) };
}
