//! Posting the caller's sends and receives on the worker, and tracking
//! each until it completes.

use super::worker::{Kind, Pending, Worker};
use super::Completion;
use crate::memory::SendPtr;
use crate::result::Error;
use crate::transport::ucx::sys;
use std::ffi::c_void;
use std::sync::mpsc::Sender;

impl Worker<'_> {
    /// Send `len` bytes at `ptr` under `tag` to the peer.
    pub(super) fn post_send(
        &mut self,
        tag: u64,
        ptr: SendPtr,
        len: usize,
        done: &Sender<Completion>,
    ) {
        if self.ep.is_null() {
            let _ = done.send(Completion {
                tag,
                result: Err(Error::state("UCX: send before connect")),
            });
            return;
        }
        let api = &self.ucx.lib().api;
        let param = blank_param();
        // SAFETY: the caller keeps the bytes valid (Pump::send's contract).
        let req = unsafe { (api.ucp_tag_send_nbx)(self.ep, ptr.0.cast(), len, tag, &param) };
        self.track(tag, req, Kind::Send(len), done);
    }

    /// Receive the message tagged `tag` (at most `cap` bytes) at `ptr`.
    pub(super) fn post_recv(
        &mut self,
        tag: u64,
        ptr: SendPtr,
        cap: usize,
        done: &Sender<Completion>,
    ) {
        let api = &self.ucx.lib().api;
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

    pub(super) fn track(
        &mut self,
        tag: u64,
        req: *mut c_void,
        kind: Kind,
        done: &Sender<Completion>,
    ) {
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
}

pub(super) fn blank_param() -> sys::RequestParam {
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
