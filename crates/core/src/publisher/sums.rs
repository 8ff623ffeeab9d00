//! Slice checksums (SUMS): the xxh3-128 of each request that asked for
//! one, hashed from the bytes as they are packed or sent (still in cache),
//! and sent for the bucket holding the request's last byte before the
//! engine can finish that entry: over IPC right after its BUCKET frame,
//! over the network after the messages that complete the request. What
//! they protect: the bytes from the publisher's memory to the engine's
//! params (transport, shared memory, packing and landing); the
//! publish-time whole-tensor sums cover the trainer's memory before that.

use crate::checksum::Checksum;
use crate::memory::SendPtr;
use crate::result::{try_vec, Result};
use crate::wire::{BucketEntry, Frame, Request};
use std::collections::HashMap;

pub(super) struct SliceSums {
    /// Per request: whether it asked for a sum, and its size.
    asked: Vec<(bool, u64)>,
    /// Whether any request asked for a sum.
    any: bool,
    /// The running hashes of requests begun and not complete. A hash's
    /// state is hundreds of bytes: made when a request's first bytes are
    /// hashed, not for each of a WANT's million requests up front.
    running: HashMap<u32, Checksum>,
    /// The sums of the bucket hashed last, sent after its BUCKET frame.
    ready: Vec<(u32, u128)>,
}

impl SliceSums {
    /// The sums `requests` ask for; `WM_ERR_OUT_OF_MEMORY` when there is
    /// no room to note them.
    pub(super) fn new(requests: &[Request]) -> Result<SliceSums> {
        let mut asked = try_vec(requests.len(), "noting the slice sums asked for")?;
        asked.extend(requests.iter().map(|q| (q.sums, q.bytes())));
        Ok(SliceSums {
            any: requests.iter().any(|q| q.sums),
            asked,
            running: HashMap::new(),
            ready: Vec::new(),
        })
    }

    /// Whether any request asked for a sum.
    pub(super) fn any(&self) -> bool {
        self.any
    }

    /// Hash the entries of the next bucket whose requests asked for sums,
    /// each's bytes at `at(entry)` (contiguous `len` bytes), on up to
    /// `threads` threads ([`SliceSums::hash_on`]); keep the sums of the
    /// requests the bucket completes.
    ///
    /// # Safety
    /// `at(e)..at(e) + e.len` must be readable host memory for each entry
    /// of a request that asked for a sum.
    pub(super) unsafe fn hash(
        &mut self,
        entries: &[BucketEntry],
        threads: usize,
        at: impl Fn(&BucketEntry) -> *const u8,
    ) {
        let at: Vec<SendPtr> = entries.iter().map(|e| SendPtr(at(e).cast_mut())).collect();
        // SAFETY: the caller's promise.
        let feed = |k: usize, h: &mut Checksum| unsafe { h.update(bytes_at(at[k], &entries[k])) };
        self.hash_on(entries, threads, &feed)
    }

    /// Whether request `q` asked for a sum (of some bytes: an empty
    /// request has none to send).
    pub(super) fn asks(&self, q: u32) -> bool {
        self.asked
            .get(q as usize)
            .is_some_and(|&(sums, size)| sums && size > 0)
    }

    /// Feed the entries of the next bucket whose requests asked for sums
    /// to their requests' running hashes, `feed(k, hash)` adding entry
    /// `k`'s bytes (where they are, or packing them as it hashes: a
    /// packed entry is then hashed as it is copied); keep the sums of the
    /// requests the bucket completes. On up to `threads` threads: each
    /// request's entries are fed in order on one thread, different
    /// requests on different threads (a bucket of a column split holds
    /// several requests; one thread hashing them all held the bucket
    /// back).
    pub(super) fn hash_on(
        &mut self,
        entries: &[BucketEntry],
        threads: usize,
        feed: &(dyn Fn(usize, &mut Checksum) + Sync),
    ) {
        // The running hashes of the requests this bucket touches, taken
        // out while threads feed them, in the order first touched, each
        // with its entries (their indices, in order).
        let mut mine: Vec<(u32, Checksum, Vec<usize>)> = Vec::new();
        let mut slot: HashMap<u32, usize> = HashMap::new();
        for (k, e) in entries.iter().enumerate() {
            let q = e.request;
            if !self.asks(q) {
                continue;
            }
            let i = *slot.entry(q).or_insert_with(|| {
                let h = self.running.remove(&q).unwrap_or_default();
                mine.push((q, h, Vec::new()));
                mine.len() - 1
            });
            mine[i].2.push(k);
        }
        let asked = &self.asked;
        let feed = |(q, mut h, ks): (u32, Checksum, Vec<usize>)| {
            let mut done = None;
            for k in ks {
                feed(k, &mut h);
                let e = &entries[k];
                if e.len > 0 && e.offset + e.len == asked[q as usize].1 {
                    done = Some(h.digest());
                }
            }
            (q, h, done)
        };
        let per = mine.len().div_ceil(threads.max(1)).max(1);
        let fed: Vec<(u32, Checksum, Option<u128>)> = match mine.len() <= per {
            true => mine.into_iter().map(feed).collect(),
            false => std::thread::scope(|s| {
                let parts: Vec<_> = {
                    let mut rest = mine;
                    let mut parts = Vec::new();
                    while !rest.is_empty() {
                        let tail = rest.split_off(per.min(rest.len()));
                        let part = std::mem::replace(&mut rest, tail);
                        parts.push(s.spawn(|| part.into_iter().map(feed).collect::<Vec<_>>()));
                    }
                    parts
                };
                parts
                    .into_iter()
                    .flat_map(|p| p.join().expect("hashing does not panic"))
                    .collect()
            }),
        };
        for (q, h, done) in fed {
            match done {
                Some(sum) => self.ready.push((q, sum)),
                None => {
                    self.running.insert(q, h);
                }
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

/// Entry `e`'s bytes at `at`.
///
/// # Safety
/// `at..at + e.len` is readable and unchanged while the slice lives.
pub(super) unsafe fn bytes_at<'a>(at: SendPtr, e: &BucketEntry) -> &'a [u8] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(at.0, e.len as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Five requests' bytes over two buckets, entries of different
    /// requests interleaved and one request without a sum: on 3 threads,
    /// each completed request's sum is the xxh3-128 of its bytes in order,
    /// sent with the bucket that completes it.
    #[test]
    fn requests_hashed_on_several_threads_sum_their_bytes_in_order() {
        let data: Vec<Vec<u8>> = (0..5u32)
            .map(|q| (0..3000 + q * 100).map(|i| (i * 31 + q) as u8).collect())
            .collect();
        let requests: Vec<Request> = data
            .iter()
            .enumerate()
            .map(|(q, d)| Request::whole(q as u32, d.len() as u64, q != 2))
            .collect();
        let entry = |q: u32, offset: u64, len: u64| BucketEntry {
            request: q,
            offset,
            len,
            buffer_offset: 0,
        };
        let mut first = Vec::new();
        let mut second = Vec::new();
        for (q, d) in data.iter().enumerate() {
            let (q, n) = (q as u32, d.len() as u64);
            first.extend([entry(q, 0, 1000), entry(q, 1000, 1000)]);
            second.push(entry(q, 2000, n - 2000));
        }
        // Interleave: request 4's entries first, then the rest.
        first.rotate_right(2);
        let data = &data;
        let feed = |es: &[BucketEntry]| {
            let es = es.to_vec();
            move |k: usize, h: &mut Checksum| {
                let e = es[k];
                let (at, n) = (e.offset as usize, e.len as usize);
                h.update(&data[e.request as usize][at..at + n]);
            }
        };
        let mut sums = SliceSums::new(&requests).unwrap();
        sums.hash_on(&first, 3, &feed(&first));
        assert!(sums.frame(0).is_none(), "nothing completed yet");
        sums.hash_on(&second, 3, &feed(&second));
        let Some(Frame::Sums {
            seq: 1,
            sums: mut got,
        }) = sums.frame(1)
        else {
            panic!("no SUMS")
        };
        got.sort();
        let want: Vec<(u32, u128)> = [0u32, 1, 3, 4]
            .iter()
            .map(|&q| (q, crate::checksum::of(&data[q as usize])))
            .collect();
        assert_eq!(got, want);
    }
}
