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
    /// Send `pieces` as one message under `tag` to the peer.
    pub(super) fn post_send(
        &mut self,
        tag: u64,
        pieces: &[(SendPtr, usize)],
        done: &Sender<Completion>,
    ) {
        if self.ep.is_null() {
            let _ = done.send(Completion {
                tag,
                result: Err(Error::state("UCX: send before connect")),
            });
            return;
        }
        if self.peer_failed() {
            let _ = done.send(Completion {
                tag,
                result: Err(Error::peer(
                    "UCX: the peer failed; nothing more is sent to it",
                )),
            });
            return;
        }
        let api = &self.ucx.lib().api;
        let (param, buffer, count, iov) = describe(pieces);
        let len = pieces.iter().map(|p| p.1).sum();
        // SAFETY: the caller keeps the bytes valid (Pump::send's contract);
        // the IOV array lives in the pending request until it finishes.
        let req = unsafe { (api.ucp_tag_send_nbx)(self.ep, buffer, count, tag, &param) };
        self.track(tag, req, Kind::Send(len), iov, done);
    }

    /// Receive the message tagged `tag` (at most the pieces' total) into
    /// `pieces`.
    pub(super) fn post_recv(
        &mut self,
        tag: u64,
        pieces: &[(SendPtr, usize)],
        done: &Sender<Completion>,
    ) {
        let api = &self.ucx.lib().api;
        let (mut param, buffer, count, iov) = describe(pieces);
        // No immediate completion: the length received is then always
        // read from the request (ucp_tag_recv_request_test).
        param.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        // SAFETY: the caller keeps the memory valid (Pump::recv's contract);
        // the IOV array lives in the pending request until it finishes.
        let req = unsafe {
            (api.ucp_tag_recv_nbx)(self.worker, buffer.cast_mut(), count, tag, u64::MAX, &param)
        };
        self.track(tag, req, Kind::Recv, iov, done);
    }

    pub(super) fn track(
        &mut self,
        tag: u64,
        req: *mut c_void,
        kind: Kind,
        iov: Vec<sys::DtIov>,
        done: &Sender<Completion>,
    ) {
        match sys::ptr_status(req) {
            None => self.pending.push(Pending {
                tag,
                req,
                kind,
                _iov: iov,
            }),
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

/// The request parameters, buffer and count of a message of `pieces`: one
/// piece is contiguous bytes (its address and length); several an IOV
/// (the array, which the caller keeps until the request finishes, and its
/// length).
fn describe(
    pieces: &[(SendPtr, usize)],
) -> (sys::RequestParam, *const c_void, usize, Vec<sys::DtIov>) {
    let mut param = blank_param();
    if let [(at, len)] = pieces {
        return (param, at.0.cast_const().cast(), *len, Vec::new());
    }
    let iov: Vec<sys::DtIov> = pieces
        .iter()
        .map(|&(at, length)| sys::DtIov {
            buffer: at.0.cast(),
            length,
        })
        .collect();
    param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = sys::UCP_DATATYPE_IOV;
    // The Vec's heap array does not move when the Vec does.
    (param, iov.as_ptr().cast(), iov.len(), iov)
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
