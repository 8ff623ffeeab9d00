//! Slice checksums (SUMS): the xxh3-128 of each request that asked for
//! one, hashed from the bytes as they are packed or sent (still in cache),
//! and sent right after the BUCKET frame holding the request's last byte,
//! before the engine can finish that entry. What they protect: the bytes
//! from the publisher's memory to the engine's params (transport, shared
//! memory, packing and landing); the publish-time whole-tensor sums cover
//! the trainer's memory before that.

use crate::checksum::Checksum;
use crate::wire::{BucketEntry, Frame, Request};

pub(super) struct SliceSums {
    /// Per request: its running hash (None: no sum asked), and its size.
    hashing: Vec<(Option<Checksum>, u64)>,
    /// The sums of the bucket hashed last, sent after its BUCKET frame.
    ready: Vec<(u32, u128)>,
}

impl SliceSums {
    pub(super) fn new(requests: &[Request]) -> SliceSums {
        SliceSums {
            hashing: requests
                .iter()
                .map(|q| (q.sums.then(Checksum::default), q.bytes()))
                .collect(),
            ready: Vec::new(),
        }
    }

    /// Whether any request asked for a sum.
    pub(super) fn any(&self) -> bool {
        self.hashing.iter().any(|(h, _)| h.is_some())
    }

    /// Hash the entries of the next bucket whose requests asked for sums,
    /// each's bytes at `at(entry)` (contiguous `len` bytes); keep the sums
    /// of the requests the bucket completes.
    ///
    /// # Safety
    /// `at(e)..at(e) + e.len` must be readable host memory for each entry
    /// of a request that asked for a sum.
    pub(super) unsafe fn hash(
        &mut self,
        entries: &[BucketEntry],
        at: impl Fn(&BucketEntry) -> *const u8,
    ) {
        for e in entries {
            let (Some(h), size) = &mut self.hashing[e.request as usize] else {
                continue;
            };
            // SAFETY: the caller's promise.
            h.update(unsafe { std::slice::from_raw_parts(at(e), e.len as usize) });
            if e.len > 0 && e.offset + e.len == *size {
                self.ready.push((e.request, h.digest()));
            }
        }
    }

    /// The SUMS frame of bucket `seq`, when it completes requests asking
    /// for sums.
    pub(super) fn frame(&mut self, seq: u64) -> Option<Frame> {
        let sums = std::mem::take(&mut self.ready);
        (!sums.is_empty()).then_some(Frame::Sums { seq, sums })
    }
}
