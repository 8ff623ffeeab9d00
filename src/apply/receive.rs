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

/// Where part of a chunk goes: bytes `at..at + len` of the chunk to `dst`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub at: u64,
    pub dst: SendPtr,
    pub len: u64,
}

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

    /// Where received bytes `[offset, offset + len)` of entry `t` go, as
    /// (byte of the chunk, destination, length) spans: one span in the
    /// arena or a buffer of the entry's own (which hold the entry's bytes
    /// as received), one per segment in the param itself.
    pub(super) fn receive_spans(&mut self, t: usize, offset: u64, len: u64) -> Result<Vec<Span>> {
        if let Some(arena) = &self.arena {
            if let Target::Param(i) = self.plan.entries[t].target {
                return self.spans_at(arena.param_shadow(i), t, offset, len);
            }
            let dst = SendPtr(arena.callback_slot(t).wrapping_add(offset as usize));
            return Ok(vec![Span { at: 0, dst, len }]);
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
            return self.spans_at(base, t, offset, len);
        }
        let buffer = self.tensor_buffer(t)?;
        let dst = SendPtr(buffer.0.wrapping_add(offset as usize));
        Ok(vec![Span { at: 0, dst, len }])
    }

    /// The spans of received bytes `[offset, offset + len)` of entry `t` in
    /// memory laid out like its param (the param, or its shadow) at `base`.
    fn spans_at(&self, base: *mut u8, t: usize, offset: u64, len: u64) -> Result<Vec<Span>> {
        let spans = self.param_spans(t, offset, len)?;
        Ok(spans
            .into_iter()
            .map(|(at, p, len)| Span {
                at,
                dst: SendPtr(base.wrapping_add(p as usize)),
                len,
            })
            .collect())
    }

    /// Received bytes `[offset, offset + len)` of entry `t` in the param,
    /// cut at segment edges: (byte of the range, param byte, length).
    pub(super) fn param_spans(
        &self,
        t: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64, u64)>> {
        let segs = self.plan.segments(t);
        let mut i = segs.partition_point(|s| s.wanted + s.len <= offset);
        let (mut at, end) = (offset, offset + len);
        let mut out = Vec::new();
        while at < end {
            let s = segs.get(i).filter(|s| s.wanted <= at).ok_or_else(|| {
                Error::format(format!(
                    "tensor '{}': byte {at} is in no planned run",
                    self.name(t)
                ))
            })?;
            let n = (s.wanted + s.len).min(end) - at;
            out.push((at - offset, s.param + (at - s.wanted), n));
            at += n;
            i += 1;
        }
        Ok(out)
    }

    /// The param byte that received byte `offset` of entry `t` goes to,
    /// when `len` bytes from there are contiguous in the param.
    pub(super) fn param_offset(&self, t: usize, offset: u64, len: u64) -> Result<u64> {
        match self.param_spans(t, offset, len.max(1))?.as_slice() {
            [(_, p, _)] => Ok(*p),
            _ => Err(Error::format(format!(
                "tensor '{}': {len} bytes from byte {offset} are not contiguous in its param",
                self.name(t)
            ))),
        }
    }

    /// A buffer holding the whole of entry `t` on its way to a device param
    /// or the callback: pinned when the staging policy says so and a buffer
    /// is free, loose otherwise.
    fn tensor_buffer(&mut self, t: usize) -> Result<SendPtr> {
        let n = self.plan.entries[t].bytes as usize;
        let (Target::Param(_), Some(Dest::Device { ordinal, .. })) =
            (self.plan.entries[t].target, self.params[t])
        else {
            return self.loose_buffer(t, n);
        };
        if !lands_in_own_pinned_buffer(n) || self.plan.segments(t).len() != 1 {
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
