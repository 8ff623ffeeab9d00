//! Planning a session's buckets: which bytes of which requests go in each
//! bucket, and where in the bucket's buffer. A request's bytes are a byte
//! stream (its runs' blocks back to back; a whole tensor is one run), so
//! the same planner serves whole tensors and parts of them.

use super::shard::Shard;
use crate::wire::{BucketEntry, Request, ALIGN};

/// Smallest bucket the ramp starts and ends with.
const RAMP_MIN: u64 = 16 << 20;

/// Pack the requests, of `sizes` bytes each, into buckets of at most
/// `bucket` bytes.
///
/// Buckets ramp up and down: the first is `RAMP_MIN` and each next may hold
/// twice as much, and near the end a bucket closes once it holds as much as
/// is left. The engine waits for the first bucket to be packed and the
/// publisher for the last to be applied, with nothing to overlap either:
/// with 512 MiB buckets throughout, that idle time was a ninth of a 4 GiB
/// update. The ramp only closes buckets early; a tensor is split only where
/// it does not fit in a whole bucket, as without it.
pub(super) fn plan_buckets(sizes: &[u64], bucket: usize) -> Vec<(Vec<BucketEntry>, u64)> {
    let bucket = bucket as u64;
    let mut left: u64 = sizes.iter().sum();
    let mut out: Vec<(Vec<BucketEntry>, u64)> = Vec::new();
    let mut cur: Vec<BucketEntry> = Vec::new();
    let mut used = 0u64;
    for (t, &n) in sizes.iter().enumerate() {
        let mut done = 0u64;
        while done < n || (n == 0 && done == 0) {
            let head = ramp_head(out.len());
            let ramp_full = used >= head || (used >= RAMP_MIN && used >= left);
            let at = used.next_multiple_of(ALIGN);
            if !cur.is_empty()
                && (ramp_full || at >= bucket || (at + (n - done) > bucket && n - done <= bucket))
            {
                out.push((std::mem::take(&mut cur), used));
                used = 0;
                continue;
            }
            let len = (n - done).min(bucket - at);
            cur.push(BucketEntry {
                request: t as u32,
                offset: done,
                len,
                buffer_offset: at,
            });
            used = at + len;
            done += len;
            left -= len;
            if n == 0 {
                break;
            }
        }
    }
    if !cur.is_empty() {
        out.push((cur, used));
    }
    out
}

/// How much bucket `k` of the ramp up holds at least before it closes:
/// `RAMP_MIN` doubled `k` times, and no bound once that passes `u64`
/// (a plain shift wrapped to 0 after 40 buckets, closing every later
/// bucket after one entry).
fn ramp_head(k: usize) -> u64 {
    u32::try_from(k)
        .ok()
        .and_then(|k| 1u64.checked_shl(k))
        .and_then(|f| RAMP_MIN.checked_mul(f))
        .unwrap_or(u64::MAX)
}

/// The byte count of each request.
pub(super) fn request_sizes(requests: &[Request]) -> Vec<u64> {
    requests.iter().map(Request::bytes).collect()
}

/// Buckets of a published version (sent as WINDOWS): planned as for
/// packing over the requests' bytes (so each holds at most `bucket` bytes,
/// ramping up and down), but every entry is a window: its `buffer_offset`
/// is where its request's tensor starts in the version's buffer (at
/// `base`, a host or a device address; 256-byte aligned, as `publish` lays
/// tensors out), and the engine finds the entry's bytes there by its own
/// request's runs. Any request is served this way, strided ones included:
/// nothing is packed, and each block is copied once, by the engine.
pub(super) fn windows(
    shard: &Shard,
    base: u64,
    requests: &[Request],
    bucket: usize,
) -> Vec<(Vec<BucketEntry>, u64)> {
    let ptrs = shard.in_memory().expect("a published shard is in memory");
    let mut buckets = plan_buckets(&request_sizes(requests), bucket);
    for (entries, _) in &mut buckets {
        for e in entries {
            e.buffer_offset = ptrs[requests[e.request as usize].tensor as usize].0 as u64 - base;
        }
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_align_split_and_fill() {
        let b = plan_buckets(&[100, 300, 2500, 10], 1024);
        // Every entry aligned, inside its bucket, every tensor covered once.
        let mut covered = vec![0u64; 4];
        for (entries, used) in &b {
            assert!(*used <= 1024);
            for e in entries {
                assert_eq!(e.buffer_offset % ALIGN, 0);
                assert!(e.buffer_offset + e.len <= 1024);
                assert_eq!(e.offset, covered[e.request as usize]);
                covered[e.request as usize] += e.len;
            }
        }
        assert_eq!(covered, vec![100, 300, 2500, 10]);
        assert!(b.len() >= 4, "{b:?}");
        assert!(plan_buckets(&[], 1024).is_empty());
    }

    #[test]
    fn buckets_ramp_up_and_down_without_splitting_tensors() {
        const MIB: u64 = 1 << 20;
        let b = plan_buckets(&[64 * MIB; 64], 512 << 20);
        let sizes: Vec<u64> = b.iter().map(|(_, used)| used.div_ceil(MIB)).collect();
        // Up from one tensor, full 512 MiB buckets, down to one tensor.
        assert_eq!(sizes[..5], [64, 64, 64, 128, 256], "{sizes:?}");
        assert_eq!(sizes[sizes.len() - 3..], [256, 128, 64], "{sizes:?}");
        assert!(
            sizes.iter().filter(|&&s| s == 512).count() >= 5,
            "{sizes:?}"
        );
        assert_eq!(sizes.iter().sum::<u64>(), 64 * 64);
        // No tensor is split: each lies whole in one bucket.
        for (entries, _) in &b {
            assert!(entries.iter().all(|e| e.len == 64 * MIB));
        }
    }

    #[test]
    fn buckets_past_the_fortieth_are_still_full() {
        // 96 GiB of 64 MiB tensors in 1 GiB buckets: about 100 buckets.
        const MIB: u64 = 1 << 20;
        let b = plan_buckets(&[64 * MIB; 1536], 1 << 30);
        let sizes: Vec<u64> = b.iter().map(|(_, used)| used.div_ceil(MIB)).collect();
        let n = sizes.len();
        assert!((96..=110).contains(&n), "{n} buckets: {sizes:?}");
        // Between the ramps every bucket is full (16 tensors), the 40th
        // and later ones included.
        assert!(sizes[8..n - 8].iter().all(|&s| s == 1024), "{sizes:?}");
        assert_eq!(ramp_head(39), RAMP_MIN << 39);
        assert_eq!(ramp_head(40), u64::MAX);
        assert_eq!(ramp_head(usize::MAX), u64::MAX);
    }
}
