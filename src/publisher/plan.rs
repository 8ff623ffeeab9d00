//! Planning a session's buckets: which bytes of which tensors go in each
//! bucket, and where in the bucket's buffer.

use super::shard::Shard;
use crate::manifest::Manifest;
use crate::wire::{BucketEntry, ALIGN};

/// Smallest bucket the ramp starts and ends with.
const RAMP_MIN: u64 = 16 << 20;

/// Pack `want` (manifest indices) into buckets of at most `bucket` bytes.
///
/// Buckets ramp up and down: the first is `RAMP_MIN` and each next may hold
/// twice as much, and near the end a bucket closes once it holds as much as
/// is left. The engine waits for the first bucket to be packed and the
/// publisher for the last to be applied, with nothing to overlap either:
/// with 512 MiB buckets throughout, that idle time was a ninth of a 4 GiB
/// update. The ramp only closes buckets early; a tensor is split only where
/// it does not fit in a whole bucket, as without it.
pub(super) fn plan_buckets(
    manifest: &Manifest,
    want: &[u32],
    bucket: usize,
) -> Vec<(Vec<BucketEntry>, u64)> {
    let bucket = bucket as u64;
    let mut left: u64 = want
        .iter()
        .map(|&t| manifest.tensors[t as usize].nbytes)
        .sum();
    let mut out: Vec<(Vec<BucketEntry>, u64)> = Vec::new();
    let mut cur: Vec<BucketEntry> = Vec::new();
    let mut used = 0u64;
    for &t in want {
        let n = manifest.tensors[t as usize].nbytes;
        let mut done = 0u64;
        while done < n || (n == 0 && done == 0) {
            let head = RAMP_MIN.checked_shl(out.len() as u32).unwrap_or(u64::MAX);
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
                tensor: t,
                tensor_offset: done,
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

/// Buckets of a published version: planned as for packing (so each holds
/// at most `bucket` bytes, ramping up and down), but every entry points at
/// its bytes where they already are in the version's buffer (at `base`, a
/// host or a device address).
pub(super) fn windows(
    shard: &Shard,
    base: u64,
    want: &[u32],
    bucket: usize,
) -> Vec<(Vec<BucketEntry>, u64)> {
    let ptrs = shard.in_memory().expect("a published shard is in memory");
    // Whole multiples of the alignment, so split tensors' pieces stay aligned.
    let bucket = (bucket as u64 / ALIGN * ALIGN) as usize;
    let mut buckets = plan_buckets(&shard.manifest, want, bucket);
    for (entries, _) in &mut buckets {
        for e in entries {
            let start = ptrs[e.tensor as usize].0 as u64 - base;
            e.buffer_offset = start + e.tensor_offset;
        }
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::TensorMeta;
    use crate::tensor::DType;

    #[test]
    fn buckets_align_split_and_fill() {
        let t = |n: u64| TensorMeta {
            name: format!("t{n}"),
            dtype: DType::U8,
            shape: vec![n],
            nbytes: n,
            checksum: None,
            placement: None,
        };
        let m = Manifest {
            tensors: vec![t(100), t(300), t(2500), t(10)],
            version: None,
        };
        let b = plan_buckets(&m, &[0, 1, 2, 3], 1024);
        // Every entry aligned, inside its bucket, every tensor covered once.
        let mut covered = vec![0u64; 4];
        for (entries, used) in &b {
            assert!(*used <= 1024);
            for e in entries {
                assert_eq!(e.buffer_offset % ALIGN, 0);
                assert!(e.buffer_offset + e.len <= 1024);
                assert_eq!(e.tensor_offset, covered[e.tensor as usize]);
                covered[e.tensor as usize] += e.len;
            }
        }
        assert_eq!(covered, vec![100, 300, 2500, 10]);
        assert!(b.len() >= 4, "{b:?}");
        assert!(plan_buckets(&m, &[], 1024).is_empty());
    }

    #[test]
    fn buckets_ramp_up_and_down_without_splitting_tensors() {
        const MIB: u64 = 1 << 20;
        let m = Manifest {
            tensors: (0..64)
                .map(|i| TensorMeta {
                    name: format!("t{i}"),
                    dtype: DType::U8,
                    shape: vec![64 * MIB],
                    nbytes: 64 * MIB,
                    checksum: None,
                    placement: None,
                })
                .collect(),
            version: None,
        };
        let want: Vec<u32> = (0..64).collect();
        let b = plan_buckets(&m, &want, 512 << 20);
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
}
