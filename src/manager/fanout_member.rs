//! A fan-out member's update (see [`crate::fanout`]): the root's
//! announcement, the vote, the root's outcome, then the bytes. In place,
//! the bytes land in the params; atomic, in a device arena copied to the
//! params once all arrived.

use super::update::UpdateRun;
use super::{check_version, Manager, UpdateStats};
use crate::apply::ApplyFailure;
use crate::apply::{Mode, Progress};
use crate::fanout::{Announcement, FanoutSession, Word};
use crate::memory::aligned_offsets;
use crate::memory::device::DeviceAllocation;
use crate::registry::Registry;
use crate::result::{Error, Result};
use std::time::Instant;

/// An atomic member's landing place: a slot per announced tensor, packed
/// like every staging arena.
struct Arena {
    memory: DeviceAllocation,
    offsets: Vec<usize>,
}

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
        let (offsets, arena_size) = aligned_offsets(announcement.tensors.iter().map(|t| t.nbytes))
            .ok_or_else(|| Error::out_of_memory("the fan-out announcement is too large"))?;
        let accepted = self.accept_announcement(run, &announcement, arena_size);
        s.vote(
            accepted.as_ref().map(|_| ()).map_err(Clone::clone),
            deadline,
        )?;
        let (params, memory) = accepted?;
        let arena = memory.map(|memory| Arena { memory, offsets });
        match s.word::<()>(None, deadline)? {
            Word::Go(()) => {}
            Word::Stop(why) => {
                return Err(Error::peer(format!(
                    "the fan-out root, rank {root}, failed its update ({why}); this rank keeps its weights"
                ))
                .into())
            }
        }
        let received = Instant::now();
        let spans = landing_spans(run.registry, &params, arena.as_ref());
        let bytes_total: u64 = spans.iter().map(|s| s.1 as u64).sum();
        self.receive_bytes(run, s, &spans).map_err(|e| {
            let e = e.context(format!("receiving the fan-out from rank {root}"));
            ApplyFailure::new(e, arena.is_none())
        })?;
        let sync = received.elapsed();
        let committed = Instant::now();
        if let Some(a) = &arena {
            commit_arena(s, run.registry, &params, a).map_err(ApplyFailure::after_writing)?;
        }
        self.config.logger.info(&format!(
            "rank {}: updated to version {} by fan-out from rank {root} ({} tensors, {bytes_total} bytes)",
            self.config.rank,
            announcement.version,
            spans.len()
        ));
        Ok(UpdateStats {
            version: announcement.version,
            rank: self.config.rank,
            tensors: spans.len() as u64,
            bytes: bytes_total,
            sync,
            update: committed.elapsed(),
            total: run.start.elapsed(),
            ..Default::default()
        })
    }

    /// This rank's vote: can it take the announced tensors? Returns the
    /// params they go to and, atomic, the arena they land in first.
    fn accept_announcement(
        &self,
        run: &mut UpdateRun,
        announcement: &Announcement,
        arena_size: usize,
    ) -> Result<(Vec<usize>, Option<DeviceAllocation>)> {
        let ordinal = self.config.device;
        crate::fanout::refuse_tensor_hook(run.req.hooks.tensor.is_some())?;
        check_version(&announcement.version)?;
        let params = crate::fanout::match_announcement(
            announcement,
            run.registry,
            ordinal,
            self.config.rank,
        )?;
        self.restore_if_released(run, false)?;
        let mut arena = None;
        if run.req.mode == Mode::Atomic {
            arena = Some(DeviceAllocation::new(
                "the fan-out atomic arena",
                ordinal,
                arena_size,
            )?);
        }
        Ok((params, arena))
    }

    /// Receive the root's broadcast into `spans`, telling the progress hook.
    fn receive_bytes(
        &self,
        run: &mut UpdateRun,
        s: &mut FanoutSession,
        spans: &[(u64, usize)],
    ) -> Result<()> {
        let bytes_total: u64 = spans.iter().map(|s| s.1 as u64).sum();
        let mut progress = run.req.hooks.progress.take();
        s.move_tensors(
            spans,
            self.config.net.bucket_size,
            crate::defaults::BUCKET_TIMEOUT.min(run.req.timeout),
            |bytes_done, tensors_done| {
                let p = Progress {
                    bytes_done,
                    bytes_total,
                    tensors_done: tensors_done as u64,
                    tensors_total: spans.len() as u64,
                };
                if let Some(hook) = progress.as_mut() {
                    if !hook(&p) {
                        return Err(Error::cancelled(
                            "the progress callback cancelled the update",
                        ));
                    }
                }
                Ok(())
            },
        )
    }
}

/// Where each announced tensor lands: (device address, bytes).
fn landing_spans(
    registry: &Registry,
    params: &[usize],
    arena: Option<&Arena>,
) -> Vec<(u64, usize)> {
    params
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let p = &registry.params()[i];
            match arena {
                Some(a) => (a.memory.ptr() + a.offsets[k] as u64, p.nbytes),
                None => (p.ptr() as u64, p.nbytes),
            }
        })
        .collect()
}

/// Atomic commit: copy the arena to the params.
fn commit_arena(
    s: &mut FanoutSession,
    registry: &Registry,
    params: &[usize],
    a: &Arena,
) -> Result<()> {
    let copies: Vec<(u64, u64, usize)> = params
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let p = &registry.params()[i];
            (
                p.ptr() as u64,
                a.memory.ptr() + a.offsets[k] as u64,
                p.nbytes,
            )
        })
        .collect();
    // SAFETY: params of this rank's GPU (matched above) and the arena.
    unsafe { s.commit(&copies, Instant::now() + crate::defaults::BUCKET_TIMEOUT) }
}
