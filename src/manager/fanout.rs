//! The manager's side of NCCL fan-out (see [`crate::fanout`]): what the
//! root sends after its own update, and a member's whole update.

use super::{check_version, ipc, Manager, UpdateRequest, UpdateStats};
use crate::apply::{Mode, Progress};
use crate::fanout::{Announcement, FanoutSession, Word};
use crate::memory::aligned_offsets;
use crate::memory::device::DeviceAllocation;
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::state::State;
use std::time::Instant;

impl Manager {
    /// The fan-out root, after its own update: the outcome, then the bytes.
    pub(super) fn send_fanout(
        &self,
        registry: &Registry,
        s: &mut FanoutSession,
        params: &[usize],
        deadline: Instant,
    ) -> Result<()> {
        s.word(Some(&Word::Go(())), deadline)?;
        let spans: Vec<(u64, usize)> = params
            .iter()
            .map(|&i| {
                let p = &registry.params()[i];
                (p.ptr() as u64, p.nbytes)
            })
            .collect();
        s.move_tensors(
            &spans,
            self.config.net.bucket_size,
            ipc::BUCKET_TIMEOUT,
            |_, _| Ok(()),
        )
    }

    /// A fan-out member's update: the root's announcement, the vote, the
    /// root's outcome, then the bytes (see [`crate::fanout`]).
    pub(super) fn receive_fanout(
        &self,
        registry: &mut Registry,
        req: &mut UpdateRequest,
        prev: State,
        restored: &mut bool,
        start: Instant,
        s: &mut FanoutSession,
    ) -> std::result::Result<UpdateStats, (Error, bool)> {
        let early = |e: Error| (e, false);
        let deadline = start + req.timeout;
        let root = s.root_rank();
        let announcement = match s.word::<Announcement>(None, deadline).map_err(early)? {
            Word::Go(a) => a,
            Word::Stop(why) => {
                return Err(early(Error::peer(format!(
                    "the fan-out root, rank {root}, could not start the update: {why}"
                ))))
            }
        };
        let ordinal = self.config.device;
        // Atomic members' arena slots, packed like every staging arena.
        let (offsets, arena_size) = aligned_offsets(announcement.tensors.iter().map(|t| t.nbytes))
            .ok_or_else(|| {
                early(Error::out_of_memory(
                    "the fan-out announcement is too large",
                ))
            })?;
        let mut arena = None;
        let accepted = (|| {
            crate::fanout::refuse_tensor_hook(req.hooks.tensor.is_some())?;
            check_version(&announcement.version)?;
            let params = crate::fanout::match_announcement(
                &announcement,
                registry,
                ordinal,
                self.config.rank,
            )?;
            self.restore_if_released(registry, prev, restored)?;
            if req.mode == Mode::Atomic {
                arena = Some(DeviceAllocation::new(
                    "the fan-out atomic arena",
                    ordinal,
                    arena_size,
                )?);
            }
            Ok(params)
        })();
        s.vote(
            accepted.as_ref().map(|_| ()).map_err(Clone::clone),
            deadline,
        )
        .map_err(early)?;
        let params = accepted.map_err(early)?;
        match s.word::<()>(None, deadline).map_err(early)? {
            Word::Go(()) => {}
            Word::Stop(why) => {
                return Err(early(Error::peer(format!(
                    "the fan-out root, rank {root}, failed its update ({why}); this rank keeps its weights"
                ))))
            }
        }
        let received = Instant::now();
        let spans: Vec<(u64, usize)> = params
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let p = &registry.params()[i];
                match &arena {
                    Some(a) => (a.ptr() + offsets[k] as u64, p.nbytes),
                    None => (p.ptr() as u64, p.nbytes),
                }
            })
            .collect();
        let bytes_total: u64 = spans.iter().map(|s| s.1 as u64).sum();
        let mut progress = req.hooks.progress.take();
        let moved = s.move_tensors(
            &spans,
            self.config.net.bucket_size,
            ipc::BUCKET_TIMEOUT.min(req.timeout),
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
        );
        let in_place = arena.is_none();
        moved.map_err(|e| {
            (
                e.context(format!("receiving the fan-out from rank {root}")),
                in_place,
            )
        })?;
        let sync = received.elapsed();
        let committed = Instant::now();
        if let Some(a) = &arena {
            let copies: Vec<(u64, u64, usize)> = params
                .iter()
                .enumerate()
                .map(|(k, &i)| {
                    let p = &registry.params()[i];
                    (p.ptr() as u64, a.ptr() + offsets[k] as u64, p.nbytes)
                })
                .collect();
            // SAFETY: params of this rank's GPU (matched above) and the arena.
            unsafe { s.commit(&copies, Instant::now() + ipc::BUCKET_TIMEOUT) }
                .map_err(|e| (e, true))?;
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
            total: start.elapsed(),
        })
    }
}
