//! A fan-out member's update (see [`crate::fanout`]): the root's
//! announcement, the member's plan and applier, the vote, the root's
//! outcome, then the bytes, through the applier like every source's
//! (`fanout/member.rs` says where they land) and committed by it.

use super::update::UpdateRun;
use super::{Manager, UpdateStats};
use crate::apply::{Applier, ApplyFailure, Mode};
use crate::checkpoint::version::check_version;
use crate::fanout::{Announcement, Bounce, FanoutSession, MemberLanding, Word};
use crate::plan::Plan;
use crate::result::{Error, Result};
use std::time::{Duration, Instant};

impl Manager {
    pub(super) fn receive_fanout(
        &self,
        run: &mut UpdateRun,
        s: &mut FanoutSession,
    ) -> std::result::Result<UpdateStats, ApplyFailure> {
        let deadline = run.deadline();
        let root = s.root_rank();
        let announcement = match s.word::<Announcement>(None, deadline)? {
            Word::Go(a) => a,
            Word::Stop(why) => {
                return Err(Error::peer(format!(
                    "the fan-out root, rank {root}, could not start the update: {why}"
                ))
                .into())
            }
        };
        let (plan, sizes, bounce) = match self.accept_announcement(run, &announcement) {
            Ok(accepted) => accepted,
            Err(e) => return Err(refuse(s, e, deadline).into()),
        };
        let batch_timeout = crate::defaults::BUCKET_TIMEOUT.min(run.req.timeout);
        // Members trust the root's verification (no checksums announced,
        // and no GPU hash kernel yet): a request's `verify` is the root's.
        run.req.verify = false;
        // The applier (and its atomic staging) is made before the vote, so
        // a rank that cannot take the update refuses it before any byte
        // moves; everything after the vote happens inside.
        let (mut voted, mut broadcast) = (false, false);
        // The member's device params are written by NCCL directly, as gdr
        // writes them: in place, the applier hands out their addresses.
        let applied = self.apply_plan(run, (&plan, &announcement.version), true, |applier| {
            voted = true;
            s.vote(Ok(()), deadline)?;
            self.hear_outcome(s, deadline)?;
            broadcast = true;
            self.receive_bytes(s, applier, &sizes, bounce.as_ref(), batch_timeout)
                .map_err(|e| e.context(format!("receiving the fan-out from rank {root}")))
        });
        if broadcast && !announcement.staged {
            // The root hears whether this rank took the bytes (staged, the
            // signal's vote decides instead).
            let mine = applied.as_ref().map(|_| ()).map_err(|f| f.error.clone());
            // Bounded like a batch (as on the root), not by the deadline.
            let vote_by = Instant::now() + crate::defaults::BUCKET_TIMEOUT;
            if let (Ok(_), Err(e)) = (&applied, s.took(mine, vote_by)) {
                (self.config.logger).warn(&format!("the fan-out's final vote: {e}"));
            }
        }
        let applied = match applied {
            Err(f) if !voted => return Err(refuse(s, f.error, deadline).into()),
            r => r?,
        };
        self.config.logger.info(&format!(
            "rank {}: updated to version {} by fan-out from rank {root} ({} tensors, {} bytes)",
            self.config.rank, announcement.version, applied.tensors, applied.bytes
        ));
        Ok(UpdateStats {
            version: announcement.version,
            rank: self.config.rank,
            tensors: applied.tensors as u64,
            bytes: applied.bytes,
            sync: applied.receive,
            update: applied.commit,
            total: run.start.elapsed(),
            ..Default::default()
        })
    }

    /// Can this rank take the announced tensors? Its plan for them, their
    /// sizes and, atomic, the GPU buffer each batch lands in first.
    fn accept_announcement(
        &self,
        run: &mut UpdateRun,
        announcement: &Announcement,
    ) -> Result<(Plan, Vec<usize>, Option<Bounce>)> {
        let ordinal = self.config.device;
        crate::fanout::refuse_tensor_hook(run.req.hooks.tensor.is_some())?;
        let staging = run.gate.is_some();
        if announcement.staged != staging {
            let how = |staged: bool| match staged {
                true => "stages it (wm_stage)",
                false => "updates in one call (wm_update)",
            };
            return Err(Error::state(format!(
                "fan-out: the root {} but rank {} {}: every rank of a fan-out group must \
                 update the same way (a one-call member would commit a version the ranks may drop)",
                how(announcement.staged),
                self.config.rank,
                how(staging)
            )));
        }
        check_version(&announcement.version)?;
        let plan =
            crate::fanout::member_plan(announcement, run.registry, ordinal, self.config.rank)?;
        self.restore_if_released(run, false)?;
        let sizes: Vec<usize> = plan.entries.iter().map(|e| e.bytes as usize).collect();
        let mut bounce = None;
        if run.req.mode == Mode::Atomic {
            let n = Bounce::size_for(&sizes, self.config.net.bucket_size)?;
            let memory = crate::memory::device::DeviceAllocation::new(
                "the fan-out landing buffer",
                ordinal,
                n,
            )?;
            bounce = Some(Bounce::Device(memory));
        }
        Ok((plan, sizes, bounce))
    }

    /// The root's outcome: its update went through, or why not.
    fn hear_outcome(&self, s: &mut FanoutSession, deadline: Instant) -> Result<()> {
        match s.word::<()>(None, deadline)? {
            Word::Go(()) => Ok(()),
            Word::Stop(why) => Err(Error::peer(format!(
                "the fan-out root, rank {}, failed its update ({why}); this rank keeps its weights",
                s.root_rank()
            ))),
        }
    }

    /// Receive the root's broadcast where the applier says.
    fn receive_bytes(
        &self,
        s: &mut FanoutSession,
        applier: &mut Applier,
        sizes: &[usize],
        bounce: Option<&Bounce>,
        batch_timeout: Duration,
    ) -> Result<()> {
        let origin = format!("the fan-out from rank {}", s.root_rank());
        let mut landing = MemberLanding::new(applier, sizes, bounce, &origin);
        s.move_tensors(
            sizes,
            self.config.net.bucket_size,
            batch_timeout,
            &mut landing,
        )
    }
}

/// This rank refuses the update for `why`: its vote says so; returns the
/// vote's error (`why`, or what went wrong voting).
fn refuse(s: &mut FanoutSession, why: Error, deadline: Instant) -> Error {
    match s.vote(Err(why.clone()), deadline) {
        Err(e) => e,
        Ok(()) => why,
    }
}
