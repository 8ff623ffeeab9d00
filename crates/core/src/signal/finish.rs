//! Finishing the action the signal asked for (an update or a clear): a
//! barrier with every rank's result, rank 0's report and move of the
//! word, and the ranks found out of step with rank 0.

use super::{group, Group, SignalPlane, DONE, HASH_BITS, TAG_BITS};
use super::{version_hash, version_hash_2};
use crate::result::{wm_result, Error, Result};
use crate::state::State;

impl SignalPlane {
    /// Finish `action` (UPDATING or CLEARING) if the signal asked for it:
    /// barrier with every rank's result, then rank 0 reports. `outcome` is
    /// this rank's result (the version on success).
    pub fn finish(&self, action: State, outcome: &Result<String>) -> Result<()> {
        {
            let mut pending = self.pending.lock();
            if *pending != Some(action) {
                return Ok(());
            }
            *pending = None;
        }
        // Two rounds, each with 28 bits of another hash of the version:
        // ranks holding different versions pass as one only if both
        // collide (about 2^-56 for two names; one FNV round alone let
        // names such as 'step-19324' and 'step-58640' pass).
        let result = |hash: fn(&str) -> u32| match outcome {
            Ok(version) => (DONE | (hash(version) & HASH_BITS)) as i32,
            Err(e) => (e.code as u32).clamp(1, DONE - 1) as i32,
        };
        let results = self.gather(result(version_hash))?;
        let seconds = self.gather(result(version_hash_2))?;
        self.check_finishing_together(action, [&results, &seconds])?;
        let failures: Vec<(u32, u32)> = (results.iter())
            .filter(|(_, r)| *r < DONE)
            .copied()
            .collect();
        // Every rank succeeded: do they hold one version?
        let both: Vec<(u32, (u32, u32))> = (results.iter().zip(&seconds))
            .map(|(&(rank, a), &(_, b))| (rank, (a, b)))
            .collect();
        let differs = match (failures.is_empty(), both.first()) {
            (true, Some(&(_, first))) if action == State::Updating => both
                .iter()
                .find(|(_, r)| *r != first)
                .map(|&(rank, _)| rank),
            _ => None,
        };
        self.conclude(action, outcome, (&failures, differs));
        Ok(())
    }

    /// Rank 0, after a finishing barrier's two rounds (`rounds`): every
    /// rank must have given a result (an error's code, or DONE): one that
    /// gave nothing or a vote is taking the signal meanwhile.
    fn check_finishing_together(&self, action: State, rounds: [&Vec<(u32, u32)>; 2]) -> Result<()> {
        if self.rank != 0 || self.group.lock().is_none() {
            return Ok(());
        }
        let mut ranks = Vec::new();
        for round in rounds {
            let gave: Vec<u32> = round.iter().map(|&(rank, _)| rank).collect();
            ranks.extend((0..self.world_size).filter(|r| !gave.contains(r)));
            ranks.extend(out_of_step(round, is_vote));
        }
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.is_empty() {
            return Ok(());
        }
        let doing = match action {
            State::Updating => "finished the update",
            _ => "finished the clear",
        };
        let mut group = self.group.lock();
        let g = group.as_mut().expect("checked above");
        Err(self.out_of_step_error(g, g.step(), &ranks, doing))
    }

    /// Ranks out of step with rank 0 (`ranks`, at `step`, while rank 0
    /// `doing`): the error every rank gets, the group stopped with it.
    pub(super) fn out_of_step_error(
        &self,
        g: &mut Group,
        step: u64,
        ranks: &[u32],
        doing: &str,
    ) -> Error {
        let e = Error::state(format!(
            "ranks out of step at step {step}: rank(s) {} were not where rank 0 was (it {doing}): \
             each rank must finish what the signal asked for (wm_update or wm_commit at \
             UPDATING, wm_clear at CLEARING) before its next wm_broadcast_signal, and call \
             them only then",
            group::list(ranks)
        ));
        g.stop_with(&e);
        self.group_failed(&e, ranks.first().copied());
        e
    }

    /// Every rank contributes `code` (0: success); rank 0 gets the (rank,
    /// code) of every non-zero one, sorted by rank; the others nothing.
    fn gather(&self, code: i32) -> Result<Vec<(u32, u32)>> {
        match self.group.lock().as_mut() {
            Some(g) => g
                .barrier(code)
                .inspect_err(|e| self.group_failed(e, g.failed_rank())),
            None if code != 0 => Ok(vec![(self.rank, code as u32)]),
            None => Ok(Vec::new()),
        }
    }

    /// Finish the pending update as failed without another barrier (the
    /// ranks agreed already, `broadcast_vote`): rank 0 reports `failures`
    /// and moves the word; `outcome` is this rank's error.
    pub fn finish_failed(&self, failures: &[(u32, u32)], outcome: &Error) {
        if self.pending.lock().take() != Some(State::Updating) {
            return;
        }
        self.conclude(State::Updating, &Err(outcome.clone()), (failures, None));
    }

    /// After every rank finished `action` (`failures`: the non-zero
    /// results, known to rank 0): rank 0 writes the report and moves the
    /// word.
    /// `differs`: every rank succeeded, but this one took another version
    /// than rank 0.
    fn conclude(
        &self,
        action: State,
        outcome: &Result<String>,
        (failures, differs): (&[(u32, u32)], Option<u32>),
    ) {
        let (Some(cell), Some(_)) = (&self.cell, &self.report) else {
            return;
        };
        let (done, target) = if action == State::Updating {
            ("update", State::Normal)
        } else {
            ("clear", State::Cleared)
        };
        let version = outcome.as_ref().map(String::as_str).unwrap_or("");
        let target = match failures.first() {
            None if differs.is_some() => {
                let rank = differs.unwrap_or_default();
                let msg = format!(
                    "{done} done on every rank, but rank {rank} took another version than rank 0's '{version}': \
                     the ranks hold different versions (each rank's wm_status names its own); \
                     update again with one version for every rank"
                );
                self.write_report(
                    wm_result::WM_ERR_MISMATCH as u32,
                    rank,
                    action as i32,
                    version,
                    &msg,
                );
                State::Cleared
            }
            None => {
                self.write_report(
                    0,
                    0,
                    action as i32,
                    version,
                    &format!("{done} done on every rank"),
                );
                target
            }
            Some(&(rank, code)) => {
                let what = wm_result::from_raw(code).map_or(code.to_string(), wm_result::name);
                let mut msg = match (rank == self.rank, outcome) {
                    // The message alone: the controller's error adds the code.
                    (true, Err(e)) => format!("{done} failed on rank {rank}: {}", e.message),
                    _ => format!(
                        "{done} failed on rank {rank} ({what}; its wm_status has the detail)"
                    ),
                };
                if failures.len() > 1 {
                    let others: Vec<String> =
                        failures[1..].iter().map(|(r, _)| r.to_string()).collect();
                    msg.push_str(&format!("; also failed on rank(s) {}", others.join(", ")));
                }
                self.write_report(code, rank, action as i32, version, &msg);
                State::Cleared
            }
        };
        self.move_word(cell, action as i32, target, done);
    }
}

/// The ranks of `said` (a barrier's non-zero contributions) whose value
/// `wrong` says belongs to another barrier.
pub(super) fn out_of_step(said: &[(u32, u32)], wrong: impl Fn(u32) -> bool) -> Vec<u32> {
    said.iter()
        .filter(|&&(_, v)| wrong(v))
        .map(|&(rank, _)| rank)
        .collect()
}

/// Whether `v`, a barrier contribution, is a finishing rank's success.
pub(super) fn is_done(v: u32) -> bool {
    v & TAG_BITS == DONE
}

/// Whether `v` is a vote: a tag of its own (an error's code has none).
fn is_vote(v: u32) -> bool {
    v & TAG_BITS != 0 && !is_done(v)
}
