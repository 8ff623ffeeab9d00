//! Where an update's bytes land, and the one record of whether a param
//! byte may have changed.
//!
//! A tensor's bytes are received in the atomic arena (`arena.rs`: a
//! param's shadow at the run's param offset, or a callback slot), the
//! param itself (host, or device with gdr), a pinned buffer of its own,
//! or a loose buffer. The policy for device params (which sizes get a
//! pinned buffer) is `memory::staging`'s. The other writes to params
//! (uploads and device copies, `upload.rs`; the atomic commit,
//! `shadows.rs`) are the landing's too.
//!
//! Whether a failed update leaves the old weights or FAILED depends on
//! whether any param byte may have changed: every write to a param (or
//! hand-out of param memory to a source) calls
//! [`Landing::writes_params`] first, the only code that sets that record.

use super::arena::{Arena, AtomicStaging};
use super::device_swap::DeviceShadows;
use super::spans::{joined, SegmentWalk, Span, Spans};
use super::types::{ApplyOptions, Mode};
use crate::memory::host::HostRegion;
use crate::memory::loose::LooseBuffers;
use crate::memory::pinned::PinnedBuffer;
use crate::memory::staging::{lands_in_own_pinned_buffer, DeviceStaging};
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::registry::Dest;
use crate::result::{Error, Result};
use std::collections::HashMap;
use std::time::Instant;

/// The memory an update writes: params, staging and buffers.
pub(super) struct Landing<'p> {
    pub plan: &'p Plan,
    /// Per plan entry: the param's memory, for `Target::Param`.
    pub params: Vec<Option<Dest>>,
    /// Atomic mode: a shadow per target param, a slot per callback tensor
    /// (taken by the commit).
    pub arena: Option<Arena>,
    /// Atomic mode: per param number, the library-owned region its shadow
    /// is swapped into at commit.
    pub swappable: Vec<Option<&'p HostRegion>>,
    /// A staged commit: the old pages of swapped params go here, by param
    /// number (see `AtomicStaging::swapped_out`; None: the swap frees them).
    pub swapped_out: Option<&'p parking_lot::Mutex<Vec<(usize, HostRegion)>>>,
    /// Atomic mode: shadows of library-owned device params, swapped in at
    /// commit (`device_swap.rs`).
    pub device_shadows: DeviceShadows<'p>,
    /// Atomic mode: where the arena's packed region is kept for the next
    /// update (None: freed).
    pub keep: Option<&'p mut Option<HostRegion>>,
    /// In-place mode: callback and device tensors being received (and a
    /// spare buffer kept for the next one).
    pub loose: LooseBuffers,
    /// In-place mode: device tensors landing in pinned memory.
    pub pinned: HashMap<usize, PinnedBuffer>,
    /// Pinned buffers and upload streams for device params (the manager's,
    /// kept across updates).
    pub staging: Option<&'p mut DeviceStaging>,
    /// gdr, in place: a source writes device params' bytes straight into
    /// them ([`Landing::receive_scatter`] gives device addresses).
    pub gdr: bool,
    pub threads: usize,
    pub deadline: Instant,
    /// True once any param byte may have changed: private, so that only
    /// [`Landing::writes_params`] sets it.
    written: bool,
}

impl<'p> Landing<'p> {
    /// The landing of `plan` into `params`, atomic mode staging as
    /// `staging` says (device memory first: it fails fast, before host
    /// staging is faulted in).
    pub fn new(
        plan: &'p Plan,
        params: Vec<Option<Dest>>,
        opts: &ApplyOptions,
        mut staging: AtomicStaging<'p>,
        deadline: Instant,
    ) -> Result<Landing<'p>> {
        let (device_shadows, arena) = match opts.mode {
            Mode::Atomic => (
                DeviceShadows::for_plan(plan, (&staging.device, staging.device_release_later))?,
                Some(Arena::for_plan(plan, &mut staging, opts.threads)?),
            ),
            Mode::InPlace => (DeviceShadows::default(), None),
        };
        Ok(Landing {
            plan,
            params,
            arena,
            swappable: staging.swappable,
            swapped_out: staging.swapped_out,
            device_shadows,
            keep: staging.keep,
            loose: LooseBuffers::new(opts.callback_staging_limit),
            pinned: HashMap::new(),
            staging: None,
            gdr: false,
            threads: opts.threads,
            deadline,
            written: false,
        })
    }

    /// Record that param bytes are about to change (or be handed to a
    /// source that changes them): from now on a failure leaves the
    /// weights half-written, which the manager reports as FAILED. The one
    /// place the record is set.
    pub fn writes_params(&mut self) {
        self.written = true;
    }

    /// True once any param byte may have changed.
    pub fn wrote_params(&self) -> bool {
        self.written
    }

    /// Where bytes `[offset, offset + len)` of plan entry `t` land, in
    /// order, for a source that writes them there itself (a network
    /// receive straight into param memory or the atomic arena, a fan-out
    /// broadcast): one (address, length) per piece, pieces that follow
    /// each other joined (a column split's rows are strided at the source
    /// but back to back in the param: one piece). Range-checked; in place,
    /// the params count as written from now on. None, with nothing
    /// counted as written, when they would land in more than `most`
    /// pieces, or in GPU memory in more than one: the source then receives
    /// them elsewhere and hands them over to be copied.
    pub fn receive_scatter(
        &mut self,
        t: usize,
        offset: u64,
        len: usize,
        most: usize,
    ) -> Result<Option<Vec<(SendPtr, usize)>>> {
        let pieces = joined(&self.landing_spans(t, offset, len)?);
        if pieces.len() > 1 && (pieces.len() > most || self.gdr_param(t).is_some()) {
            return Ok(None);
        }
        if self.received_in_param(t) {
            self.writes_params();
        }
        Ok(Some(pieces))
    }

    /// Where bytes `[offset, offset + len)` of entry `t` land, cut at
    /// segment edges, once checked against the entry.
    fn landing_spans(&mut self, t: usize, offset: u64, len: usize) -> Result<Vec<Span>> {
        let Some(entry) = self.plan.entries.get(t) else {
            return Err(Error::format(format!(
                "chunk names tensor #{t} but the plan has {}",
                self.plan.entries.len()
            )));
        };
        let n = entry.bytes;
        if entry.target == Target::Skip || offset.checked_add(len as u64).is_none_or(|end| end > n)
        {
            return Err(Error::format(format!(
                "tensor '{}': {len} bytes at byte {offset} do not fit its {n} bytes (or it is skipped)",
                entry.meta.name
            )));
        }
        self.receive_spans(t, offset, len as u64)
    }

    pub fn name(&self, t: usize) -> &str {
        &self.plan.entries[t].meta.name
    }

    /// The manager's pinned staging, which device params need.
    pub fn staging(&mut self) -> Result<&mut DeviceStaging> {
        self.staging.as_deref_mut().ok_or_else(|| {
            Error::unsupported("device params need the manager's pinned staging (internal)")
        })
    }

    /// True in place (atomic until the commit takes the arena).
    pub fn in_place(&self) -> bool {
        self.arena.is_none()
    }

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
    /// when `len` bytes from there are contiguous in the param (segments
    /// back to back count as one piece, as [`Landing::receive_scatter`]
    /// joins them).
    pub(super) fn param_offset(&self, t: usize, offset: u64, len: u64) -> Result<u64> {
        let spans = self.param_spans(t, offset, len.max(1))?;
        let follow_on = spans.windows(2).all(|w| w[0].1 + w[0].2 == w[1].1);
        match spans.first() {
            Some((_, p, _)) if follow_on => Ok(*p),
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

impl Drop for Landing<'_> {
    /// Pinned buffers of tensors that never completed go back to the
    /// staging; an arena left by a failure frees its own shadows (the new
    /// pages) and keeps its packed region when asked to.
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            self.keep_packed(arena);
        }
        for (t, buf) in self.pinned.drain() {
            if let (Some(Dest::Device { ordinal, .. }), Some(s)) =
                (self.params[t], self.staging.as_deref_mut())
            {
                s.give_back(ordinal, buf);
            }
        }
    }
}
