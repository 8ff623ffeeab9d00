//! Where a tensor's bytes are received: the atomic arena (`arena.rs`: a
//! param's shadow at the run's param offset, or a callback slot), the param itself
//! (host, or device with gdr), a pinned buffer of its own, or a loose
//! buffer. The policy for device params (which sizes get a pinned buffer)
//! is `memory::staging`'s.

use super::{Applier, Dest};
use crate::memory::staging::lands_in_own_pinned_buffer;
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::result::{Error, Result};

impl Applier<'_, '_> {
    /// The device param of entry `t` when a source writes its bytes into it
    /// directly (gdr, in place): its address and GPU.
    pub(super) fn gdr_param(&self, t: usize) -> Option<(u64, i32)> {
        match (
            self.gdr,
            &self.arena,
            self.plan.entries[t].target,
            self.params[t],
        ) {
            (true, None, Target::Param(_), Some(Dest::Device { ptr, ordinal })) => {
                Some((ptr, ordinal))
            }
            _ => None,
        }
    }

    /// True when bytes of entry `t` received now are the param's own
    /// (in place, a host param or a gdr device param).
    pub(super) fn received_in_param(&self, t: usize) -> bool {
        self.arena.is_none()
            && (matches!(self.params[t], Some(Dest::Host(_))) || self.gdr_param(t).is_some())
    }

    /// Where byte `offset` of entry `t` is received (allocating its buffer
    /// on first use). Bytes received in the param itself map through the
    /// plan's run holding `offset`.
    pub(super) fn receive_at(&mut self, t: usize, offset: u64) -> Result<SendPtr> {
        if let Some(arena) = &self.arena {
            let at = match self.plan.entries[t].target {
                Target::Param(i) => arena
                    .param_shadow(i)
                    .wrapping_add(self.param_offset(t, offset)? as usize),
                _ => arena.callback_slot(t).wrapping_add(offset as usize),
            };
            return Ok(SendPtr(at));
        }
        let param = match (self.gdr_param(t), self.params[t]) {
            (Some((ptr, _)), _) => Some(ptr as *mut u8),
            (None, Some(Dest::Host(p)))
                if matches!(self.plan.entries[t].target, Target::Param(_)) =>
            {
                Some(p.0)
            }
            _ => None,
        };
        if let Some(base) = param {
            let at = self.param_offset(t, offset)?;
            return Ok(SendPtr(base.wrapping_add(at as usize)));
        }
        let buffer = self.tensor_buffer(t)?;
        Ok(SendPtr(buffer.0.wrapping_add(offset as usize)))
    }

    /// The param byte that byte `offset` of entry `t` goes to.
    pub(super) fn param_offset(&self, t: usize, offset: u64) -> Result<u64> {
        let run = self.plan.run_at(t, offset).ok_or_else(|| {
            Error::format(format!(
                "tensor '{}': byte {offset} is in no planned run",
                self.name(t)
            ))
        })?;
        Ok(run.param_offset(offset))
    }

    /// A buffer holding the whole of entry `t` on its way to a device param
    /// or the callback: pinned when the staging policy says so and a buffer
    /// is free, loose otherwise.
    fn tensor_buffer(&mut self, t: usize) -> Result<SendPtr> {
        let n = self.plan.entries[t].meta.nbytes as usize;
        let (Target::Param(_), Some(Dest::Device { ordinal, .. })) =
            (self.plan.entries[t].target, self.params[t])
        else {
            return self.loose_buffer(t, n);
        };
        if !lands_in_own_pinned_buffer(n) || self.plan.runs_of(t).len() != 1 {
            return self.loose_buffer(t, n);
        }
        if let Some(b) = self.pinned.get(&t) {
            return Ok(SendPtr(b.ptr()));
        }
        if self.loose.contains(t) {
            return self.loose_buffer(t, n); // fell back earlier
        }
        let deadline = self.deadline;
        match self.staging()?.take(ordinal, n, deadline)? {
            Some(buf) => {
                let at = SendPtr(buf.ptr());
                self.pinned.insert(t, buf);
                Ok(at)
            }
            // Every pinned buffer is held by tensors of this batch: this
            // one lands in ordinary memory and is uploaded from there.
            None => self.loose_buffer(t, n),
        }
    }

    /// A library buffer for entry `t` (`n` bytes): bounded by the callback
    /// staging limit for callback tensors, fallible for all.
    fn loose_buffer(&mut self, t: usize, n: usize) -> Result<SendPtr> {
        let entry = &self.plan.entries[t];
        let bounded = entry.target == Target::Callback;
        let at = self.loose.buffer_for(t, &entry.meta.name, n, bounded)?;
        Ok(SendPtr(at))
    }
}
