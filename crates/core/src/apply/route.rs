//! How a chunk's bytes reach where they end up, decided once per run of
//! chunks (`batch.rs`: consecutive chunks of one tensor from one kind of
//! source take the same route).

use super::landing::Landing;
use super::types::{Chunk, DeviceBytes};
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::Target;
use crate::registry::Dest;

/// The path of one chunk through the applier, with what that path needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// The copier copies it where its tensor is received: the atomic
    /// arena, a host param (in place), or a pinned or loose buffer on its
    /// way to a device param or the callback.
    Copy,
    /// The source already wrote it where [`Landing::receive_scatter`] said, in
    /// host memory: only accounted for (and hashed).
    Landed,
    /// A whole callback tensor at `src` in the source's host memory, in
    /// place: handed to the callback where it is, without a copy.
    HostView { src: SendPtr },
    /// A whole callback tensor in the source's GPU memory (CUDA IPC), in
    /// place, unverified: handed to the callback as a device pointer.
    DeviceView(DeviceBytes),
    /// The source's GPU memory (each chunk's `src`) into the device param
    /// at `param` (address, GPU), in place, unverified: copied device to
    /// device on the param's upload stream.
    DeviceToDevice { param: (u64, i32) },
    /// gdr, in place: the source wrote it into the device param at `param`
    /// itself; verification hashes it there once the tensor is complete.
    OnDevice { param: (u64, i32) },
}

impl Landing<'_> {
    /// The route of chunk `c` (a run of chunks as one: its first's source,
    /// their bytes), which is whole when it holds its entire tensor in one
    /// piece; `landed`: the source wrote its bytes itself; `verify`: the
    /// update checks checksums (which device views would skip).
    pub(super) fn route(&self, c: &Chunk, whole: bool, landed: bool, verify: bool) -> Route {
        let t = c.tensor;
        let target = self.plan.entries[t].target;
        let in_place = self.arena.is_none();
        if let (CopySource::Device { ptr: src, ordinal }, false, true, false) =
            (c.src, landed, in_place, verify)
        {
            match (target, self.params[t]) {
                (Target::Param(_), Some(Dest::Device { ptr, ordinal: to })) => {
                    return Route::DeviceToDevice { param: (ptr, to) }
                }
                (Target::Callback, _) if whole => {
                    let len = c.len;
                    return Route::DeviceView(DeviceBytes {
                        ptr: src,
                        len,
                        ordinal,
                    });
                }
                _ => {}
            }
        }
        if let (true, Target::Callback, CopySource::Memory(src), false, true) =
            (in_place, target, c.src, landed, whole)
        {
            return Route::HostView { src };
        }
        match self.gdr_param(t) {
            Some(param) => Route::OnDevice { param },
            None if landed => Route::Landed,
            None => Route::Copy,
        }
    }
}
