//! One UCX worker driven by its own thread.
//!
//! The caller posts sends and receives (pointer, length, tag) and collects
//! their completions; the pump thread makes progress in between, sleeping on
//! the worker's event descriptor when nothing moves. A UCX worker in
//! single-thread mode is touched only by the thread that created it, so no
//! lock guards it.

use super::{sys, ucx, Ucx};
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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
    Send { tag: u64, ptr: SendPtr, len: usize },
    Recv { tag: u64, ptr: SendPtr, cap: usize },
}

pub struct Pump {
    cmds: Option<Sender<Cmd>>,
    done: Receiver<Completion>,
    wake: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    address: Vec<u8>,
}

/// How long shutdown waits for cancelled requests to finish.
const DRAIN: Duration = Duration::from_secs(2);
/// How long shutdown spends taking in messages nobody asked for, and the
/// largest it takes (a network message is at most 1 MiB).
const DRAIN_UNEXPECTED: Duration = Duration::from_millis(500);
const MAX_UNEXPECTED: usize = 64 << 20;

impl Pump {
    /// Start a worker thread; fails with `WM_ERR_UNSUPPORTED` without UCX.
    pub fn start(name: &str) -> Result<Pump> {
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
        let thread = std::thread::Builder::new()
            .name(format!("wm-ucx-{name}"))
            .spawn(move || run(ucx, cmd_rx, done_tx, ready_tx, thread_wake))
            .map_err(|e| Error::io("starting the UCX thread", e))?;
        let address = ready_rx
            .recv()
            .map_err(|_| Error::peer("UCX: the worker thread died while starting"))??;
        Ok(Pump {
            cmds: Some(cmd_tx),
            done: done_rx,
            wake,
            thread: Some(thread),
            address,
        })
    }

    /// This worker's address, for the peer to connect to.
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
        self.post(Cmd::Send {
            tag,
            ptr: SendPtr(ptr as *mut u8),
            len,
        })
    }

    /// Receive the message tagged `tag` (at most `cap` bytes) at `ptr`.
    ///
    /// # Safety
    /// The memory stays valid and untouched until its completion is collected
    /// or the pump is dropped.
    pub unsafe fn recv(&self, tag: u64, ptr: *mut u8, cap: usize) -> Result<()> {
        self.post(Cmd::Recv {
            tag,
            ptr: SendPtr(ptr),
            cap,
        })
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
        drop(self.cmds.take());
        let one = 1u64.to_ne_bytes();
        // SAFETY: as in post().
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Kind {
    Send(usize),
    Recv,
}

struct Pending {
    tag: u64,
    req: *mut c_void,
    kind: Kind,
}

struct Worker<'a> {
    ucx: &'a Ucx,
    worker: *mut c_void,
    ep: *mut c_void,
    pending: Vec<Pending>,
}

fn run(
    ucx: &'static Ucx,
    cmds: Receiver<Cmd>,
    done: Sender<Completion>,
    ready: SyncSender<Result<Vec<u8>>>,
    wake: Arc<OwnedFd>,
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
        if !w.take_commands(&cmds, &done) {
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

/// A worker of our own, its event descriptor and its address (what the
/// peer connects to).
fn start_worker(ucx: &'static Ucx) -> Result<(Worker<'static>, i32, Vec<u8>)> {
    let api = &ucx.lib().api;
    let params = sys::WorkerParams {
        field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        thread_mode: sys::UCS_THREAD_MODE_SINGLE,
        spare: [0; 48],
    };
    let mut worker = std::ptr::null_mut();
    // SAFETY: a live context; params valid for the call.
    let st = unsafe { (api.ucp_worker_create)(ucx.context(), &params, &mut worker) };
    if st != sys::UCS_OK {
        return Err(ucx.error("creating a worker", st));
    }
    let mut efd = -1;
    // SAFETY: out-parameters on a live worker.
    let st = unsafe { (api.ucp_worker_get_efd)(worker, &mut efd) };
    if st != sys::UCS_OK {
        return Err(ucx.error("getting the worker's event descriptor", st));
    }
    let (mut addr, mut len) = (std::ptr::null_mut(), 0usize);
    // SAFETY: as above; the address is copied, then released.
    let st = unsafe { (api.ucp_worker_get_address)(worker, &mut addr, &mut len) };
    if st != sys::UCS_OK {
        return Err(ucx.error("getting the worker's address", st));
    }
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    unsafe { (api.ucp_worker_release_address)(worker, addr) };
    let w = Worker {
        ucx,
        worker,
        ep: std::ptr::null_mut(),
        pending: Vec::new(),
    };
    Ok((w, efd, bytes))
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

/// UCX's endpoint error callback. A dead peer already fails the posted
/// operations (their completions carry the error) and closes the TCP control
/// connection, which both sides watch; without a callback UCX would print an
/// ERROR line of its own for every endpoint whose peer went away.
extern "C" fn peer_failed(_arg: *mut c_void, _ep: *mut c_void, _status: i8) {}

impl Worker<'_> {
    /// Run every command queued; false once the pump was dropped.
    fn take_commands(&mut self, cmds: &Receiver<Cmd>, done: &Sender<Completion>) -> bool {
        loop {
            match cmds.try_recv() {
                Ok(cmd) => self.handle(cmd, done),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn handle(&mut self, cmd: Cmd, done: &Sender<Completion>) {
        let api = &self.ucx.lib().api;
        match cmd {
            Cmd::Connect(address, reply) => {
                let params = sys::EpParams {
                    field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                        | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                        | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
                    address: address.as_ptr().cast(),
                    err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
                    err_handler_cb: peer_failed as *const c_void,
                    err_handler_arg: std::ptr::null_mut(),
                    user_data: std::ptr::null_mut(),
                    flags: 0,
                    spare: [0; 32],
                };
                let r = if !self.ep.is_null() {
                    Err(Error::state("UCX: this worker is already connected"))
                } else {
                    // SAFETY: the address bytes outlive the call (UCX copies what it needs).
                    let st = unsafe { (api.ucp_ep_create)(self.worker, &params, &mut self.ep) };
                    if st == sys::UCS_OK {
                        Ok(())
                    } else {
                        self.ep = std::ptr::null_mut();
                        Err(self.ucx.error("connecting to the peer worker", st))
                    }
                };
                let _ = reply.send(r);
            }
            Cmd::Send { tag, ptr, len } => {
                if self.ep.is_null() {
                    let _ = done.send(Completion {
                        tag,
                        result: Err(Error::state("UCX: send before connect")),
                    });
                    return;
                }
                let param = blank_param();
                // SAFETY: the caller keeps the bytes valid (Pump::send's contract).
                let req =
                    unsafe { (api.ucp_tag_send_nbx)(self.ep, ptr.0.cast(), len, tag, &param) };
                self.track(tag, req, Kind::Send(len), done);
            }
            Cmd::Recv { tag, ptr, cap } => {
                // No immediate completion: the length received is then always
                // read from the request (ucp_tag_recv_request_test).
                let mut param = blank_param();
                param.op_attr_mask = sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
                // SAFETY: the caller keeps the memory valid (Pump::recv's contract).
                let req = unsafe {
                    (api.ucp_tag_recv_nbx)(self.worker, ptr.0.cast(), cap, tag, u64::MAX, &param)
                };
                self.track(tag, req, Kind::Recv, done);
            }
        }
    }

    fn track(&mut self, tag: u64, req: *mut c_void, kind: Kind, done: &Sender<Completion>) {
        match sys::ptr_status(req) {
            None => self.pending.push(Pending { tag, req, kind }),
            Some(sys::UCS_OK) => {
                let n = match kind {
                    Kind::Send(len) => len,
                    Kind::Recv => unreachable!("receives never complete immediately"),
                };
                let _ = done.send(Completion { tag, result: Ok(n) });
            }
            Some(st) => {
                let _ = done.send(Completion {
                    tag,
                    result: Err(self.ucx.error(&format!("message {tag}"), st)),
                });
            }
        }
    }

    /// Report finished requests; true when any finished.
    fn reap(&mut self, done: &Sender<Completion>) -> bool {
        let api = &self.ucx.lib().api;
        let before = self.pending.len();
        let ucx = self.ucx;
        self.pending.retain(|p| {
            let mut info = sys::TagRecvInfo {
                sender_tag: 0,
                length: 0,
            };
            // SAFETY: p.req is a live request of this worker.
            let st = unsafe {
                match p.kind {
                    Kind::Recv => (api.ucp_tag_recv_request_test)(p.req, &mut info),
                    Kind::Send(_) => (api.ucp_request_check_status)(p.req),
                }
            };
            if st == sys::UCS_INPROGRESS {
                return true;
            }
            let result = if st == sys::UCS_OK {
                Ok(match p.kind {
                    Kind::Send(len) => len,
                    Kind::Recv => info.length,
                })
            } else {
                Err(ucx.error(&format!("message {}", p.tag), st))
            };
            // SAFETY: completed; freed once.
            unsafe { (api.ucp_request_free)(p.req) };
            let _ = done.send(Completion { tag: p.tag, result });
            false
        });
        self.pending.len() != before
    }

    /// Make progress until every pending request finished, or `until`.
    fn settle(&mut self, until: Instant, done: &Sender<Completion>) {
        let api = &self.ucx.lib().api;
        while !self.pending.is_empty() && Instant::now() < until {
            // SAFETY: our worker, on its own thread.
            unsafe { (api.ucp_worker_progress)(self.worker) };
            self.reap(done);
        }
    }

    fn shutdown(mut self) {
        let api = &self.ucx.lib().api;
        for p in &self.pending {
            // SAFETY: live requests of this worker.
            unsafe { (api.ucp_request_cancel)(self.worker, p.req) };
        }
        let (tx, _rx) = mpsc::channel();
        self.settle(Instant::now() + DRAIN, &tx);
        // Messages that arrived for receives never posted (the caller
        // stopped early) are taken into scratch memory and dropped: UCX
        // would otherwise warn about each one when the worker is destroyed.
        let mut scratch: Vec<Vec<u8>> = Vec::new();
        let until = Instant::now() + DRAIN_UNEXPECTED;
        while self.pending.is_empty() && Instant::now() < until {
            let mut info = sys::TagRecvInfo {
                sender_tag: 0,
                length: 0,
            };
            // SAFETY: our worker; remove = 1 hands the message to us.
            let msg = unsafe { (api.ucp_tag_probe_nb)(self.worker, 0, 0, 1, &mut info) };
            if msg.is_null() || info.length > MAX_UNEXPECTED {
                break;
            }
            let mut buf = vec![0u8; info.length];
            let mut param = blank_param();
            param.op_attr_mask = sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
            // SAFETY: `buf` is kept until the request is done (or leaked with
            // the worker, below).
            let req = unsafe {
                (api.ucp_tag_msg_recv_nbx)(
                    self.worker,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    msg,
                    &param,
                )
            };
            scratch.push(buf);
            self.track(info.sender_tag, req, Kind::Recv, &tx);
            self.settle(until, &tx);
        }
        if !self.ep.is_null() {
            let mut param = blank_param();
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
            // SAFETY: our endpoint, closed once.
            let req = unsafe { (api.ucp_ep_close_nbx)(self.ep, &param) };
            if sys::ptr_status(req).is_none() {
                let until = Instant::now() + DRAIN;
                // SAFETY: polling and freeing the close request.
                unsafe {
                    while (api.ucp_request_check_status)(req) == sys::UCS_INPROGRESS
                        && Instant::now() < until
                    {
                        (api.ucp_worker_progress)(self.worker);
                    }
                    (api.ucp_request_free)(req);
                }
            }
        }
        if self.pending.is_empty() {
            // SAFETY: nothing of this worker is in use any more.
            unsafe { (api.ucp_worker_destroy)(self.worker) };
        } else {
            std::mem::forget(scratch);
        }
        // Otherwise UCX still holds requests: the worker is leaked rather than
        // destroyed under them (and it makes no progress, so no more bytes land).
    }
}

fn blank_param() -> sys::RequestParam {
    sys::RequestParam {
        op_attr_mask: 0,
        flags: 0,
        request: std::ptr::null_mut(),
        cb: std::ptr::null(),
        datatype: 0,
        user_data: std::ptr::null_mut(),
        reply_buffer: std::ptr::null_mut(),
        memory_type: 0,
        recv_info: std::ptr::null_mut(),
        memh: std::ptr::null_mut(),
        spare: [0; 8],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two workers in one process over whatever transport UCX picks
    /// (`UCX_TLS=tcp` in the test command): bytes arrive whole, tags match,
    /// and a short buffer is an error, not an overflow.
    #[test]
    fn two_workers_exchange_tagged_messages() {
        if let Err(e) = ucx() {
            eprintln!("SKIP two_workers_exchange_tagged_messages: {e}");
            return;
        }
        let a = Pump::start("a").unwrap();
        let b = Pump::start("b").unwrap();
        a.connect(b.address()).unwrap();
        let src: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len() + 100];
        let mut small = vec![0u8; 10];
        let deadline = Instant::now() + Duration::from_secs(20);
        unsafe {
            b.recv(7, dst.as_mut_ptr(), dst.len()).unwrap();
            a.send(7, src.as_ptr(), src.len()).unwrap();
            b.recv(8, small.as_mut_ptr(), small.len()).unwrap();
            a.send(8, src.as_ptr(), 100).unwrap();
        }
        let mut got = Vec::new();
        while got.len() < 2 {
            if let Some(c) = b.next(deadline).unwrap() {
                got.push(c);
            } else {
                panic!("no completion before the deadline");
            }
        }
        got.sort_by_key(|c| c.tag);
        assert_eq!(*got[0].result.as_ref().unwrap(), src.len());
        assert_eq!(&dst[..src.len()], &src[..]);
        assert!(got[1].result.is_err(), "{:?}", got[1]);
        drop(a);
        drop(b);
    }
}
