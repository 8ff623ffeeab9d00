//! Where bytes land, and the engine that moves them.
//!
//! - [`host`]: library-owned host memory whose physical pages can be released
//!   and brought back at the same address.
//! - [`swap`]: the page swap that commits an atomic update into a
//!   library-owned host param without copying.
//! - [`deferred`]: what a staged commit took out of params, freed after
//!   the commit returned.
//! - [`loose`]: bounded, fallible buffers for tensors received outside params.
//! - [`copy`]: the parallel copier every source uses (memory to memory, and
//!   file to memory with `pread`).
//! - [`hashing`]: copies that hash what they move, and checksums of
//!   regions on several threads.
//! - [`shared`]: sealed memfd buffers passed between processes.
//! - [`pool`]: buffers kept for the next session.
//! - [`cuda`]: the CUDA driver (loaded at run time) and device params.
//! - [`cuda_ipc`]: GPU memory shared between processes (CUDA IPC handles).
//! - [`device`]: library-owned device memory at stable addresses (CUDA VMM).
//! - [`device_swap`]: the page swap that commits an atomic update into a
//!   library-owned device param without writing its memory.
//! - [`staging`]: pinned host buffers and asynchronous uploads to the GPU.
//! - [`sigbus`]: the SIGBUS guard: a mapping whose file or shared-memory
//!   object shrinks under us becomes an error, not a crash.
//! - [`mapped_file`]: a window of a file read through a memory map, under
//!   that guard.
//! - [`kept_mappings`]: the IPC buffers an engine keeps mapped between
//!   sessions.

pub mod copy;
pub mod cuda;
pub mod cuda_ipc;
pub mod deferred;
pub mod device;
pub mod device_swap;
pub mod hashing;
pub mod host;
pub mod kept_mappings;
pub mod loose;
pub mod mapped_file;
pub mod nvrtc;
pub mod pinned;
pub mod pool;
pub mod shared;
pub mod sigbus;
pub mod staging;
pub mod strided;
pub mod swap;

/// A raw pointer that may cross threads. The owner guarantees the memory
/// outlives every copy that uses it and that no two copies write one byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendPtr(pub *mut u8);

// SAFETY: SendPtr is only an address: reading or writing through it takes
// unsafe code, whose caller answers for the memory being alive and free of
// races (the plan's ranges never overlap; the memory outlives the copies).
unsafe impl Send for SendPtr {}
// SAFETY: as for Send: sharing the address shares no access.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The address `n` bytes further on (a method, so that a closure
    /// using it captures the whole `SendPtr`, not its raw pointer).
    pub fn wrapping_add(self, n: usize) -> SendPtr {
        SendPtr(self.0.wrapping_add(n))
    }
}

/// Slots for `sizes` packed one after another at 256-byte aligned offsets
/// (the bucket alignment checkpoint-engine uses): each one's offset, and the bytes they
/// span. None if that overflows. Staging arenas and published buffers.
pub fn aligned_offsets(sizes: impl IntoIterator<Item = u64>) -> Option<(Vec<usize>, usize)> {
    let mut offsets = Vec::new();
    let mut end = 0u64;
    for n in sizes {
        let at = end.checked_next_multiple_of(crate::wire::ALIGN)?;
        offsets.push(usize::try_from(at).ok()?);
        end = at.checked_add(n)?;
    }
    Some((offsets, usize::try_from(end).ok()?))
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

#[cfg(test)]
mod tests {
    #[test]
    fn slots_are_packed_at_aligned_offsets() {
        assert_eq!(
            super::aligned_offsets([10, 0, 256, 1]),
            Some((vec![0, 256, 256, 512], 513))
        );
        assert_eq!(super::aligned_offsets([]), Some((vec![], 0)));
        assert_eq!(super::aligned_offsets([u64::MAX, 1]), None);
    }
}
