//! The pump thread's worker: made with its event descriptor and address
//! (what the peer connects to), its endpoint to the peer, and the
//! caller's commands handed to it.

use super::{Cmd, Completion};
use crate::result::{Error, Result};
use crate::transport::ucx::{sys, Ucx};
use std::ffi::c_void;
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
    };
    Ok((w, efd, bytes))
}

/// UCX's endpoint error callback. A dead peer already fails the posted
/// operations (their completions carry the error) and closes the TCP control
/// connection, which both sides watch; without a callback UCX would print an
/// ERROR line of its own for every endpoint whose peer went away.
extern "C" fn peer_failed(_arg: *mut c_void, _ep: *mut c_void, _status: i8) {}

impl Worker<'_> {
    /// Run every command queued; false once the pump was dropped.
    pub(super) fn take_commands(
        &mut self,
        cmds: &Receiver<Cmd>,
        done: &Sender<Completion>,
    ) -> bool {
        loop {
            match cmds.try_recv() {
                Ok(cmd) => self.handle(cmd, done),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
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
