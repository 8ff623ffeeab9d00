//! The fan-out root's update (see [`crate::fanout`]): the ordinary update
//! (`update.rs`) with a step before the bytes move (announce the plan, hear
//! the members' vote) and one after the commit (tell the members the
//! outcome, then broadcast the params). When the root fails before its
//! commit, it tells the members why (they stop too).
//!
//! Staged (`staged.rs`), the root sends before its commit instead: once
//! every byte arrived and verified, it tells the members it staged, then
//! broadcasts its staging (host memory, through a GPU bounce buffer), so
//! each member stages the same bytes; every rank then commits at the same
//! step through the signal's vote, or none does.

use super::prepare::Prepared;
use super::update::UpdateRun;
use super::{Manager, UpdateStats};
use crate::apply::{Applier, ApplyFailure};
use crate::fanout::transfer::{FromParams, FromStaged};
use crate::fanout::{Announcement, Bounce, FanoutSession, Word};
use crate::logging::Logger;
use crate::memory::device::DeviceAllocation;
use crate::registry::Registry;
use crate::result::{Error, Result};
use std::time::Instant;

/// The root's side of one update's fan-out.
struct FanoutRoot<'a, 'l> {
    session: &'a mut FanoutSession<'l>,
    logger: &'a Logger,
    /// Bound on every word to the members.
    said_by: Instant,
    /// Staged: the members were told it staged (and got its bytes); from
    /// then on the signal's vote decides for every rank, and no Stop word
    /// follows (the members listen for none).
    staged_sent: bool,
    /// The params announced, by registry index, in broadcast order.
    params: Vec<usize>,
}

impl Manager {
    /// The ordinary update, wrapped in the fan-out root's steps.
    pub(super) fn update_as_fanout_root(
        &self,
        run: &mut UpdateRun,
        session: &mut FanoutSession,
    ) -> std::result::Result<UpdateStats, ApplyFailure> {
        let mut root = FanoutRoot {
            session,
            logger: &self.config.logger,
            said_by: run.deadline(),
            staged_sent: false,
            params: Vec::new(),
        };
        let mut prepared = self.prepare(run).map_err(|e| root.stop(e))?;
        let has_tensor_hook = run.req.hooks.tensor.is_some();
        let staged = run.gate.is_some();
        root.before(
            &prepared,
            run.registry,
            has_tensor_hook,
            (self.config.device, staged),
        )?;
        let sizes = root.sizes(run.registry);
        let bucket = self.config.net.bucket_size;
        let applied = match staged {
            true => {
                let mut send =
                    |a: &mut Applier| root.send_staged(a, &sizes, (bucket, self.config.device));
                self.apply(run, &mut prepared, Some(&mut send))
            }
            false => self.apply(run, &mut prepared, None),
        };
        let mut stats = applied.map_err(|f| {
            self.kept.plans.forget(&prepared.plan);
            ApplyFailure {
                error: root.stop(f.error),
                weights: f.weights,
            }
        })?;
        if staged {
            return Ok(self.updated(run, &prepared, stats));
        }
        let sent = Instant::now();
        root.after(&sizes, run.registry, bucket).map_err(|e| {
            ApplyFailure::after_writing(e.context(format!(
                "the update to {} was applied on rank {}, but its fan-out to rank(s) {} failed",
                stats.version,
                self.config.rank,
                crate::signal::group::list(root.session.members())
            )))
        })?;
        stats.update += sent.elapsed();
        Ok(self.updated(run, &prepared, stats))
    }
}

impl FanoutRoot<'_, '_> {
    /// Before any byte moves: announce what this update moves and hear the
    /// members' vote. A failed announcement stops the members; a failed
    /// word or vote needs no stop (the members saw it fail too).
    fn before(
        &mut self,
        prepared: &Prepared,
        registry: &Registry,
        has_tensor_hook: bool,
        (ordinal, staged): (i32, bool),
    ) -> Result<()> {
        let announced = crate::fanout::refuse_tensor_hook(has_tensor_hook).and_then(|()| {
            crate::fanout::announce(&prepared.version, &prepared.plan, registry, ordinal)
        });
        let (mut announcement, params) = announced.map_err(|e| self.stop(e))?;
        announcement.staged = staged;
        self.params = params;
        self.session
            .word(Some(&Word::Go(announcement)), self.said_by)?;
        self.session.vote(Ok(()), self.said_by)
    }

    /// The announced params' sizes, in broadcast order.
    fn sizes(&self, registry: &Registry) -> Vec<usize> {
        let params = registry.params();
        self.params.iter().map(|&i| params[i].nbytes).collect()
    }

    /// After the root's commit: tell the members it went through,
    /// broadcast the announced params, then hear whether every member took
    /// them (a member failing on the last batch leaves no broadcast failed).
    fn after(&mut self, sizes: &[usize], registry: &Registry, bucket_size: usize) -> Result<()> {
        self.session.word(Some(&Word::Go(())), self.said_by)?;
        let at: Vec<u64> = (self.params.iter())
            .map(|&i| registry.params()[i].ptr() as u64)
            .collect();
        self.session.move_tensors(
            sizes,
            bucket_size,
            crate::defaults::BUCKET_TIMEOUT,
            &mut FromParams(&at),
        )?;
        // Bounded like a batch, not by the update's deadline: the batches
        // before it are bounded that way too, so a long last batch does not
        // leave the vote no time (and the members waiting in it).
        let vote_by = Instant::now() + crate::defaults::BUCKET_TIMEOUT;
        self.session.took(Ok(()), vote_by)
    }

    /// Staged, before the gate: every byte arrived and verified, tell the
    /// members so, then broadcast the staging (`sizes`, in at most
    /// `bucket_size`-byte batches through a bounce buffer on GPU
    /// `ordinal`). The bounce buffer is taken before the word, so a
    /// failure to take it stops the members with its reason.
    fn send_staged(
        &mut self,
        applier: &mut Applier,
        sizes: &[usize],
        (bucket_size, ordinal): (usize, i32),
    ) -> Result<()> {
        applier.check_received()?;
        let staged = (self.params.iter())
            .map(|&i| {
                applier.staged_param(i).ok_or_else(|| {
                    Error::state(format!("fan-out: param #{i} has no staging (internal)"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let n = Bounce::size_for(sizes, bucket_size)?;
        let bounce = DeviceAllocation::new("the fan-out root's bounce buffer", ordinal, n)?;
        self.session.word(Some(&Word::Go(())), self.said_by)?;
        self.staged_sent = true;
        let mut from = FromStaged {
            staged: &staged,
            sizes,
            bounce: &bounce,
        };
        self.session.move_tensors(
            sizes,
            bucket_size,
            crate::defaults::BUCKET_TIMEOUT,
            &mut from,
        )
    }

    /// Tell the members why the root stops (they stop too); hand the error on.
    fn stop(&mut self, e: Error) -> Error {
        if self.staged_sent {
            return e;
        }
        let word: Word<Announcement> = Word::Stop(e.to_string());
        if let Err(se) = self.session.word(Some(&word), self.said_by) {
            self.logger
                .warn(&format!("telling the fan-out members: {se}"));
        }
        e
    }
}
