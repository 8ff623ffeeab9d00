//! Copies to device params: whole, verified tensors go up from host memory
//! (a pinned buffer of their own, or any host bytes through the staging's
//! shared buffers), and chunks in a source's GPU memory are copied device
//! to device. All are queued on the staging's streams; the applier waits for
//! them before the update counts as done. Atomic, a param with a device
//! shadow (`device_swap.rs`) gets its bytes in the shadow instead.

use super::landing::Landing;
use crate::memory::pinned::PinnedBuffer;
use crate::memory::strided::Strided;
use crate::plan::{Segment, Target};
use crate::result::{Error, Result};

/// The host bytes of a whole tensor on its way to a device param.
pub(super) enum UploadFrom<'d> {
    /// A pinned buffer of the tensor's own, sent as it is.
    Pinned(PinnedBuffer),
    /// Any host memory (a loose buffer, the atomic arena), copied through
    /// the staging's pinned buffers.
    Host(&'d [u8]),
    /// A param's atomic shadow: the param's bytes, indexed by the runs'
    /// param offsets.
    ParamShadow(&'d [u8]),
}

impl Landing<'_> {
    /// Queue the copy of whole, verified tensor `t` to its device param
    /// (`ptr` on GPU `ordinal`), run by run; to the param's shadow instead
    /// when it has one (`device_swap.rs`: the param is not written).
    pub(super) fn upload(
        &mut self,
        origin: &str,
        t: usize,
        (param, ordinal): (u64, i32),
        from: UploadFrom,
    ) -> Result<()> {
        let (shadow, has_shadow) = match self.plan.entries[t].target {
            Target::Param(i) => (self.device_shadows.target(i), self.device_shadows.has(i)),
            _ => (None, false),
        };
        if has_shadow && shadow.is_none() {
            return Err(Error::state(format!(
                "internal: {origin}: tensor '{}' uploaded after its shadow's view was dropped",
                self.plan.entries[t].meta.name
            )));
        }
        if shadow.is_none() {
            self.writes_params();
        }
        let ptr = shadow.unwrap_or(param);
        let (threads, deadline, plan) = (self.threads, self.deadline, self.plan);
        let name = &plan.entries[t].meta.name;
        let context =
            |e: Error| e.context(format!("tensor '{name}' from {origin} to GPU {ordinal}"));
        let segments = plan.segments(t);
        let staging = self.staging()?;
        match from {
            // The staging policy gives a pinned buffer only to entries of
            // one segment.
            UploadFrom::Pinned(buf) => {
                let s = segments[0];
                // SAFETY: the device range was checked at registration to
                // hold the param's bytes, and only this update writes it;
                // the buffer holds the entry's bytes.
                unsafe { staging.upload_buffer(ordinal, buf, ptr + s.param, s.len as usize) }
                    .map_err(context)
            }
            UploadFrom::Host(data) | UploadFrom::ParamShadow(data) => {
                // A shadow holds the param's bytes at their param offsets;
                // other host bytes are the entry's as received.
                let by_param = matches!(from, UploadFrom::ParamShadow(_));
                for (at, param, len) in following_on(segments, by_param) {
                    let bytes = &data[at as usize..(at + len) as usize];
                    // SAFETY: as above.
                    unsafe { staging.upload_bytes(ordinal, ptr + param, bytes, threads, deadline) }
                        .map_err(&context)?;
                }
                Ok(())
            }
        }
    }

    /// Atomic: upload whole, verified tensor `t` from its param's staged
    /// bytes (the arena's shadow of param `i`) to its device param at
    /// `dest`, into the param's device shadow when it has one. The one
    /// upload of atomic mode: as soon as `t` is complete when the param
    /// has a device shadow (the param is untouched: a staged update's
    /// pause is then the swap alone), else at the commit.
    pub(super) fn upload_staged(
        &mut self,
        origin: &str,
        t: usize,
        (i, dest): (usize, (u64, i32)),
        arena: &super::arena::Arena,
    ) -> Result<()> {
        let end = self.plan.segments(t).iter().map(|s| s.param + s.len).max();
        // SAFETY: the arena's shadow of param `i` holds its verified bytes
        // up to its last run's end (every run of `t` arrived); the arena
        // outlives this call, and `upload` copies the bytes into pinned
        // buffers before it returns.
        let shadow =
            unsafe { std::slice::from_raw_parts(arena.param_shadow(i), end.unwrap_or(0) as usize) };
        self.upload(origin, t, dest, UploadFrom::ParamShadow(shadow))
    }

    /// Whether param `i`'s tensors go up as they complete (atomic, with a
    /// device shadow) rather than at the commit.
    pub(super) fn uploads_early(&self, i: usize) -> bool {
        self.device_shadows.has(i)
    }

    /// Queue a device-to-device copy of `run` (a block, or equally spaced
    /// blocks as one 2D copy) on GPU `ordinal`.
    pub(super) fn copy_on_device(
        &mut self,
        origin: &str,
        (ordinal, run): (i32, Strided),
    ) -> Result<()> {
        let staging = self.staging()?;
        // SAFETY: every destination row lies in a device param (range
        // checked when the chunk was accepted, the param's range at
        // registration; rows never overlap); the source's GPU memory stays
        // put until the source waits for these copies.
        unsafe { staging.copy_device(ordinal, &run) }
            .map_err(|e| e.context(format!("{origin} to GPU {ordinal}")))
    }

    /// Wait for every queued copy to the GPUs (uploads, and device to
    /// device copies out of a source's GPU memory): the bytes are then in
    /// the params, and the source's memory is no longer read.
    pub fn settle_uploads(&mut self) -> Result<()> {
        let deadline = self.deadline;
        match self.staging.as_deref_mut() {
            Some(s) => s
                .wait(deadline)
                .map_err(|e| e.context("uploading to the GPU")),
            None => Ok(()),
        }
    }
}

/// `segments` as (offset in the host bytes, param offset, len), those that
/// follow on in both joined: the rows of a column split come from far
/// apart in the source but lie back to back in the received bytes and in
/// the param, so they go up as one copy, not one per row. The host bytes
/// are indexed by param offset when `by_param` (a shadow), else as
/// received.
fn following_on(segments: &[Segment], by_param: bool) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for s in segments {
        let at = if by_param { s.param } else { s.wanted };
        match out.last_mut() {
            Some((a, p, n)) if *a + *n == at && *p + *n == s.param => *n += s.len,
            _ => out.push((at, s.param, s.len)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_back_to_back_go_up_as_one_copy() {
        let seg = |source, wanted, param, len| Segment {
            source,
            wanted,
            param,
            len,
        };
        // Three rows of a column split, then a row landing elsewhere.
        let segments = [
            seg(32, 0, 0, 96),
            seg(224, 96, 96, 96),
            seg(416, 192, 192, 96),
            seg(608, 288, 1000, 96),
        ];
        assert_eq!(
            following_on(&segments, false),
            vec![(0, 0, 288), (288, 1000, 96)]
        );
        assert_eq!(
            following_on(&segments, true),
            vec![(0, 0, 288), (1000, 1000, 96)]
        );
    }
}
