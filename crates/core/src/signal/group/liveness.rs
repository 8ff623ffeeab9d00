//! How a group fails: the first reason is written into the segment (and
//! sent over TCP), every later wait fails with it, and a dead rank is named.

use super::{Group, GroupShared, Link, NO_RANK};
use crate::result::{Error, Result};
use crate::signal::futex;
use crate::signal::link::{self, Msg};
use std::sync::atomic::Ordering;

impl Group {
    /// Record why this group stops, wake every sleeper, and tell the other
    /// nodes. Only the first reason is kept.
    pub(super) fn abort(&mut self, e: &Error) {
        self.record_abort(e);
        let reason = e.message.clone();
        match &mut self.link {
            Link::Root(peers) => {
                for p in peers.iter_mut() {
                    let _ = link::send(
                        &mut p.stream,
                        &Msg::Abort {
                            reason: reason.clone(),
                        },
                        "peer",
                    );
                }
            }
            Link::Leader(up) => {
                let _ = link::send(up, &Msg::Abort { reason }, "rank 0");
            }
            Link::Local | Link::Member => {}
        }
    }

    /// Write the reason into the segment (unless one is there) and wake
    /// every sleeper on it.
    fn record_abort(&self, e: &Error) {
        let h = self.header();
        if h.aborted.load(Ordering::Acquire) != 0 {
            return;
        }
        let text = format!("rank {}: {}", self.cfg.rank, e.message);
        let mut n = text.len().min(h.abort_msg.len() - 1);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        for (d, b) in h
            .abort_msg
            .iter()
            .zip(text.as_bytes()[..n].iter().chain(std::iter::once(&0)))
        {
            d.store(*b, Ordering::Relaxed);
        }
        h.aborted.store(1, Ordering::SeqCst);
        futex::wake_all(&h.published);
        futex::wake_all(&h.arrived);
        futex::wake_all(&h.released);
    }

    /// Stop the whole group with `e`, as a failed operation does: for a
    /// reason found outside the group's own waits (ranks out of step).
    pub fn stop_with(&mut self, e: &Error) {
        self.abort(e);
    }

    /// Run one group operation; on failure, stop the whole group.
    pub(super) fn guarded<T>(&mut self, op: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.check_abort()?;
        let r = op(self);
        if let Err(e) = &r {
            self.abort(e);
        }
        r
    }
}

/// What any thread may check of the group (the fan-out meetings too).
impl GroupShared {
    pub(crate) fn check_abort(&self) -> Result<()> {
        let h = self.header();
        let aborted = h.aborted.load(Ordering::Acquire);
        // Reads of a segment that shrank under us return zeros (see
        // `memory::sigbus`): nothing read from it can be trusted any more.
        self.seg
            .check(|| format!("group '{}': segment", self.cfg.name))?;
        if aborted == 0 {
            return Ok(());
        }
        let bytes: Vec<u8> = h
            .abort_msg
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .take_while(|b| *b != 0)
            .collect();
        Err(Error::peer(format!(
            "group '{}' stopped: {}",
            self.cfg.name,
            String::from_utf8_lossy(&bytes)
        )))
    }

    /// The rank this process found dead (for the report), if any.
    pub fn failed_rank(&self) -> Option<u32> {
        Some(self.failed_rank.load(Ordering::Relaxed)).filter(|&r| r != NO_RANK)
    }

    pub(crate) fn dead(&self, local: u32, when: &str) -> Error {
        let s = self.slot(local);
        self.failed_rank
            .store(s.rank.load(Ordering::Relaxed), Ordering::Relaxed);
        Error::peer(format!(
            "group '{}': rank {} (pid {}) died {when}",
            self.cfg.name,
            s.rank.load(Ordering::Relaxed),
            s.pid.load(Ordering::Relaxed)
        ))
    }
}
