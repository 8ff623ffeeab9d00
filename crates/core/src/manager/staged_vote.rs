//! Every rank switches at the same step (two-phase updates under the
//! control plane).
//!
//! After the signal asked for an update (UPDATING), each rank stages it
//! (`staged.rs`, typically on a side thread) and keeps serving and asking
//! for the signal every step. While that update is pending, each
//! `broadcast_signal` carries a vote: in the barrier after the step every
//! rank says where its staging is (not ready, staged version V, failed
//! with code C); rank 0 decides on what the ranks said at the step before
//! and serves the decision as the next step's signal, so every rank gets
//! it at the same step:
//!
//! - every rank staged the same version: COMMIT. A staged rank's vote
//!   carries 28 bits of one of two independent hashes of the version's
//!   name, the other at the next step, so rank 0 commits once every rank
//!   was ready at two steps in a row and both hashes agree: two names pass
//!   as one only if both collide (about 2^-56; one 28-bit hash let
//!   'step-19324' and 'step-58640' pass). Each rank calls commit
//!   before its next step; the commit's finish (a barrier with every
//!   rank's result) then reports to the controller, as a one-call update;
//! - a rank failed to stage, or ranks staged different versions: no rank
//!   commits. Every rank drops what it staged (or stops staging), rank 0
//!   reports the failure (naming the rank) and moves the word to CLEARED,
//!   and every rank gets CLEARED with the reason in its last error;
//! - otherwise: UPDATING (keep serving, ask again).
//!
//! Rank 0 serves decisions only while it stages itself; before, it serves
//! the control word (UPDATING), and ranks that do not stage say "not
//! ready". A rank that dies is named by the group, as for any step.

use super::Manager;
use crate::result::{wm_result, Error, Result};
use crate::signal::{version_hash, version_hash_2, Votes};
use crate::state::State;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// Where this rank's staging is, for the vote.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) enum StageStatus {
    /// No stage under the pending update (yet).
    #[default]
    Idle,
    Staging,
    /// Staged this version; waiting for the decision.
    Ready(String),
    /// Staging failed with this code, and why (the error, whole).
    Failed(wm_result, String),
}

/// A rank's vote: not ready.
const NOT_READY: u32 = 0x7000_0000;
/// A rank's vote: staged, with 28 bits of the version's first hash
/// ([`version_hash`]); every other step, with its second
/// ([`version_hash_2`]).
const READY: u32 = 0x4000_0000;
const READY_SECOND: u32 = 0x5000_0000;
const HASH_BITS: u32 = 0x0fff_ffff;
/// An abort's code when the ranks staged different versions.
const VERSIONS_DIFFER: u32 = 255;

/// What rank 0 decided, as every rank gets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    Wait,
    Commit,
    /// No rank commits: `rank` failed with `code` (or staged another
    /// version than rank 0: `VERSIONS_DIFFER`).
    Abort {
        rank: u32,
        code: u32,
    },
}

/// Abort decisions are served as `ABORT_BASE - (rank << 8 | code)`: below
/// every control word value.
const ABORT_BASE: i32 = -1000;

impl Decision {
    pub fn encode(self) -> i32 {
        match self {
            Decision::Wait => State::Updating as i32,
            Decision::Commit => State::Commit as i32,
            Decision::Abort { rank, code } => ABORT_BASE - ((rank << 8 | code.min(255)) as i32),
        }
    }

    /// The decision a step's value carries; None: not a decision (the
    /// control word's value, served before rank 0 staged).
    pub fn decode(raw: i32) -> Option<Decision> {
        match raw {
            1 => Some(Decision::Wait),
            2 => Some(Decision::Commit),
            r if r <= ABORT_BASE => {
                let v = (ABORT_BASE - r) as u32;
                Some(Decision::Abort {
                    rank: v >> 8,
                    code: v & 0xff,
                })
            }
            _ => None,
        }
    }
}

/// A rank's vote for `status` (never 0, so that every rank's vote reaches
/// rank 0); a staged rank carries its version's `second` hash at every
/// other step.
pub(super) fn vote_of(status: &StageStatus, second: bool) -> i32 {
    let v = match status {
        StageStatus::Idle | StageStatus::Staging => NOT_READY,
        StageStatus::Ready(version) if second => {
            READY_SECOND | (version_hash_2(version) & HASH_BITS)
        }
        StageStatus::Ready(version) => READY | (version_hash(version) & HASH_BITS),
        StageStatus::Failed(code, _) => (*code as u32).clamp(1, 254),
    };
    v as i32
}

/// The status a rank votes: its own, except that a rank that dropped one
/// staged version and staged another between two steps (an abort and a
/// stage in one step) says "not ready" once, so that rank 0 never pairs
/// one version's hash with the other's. `last`: the version of this rank's
/// last ready vote, kept here.
pub(super) fn voted_status(status: StageStatus, last: &mut Option<String>) -> StageStatus {
    match status {
        StageStatus::Ready(v) if last.as_ref().is_some_and(|u| *u != v) => {
            *last = None;
            StageStatus::Staging
        }
        StageStatus::Ready(v) => {
            *last = Some(v.clone());
            StageStatus::Ready(v)
        }
        other => {
            *last = None;
            other
        }
    }
}

/// Which of its two hashes a ready vote carries, and the hash.
fn ready_hash(vote: u32) -> Option<(usize, u32)> {
    match vote & !HASH_BITS {
        READY => Some((0, vote & HASH_BITS)),
        READY_SECOND => Some((1, vote & HASH_BITS)),
        _ => None,
    }
}

/// Rank 0's decision on every rank's votes at the last two steps
/// (`world` ranks in all). A rank ready at the last step also counts its
/// hash of the step before: no rank goes from one staged version to
/// another in one step (a commit or an abort ends each, and the next
/// update's staging starts at a later step).
pub(super) fn decide(votes: &Votes, world: u32) -> Decision {
    if let Some(&(rank, code)) = votes.last.iter().find(|(_, v)| *v < READY) {
        return Decision::Abort { rank, code };
    }
    let mut hashes: BTreeMap<u32, [Option<u32>; 2]> = BTreeMap::new();
    for &(rank, vote) in &votes.last {
        if let Some((i, hash)) = ready_hash(vote) {
            hashes.entry(rank).or_default()[i] = Some(hash);
        }
    }
    for &(rank, vote) in &votes.before {
        if let (Some(h), Some((i, hash))) = (hashes.get_mut(&rank), ready_hash(vote)) {
            h[i].get_or_insert(hash);
        }
    }
    for i in 0..2 {
        let mut known = hashes.iter().filter_map(|(&rank, h)| Some((rank, h[i]?)));
        if let Some((_, first)) = known.next() {
            if let Some((rank, _)) = known.find(|&(_, hash)| hash != first) {
                return Decision::Abort {
                    rank,
                    code: VERSIONS_DIFFER,
                };
            }
        }
    }
    let both = hashes.values().filter(|h| h[0].is_some() && h[1].is_some());
    match both.count() == world as usize {
        true => Decision::Commit,
        false => Decision::Wait,
    }
}

impl Manager {
    /// `broadcast_signal` while an update is pending: the step's signal,
    /// with this rank's vote (see the module docs).
    pub(super) fn broadcast_voting(&self) -> Result<State> {
        let status = self.stage_status.lock().clone();
        let status = voted_status(status, &mut self.last_ready_vote.lock());
        let world = self.config.world_size;
        let decide = |votes: &Votes| decide(votes, world).encode();
        let staging = status != StageStatus::Idle;
        let second = self.vote_second.fetch_xor(true, Ordering::Relaxed);
        let vote = vote_of(&status, second);
        let raw = (self.signal).broadcast_vote(vote, staging.then_some(&decide))?;
        match Decision::decode(raw) {
            Some(Decision::Wait) => Ok(State::Updating),
            Some(Decision::Commit) => Ok(State::Commit),
            Some(Decision::Abort { rank, code }) => Ok(self.abort_everywhere(rank, code)),
            None => self.signal.signal_of(raw),
        }
    }

    /// The ranks agreed that none commits: drop what this rank staged,
    /// finish the update as failed (rank 0 reports it), and say why.
    fn abort_everywhere(&self, rank: u32, code: u32) -> State {
        // The failing rank knows why; the others got its code in the vote.
        let own = match &*self.stage_status.lock() {
            StageStatus::Failed(_, why) if rank == self.config.rank => Some(why.clone()),
            _ => None,
        };
        let why = match (code, own) {
            (VERSIONS_DIFFER, _) => format!("rank {rank} staged another version than rank 0"),
            (_, Some(why)) => format!("rank {rank} failed to stage: {why}"),
            (c, None) => format!(
                "rank {rank} failed to stage ({}; that rank's last error says why)",
                wm_result::from_raw(c).map_or(c.to_string(), wm_result::name)
            ),
        };
        let why = format!("no rank commits: {why}");
        // Read as "the staged version was dropped by ..." by a stage
        // still running.
        if let Err(e) = self.abort_staged(&format!("the ranks' vote ({why})")) {
            self.config
                .logger
                .warn(&format!("dropping the staged version: {e}"));
        }
        *self.stage_status.lock() = StageStatus::Idle;
        let error = Error::cancelled(format!("rank {}: {why}", self.config.rank));
        // The report carries a library code: different versions are a mismatch.
        let code = match code {
            VERSIONS_DIFFER => wm_result::WM_ERR_MISMATCH as u32,
            c => c,
        };
        self.signal.finish_failed(&[(rank, code)], &error);
        self.record_error(error);
        State::Cleared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's votes at two steps in a row: `before`, then `last`
    /// (each rank flips its hash between them, as `broadcast_voting` does).
    fn steps(before: &[StageStatus], last: &[StageStatus]) -> Votes {
        let said = |v: &[StageStatus], second| -> Vec<(u32, u32)> {
            (v.iter().enumerate())
                .map(|(r, s)| (r as u32, vote_of(s, second) as u32))
                .collect()
        };
        Votes {
            before: said(before, false),
            last: said(last, true),
        }
    }

    /// The same statuses at both steps.
    fn twice(v: &[StageStatus]) -> Votes {
        steps(v, v)
    }

    #[test]
    fn every_rank_ready_twice_with_one_version_commits() {
        let ready = StageStatus::Ready("step-7".into());
        let both = [ready.clone(), ready.clone()];
        assert_eq!(decide(&twice(&both), 2), Decision::Commit);
        let one = std::slice::from_ref(&ready);
        assert_eq!(decide(&twice(one), 1), Decision::Commit);
        // A rank missing from the votes (it said nothing) is not ready.
        assert_eq!(decide(&twice(one), 2), Decision::Wait);
        // Ready at one step only: one hash seen, wait for the other.
        let staging = [ready.clone(), StageStatus::Staging];
        assert_eq!(decide(&steps(&staging, &both), 2), Decision::Wait);
        assert_eq!(decide(&steps(&[], &both), 2), Decision::Wait);
    }

    #[test]
    fn names_whose_first_hashes_collide_do_not_commit() {
        // 28 bits of FNV-1a: these two pass the first hash as one.
        let (a, b) = ("step-19324", "step-58640");
        assert_eq!(version_hash(a) & HASH_BITS, version_hash(b) & HASH_BITS);
        let v = [StageStatus::Ready(a.into()), StageStatus::Ready(b.into())];
        let differ = Decision::Abort {
            rank: 1,
            code: VERSIONS_DIFFER,
        };
        assert_eq!(decide(&twice(&v), 2), differ);
        // Seen with the first hash alone, they wait (never commit).
        let first_only = Votes {
            before: Vec::new(),
            last: (v.iter().enumerate())
                .map(|(r, s)| (r as u32, vote_of(s, false) as u32))
                .collect(),
        };
        assert_eq!(decide(&first_only, 2), Decision::Wait);
    }

    #[test]
    fn a_rank_not_ready_waits_and_a_failure_or_another_version_aborts() {
        let ready = StageStatus::Ready("step-7".into());
        let other = StageStatus::Ready("step-8".into());
        let d = decide(&twice(&[ready.clone(), StageStatus::Staging]), 2);
        assert_eq!(d, Decision::Wait);
        let d = decide(&twice(&[StageStatus::Idle, ready.clone()]), 2);
        assert_eq!(d, Decision::Wait);
        let failed = StageStatus::Failed(wm_result::WM_ERR_NOT_FOUND, "gone".into());
        let d = decide(&twice(&[StageStatus::Staging, failed]), 2);
        let code = wm_result::WM_ERR_NOT_FOUND as u32;
        assert_eq!(d, Decision::Abort { rank: 1, code });
        let d = decide(&twice(&[ready, StageStatus::Staging, other]), 3);
        assert_eq!(
            d,
            Decision::Abort {
                rank: 2,
                code: VERSIONS_DIFFER
            }
        );
    }

    #[test]
    fn a_version_swapped_between_two_steps_votes_not_ready_once() {
        let (a, b) = (
            StageStatus::Ready("a".into()),
            StageStatus::Ready("b".into()),
        );
        let mut last = None;
        assert_eq!(
            voted_status(StageStatus::Staging, &mut last),
            StageStatus::Staging
        );
        assert_eq!(voted_status(a.clone(), &mut last), a);
        assert_eq!(voted_status(a.clone(), &mut last), a);
        // Aborted and staged again between two steps.
        assert_eq!(voted_status(b.clone(), &mut last), StageStatus::Staging);
        assert_eq!(voted_status(b.clone(), &mut last), b);
        assert_eq!(
            voted_status(StageStatus::Idle, &mut last),
            StageStatus::Idle
        );
        assert_eq!(voted_status(a.clone(), &mut last), a);
    }

    #[test]
    fn decisions_survive_the_step_value() {
        for d in [
            Decision::Wait,
            Decision::Commit,
            Decision::Abort { rank: 0, code: 6 },
            Decision::Abort {
                rank: 4095,
                code: VERSIONS_DIFFER,
            },
        ] {
            assert_eq!(Decision::decode(d.encode()), Some(d));
        }
        // Control word values other than UPDATING are not decisions.
        for raw in [0, -1, -2, 5] {
            assert_eq!(Decision::decode(raw), None);
        }
    }
}
