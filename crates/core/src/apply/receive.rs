//! Where a tensor's bytes are received: the atomic arena (`arena.rs`: a
//! param's shadow at the run's param offset, or a callback slot), the param itself
//! (host, or device with gdr), a pinned buffer of its own, or a loose
//! buffer. The policy for device params (which sizes get a pinned buffer)
//! is `memory::staging`'s.

use super::spans::SegmentWalk;
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

/// `spans` as (address, length) pieces, in order, each run of spans that
/// follow each other in memory joined into one.
pub(super) fn joined(spans: &[Span]) -> Vec<(SendPtr, usize)> {
    let mut out: Vec<(SendPtr, usize)> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some((at, n)) if at.0.wrapping_add(*n) == s.dst.0 => *n += s.len as usize,
            _ => out.push((s.dst, s.len as usize)),
        }
    }
    out
}

/// Where an entry's received bytes go, chunk after chunk (in order).
pub(super) enum Spans<'s> {
    /// Back to back from here (the entry's own buffer or arena slot).
    Packed(*mut u8),
    /// In memory laid out like the param, at `base`.
    Param {
        base: *mut u8,
        walk: SegmentWalk<'s>,
    },
}

impl Spans<'_> {
    /// Received bytes `[offset, offset + len)` (following on from the last
    /// call's), as spans handed to `f` in order. Err: a byte in no run.
    pub(super) fn map(
        &mut self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(Span),
    ) -> Result<(), u64> {
        match self {
            Spans::Packed(base) => {
                let dst = SendPtr(base.wrapping_add(offset as usize));
                f(Span { at: 0, dst, len });
                Ok(())
            }
            Spans::Param { base, walk } => walk.map(offset, len, |at, p, len| {
                let dst = SendPtr(base.wrapping_add(p as usize));
                f(Span { at, dst, len })
            }),
        }
    }
}

impl<'p> Applier<'p, '_> {
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

    /// Where received bytes of entry `t` go, from received byte `offset`
    /// on: the arena or a buffer of the entry's own (which hold the
    /// entry's bytes as received), or memory laid out like its param (the
    /// param itself, or its shadow), cut at segment edges.
    pub(super) fn spans_from(&mut self, t: usize, offset: u64) -> Result<Spans<'p>> {
        let plan = self.plan;
        let laid_out = |base: *mut u8| Spans::Param {
            base,
            walk: SegmentWalk::at(plan.segments(t), offset),
        };
        if let Some(arena) = &self.arena {
            if let Target::Param(i) = plan.entries[t].target {
                return Ok(laid_out(arena.param_shadow(i)));
            }
            return Ok(Spans::Packed(arena.callback_slot(t)));
        }
        let param = match (self.gdr_param(t), self.params[t]) {
            (Some((ptr, _)), _) => Some(ptr as *mut u8),
            (None, Some(Dest::Host(p))) if matches!(plan.entries[t].target, Target::Param(_)) => {
                Some(p.0)
            }
            _ => None,
        };
        match param {
            Some(base) => Ok(laid_out(base)),
            None => Ok(Spans::Packed(self.tensor_buffer(t)?.0)),
        }
    }

    /// [`Applier::spans_from`] for the one range `[offset, offset + len)`.
    pub(super) fn receive_spans(&mut self, t: usize, offset: u64, len: u64) -> Result<Vec<Span>> {
        let mut out = Vec::new();
        let mut spans = self.spans_from(t, offset)?;
        spans
            .map(offset, len, |s| out.push(s))
            .map_err(|at| self.no_run(t, at))?;
        Ok(out)
    }

    /// Received bytes `[offset, offset + len)` of entry `t` in the param,
    /// cut at segment edges: (byte of the range, param byte, length).
    pub(super) fn param_spans(
        &self,
        t: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64, u64)>> {
        let mut out = Vec::new();
        SegmentWalk::at(self.plan.segments(t), offset)
            .map(offset, len, |at, p, n| out.push((at, p, n)))
            .map_err(|at| self.no_run(t, at))?;
        Ok(out)
    }

    /// The error for received byte `at` of entry `t`, in none of its runs.
    pub(super) fn no_run(&self, t: usize, at: u64) -> Error {
        Error::format(format!(
            "tensor '{}': byte {at} is in no planned run",
            self.name(t)
        ))
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
