//! The end of an update: check that every planned byte arrived, then make
//! the bytes the engine's weights. Atomic: swap shadows into library-owned
//! host params, copy the rest into engine-owned ones, upload device params,
//! hand callback tensors out, quantize into FP8 params (`quantize.rs`),
//! and once the uploads settled swap device shadows in (`shadows.rs`,
//! `device_swap.rs`). In place: quantized params, and callback
//! tensors not yet delivered (empty ones) are left. Either way, wait for
//! the uploads.

use super::arena::Arena;
use super::{Applied, Applier, Dest};
use crate::plan::Target;
use crate::result::Result;
use std::time::Instant;

impl Applier<'_, '_> {
    pub(super) fn commit(&mut self) -> Result<Applied> {
        let receive = (self.tally.received_in).unwrap_or_else(|| self.tally.started.elapsed());
        self.tally.check_complete(self.plan)?;
        self.check_deadline()?;
        let commit_start = Instant::now();
        if let Some(arena) = self.landing.arena.take() {
            self.check_quantized(Some(&arena))?;
            // `upload` copies the arena's bytes into pinned buffers before
            // it returns, so the arena may be reused or freed after this.
            self.commit_arena(arena)?;
        } else {
            self.write_quantized(None)?;
            for t in 0..self.plan.entries.len() {
                if self.plan.entries[t].target == Target::Callback && !self.tally.was_delivered(t) {
                    self.deliver(t, &[])?;
                }
            }
        }
        self.landing.settle_uploads()?;
        let swap_start = Instant::now();
        self.landing.swap_device_shadows()?;
        Ok(Applied {
            tensors: self.plan.tensors,
            bytes: self.params_took(),
            receive,
            commit: commit_start.elapsed(),
            device_swap: swap_start.elapsed(),
            deltas: self.deltas.clone(),
        })
    }

    /// Atomic: runs into host params without a shadow of their own are
    /// copied in parallel, device params are uploaded from their shadows,
    /// callback tensors handed out from their slots; last, each own shadow
    /// is swapped in.
    fn commit_arena(&mut self, mut arena: Arena) -> Result<()> {
        self.landing.copy_shadows(&arena)?;
        for t in 0..self.plan.entries.len() {
            match (self.plan.entries[t].target, self.landing.params[t]) {
                // Uploaded when it completed already (`uploads_early`).
                (Target::Param(i), Some(Dest::Device { ptr, ordinal }))
                    if !self.landing.uploads_early(i) =>
                {
                    let dest = (i, (ptr, ordinal));
                    (self.landing).upload_staged("the staging arena", t, dest, &arena)?
                }
                (Target::Callback, _) => {
                    let n = self.plan.entries[t].meta.nbytes as usize;
                    // SAFETY: slot t holds n verified bytes; the arena outlives this call.
                    let data = unsafe { std::slice::from_raw_parts(arena.callback_slot(t), n) };
                    self.deliver(t, data)?
                }
                _ => {}
            }
        }
        self.write_quantized(Some(&arena))?;
        self.landing.swap_shadows(&mut arena)?;
        self.landing.keep_packed(arena);
        Ok(())
    }
}
