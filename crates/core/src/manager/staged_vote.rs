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
//! - every rank staged the same version: COMMIT. Each rank calls commit
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
use crate::signal::version_hash;
use crate::state::State;

/// Where this rank's staging is, for the vote.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) enum StageStatus {
    /// No stage under the pending update (yet).
    #[default]
    Idle,
    Staging,
    /// Staged this version; waiting for the decision.
    Ready(String),
    /// Staging failed with this code (the rank's last error says why).
    Failed(wm_result),
}

/// A rank's vote: not ready.
const NOT_READY: u32 = 0x7000_0000;
/// A rank's vote: staged, with 28 bits of the version's hash.
const READY: u32 = 0x4000_0000;
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
/// rank 0).
pub(super) fn vote_of(status: &StageStatus) -> i32 {
    let v = match status {
        StageStatus::Idle | StageStatus::Staging => NOT_READY,
        StageStatus::Ready(version) => READY | (version_hash(version) & HASH_BITS),
        StageStatus::Failed(code) => (*code as u32).clamp(1, 254),
    };
    v as i32
}

/// Rank 0's decision on every rank's vote (`votes`: (rank, vote), sorted
/// by rank; `world` ranks in all).
pub(super) fn decide(votes: &[(u32, u32)], world: u32) -> Decision {
    if let Some(&(rank, code)) = votes.iter().find(|(_, v)| *v < READY) {
        return Decision::Abort { rank, code };
    }
    let ready: Vec<_> = votes
        .iter()
        .filter(|(_, v)| v & !HASH_BITS == READY)
        .collect();
    if let Some(first) = ready.first() {
        if let Some(&&(rank, _)) = ready.iter().find(|(_, v)| *v != first.1) {
            return Decision::Abort {
                rank,
                code: VERSIONS_DIFFER,
            };
        }
    }
    match ready.len() == world as usize && votes.len() == world as usize {
        true => Decision::Commit,
        false => Decision::Wait,
    }
}

impl Manager {
    /// `broadcast_signal` while an update is pending: the step's signal,
    /// with this rank's vote (see the module docs).
    pub(super) fn broadcast_voting(&self) -> Result<State> {
        let status = self.stage_status.lock().clone();
        let world = self.config.world_size;
        let decide = |votes: &[(u32, u32)]| decide(votes, world).encode();
        let staging = status != StageStatus::Idle;
        let raw = (self.signal).broadcast_vote(vote_of(&status), staging.then_some(&decide))?;
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
        let why = match code {
            VERSIONS_DIFFER => format!("rank {rank} staged another version than rank 0"),
            c => format!(
                "rank {rank} failed to stage ({})",
                wm_result::from_raw(c).map_or(c.to_string(), wm_result::name)
            ),
        };
        let why = format!("no rank commits: {why}");
        if let Err(e) = self.abort_staged(&why) {
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

    fn votes(v: &[StageStatus]) -> Vec<(u32, u32)> {
        v.iter()
            .enumerate()
            .map(|(r, s)| (r as u32, vote_of(s) as u32))
            .collect()
    }

    #[test]
    fn every_rank_ready_with_one_version_commits() {
        let ready = StageStatus::Ready("step-7".into());
        assert_eq!(
            decide(&votes(&[ready.clone(), ready.clone()]), 2),
            Decision::Commit
        );
        assert_eq!(
            decide(&votes(std::slice::from_ref(&ready)), 1),
            Decision::Commit
        );
        // A rank missing from the votes (it said nothing) is not ready.
        assert_eq!(decide(&votes(&[ready]), 2), Decision::Wait);
    }

    #[test]
    fn a_rank_not_ready_waits_and_a_failure_or_another_version_aborts() {
        let ready = StageStatus::Ready("step-7".into());
        let other = StageStatus::Ready("step-8".into());
        let d = decide(&votes(&[ready.clone(), StageStatus::Staging]), 2);
        assert_eq!(d, Decision::Wait);
        let d = decide(&votes(&[StageStatus::Idle, ready.clone()]), 2);
        assert_eq!(d, Decision::Wait);
        let failed = StageStatus::Failed(wm_result::WM_ERR_NOT_FOUND);
        let d = decide(&votes(&[StageStatus::Staging, failed]), 2);
        let code = wm_result::WM_ERR_NOT_FOUND as u32;
        assert_eq!(d, Decision::Abort { rank: 1, code });
        let d = decide(&votes(&[ready, StageStatus::Staging, other]), 3);
        assert_eq!(
            d,
            Decision::Abort {
                rank: 2,
                code: VERSIONS_DIFFER
            }
        );
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
