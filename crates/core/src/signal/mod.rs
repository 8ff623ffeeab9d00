//! The control plane: the signal every rank acts on each step, and the
//! control cell a controller uses to ask for updates and clears.
//!
//! - [`cell`]: the FastDeploy-compatible int32 control word in /dev/shm.
//! - [`report`]: beside it, the outcome (and reason) of the last action.
//! - [`group`]: ranks in step: shared memory on a node, TCP across nodes.
//! - [`controller`]: the controller's side of the protocol (spelled out there).
//! - [`fanout`]: fan-out ranks agreeing on their NCCL communicator.
//! - [`futex`], [`shm`], [`link`]: the waits, shared objects and wire under them.
//!
//! `finish.rs` finishes the action the signal asked for (the barrier with
//! every rank's result, the report) and finds ranks out of step.
//!
//! [`SignalPlane`] is what a manager holds. Only rank 0 reads the cell, and
//! only rank 0 writes it: after an update (or clear) that the signal asked
//! for, every rank passes a barrier carrying its result; rank 0 then writes
//! the report and moves the word by compare-and-swap from the value being
//! served: UPDATING to NORMAL if every rank succeeded with the same version
//! (each rank's result carries its version's hash), CLEARING to CLEARED.
//! Ranks that took different versions (each source named its own) go to
//! CLEARED too, the report naming a rank whose version is not rank 0's:
//! an engine must not serve a mix.
//! After any failure the word goes to CLEARED (never NORMAL): the engine has
//! no complete new model, the controller's wait ends, and CLEARED is the
//! state from which a controller may ask for an update again; the report says
//! which rank failed and why, and each rank's `wm_status` has its own detail.
//! If the controller changed the word meanwhile, the swap fails and rank 0
//! leaves the newer request alone (the FastDeploy lost-update race).
//!
//! When the group itself fails (a rank died or stopped answering), rank 0
//! writes the reason, naming the rank, into the report and, if the word
//! holds a request, moves it to CLEARED; that report is kept after the
//! engine exits. If rank 0 itself is gone, the controller notices while it
//! waits (see [`controller`]).

pub mod cell;
pub mod controller;
pub mod fanout;
mod finish;
use finish::{is_done, out_of_step};
pub mod futex;
pub mod group;
pub mod link;
pub mod report;
pub mod shm;

use crate::logging::Logger;
use crate::result::{Error, Result};
use crate::state::State;
pub use cell::ControlCell;
pub use group::{Group, GroupConfig};
use parking_lot::Mutex;
use report::ReportCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Rank 0's decision on every rank's vote ((rank, vote), sorted by rank)
/// at the step before and at the one before that.
pub type Decide<'a> = dyn Fn(&Votes) -> i32 + 'a;

/// Every rank's non-zero contribution to the last two steps' barriers
/// ((rank, vote), sorted by rank), as rank 0 got them.
#[derive(Debug, Default)]
pub struct Votes {
    pub before: Vec<(u32, u32)>,
    pub last: Vec<(u32, u32)>,
}

impl Votes {
    fn push(&mut self, said: Vec<(u32, u32)>) {
        self.before = std::mem::replace(&mut self.last, said);
    }
}

/// A rank's result in a finishing barrier: an error's code (below this),
/// or done with 28 bits of its version's hash, so that rank 0 learns
/// whether every rank took the same version. Its top bits are no vote's
/// (`manager::staged_vote`: 0x4, 0x5 and 0x7 there), so a result met in a
/// step's barrier, or a vote met in a finishing one, shows ranks out of
/// step ([`out_of_step`]).
const DONE: u32 = 0x6000_0000;
const HASH_BITS: u32 = 0x0fff_ffff;
const TAG_BITS: u32 = !HASH_BITS;

/// FNV-1a, 32 bits: a version's fingerprint in the ranks' barriers and
/// votes.
pub fn version_hash(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// A second, independent fingerprint of a version (the top bits of its
/// xxh3-128), for the finishing barrier's second round and the two-phase
/// vote's other step.
pub fn version_hash_2(s: &str) -> u32 {
    (crate::checksum::of(s.as_bytes()) >> 96) as u32
}

pub struct SignalPlane {
    rank: u32,
    world_size: u32,
    cell: Option<ControlCell>,
    report: Option<ReportCell>,
    /// The steps' state, held by the stepping thread through each barrier.
    group: Mutex<Option<Group>>,
    /// The group's shared part, for the staging threads: read without the
    /// lock above, which the stepping thread holds while it waits in a
    /// barrier (a staging thread that took it to meet the fan-out group
    /// waited for the barrier, which waited for another rank's update,
    /// which waited for this meeting: stalled until the group's timeout).
    shared: Option<Arc<group::GroupShared>>,
    /// The action (UPDATING or CLEARING) the last signal asked this rank for,
    /// until the matching update or clear finishes it.
    pending: Mutex<Option<State>>,
    /// Set once the group failed: the report then outlives this engine.
    group_failed: AtomicBool,
    /// Why the group stopped, once it did (any rank): no staged version
    /// may commit then, nor an update the signal asked for start.
    stopped: Mutex<Option<Error>>,
    /// Rank 0: every rank's non-zero contribution to the last two steps'
    /// barriers (two-phase staging statuses, `broadcast_vote`).
    votes: Mutex<Votes>,
    logger: Logger,
}

impl SignalPlane {
    /// `cell` is read and written by rank 0 only; other ranks ignore it.
    /// With several ranks, `group` makes them meet here (bounded by its
    /// timeout); without it the ranks can update but not signal.
    pub fn new(
        rank: u32,
        world_size: u32,
        cell: Option<&str>,
        group: Option<GroupConfig>,
        logger: Logger,
    ) -> Result<SignalPlane> {
        let (cell, report) = match cell {
            Some(name) if rank == 0 => (
                Some(ControlCell::open_or_create(name)?),
                Some(ReportCell::open_or_create(name)?),
            ),
            Some(name) => {
                cell::check_name(name)?;
                (None, None)
            }
            None => (None, None),
        };
        let group = match group {
            Some(g) if world_size > 1 => match Group::join(g) {
                Ok(g) => Some(g),
                Err(e) => {
                    // No engine will serve the cell: leave no report behind.
                    if let (Some(name), Some(_)) = (cell.as_ref().map(ControlCell::name), &report) {
                        let _ = shm::unlink(&report::report_name(name));
                    }
                    return Err(e);
                }
            },
            _ => None,
        };
        Ok(SignalPlane {
            rank,
            world_size,
            cell,
            report,
            shared: group.as_ref().map(Group::shared),
            group: Mutex::new(group),
            pending: Mutex::new(None),
            group_failed: AtomicBool::new(false),
            stopped: Mutex::new(None),
            votes: Mutex::default(),
            logger,
        })
    }

    /// The raw word: a value that is no state is published as it is, and every
    /// rank fails that step alike (the group itself goes on).
    fn read_cell(&self) -> Result<i32> {
        self.cell
            .as_ref()
            .map_or(Ok(State::Normal as i32), ControlCell::load)
    }

    /// This step's signal. NORMAL costs one shared-memory read; any other
    /// value returns only after every rank got it (barrier).
    pub fn broadcast(&self) -> Result<State> {
        let raw = self.broadcast_vote(0, None)?;
        self.signal_of(raw)
    }

    /// The control word's value `raw` as this step's signal (UPDATING and
    /// CLEARING become the pending action).
    pub fn signal_of(&self, raw: i32) -> Result<State> {
        let state = State::from_raw(raw).filter(|s| s.is_signal()).ok_or_else(|| {
            Error::format(format!(
                "the control word holds {raw}, which is not NORMAL(0), UPDATING(1), CLEARING(-1) or CLEARED(-2)"
            ))
        })?;
        if matches!(state, State::Updating | State::Clearing) {
            *self.pending.lock() = Some(state);
        }
        Ok(state)
    }

    /// This step's value while an update is pending and ranks stage it
    /// (two-phase, see `manager::staged_vote`): every rank contributes
    /// `mine` (its staging's status) to the barrier after the step; rank 0
    /// serves `decide`'s decision on the statuses of the two steps before
    /// instead of the control word when it stages too (`decide` given),
    /// else the word. The raw value: the word's, or a decision.
    pub fn broadcast_vote(&self, mine: i32, decide: Option<&Decide>) -> Result<i32> {
        let read = || match decide {
            Some(d) => Ok(d(&self.votes.lock())),
            None => self.read_cell(),
        };
        let mut group = self.group.lock();
        match group.as_mut() {
            Some(g) => match g.broadcast(read, mine) {
                Ok((step, raw, said)) => {
                    if self.rank == 0 {
                        // A finishing result here, or anything but 0 where
                        // rank 0 votes nothing: another rank is finishing.
                        let elsewhere = |v: u32| is_done(v) || mine == 0;
                        let ranks = out_of_step(&said, elsewhere);
                        if !ranks.is_empty() {
                            let e = self.out_of_step_error(g, step, &ranks, "took its next signal");
                            return Err(e);
                        }
                        self.votes.lock().push(said);
                    }
                    Ok(raw)
                }
                Err(e) => {
                    self.group_failed(&e, g.failed_rank());
                    Err(e)
                }
            },
            None if self.world_size > 1 => Err(Error::state(format!(
                "wm_broadcast_signal with world_size {} needs the ranks in a group: set wm_config.group (a wm_group_config with a name)",
                self.world_size
            ))),
            None => {
                let raw = read()?;
                self.votes.lock().push(match mine {
                    0 => Vec::new(),
                    m => vec![(self.rank, m as u32)],
                });
                Ok(raw)
            }
        }
    }

    /// Local ranks in this rank's fan-out group (itself included); 0 when
    /// it is in none or in no group.
    pub fn fanout_size(&self) -> usize {
        (self.shared.as_ref()).map_or(0, |g| g.fanout_members().len())
    }

    /// Run a fan-out meeting (see [`fanout`]).
    pub fn fanout_meet(
        &self,
        have: u64,
        make_id: impl FnOnce() -> Result<[u8; fanout::ID_BYTES]>,
        deadline: std::time::Instant,
    ) -> Result<fanout::FanoutMeeting> {
        // Not under the steps' lock: the meeting waits for other ranks
        // while this rank's steps go on (`GroupShared`).
        match &self.shared {
            Some(g) => g.fanout_meet(have, make_id, deadline),
            None => Err(Error::state(
                "a fan-out update needs the ranks in a group: set wm_config.group (a wm_group_config with a name)",
            )),
        }
    }

    /// Why the ranks' group stopped (a rank died or stopped answering),
    /// once a step or barrier of this rank's failed with it.
    pub fn stopped(&self) -> Option<Error> {
        self.stopped.lock().clone()
    }

    /// Whether the last signal asked for an update that is not finished.
    pub fn update_pending(&self) -> bool {
        *self.pending.lock() == Some(State::Updating)
    }

    fn write_report(&self, code: u32, rank: u32, action: i32, version: &str, message: &str) {
        if let Some(report) = &self.report {
            if let Err(e) = report.write(code, rank, action, version, message) {
                self.logger.warn(&format!("writing the report: {e}"));
            }
        }
    }

    /// Compare-and-swap the word from the action being served to `target`.
    fn move_word(&self, cell: &ControlCell, action: i32, target: State, done: &str) {
        match cell.compare_exchange(action, target as i32) {
            Ok(Ok(())) => {}
            Ok(Err(now)) => self.logger.warn(&format!(
                "control cell {} changed to {now} during the {done}; leaving it (not writing {target})",
                cell.name()
            )),
            Err(e) => self.logger.warn(&format!("{e}")),
        }
    }

    /// Rank 0, after the group failed (a rank died, or stopped answering):
    /// the report says why, naming the rank, and stays after this engine
    /// exits (a controller asking later learns it). A request in the word
    /// (UPDATING or CLEARING) can never finish now: the word goes to CLEARED,
    /// from which the controller may ask again once the ranks restarted.
    fn group_failed(&self, e: &Error, dead_rank: Option<u32>) {
        self.stopped.lock().get_or_insert_with(|| e.clone());
        let Some(cell) = &self.cell else { return };
        self.group_failed.store(true, Ordering::Relaxed);
        let Ok(raw) = cell.load() else { return };
        let rank = dead_rank.unwrap_or(self.rank);
        let done = match State::from_raw(raw) {
            Some(State::Updating) => "update",
            Some(State::Clearing) => "clear",
            _ => {
                let msg = format!("the engine's ranks stopped: {}", e.message);
                return self.write_report(e.code as u32, rank, raw, "", &msg);
            }
        };
        let msg = format!("{done} failed: {}", e.message);
        self.write_report(e.code as u32, rank, raw, "", &msg);
        self.move_word(cell, raw, State::Cleared, done);
    }
}

impl Drop for SignalPlane {
    /// The report describes a live engine: rank 0 removes it on the way out
    /// (the cell itself is the controller's and stays), unless it says why
    /// the group failed, which a controller must still be able to read.
    fn drop(&mut self) {
        if self.group_failed.load(Ordering::Relaxed) {
            return;
        }
        if let (Some(cell), Some(_)) = (&self.cell, &self.report) {
            let _ = shm::unlink(&report::report_name(cell.name()));
        }
    }
}
