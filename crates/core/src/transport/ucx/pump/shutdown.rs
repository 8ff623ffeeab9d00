//! The worker's end, bounded: cancel what is posted, take in messages
//! nobody asked for, close the endpoint, destroy the worker (or leak it
//! when UCX still holds requests).

use super::post::blank_param;
use super::worker::{Kind, Worker};
use crate::transport::ucx::sys;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long the whole shutdown may take: cancelled requests finishing,
/// unexpected messages taken in, the endpoint's close (the header promises
/// an rdma or gdr update at most this much past its failure).
const DRAIN: Duration = Duration::from_secs(2);
/// How long shutdown spends taking in messages nobody asked for, and the
/// largest it takes (a network message is at most 1 MiB).
const DRAIN_UNEXPECTED: Duration = Duration::from_millis(500);
const MAX_UNEXPECTED: usize = 64 << 20;
/// Most progress calls before the endpoint is closed (each returns at once
/// when nothing is scheduled).
const PROGRESS_BEFORE_CLOSE: usize = 1000;

impl Worker<'_> {
    pub(super) fn shutdown(mut self) {
        let api = &self.ucx.lib().api;
        for p in &self.pending {
            // SAFETY: live requests of this worker.
            unsafe { (api.ucp_request_cancel)(self.worker, p.req) };
        }
        let (tx, _rx) = mpsc::channel();
        let until = Instant::now() + DRAIN;
        self.settle(until, &tx);
        let scratch = self.take_unexpected(until, &tx);
        // Let UCX run what it scheduled: a peer failure noticed on its
        // async thread reaches the endpoint (and sets `failed`) only when
        // the worker progresses.
        for _ in 0..PROGRESS_BEFORE_CLOSE {
            // SAFETY: our own worker, on its own thread.
            if unsafe { (api.ucp_worker_progress)(self.worker) } == 0 {
                break;
            }
        }
        // UCX 1.22 may still be tearing down a failed TCP endpoint (its
        // connection refused: the peer is gone); closing it then can touch
        // freed memory. A failed endpoint is left, with its worker, as when
        // requests are still held (below).
        let failed = !self.ep.is_null() && self.peer_failed();
        if !failed {
            self.close_endpoint(until);
        }
        if self.pending.is_empty() && !failed {
            // SAFETY: nothing of this worker is in use any more.
            unsafe { (api.ucp_worker_destroy)(self.worker) };
            // SAFETY: made by Box::into_raw in start_worker; the worker that
            // could call back with it is gone.
            drop(unsafe { Box::from_raw(self.failed.cast_mut()) });
        } else {
            // So are the memory and IOV arrays of its requests.
            std::mem::forget(scratch);
            std::mem::forget(std::mem::take(&mut self.pending));
        }
        // Otherwise UCX still holds requests (or a failed endpoint): the
        // worker is leaked rather than destroyed under them (and it makes no
        // progress, so no more bytes land).
    }

    /// Messages that arrived for receives never posted (the caller stopped
    /// early), taken into scratch memory (returned: kept until the worker
    /// is gone) and dropped: UCX would otherwise warn about each one when
    /// the worker is destroyed.
    fn take_unexpected(
        &mut self,
        drained_by: Instant,
        tx: &mpsc::Sender<super::Completion>,
    ) -> Vec<Vec<u8>> {
        let api = &self.ucx.lib().api;
        let mut scratch: Vec<Vec<u8>> = Vec::new();
        let until = drained_by.min(Instant::now() + DRAIN_UNEXPECTED);
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
            // the worker).
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
            self.track(info.sender_tag, req, Kind::Recv, Vec::new(), tx);
            self.settle(until, tx);
        }
        scratch
    }

    /// Close the endpoint (when there is one), waiting for the close until
    /// `until` (the shutdown's end).
    fn close_endpoint(&mut self, until: Instant) {
        if self.ep.is_null() {
            return;
        }
        let api = &self.ucx.lib().api;
        let mut param = blank_param();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: our endpoint, closed once.
        let req = unsafe { (api.ucp_ep_close_nbx)(self.ep, &param) };
        if sys::ptr_status(req).is_none() {
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
}
