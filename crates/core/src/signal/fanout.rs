//! Fan-out meetings: the ranks of one fan-out group agree, through their
//! node's group segment, on the NCCL communicator an update uses.
//!
//! A fan-out group is the ranks of one node that set the same fan-out group
//! number (`crate::fanout`); its root is the one with the lowest local rank.
//! Every fan-out update starts with a meeting:
//!
//! 1. A member reads the root's last decided meeting `d`, records the
//!    communicator generation it holds (`fan_have`, 0 for none), and asks
//!    for meeting `d + 1` (`fan_seq`).
//! 2. The root waits until every member asks for meeting `d + 1`. If every
//!    member holds the root's own generation, the communicator is reused;
//!    otherwise the root makes a new NCCL id under a new generation. It
//!    writes id and generation, then marks meeting `d + 1` decided.
//! 3. A member waits for the decision; a generation it does not hold comes
//!    with the id to build it from.
//!
//! The numbering is the root's, so a rank that missed a meeting (it failed
//! before it came, or it timed out) simply asks for the next one: nobody's
//! count drifts. Every wait is bounded by the caller's deadline, fails at
//! once when the group stopped, and checks that the ranks it waits for are
//! alive. A failed meeting does not stop the signal group: the update fails
//! and the group's barrier reports it.

use super::group::segment::Slot;
use super::group::GroupShared;
use super::shm;
use crate::result::{Error, Result};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub(crate) use super::group::segment::ID_BYTES;

/// What a meeting decided, for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FanoutMeeting {
    /// Global ranks of the fan-out group, root first.
    pub ranks: Vec<u32>,
    /// Their process ids, to tell a dead member from a slow one.
    pub pids: Vec<u32>,
    /// This rank's place in `ranks` (0: the root).
    pub index: usize,
    /// The communicator generation to use.
    pub gen: u64,
    /// Set when this rank does not hold generation `gen`: the id to build
    /// it from.
    pub id: Option<[u8; ID_BYTES]>,
}

impl FanoutMeeting {
    /// The first rank of the group (root or member) whose process is gone,
    /// and its pid.
    pub fn dead_rank(&self) -> Option<(u32, u32)> {
        self.ranks
            .iter()
            .zip(&self.pids)
            .find(|(_, &pid)| !shm::pid_alive(pid))
            .map(|(&r, &pid)| (r, pid))
    }
}

impl GroupShared {
    /// Local slots of this rank's fan-out group, root first; empty when the
    /// rank is in none.
    pub fn fanout_members(&self) -> Vec<u32> {
        let color = self.me().fanout.load(Ordering::Relaxed);
        if color == 0 {
            return Vec::new();
        }
        (0..self.cfg.local_world_size)
            .filter(|&i| self.slot(i).fanout.load(Ordering::Relaxed) == color)
            .collect()
    }

    /// Run one meeting (module docs). `have`: the generation this rank
    /// holds (0: none); `make_id` runs on the root only, when a new
    /// communicator is needed.
    pub fn fanout_meet(
        &self,
        have: u64,
        make_id: impl FnOnce() -> Result<[u8; ID_BYTES]>,
        deadline: Instant,
    ) -> Result<FanoutMeeting> {
        self.check_abort()?;
        let locals = self.fanout_members();
        let Some(&root) = locals.first() else {
            return Err(Error::state(format!(
                "rank {}: a fan-out update needs a fan-out group in the config",
                self.cfg.rank
            )));
        };
        let index = locals
            .iter()
            .position(|&i| i == self.cfg.local_rank)
            .expect("a rank is in its own fan-out group");
        let (gen, id) = if index == 0 {
            self.decide_meeting(have, &locals[1..], make_id, deadline)?
        } else {
            self.attend_meeting(have, root, deadline)?
        };
        Ok(FanoutMeeting {
            ranks: locals
                .iter()
                .map(|&i| self.slot(i).rank.load(Ordering::Relaxed))
                .collect(),
            pids: locals
                .iter()
                .map(|&i| self.slot(i).pid.load(Ordering::Relaxed))
                .collect(),
            index,
            gen,
            id,
        })
    }

    /// The root: wait until every member asks for the next meeting, then
    /// decide its generation (a new one, and its id, unless every member
    /// holds the root's own).
    fn decide_meeting(
        &self,
        have: u64,
        members: &[u32],
        make_id: impl FnOnce() -> Result<[u8; ID_BYTES]>,
        deadline: Instant,
    ) -> Result<(u64, Option<[u8; ID_BYTES]>)> {
        let me = self.me();
        let meeting = me.fan_seq.load(Ordering::Relaxed) + 1;
        self.wait_for(
            members,
            deadline,
            &format!("to come to fan-out meeting {meeting}"),
            |s| s.fan_seq.load(Ordering::Acquire) == meeting,
        )?;
        let all_hold_mine = have != 0
            && members
                .iter()
                .all(|&i| self.slot(i).fan_have.load(Ordering::Relaxed) == have);
        let decided = if all_hold_mine {
            (have, None)
        } else {
            let newest = members
                .iter()
                .map(|&i| self.slot(i).fan_have.load(Ordering::Relaxed))
                .fold(have, u64::max);
            let id = make_id()?;
            for (d, b) in me.fan_id.iter().zip(id) {
                d.store(b, Ordering::Relaxed);
            }
            (newest + 1, Some(id))
        };
        me.fan_gen.store(decided.0, Ordering::Relaxed);
        me.fan_seq.store(meeting, Ordering::Release);
        Ok(decided)
    }

    /// A member: ask for the root's next meeting and wait for its decision;
    /// the id comes along when the generation is not the one held.
    fn attend_meeting(
        &self,
        have: u64,
        root: u32,
        deadline: Instant,
    ) -> Result<(u64, Option<[u8; ID_BYTES]>)> {
        let root_slot = self.slot(root);
        let me = self.me();
        let meeting = root_slot.fan_seq.load(Ordering::Acquire) + 1;
        // The root reads `fan_have` once it sees the request (Release).
        me.fan_have.store(have, Ordering::Relaxed);
        me.fan_seq.store(meeting, Ordering::Release);
        self.wait_for(
            &[root],
            deadline,
            &format!("to decide fan-out meeting {meeting}"),
            |s| s.fan_seq.load(Ordering::Acquire) >= meeting,
        )?;
        let gen = root_slot.fan_gen.load(Ordering::Relaxed);
        let id = (gen != have).then(|| {
            let mut id = [0u8; ID_BYTES];
            for (d, b) in id.iter_mut().zip(&root_slot.fan_id) {
                *d = b.load(Ordering::Relaxed);
            }
            id
        });
        Ok((gen, id))
    }

    /// Wait until `ready` holds for every slot of `locals`: bounded, failing
    /// at once on a stopped group or a dead rank, naming who kept us.
    fn wait_for(
        &self,
        locals: &[u32],
        deadline: Instant,
        what: &str,
        ready: impl Fn(&Slot) -> bool,
    ) -> Result<()> {
        loop {
            let pending: Vec<u32> = locals
                .iter()
                .copied()
                .filter(|&i| !ready(self.slot(i)))
                .collect();
            if pending.is_empty() {
                return Ok(());
            }
            self.check_abort()?;
            if let Some(&dead) = pending
                .iter()
                .find(|&&i| !shm::pid_alive(self.slot(i).pid.load(Ordering::Relaxed)))
            {
                return Err(self.dead(
                    dead,
                    &format!("while rank {} waited for it {what}", self.cfg.rank),
                ));
            }
            if Instant::now() >= deadline {
                let ranks: Vec<String> = pending
                    .iter()
                    .map(|&i| self.slot(i).rank.load(Ordering::Relaxed).to_string())
                    .collect();
                return Err(Error::timeout(format!(
                    "group '{}': rank {} waited for rank(s) {} {what}; did every rank of the fan-out group call wm_update?",
                    self.cfg.name,
                    self.cfg.rank,
                    ranks.join(", ")
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
