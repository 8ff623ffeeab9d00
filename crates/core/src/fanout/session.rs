//! One rank's fan-out: its communicator, kept across updates
//! ([`FanoutLink`]), and one update's exchanges over it
//! ([`FanoutSession`]: the root's words, the vote, the tensors).

use super::nccl::{self, Alive, Comm, Nccl};
use super::transfer::{move_batches, Landing, Mover};
use super::{FanoutSettings, Word};
use crate::result::{Error, Result};
use crate::signal::fanout::FanoutMeeting;
use crate::signal::SignalPlane;
use serde::{de::DeserializeOwned, Serialize};
use std::time::{Duration, Instant};

/// A rank's fan-out state, kept across updates: its communicator.
pub struct FanoutLink {
    pub settings: FanoutSettings,
    /// This rank's GPU.
    pub ordinal: i32,
    comm: Option<(u64, Comm)>,
}

impl FanoutLink {
    pub fn new(settings: FanoutSettings, ordinal: i32) -> FanoutLink {
        FanoutLink {
            settings,
            ordinal,
            comm: None,
        }
    }

    fn nccl(&self) -> Result<&'static Nccl> {
        nccl::nccl(self.settings.nccl_library.as_deref())
    }

    /// Meet the group and have a working communicator (module docs, step 1).
    pub fn start(
        &mut self,
        signal: &SignalPlane,
        rank: u32,
        deadline: Instant,
    ) -> Result<FanoutSession<'_>> {
        let nccl = self.nccl()?;
        if self.comm.as_ref().is_some_and(|(_, c)| c.failed()) {
            self.comm = None;
        }
        let have = self.comm.as_ref().map_or(0, |(g, _)| *g);
        let meeting = signal.fanout_meet(have, || Ok(nccl.unique_id()?.internal), deadline)?;
        if let Some(id) = meeting.id {
            // The group moved on from the old communicator: stop it (a
            // local, immediate call; finalizing would wait on peers that
            // already left it).
            if let Some((_, mut old)) = self.comm.take() {
                old.abort();
            }
            let alive = member_check(&meeting);
            let comm = Comm::join(
                nccl,
                nccl::UniqueId { internal: id },
                meeting.ranks.len(),
                meeting.index,
                self.ordinal,
                deadline,
                &alive,
            )
            .map_err(|e| e.context(format!("rank {rank}: building the fan-out communicator")))?;
            self.comm = Some((meeting.gen, comm));
        }
        let (_, comm) = self
            .comm
            .as_mut()
            .expect("a communicator after the meeting");
        Ok(FanoutSession {
            comm,
            meeting,
            rank,
        })
    }
}

/// Fails once a rank of the meeting is gone (this one is alive while it
/// asks).
fn member_check(meeting: &FanoutMeeting) -> impl Fn() -> Result<()> + '_ {
    move || match meeting.dead_rank() {
        Some((r, pid)) => Err(Error::peer(format!(
            "fan-out rank {r} (pid {pid}) died during the update"
        ))),
        None => Ok(()),
    }
}

/// One update's fan-out, after the meeting.
pub struct FanoutSession<'a> {
    comm: &'a mut Comm,
    meeting: FanoutMeeting,
    rank: u32,
}

impl FanoutSession<'_> {
    pub fn is_root(&self) -> bool {
        self.meeting.index == 0
    }

    pub fn root_rank(&self) -> u32 {
        self.meeting.ranks[0]
    }

    /// The other ranks of the group.
    pub fn members(&self) -> &[u32] {
        &self.meeting.ranks[1..]
    }

    /// The root says `word`; members hear it.
    pub fn word<T: Serialize + DeserializeOwned>(
        &mut self,
        word: Option<&Word<T>>,
        deadline: Instant,
    ) -> Result<Word<T>> {
        let bytes = match word {
            Some(w) if self.is_root() => serde_json::to_vec(w)
                .map_err(|e| Error::format(format!("encoding a fan-out message: {e}")))?,
            _ => Vec::new(),
        };
        let alive = member_check(&self.meeting);
        let got = self.comm.broadcast_message(&bytes, 0, deadline, &alive)?;
        serde_json::from_slice(&got).map_err(|e| {
            Error::format(format!(
                "a fan-out message from rank {} is not valid: {e}",
                self.root_rank()
            ))
        })
    }

    /// Every rank's vote: Ok(()) when all accept, else the error naming the
    /// lowest refusing rank (this rank's own error when it refused).
    pub fn vote(&mut self, mine: Result<()>, deadline: Instant) -> Result<()> {
        let value = if mine.is_ok() {
            i32::MAX
        } else {
            self.rank as i32
        };
        let alive = member_check(&self.meeting);
        let lowest = self.comm.min(value, deadline, &alive)?;
        mine?;
        if lowest == i32::MAX {
            return Ok(());
        }
        Err(Error::state(format!(
            "fan-out rank {lowest} refused the update (its wm_status has why); no bytes moved"
        )))
    }

    /// The final vote of a one-call update, once the bytes moved: every
    /// rank says whether it took them (`mine`: its whole update, commit
    /// included). The root gets the error naming the lowest rank that did
    /// not; a member's result is its own. Skipped (Ok) where the
    /// communicator failed: every rank's broadcast failed then, and each
    /// already reports it.
    pub fn took(&mut self, mine: Result<()>, deadline: Instant) -> Result<()> {
        if self.comm.failed() {
            return mine;
        }
        let value = match &mine {
            Ok(()) => i32::MAX,
            Err(_) => self.rank as i32,
        };
        let alive = member_check(&self.meeting);
        let lowest = self.comm.min(value, deadline, &alive);
        mine?;
        match lowest? {
            i32::MAX => Ok(()),
            _ if !self.is_root() => Ok(()),
            lowest => Err(Error::state(format!(
                "fan-out rank {lowest} did not take the bytes it received (its wm_status has why)"
            ))),
        }
    }

    /// Broadcast tensors of `sizes` from the root, where `landing` says,
    /// batch by batch (`transfer::move_batches`).
    pub fn move_tensors(
        &mut self,
        sizes: &[usize],
        limit: usize,
        batch_timeout: Duration,
        landing: &mut dyn Landing,
    ) -> Result<()> {
        let alive = member_check(&self.meeting);
        let mut mover = NcclMover {
            comm: &mut *self.comm,
            alive: &alive,
        };
        move_batches(sizes, limit, batch_timeout, &mut mover, landing)
    }
}

/// NCCL broadcasts from the group's root (index 0), each wait bounded and
/// watching the group's ranks.
struct NcclMover<'c> {
    comm: &'c mut Comm,
    alive: Alive<'c>,
}

impl Mover for NcclMover<'_> {
    unsafe fn broadcast(&mut self, at: u64, len: usize, deadline: Instant) -> Result<()> {
        // SAFETY: the caller's (device memory of this rank's GPU, per the
        // landing: params, or a member's landing buffer).
        unsafe { self.comm.broadcast(at, len, 0, deadline, self.alive) }
    }

    fn wait(&mut self, deadline: Instant) -> Result<()> {
        self.comm
            .synchronize("a fan-out broadcast", deadline, self.alive)
    }

    fn abort(&mut self) {
        self.comm.abort();
    }
}
