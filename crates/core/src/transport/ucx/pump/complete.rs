//! Completions: requests UCX finished are freed and reported to the
//! caller, with the bytes moved or why they failed.

use super::worker::{Kind, Worker};
use super::Completion;
use crate::transport::ucx::sys;
use std::sync::mpsc::Sender;
use std::time::Instant;

impl Worker<'_> {
    /// Report finished requests; true when any finished.
    pub(super) fn reap(&mut self, done: &Sender<Completion>) -> bool {
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
    pub(super) fn settle(&mut self, until: Instant, done: &Sender<Completion>) {
        let api = &self.ucx.lib().api;
        while !self.pending.is_empty() && Instant::now() < until {
            // SAFETY: our worker, on its own thread.
            unsafe { (api.ucp_worker_progress)(self.worker) };
            self.reap(done);
        }
    }
}
