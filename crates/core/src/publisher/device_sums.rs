//! Slice checksums of a GPU version: the requests' bytes read back to the
//! host in bounded pieces and hashed there.
//!
//! What they protect: the same as a host version's sums (`sums.rs`), from
//! the version's GPU buffer to the engine's params: the engine's copies
//! out of the CUDA IPC buffer, its staging and landing (the manifest's
//! whole-tensor sums cover the trainer's memory before). Verifying, the engine copies what it receives to
//! host memory and hashes it there, on its way to device params too
//! (`source/ipc.rs`), so both ends hash the same bytes on the CPU.
//!
//! What they cost the trainer: every byte of a request that asks for a
//! sum crosses PCIe once more (device to host, into one pinned buffer of
//! [`STAGE`] bytes per session, allocated on the first such bucket), and
//! is hashed on one core (xxh3, several GB/s), before its bucket is
//! announced. Equally spaced blocks (a column split's rows) come down with
//! one 2D copy per run, packed back to back.

use super::shard::BLOCK_BATCH;
use super::sums::SliceSums;
use crate::memory::cuda_ipc::download_2d;
use crate::memory::pinned::PinnedBuffer;
use crate::memory::strided::runs;
use crate::result::Result;
use crate::wire::{BucketEntry, Request};

/// Bytes of pinned host memory a session hashing slices of a GPU version
/// holds: the most read back at once.
pub(super) const STAGE: usize = 4 << 20;

/// A session's pinned staging for the sums of a GPU version.
pub(super) struct DeviceSums {
    ordinal: i32,
    staging: Option<PinnedBuffer>,
}

impl DeviceSums {
    /// Sums of the GPU version on GPU `ordinal`.
    pub(super) fn new(ordinal: i32) -> DeviceSums {
        DeviceSums {
            ordinal,
            staging: None,
        }
    }

    /// Hash `blocks` (checked to lie in the version's buffer at device
    /// address `base`; request numbers into `requests`) into `sums`, the
    /// blocks of requests asking for no sum skipped.
    pub(super) fn hash(
        &mut self,
        sums: &mut SliceSums,
        base: u64,
        blocks: &[BucketEntry],
        requests: &[Request],
    ) -> Result<()> {
        let wanted = blocks
            .iter()
            .filter(|b| b.len > 0 && requests.get(b.request as usize).is_some_and(|q| q.sums));
        let mut batch = Vec::new();
        let mut filled = 0u64;
        for piece in wanted.flat_map(pieces) {
            // Bounded in blocks too: one-byte rows would be millions.
            if filled + piece.len > STAGE as u64 || batch.len() == BLOCK_BATCH {
                self.hash_batch(sums, base, &batch)?;
                (batch, filled) = (Vec::new(), 0);
            }
            batch.push((piece, filled));
            filled += piece.len;
        }
        self.hash_batch(sums, base, &batch)
    }

    /// Read `batch` (pieces, each with its offset in the staging) back into
    /// the staging and hash it there, in order.
    fn hash_batch(
        &mut self,
        sums: &mut SliceSums,
        base: u64,
        batch: &[(BucketEntry, u64)],
    ) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let staging = match &mut self.staging {
            Some(s) => s,
            None => self.staging.insert(PinnedBuffer::new(self.ordinal, STAGE)?),
        };
        let at = staging.ptr();
        let blocks = batch.iter().map(|(p, to)| {
            let dst = at.wrapping_add(*to as usize) as u64;
            ((), (dst, base + p.buffer_offset, p.len as usize))
        });
        for ((), run) in runs(blocks) {
            // SAFETY: the pieces lie in the version's buffer (checked by
            // the caller) and at disjoint offsets of the staging, within
            // its STAGE bytes.
            unsafe { download_2d(self.ordinal, &run) }
                .map_err(|e| e.context("reading a GPU version back for its slice checksums"))?;
        }
        // The pieces, each pointing at its bytes in the staging.
        let entries: Vec<BucketEntry> = batch
            .iter()
            .map(|&(p, to)| BucketEntry {
                buffer_offset: to,
                ..p
            })
            .collect();
        // SAFETY: each entry's bytes were just copied to the staging there.
        unsafe { sums.hash(&entries, 1, |e| at.wrapping_add(e.buffer_offset as usize)) };
        Ok(())
    }
}

/// Block `b` in pieces of at most [`STAGE`] bytes, in order.
fn pieces(b: &BucketEntry) -> impl Iterator<Item = BucketEntry> + '_ {
    let step = STAGE as u64;
    (0..b.len.div_ceil(step)).map(move |k| BucketEntry {
        request: b.request,
        offset: b.offset + k * step,
        len: (b.len - k * step).min(step),
        buffer_offset: b.buffer_offset + k * step,
    })
}
