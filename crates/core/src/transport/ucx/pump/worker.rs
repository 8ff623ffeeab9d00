//! The pump thread's worker: made with its event descriptor and address
//! (what the peer connects to), its endpoint to the peer, and the
//! caller's commands handed to it.

use super::{Cmd, Completion};
use crate::result::{Error, Result};
use crate::transport::ucx::{sys, Ucx};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};

/// What a posted request is: a send of so many bytes, or a receive (its
/// length comes from the request).
pub(super) enum Kind {
    Send(usize),
    Recv,
}

/// A request UCX has not finished yet.
pub(super) struct Pending {
    pub tag: u64,
    pub req: *mut c_void,
    pub kind: Kind,
    /// An IOV request's pieces: never read here, kept because UCX reads
    /// the array until the request finishes.
    pub _iov: Vec<sys::DtIov>,
}

/// The worker, its endpoint to the peer (null until connected) and its
/// unfinished requests; touched by the pump thread only.
pub(super) struct Worker<'a> {
    pub ucx: &'a Ucx,
    pub worker: *mut c_void,
    pub ep: *mut c_void,
    pub pending: Vec<Pending>,
    /// Set by UCX's error callback when the endpoint's peer failed: no
    /// send is posted on the endpoint after that. UCX 1.22 can still route
    /// a send posted then to the TCP endpoint it is tearing down, and
    /// crash (seen as SIGSEGV in `uct_ep_am_zcopy`, or an assertion in
    /// `stubs.c`) instead of failing it. The callback's argument: freed
    /// with the worker, leaked with it.
    pub failed: *const AtomicBool,
}

/// A worker of our own, its event descriptor and its address (what the
/// peer connects to).
pub(super) fn start_worker(ucx: &'static Ucx) -> Result<(Worker<'static>, i32, Vec<u8>)> {
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
    // SAFETY: on UCS_OK ucp_worker_get_address gave `len` readable bytes at
    // `addr`, valid until released below; they are copied out first.
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // SAFETY: the address this worker gave us, released once, not used after.
    unsafe { (api.ucp_worker_release_address)(worker, addr) };
    let w = Worker {
        ucx,
        worker,
        ep: std::ptr::null_mut(),
        pending: Vec::new(),
        failed: Box::into_raw(Box::new(AtomicBool::new(false))),
    };
    Ok((w, efd, bytes))
}

/// UCX's endpoint error callback. A dead peer already fails the posted
/// operations (their completions carry the error) and closes the TCP control
/// connection, which both sides watch; without a callback UCX would print an
/// ERROR line of its own for every endpoint whose peer went away. It marks
/// the endpoint failed (`arg`: the worker's [`Worker::failed`]), so that
/// nothing more is posted on it.
extern "C" fn peer_failed(arg: *mut c_void, _ep: *mut c_void, _status: i8) {
    // SAFETY: `arg` is the worker's flag, alive as long as the worker.
    if let Some(failed) = unsafe { arg.cast::<AtomicBool>().as_ref() } {
        failed.store(true, Ordering::Release);
    }
}

impl Worker<'_> {
    /// Run every command queued; false once the pump was dropped. Once the
    /// pump is `closing`, commands still queued are answered, not run: a
    /// pump is dropped when its session ends, often because the peer
    /// failed, and what was queued for it must not reach the endpoint.
    pub(super) fn take_commands(
        &mut self,
        cmds: &Receiver<Cmd>,
        done: &Sender<Completion>,
        closing: &AtomicBool,
    ) -> bool {
        loop {
            match cmds.try_recv() {
                Ok(cmd) if closing.load(Ordering::Acquire) => {
                    refuse(cmd, done, "the pump is closing")
                }
                Ok(cmd) => self.handle(cmd, done),
                Err(mpsc::TryRecvError::Empty) => return !closing.load(Ordering::Acquire),
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// The peer failed (UCX called [`peer_failed`]).
    pub(super) fn peer_failed(&self) -> bool {
        // SAFETY: the flag lives as long as the worker.
        unsafe { &*self.failed }.load(Ordering::Acquire)
    }

    fn handle(&mut self, cmd: Cmd, done: &Sender<Completion>) {
        match cmd {
            Cmd::Connect(address, reply) => {
                let _ = reply.send(self.connect(&address));
            }
            Cmd::Send { tag, parts } => self.post_send(tag, &parts, done),
            Cmd::Recv { tag, parts } => self.post_recv(tag, &parts, done),
        }
    }

    /// Connect to the peer worker at `address` (once).
    fn connect(&mut self, address: &[u8]) -> Result<()> {
        if !self.ep.is_null() {
            return Err(Error::state("UCX: this worker is already connected"));
        }
        check_address(address)?;
        let params = sys::EpParams {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler_cb: peer_failed as *const c_void,
            err_handler_arg: self.failed.cast_mut().cast(),
            user_data: std::ptr::null_mut(),
            flags: 0,
            spare: [0; 32],
        };
        let api = &self.ucx.lib().api;
        // SAFETY: the address bytes outlive the call (UCX copies what it needs).
        let st = unsafe { (api.ucp_ep_create)(self.worker, &params, &mut self.ep) };
        if st == sys::UCS_OK {
            return Ok(());
        }
        self.ep = std::ptr::null_mut();
        Err(self.ucx.error("connecting to the peer worker", st))
    }
}

/// A peer's worker address is checked before UCX reads it: UCX asserts
/// (aborting the process) on an address whose header names a version
/// other than its two (the low 4 bits of the first byte: 0 for v1, 1 for
/// v2), where every other corruption comes back as an error.
fn check_address(address: &[u8]) -> Result<()> {
    match address.first().map(|b| b & 0x0f) {
        Some(0 | 1) => Ok(()),
        Some(v) => Err(Error::peer(format!(
            "UCX: the peer's worker address names address version {v} (UCX has 0 and 1): \
             not a UCX worker address"
        ))),
        None => Err(Error::peer("UCX: the peer's worker address is empty")),
    }
}

/// Answer `cmd` with an error instead of running it.
fn refuse(cmd: Cmd, done: &Sender<Completion>, why: &str) {
    let error = || Error::peer(format!("UCX: {why}"));
    match cmd {
        Cmd::Connect(_, reply) => {
            let _ = reply.send(Err(error()));
        }
        Cmd::Send { tag, .. } | Cmd::Recv { tag, .. } => {
            let _ = done.send(Completion {
                tag,
                result: Err(error()),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_address_ucx_would_abort_on_is_refused_first() {
        assert!(super::check_address(&[0x01, 0, 0]).is_ok());
        assert!(super::check_address(&[0x00]).is_ok());
        assert!(super::check_address(&[0x21]).is_ok());
        for bad in [&[0xffu8, 0xff][..], &[0x0f], &[0x02], &[]] {
            let e = super::check_address(bad).unwrap_err();
            assert!(e.message.contains("worker address"), "{e}");
        }
    }
}
