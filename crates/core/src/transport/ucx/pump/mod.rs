//! One UCX worker driven by its own thread.
//!
//! The caller posts sends and receives (tag, and the bytes: one range, or
//! pieces UCX gathers from or scatters into, in order) and collects
//! their completions; the pump thread makes progress in between, sleeping on
//! the worker's event descriptor when nothing moves. A UCX worker in
//! single-thread mode is touched only by the thread that created it, so no
//! lock guards it.
//!
//! Files: this one is the caller's side ([`Pump`]); on the pump thread,
//! `thread.rs` runs the progress loop, `worker.rs` makes the worker (its
//! address) and its endpoint to the peer, `post.rs` posts sends and
//! receives, `complete.rs` reports what finished, `shutdown.rs` lets go of
//! everything, bounded.

mod complete;
mod post;
mod shutdown;
mod thread;
mod worker;

#[cfg(test)]
mod tests;

use super::ucx;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A finished send or receive: bytes moved, or why it failed.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub result: Result<usize>,
}

enum Cmd {
    Connect(Vec<u8>, SyncSender<Result<()>>),
    Send { tag: u64, parts: ScatterList },
    Recv { tag: u64, parts: ScatterList },
}

/// A message's bytes: its parts (pointer, length), back to back in the
/// message. One part goes as contiguous bytes, several as a UCX IOV.
/// ("Pieces" means something else here: a param's pieces of a global
/// tensor.)
pub type ScatterList = Vec<(SendPtr, usize)>;

pub struct Pump {
    cmds: Option<Sender<Cmd>>,
    /// Set when the pump is dropped, before its commands stop: the thread
    /// then runs none of those still queued.
    closing: Arc<AtomicBool>,
    done: Receiver<Completion>,
    wake: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    /// The worker's address once it exists (empty before `started`).
    address: Vec<u8>,
    /// Until `started`: where the thread reports its worker made (its
    /// address) or not. Kept while the thread runs, so that its report
    /// never fails and it always reaches its loop and shuts the worker down.
    starting: Option<mpsc::Receiver<Result<Vec<u8>>>>,
}

impl Pump {
    /// Start a worker thread and wait for its worker; fails with
    /// `WM_ERR_UNSUPPORTED` without UCX.
    pub fn start(name: &str) -> Result<Pump> {
        let mut pump = Pump::spawn(name)?;
        pump.started(Instant::now() + Duration::from_secs(30))?;
        Ok(pump)
    }

    /// Start a worker thread without waiting for UCX to make its worker (a
    /// few ms): the caller goes on (connects, hashes) and calls
    /// [`Pump::started`] when it needs the address. Commands posted before
    /// run once the worker exists.
    pub fn spawn(name: &str) -> Result<Pump> {
        let ucx = ucx()?;
        // SAFETY: eventfd has no memory arguments.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(Error::io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_wake = wake.clone();
        let closing = Arc::new(AtomicBool::new(false));
        let thread_closing = closing.clone();
        let thread = std::thread::Builder::new()
            .name(format!("wm-ucx-{name}"))
            .spawn(move || thread::run(ucx, cmd_rx, done_tx, ready_tx, thread_wake, thread_closing))
            .map_err(|e| Error::io("starting the UCX thread", e))?;
        Ok(Pump {
            cmds: Some(cmd_tx),
            closing,
            done: done_rx,
            wake,
            thread: Some(thread),
            address: Vec::new(),
            starting: Some(ready_rx),
        })
    }

    /// Wait (until `deadline`) until the worker exists; why not, if it
    /// could not be made.
    pub fn started(&mut self, deadline: Instant) -> Result<()> {
        let Some(starting) = &self.starting else {
            return Ok(());
        };
        let wait = deadline.saturating_duration_since(Instant::now());
        let address = match starting.recv_timeout(wait) {
            Ok(made) => made?,
            Err(RecvTimeoutError::Timeout) => {
                return Err(Error::timeout(format!(
                    "UCX: making a worker took over {wait:?} (the deadline)"
                )))
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Error::peer("UCX: the worker thread died while starting"))
            }
        };
        self.address = address;
        self.starting = None;
        Ok(())
    }

    /// This worker's address, for the peer to connect to (empty before
    /// [`Pump::started`]).
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    fn post(&self, cmd: Cmd) -> Result<()> {
        self.cmds
            .as_ref()
            .expect("live until drop")
            .send(cmd)
            .map_err(|_| Error::peer("UCX: the worker thread is gone"))?;
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd; EAGAIN (counter full) is fine.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        Ok(())
    }

    /// Connect to a peer worker (the one sends go to).
    pub fn connect(&self, address: &[u8]) -> Result<()> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.post(Cmd::Connect(address.to_vec(), tx))?;
        rx.recv_timeout(Duration::from_secs(30))
            .map_err(|_| Error::timeout("UCX: connecting to the peer worker took over 30 s"))?
    }

    /// Send `len` bytes at `ptr` under `tag`.
    ///
    /// # Safety
    /// The bytes stay valid and unchanged until its completion is collected
    /// or the pump is dropped.
    pub unsafe fn send(&self, tag: u64, ptr: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.send_scatter(tag, vec![(SendPtr(ptr as *mut u8), len)]) }
    }

    /// Send `pieces`, back to back, as one message under `tag` (gathered by
    /// UCX: nothing is packed here).
    ///
    /// # Safety
    /// As [`Pump::send`], for every piece.
    pub unsafe fn send_scatter(&self, tag: u64, pieces: ScatterList) -> Result<()> {
        self.post(Cmd::Send { tag, parts: pieces })
    }

    /// Receive the message tagged `tag` (at most `cap` bytes) at `ptr`.
    ///
    /// # Safety
    /// The memory stays valid and untouched until its completion is collected
    /// or the pump is dropped.
    pub unsafe fn recv(&self, tag: u64, ptr: *mut u8, cap: usize) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.recv_scatter(tag, vec![(SendPtr(ptr), cap)]) }
    }

    /// Receive the message tagged `tag` (at most the pieces' total) into
    /// `pieces`, in order (scattered by UCX: no bounce buffer).
    ///
    /// # Safety
    /// As [`Pump::recv`], for every piece.
    pub unsafe fn recv_scatter(&self, tag: u64, pieces: ScatterList) -> Result<()> {
        self.post(Cmd::Recv { tag, parts: pieces })
    }

    /// The next completion, or None when `deadline` (or the `poll` interval)
    /// passes first.
    pub fn next(&self, deadline: Instant) -> Result<Option<Completion>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.done.recv_timeout(wait) {
            Ok(c) => Ok(Some(c)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Error::peer("UCX: the worker thread stopped"))
            }
        }
    }
}

impl Drop for Pump {
    /// Cancel what is still posted, wait for UCX to let go of the memory
    /// (bounded), close the connection and destroy the worker.
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        drop(self.cmds.take());
        let one = 1u64.to_ne_bytes();
        // SAFETY: as in post().
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
