//! An update: open the source, name the version, plan (nothing moves yet),
//! bring released memory back, stream the source through the applier,
//! commit. With NCCL fan-out the root wraps these steps
//! (`fanout_root.rs`) and a member receives from the root instead
//! (`fanout_member.rs`). What a failure leaves behind: the module docs.

use super::deltas;
use super::memory::note_unmapped;
use super::prepare::Prepared;
use super::quantized::Quantized;
use super::{Manager, UpdateRequest, UpdateStats};
use crate::apply::{Applied, Applier, ApplyFailure, ApplyOptions, Hooks, Mode, Progress};
use crate::checkpoint::version::check_version;
use crate::logging::LogLevel;
use crate::plan::{Plan, Target};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::source::{stream_all, Source};
use crate::state::State;
use std::time::{Duration, Instant};

/// One update in flight: what it works on and what it did so far.
pub(super) struct UpdateRun<'a, 'h> {
    pub registry: &'a mut Registry,
    pub req: UpdateRequest<'h>,
    /// The state before the update (CLEARED or FAILED: memory may be released).
    pub prev: State,
    pub start: Instant,
    /// Released memory was brought back; a failure before any write
    /// releases it again.
    pub restored: bool,
    /// A staged update (`staged.rs`): called with the version once every
    /// byte arrived and verified, before the commit; it returns when the
    /// engine decided (an error: abort, nothing written).
    pub gate: Option<CommitGate<'a>>,
}

/// A step once every source is streamed, before the gate and the commit.
pub(super) type AfterStreaming<'f> = &'f mut dyn FnMut(&mut Applier) -> Result<()>;

/// The gate a staged update waits at before its commit.
pub(super) type CommitGate<'p> = Box<dyn FnMut(&str) -> Result<()> + Send + 'p>;

impl UpdateRun<'_, '_> {
    /// The end of the whole update.
    pub fn deadline(&self) -> Instant {
        self.start + self.req.timeout
    }
}

impl Manager {
    /// Run one update. See the module docs for what failure leaves behind.
    pub fn update(&self, req: UpdateRequest) -> Result<UpdateStats> {
        self.update_gated(req, None)
    }

    /// [`Manager::update`], stopping at `gate` before the commit when one
    /// is given (a staged update).
    /// A staged update that ends before its gate let it commit (failed, or
    /// dropped) is not finished with the group here: the ranks' vote on
    /// staged versions finishes it (`staged_vote.rs`); `passed` says
    /// whether the gate let it commit.
    pub(super) fn update_gated(
        &self,
        req: UpdateRequest,
        gate: Option<(CommitGate, &std::sync::atomic::AtomicBool)>,
    ) -> Result<UpdateStats> {
        let (gate, passed) = gate.unzip();
        // Refused because another call runs: this call finishes nothing
        // the signal asked for (the running one does).
        let Some(op) = self.op.try_lock() else {
            // The staging thread's own update finds the op taken by
            // another call: its stage slot is not what makes it busy.
            let busy = match gate.is_some() {
                true => self.busy_running(),
                false => self.busy(),
            };
            return self.refused(State::Updating, busy);
        };
        let r = self
            .try_update(op, req, gate)
            .map_err(|e| self.cancel_cause(e));
        let stopped = passed.is_some_and(|p| !p.load(std::sync::atomic::Ordering::Acquire));
        let r = match stopped {
            true => r,
            false => self.finish_action(State::Updating, r, |s| s.version.clone()),
        };
        // A staged version the engine dropped (its clear or cancel, which
        // succeeded) is no failed call: its commit says why, if called.
        match stopped && self.stage_dropped() {
            true => r,
            false => self.recorded(r),
        }
    }

    /// The update, holding the manager's `_op`.
    fn try_update(
        &self,
        _op: parking_lot::MutexGuard<'_, ()>,
        req: UpdateRequest,
        gate: Option<CommitGate>,
    ) -> Result<UpdateStats> {
        let start = Instant::now();
        let _running = self.running_as(State::Updating);
        self.watch_stops();
        self.check_cancelled()?;
        // The signal asked for this update, but the ranks' group stopped:
        // its finishing barrier would fail after the commit.
        if let (true, Some(e)) = (self.signal.update_pending(), self.signal.stopped()) {
            return Err(Error::peer(format!(
                "rank {}: the ranks' group stopped ({}): the update the signal asked for cannot finish",
                self.config.rank, e.message
            )));
        }
        if let Some(v) = &req.version {
            check_version(v)?;
        }
        let (prev, was_open) = {
            let mut rec = self.record.lock();
            let was_open = std::mem::replace(&mut rec.registration_open, false);
            (std::mem::replace(&mut rec.state, State::Updating), was_open)
        };
        let mut registry = self.registry.write();
        let mut run = UpdateRun {
            registry: &mut registry,
            req,
            prev,
            start,
            restored: false,
            gate,
        };
        let outcome = self.run_update(&mut run);
        let restored = run.restored;
        drop(run);
        let state = match &outcome {
            Ok(_) => State::Normal,
            Err(f) if f.params_written() => {
                note_unmapped(&mut registry);
                State::Failed
            }
            Err(_) if restored => self.release_again(&mut registry, prev),
            Err(_) => prev,
        };
        let result = outcome.map_err(|f| f.error);
        let mut rec = self.record.lock();
        rec.state = state;
        // An update that failed without writing a param leaves registration
        // as it found it: a typo in the first update's path does not fix
        // the params for good (a kept plan is keyed by every param, so a
        // later registration cannot reuse a stale one).
        if was_open && result.is_err() && state != State::Failed {
            rec.registration_open = true;
        }
        // Half-written params hold no version (the next update names no
        // delta base either).
        if state == State::Failed {
            rec.version = None;
        }
        rec.resident_bytes = registry.resident_bytes();
        if let Ok(stats) = &result {
            rec.version = Some(stats.version.clone());
            rec.updates += 1;
            rec.last_update = Some(stats.clone());
            rec.last_error = None;
        }
        result
    }

    /// After an update failed before writing, release the memory it
    /// brought back; returns the state to be in.
    fn release_again(&self, registry: &mut Registry, prev: State) -> State {
        match self.release(registry) {
            Ok(_) => prev,
            Err(re) => {
                self.config
                    .logger
                    .warn(&format!("re-releasing after a failed update: {re}"));
                State::Failed
            }
        }
    }

    /// The ordinary update, or a fan-out root's or member's.
    fn run_update(&self, run: &mut UpdateRun) -> std::result::Result<UpdateStats, ApplyFailure> {
        let mut link = self
            .kept
            .fanout
            .as_ref()
            .filter(|_| self.signal.fanout_size() > 1)
            .map(|l| l.lock());
        let Some(link) = link.as_mut() else {
            return self.update_from_source(run);
        };
        let meet_by = Instant::now() + crate::defaults::BUCKET_TIMEOUT.min(run.req.timeout);
        let mut session = link.start(&self.signal, self.config.rank, meet_by)?;
        if session.is_root() {
            self.update_as_fanout_root(run, &mut session)
        } else {
            self.receive_fanout(run, &mut session)
        }
    }

    fn update_from_source(
        &self,
        run: &mut UpdateRun,
    ) -> std::result::Result<UpdateStats, ApplyFailure> {
        let mut prepared = self.prepare(run)?;
        let stats = self.apply(run, &mut prepared, None).inspect_err(|_| {
            // A failed update's plan is not kept (it may be a hostile
            // source's geometry); the next update plans again.
            self.kept.plans.forget(&prepared.plan);
        })?;
        Ok(self.updated(run, &prepared, stats))
    }

    /// Bring released memory back, then stream the prepared sources
    /// through the applier and commit; `then`, once they are all streamed,
    /// before the gate and the commit (a staged fan-out root sends its
    /// staging on). The stats' `total` is left for [`Self::updated`].
    pub(super) fn apply(
        &self,
        run: &mut UpdateRun,
        prepared: &mut Prepared,
        then: Option<AfterStreaming>,
    ) -> std::result::Result<UpdateStats, ApplyFailure> {
        let swaps_host = run.req.mode == Mode::Atomic && run.req.hooks.tensor.is_none();
        self.restore_if_released(run, swaps_host)?;
        let Prepared {
            sources, plan, gdr, ..
        } = prepared;
        let plan = &**plan;
        let applied = self.apply_plan(run, (plan, &prepared.version), *gdr, |applier| {
            stream_all(sources, plan, applier)?;
            then.map_or(Ok(()), |then| then(applier))
        })?;
        // Where an update's time went, for engine authors tuning (and the
        // GPU bench's breakdown of a staged commit's pause).
        let logger = &self.config.logger;
        if logger.enabled(LogLevel::Debug) {
            logger.debug(&format!(
                "rank {}: version {}: planned in {:?}, received in {:?}, committed in {:?} \
             (device page swap {:?})",
                self.config.rank,
                prepared.version,
                prepared.plan_time,
                applied.receive,
                applied.commit,
                applied.device_swap
            ));
        }
        Ok(UpdateStats {
            version: prepared.version.clone(),
            rank: self.config.rank,
            tensors: applied.tensors as u64,
            bytes: applied.bytes,
            sync: applied.receive,
            update: applied.commit,
            total: Duration::ZERO,
            plan_time: prepared.plan_time,
            plan_reused: prepared.plan_reused,
            source_bytes: source_bytes(plan, prepared.sources.len()),
            deltas: deltas::stats_of(&prepared.delta_base, plan, &applied),
        })
    }

    /// Build the applier for `plan` (the request's mode, hooks and
    /// timeout, cancellation, the manager's staging), let `feed` hand it
    /// every byte, then commit. Every update's bytes go through here: the
    /// sources' streams, or a fan-out member's broadcasts.
    pub(super) fn apply_plan(
        &self,
        run: &mut UpdateRun,
        (plan, version): (&Plan, &str),
        gdr: bool,
        feed: impl FnOnce(&mut Applier) -> Result<()>,
    ) -> std::result::Result<Applied, ApplyFailure> {
        let keep = self.config.keep_atomic_staging;
        let landing = keep.then_some(&self.kept.quant_landing);
        let quantized = Quantized::of(run.registry, plan, run.req.mode, landing)?;
        let dests = quantized.dests(plan, run.registry);
        let apply_opts = ApplyOptions {
            mode: run.req.mode,
            verify: run.req.verify,
            threads: self.threads,
            timeout: run.req.timeout,
            begun: run.start,
            callback_staging_limit: self.config.callback_staging_limit,
        };
        let Hooks {
            progress: mut user_progress,
            tensor: mut user_tensor,
        } = std::mem::take(&mut run.req.hooks);
        // Cancellation rides on the progress hook, which the applier calls
        // after every batch, before anything more moves.
        let staging = run.gate.is_some();
        let mut progress = |p: &Progress| {
            let go_on = user_progress.as_mut().is_none_or(|f| f(p));
            go_on && !self.is_cancelled() && !(staging && self.stage_dropped())
        };
        // A destroy from inside a tensor callback stops the update when the
        // callback returns: no more tensors are handed over.
        let mut tensor = user_tensor.as_mut().map(|t| {
            move |view: &crate::apply::TensorView| {
                t(view)?;
                match self.is_cancelled() {
                    true => Err("the manager was shut down".to_string()),
                    false => Ok(()),
                }
            }
        });
        let hooks = Hooks {
            progress: Some(&mut progress),
            tensor: match tensor.as_mut() {
                Some(t) => Some(t),
                None => None,
            },
        };
        let mut staging = self.kept.staging.lock();
        let mut kept = self.kept.atomic_staging.lock();
        let atomic_mode = apply_opts.mode == Mode::Atomic;
        // A staged commit before this one may still be freeing memory:
        // done before this update takes any.
        self.kept.wait_released();
        let mut atomic = self.atomic_staging(run.registry, keep.then_some(&mut *kept), atomic_mode);
        if run.gate.is_some() {
            atomic.device_release_later = Some(&self.kept.device_release);
            atomic.swapped_out = Some(&self.kept.swapped_out);
        }
        let mut applier = Applier::with_atomic_staging(plan, dests, apply_opts, hooks, atomic)?
            .with_staging(&mut staging)
            .with_gdr(gdr)
            .with_quantized(quantized.targets.clone())
            .with_stop(self.stop_flag());
        if let Err(error) = feed(&mut applier) {
            return Err(applier.failure(error));
        }
        if let Some(gate) = run.gate.as_mut() {
            super::staged::pass_gate(&mut applier, gate, version, run.req.timeout)?;
        }
        let applied = applier.finish();
        let keep_next = applied.is_ok() && keep && atomic_mode && crate::memory::swap::swaps_here();
        self.hand_on_old_pages(run.registry, keep_next);
        applied
    }

    /// The update went through: say so, and time the whole call.
    pub(super) fn updated(
        &self,
        run: &UpdateRun,
        prepared: &Prepared,
        mut stats: UpdateStats,
    ) -> UpdateStats {
        self.config.logger.info(&format!(
            "rank {}: updated to version {} from {} ({} tensors, {} bytes)",
            self.config.rank,
            stats.version,
            describe_all(&prepared.sources),
            stats.tensors,
            stats.bytes
        ));
        stats.total = run.start.elapsed();
        stats
    }

    /// After a clear (or a failed update), bring the params' memory back.
    /// `swaps_host`: the update swaps fresh pages into library-owned host
    /// params (atomic, not for the callback), so they are not faulted in.
    pub(super) fn restore_if_released(&self, run: &mut UpdateRun, swaps_host: bool) -> Result<()> {
        if run.prev == State::Cleared || run.prev == State::Failed {
            run.restored = run.registry.params().iter().any(|p| !p.resident);
            let taken = self.restore(run.registry, swaps_host)?;
            self.record.lock().device_bytes_restored = taken;
        }
        Ok(())
    }
}

/// Bytes the plan moves from each of `n` sources.
fn source_bytes(plan: &Plan, n: usize) -> Vec<u64> {
    let mut bytes = vec![0; n];
    for e in plan.entries.iter().filter(|e| e.target != Target::Skip) {
        bytes[e.source] += e.bytes;
    }
    bytes
}

/// The sources, for the log: the one, or how many and the first.
fn describe_all(sources: &[Box<dyn Source>]) -> String {
    match sources {
        [one] => one.describe(),
        [first, ..] => format!(
            "{} sources ({} and others)",
            sources.len(),
            first.describe()
        ),
        [] => "no source".into(),
    }
}
