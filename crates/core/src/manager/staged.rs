//! Two-phase updates: stage the next version while the engine serves from
//! the old one, then switch with a short commit, or drop it with an abort.
//!
//! [`Manager::stage`] runs an ordinary atomic update on a thread of its own
//! (`wm-stage`). It receives and verifies every byte into the atomic
//! staging (the arena, library-owned shadows, device shadows) as a one-call
//! atomic update does, so nothing the engine reads changes; then, instead
//! of committing, it stops at the commit gate and `stage` returns. The
//! thread waits there for the engine's decision: [`Staged::commit`] lets
//! it commit (page swaps into library-owned host params, copies into
//! engine-owned ones, uploads and remaps for device params) and returns
//! how long that took; [`Staged::abort`], dropping the [`Staged`],
//! [`Manager::clear`] or [`Manager::cancel`] make the update end as a
//! failed atomic update does before writing: old weights and version
//! kept, staging freed.
//!
//! One staged version at a time. The stage thread holds the manager's
//! update lock from stage to commit, so other updates are refused
//! meanwhile (busy, saying a version is staged); the state reads UPDATING
//! until the commit ends. Every wait is bounded by the request's timeout,
//! except the wait for the decision, which the engine owns (the `Staged`
//! it holds; dropping it aborts).

use super::staged_vote::StageStatus;
use super::update::CommitGate;
use super::{Manager, UpdateRequest, UpdateStats};
use crate::apply::{Applier, ApplyFailure, Mode};
use crate::result::{wm_result, Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Beyond a request's timeout: the time an update takes to end (its
/// group's finishing barrier included) once it stopped.
const END_MARGIN: Duration = Duration::from_secs(60);

/// The engine's decision for a staged version.
pub(super) enum Decision {
    Commit,
    Abort(Error),
}

/// What the stage thread reports: staged (the version, and how long
/// staging took), or the update's end.
enum Report {
    Staged(String, Duration),
    Done(Result<UpdateStats>),
}

/// A version staged beside the one the engine serves (see the module
/// docs). Dropping it aborts.
pub struct Staged {
    version: String,
    staged_in: Duration,
    decide: mpsc::Sender<Decision>,
    reports: mpsc::Receiver<Report>,
    thread: Option<JoinHandle<()>>,
    timeout: Duration,
    /// Where the commit's own figures go (`wm_status`'s last update).
    manager: Arc<Manager>,
}

impl Manager {
    /// Stage the version `req` names: returns once every byte arrived and
    /// verified, the params untouched. Atomic mode only, without the
    /// per-tensor callback or a progress hook (they would run on the stage
    /// thread). With NCCL fan-out the root broadcasts its staging before
    /// its commit, so members stage the same bytes (`fanout_root.rs`).
    pub fn stage(self: &Arc<Self>, req: UpdateRequest) -> Result<Staged> {
        let r = self
            .check_stage(&req)
            .and_then(|()| self.start_stage(HooklessParts::of(req)));
        self.recorded(r)
    }

    fn check_stage(&self, req: &UpdateRequest) -> Result<()> {
        if req.mode != Mode::Atomic {
            return Err(Error::invalid_argument(
                "stage: an in-place update writes the params as bytes arrive; staging needs atomic mode",
            ));
        }
        if req.hooks.tensor.is_some() || req.hooks.progress.is_some() {
            return Err(Error::invalid_argument(
                "stage: the per-tensor callback and the progress hook are not taken (staging runs on a thread of the library's)",
            ));
        }
        self.check_cancelled()
    }

    fn start_stage(self: &Arc<Self>, parts: HooklessParts) -> Result<Staged> {
        let mut slot = self.staged.lock();
        if slot.is_some() {
            return Err(Error::state(
                "stage: a version is staged already: commit or abort it first",
            ));
        }
        let (decide, decisions) = mpsc::channel();
        let (report, reports) = mpsc::channel();
        let timeout = parts.timeout;
        let m = Arc::clone(self);
        // Set before the thread starts, which clears it when it ends.
        *slot = Some(decide.clone());
        self.stage_dropped.lock().take();
        // Under a pending update the ranks vote on this stage.
        *self.stage_status.lock() = match self.signal.update_pending() {
            true => StageStatus::Staging,
            false => StageStatus::Idle,
        };
        let thread = std::thread::Builder::new()
            .name("wm-stage".into())
            .spawn(move || m.run_stage(parts, decisions, report));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                slot.take();
                return Err(Error::io("stage: starting its thread", e));
            }
        };
        drop(slot);
        let mut staged = Staged {
            version: String::new(),
            staged_in: Duration::ZERO,
            decide,
            reports,
            thread: Some(thread),
            timeout,
            manager: Arc::clone(self),
        };
        match staged.reports.recv_timeout(timeout + END_MARGIN) {
            Ok(Report::Staged(version, took)) => {
                (staged.version, staged.staged_in) = (version, took);
                Ok(staged)
            }
            Ok(Report::Done(r)) => {
                staged.join();
                Err(r.err().unwrap_or_else(|| {
                    Error::state("stage: the update committed without stopping")
                }))
            }
            Err(_) => Err(Error::timeout(format!(
                "stage: not staged within the request's timeout ({timeout:?})"
            ))),
        }
    }

    /// The stage thread: the update up to its gate, the decision, its end.
    fn run_stage(
        self: Arc<Self>,
        parts: HooklessParts,
        decisions: mpsc::Receiver<Decision>,
        report: mpsc::Sender<Report>,
    ) {
        let passed = AtomicBool::new(false);
        let gate = self.commit_gate(decisions, report.clone(), &passed);
        *self.stage_thread.lock() = Some(std::thread::current().id());
        let r = self.update_gated(parts.into_request(), Some((gate, &passed)));
        *self.stage_thread.lock() = None;
        self.at_gate.store(false, Ordering::Release);
        let mut slot = self.staged.lock();
        let dropped = self.stage_dropped.lock().take();
        let r = r.map_err(|e| match dropped {
            Some(why) if e.code == wm_result::WM_ERR_CANCELLED => Error::cancelled(format!(
                "rank {}: the staged version was dropped by {why}",
                self.config.rank
            )),
            _ => e,
        });
        // A stage that failed on its own is this rank's vote until the
        // ranks decide; anything else leaves nothing to vote on.
        let mut status = self.stage_status.lock();
        *status = match (&r, &*status) {
            (Err(e), StageStatus::Staging) if !passed.load(Ordering::Acquire) => {
                StageStatus::Failed(e.code, e.to_string())
            }
            _ => StageStatus::Idle,
        };
        drop(status);
        slot.take();
        drop(slot);
        let _ = report.send(Report::Done(r));
    }

    /// The gate the stage thread's update stops at: report the version
    /// staged (and vote for it), then wait for the decision (all senders
    /// gone: aborted). `passed`: set when it lets the update commit.
    fn commit_gate<'p>(
        self: &Arc<Self>,
        decisions: mpsc::Receiver<Decision>,
        report: mpsc::Sender<Report>,
        passed: &'p AtomicBool,
    ) -> CommitGate<'p> {
        let started = Instant::now();
        let m = Arc::clone(self);
        Box::new(move |version: &str| {
            {
                let mut status = m.stage_status.lock();
                if *status == StageStatus::Staging {
                    *status = StageStatus::Ready(version.to_string());
                }
            }
            m.at_gate.store(true, Ordering::Release);
            let _ = report.send(Report::Staged(version.to_string(), started.elapsed()));
            match decisions.recv() {
                // The ranks cannot switch together any more: nothing is
                // written (the commit would fail their finishing barrier
                // after writing the new version).
                Ok(Decision::Commit) if m.signal.stopped().is_some() => {
                    let why = m.signal.stopped().map(|e| e.message).unwrap_or_default();
                    Err(Error::peer(format!(
                        "rank {}: no commit: the ranks' group stopped ({why})",
                        m.config.rank
                    )))
                }
                Ok(Decision::Commit) => {
                    m.config.logger.debug(&format!(
                        "rank {}: staged version {version}: committing",
                        m.config.rank
                    ));
                    passed.store(true, Ordering::Release);
                    Ok(())
                }
                Ok(Decision::Abort(e)) => Err(e),
                Err(_) => Err(Error::cancelled("the staged version was dropped")),
            }
        })
    }

    /// Abort the staged version, if any (a clear or a cancel), and wait
    /// (bounded) until its update ended. `why` names what dropped it (a
    /// noun: "a clear"), read as "the staged version was dropped by {why}".
    pub(super) fn abort_staged(&self, why: &str) -> Result<()> {
        if !self.is_staged() {
            return Ok(());
        }
        // Called from the staging's own callbacks (acquire): the staging
        // cannot end while this waits for it.
        if self.on_stage_thread() {
            return Err(self.busy_running());
        }
        self.drop_staged(why);
        let until = Instant::now() + END_MARGIN;
        while self.staged.lock().is_some() {
            if Instant::now() > until {
                return Err(self.busy());
            }
            // Again each time: the stage thread's update may not have
            // registered its flag yet (`watch_stops`).
            self.stop_staging();
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Tell a staged or staging version to drop, for `why`, without waiting
    /// for it: a staging stops at its next batch (or when the wait it is
    /// in ends), a staged version at its decision.
    pub(super) fn drop_staged(&self, why: &str) {
        let Some(decide) = self.staged.lock().clone() else {
            return;
        };
        *self.stage_dropped.lock() = Some(why.to_string());
        let _ = decide.send(Decision::Abort(Error::cancelled(why)));
        self.stop_staging();
    }

    /// Whether the staging reached its commit gate: staged, and `stage`
    /// is returning (or returned) it.
    pub fn stage_at_gate(&self) -> bool {
        self.at_gate.load(Ordering::Acquire)
    }

    /// Whether this thread is the staging's own (its callbacks run there).
    pub fn on_stage_thread(&self) -> bool {
        *self.stage_thread.lock() == Some(std::thread::current().id())
    }

    /// Whether a version is staged (or staging).
    pub fn is_staged(&self) -> bool {
        self.staged.lock().is_some()
    }

    /// Whether the version staging now was dropped (`abort_staged`).
    pub(super) fn stage_dropped(&self) -> bool {
        self.stage_dropped.lock().is_some()
    }
}

/// A request's fields but its hooks (checked: none were set): unlike the
/// hooks (closures), they may move to the stage thread.
struct HooklessParts {
    source: crate::source::SourceKind,
    locations: Vec<std::path::PathBuf>,
    version: Option<String>,
    flags: (bool, bool, bool),
    deltas: super::DeltaMode,
    mode: Mode,
    timeout: Duration,
}

impl HooklessParts {
    fn of(r: UpdateRequest) -> HooklessParts {
        HooklessParts {
            source: r.source,
            locations: r.locations,
            version: r.version,
            flags: (r.verify, r.skip_network_checksums, r.skip_unknown),
            deltas: r.deltas,
            mode: r.mode,
            timeout: r.timeout,
        }
    }

    fn into_request(self) -> UpdateRequest<'static> {
        let (verify, skip_network_checksums, skip_unknown) = self.flags;
        UpdateRequest {
            source: self.source,
            locations: self.locations,
            version: self.version,
            verify,
            skip_network_checksums,
            mode: self.mode,
            skip_unknown,
            deltas: self.deltas,
            timeout: self.timeout,
            hooks: Default::default(),
        }
    }
}

impl Staged {
    /// The version staged.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// How long staging took (from `stage` until every byte was verified).
    pub fn staged_in(&self) -> Duration {
        self.staged_in
    }

    /// Make the staged version the params' contents. The stats' `update`
    /// is the pause: this call's own time; `sync` the staging's receive
    /// time. An error leaves the old weights, or FAILED when the commit
    /// had started writing (as a one-call atomic update's commit).
    pub fn commit(mut self) -> Result<UpdateStats> {
        let t = Instant::now();
        // A thread that ended already (a clear or cancel aborted it)
        // reports why below.
        let _ = self.decide.send(Decision::Commit);
        let mut stats = self.outcome()?;
        stats.update = t.elapsed();
        stats.total = self.staged_in + stats.update;
        // The status reports what this call returns (the pause as its
        // update time), not the stage thread's own timing.
        if let Some(last) = self.manager.record.lock().last_update.as_mut() {
            if last.version == stats.version {
                *last = stats.clone();
            }
        }
        Ok(stats)
    }

    /// Drop the staged version: the old weights and version stay. An
    /// abort that succeeds is no failure: the status's last error stays
    /// what it was (the staged update's cancel is not recorded).
    pub fn abort(mut self) -> Result<()> {
        let before = self.manager.record.lock().last_error.clone();
        self.send_abort();
        match self.outcome() {
            Err(e) if e.code == wm_result::WM_ERR_CANCELLED => {
                let mut record = self.manager.record.lock();
                if record
                    .last_error
                    .as_ref()
                    .is_some_and(|l| l.message == e.message)
                {
                    record.last_error = before;
                }
                Ok(())
            }
            Err(e) => Err(e),
            Ok(s) => Err(Error::state(format!(
                "abort: version {} was committed instead",
                s.version
            ))),
        }
    }

    fn send_abort(&self) {
        let _ = (self.decide).send(Decision::Abort(Error::cancelled(
            "the staged version was aborted by the engine",
        )));
    }

    /// The update's end, once the thread reported it.
    fn outcome(&mut self) -> Result<UpdateStats> {
        match self.reports.recv_timeout(self.timeout + END_MARGIN) {
            Ok(Report::Done(r)) => {
                self.join();
                r
            }
            Ok(Report::Staged(..)) => Err(Error::state("staged twice")),
            // Left running (detached): it ends at its own deadline.
            Err(_) => {
                self.thread.take();
                Err(Error::timeout(format!(
                    "the staged update did not end within its timeout ({:?})",
                    self.timeout
                )))
            }
        }
    }

    fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("version", &self.version)
            .field("staged_in", &self.staged_in)
            .finish_non_exhaustive()
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.send_abort();
            let _ = self.outcome();
        }
    }
}

/// Staged: every byte is in, verified and (for device params) uploaded, so
/// the commit is the switch alone; wait for the engine's decision (`gate`),
/// then give the applier `timeout` again for the commit.
pub(super) fn pass_gate(
    applier: &mut Applier,
    gate: &mut CommitGate,
    version: &str,
    timeout: std::time::Duration,
) -> std::result::Result<(), ApplyFailure> {
    let decided = (applier.check_received())
        .and_then(|()| applier.ready_to_commit())
        .and_then(|()| gate(version));
    if let Err(error) = decided {
        return Err(applier.failure(error));
    }
    applier.renew_deadline(timeout);
    Ok(())
}
