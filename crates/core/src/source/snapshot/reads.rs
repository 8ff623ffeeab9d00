//! Which file reads bring in one plan entry's segments.
//!
//! A segment is read straight into its destination (one copy: a `pread`,
//! or from a mapped window when it is long, `reader.rs`) unless one of two
//! things makes a covering read better; a covering read brings a stretch
//! of the tensor in (a mapped window, else a bounded buffer) and the
//! applier copies the segments out of it.
//!
//! - **Verifying a slice**: the bytes must be checked against block sums,
//!   so the blocks covering the segments are read, those that touch or
//!   overlap merged into one read each.
//! - **Short segments close together** (a column split of a row-major
//!   tensor is one segment per row): a segment shorter than
//!   [`SHORT_SEGMENT`] joins the read before it when that read's last
//!   segment is short too and the gap between them is at most
//!   [`MAX_GAP`]. Measured on the 2-core machine (shared, page cache warm,
//!   16 MiB wanted; one pread per segment against one read of the span in
//!   8 MiB windows plus a copy of each segment, GB/s of wanted bytes):
//!
//!   | segment | density 1/8 | 1/4         | 1/2         |
//!   |---------|-------------|-------------|-------------|
//!   | 64 B    | 0.07 / 0.31 | 0.07 / 0.51 | 0.09 / 1.21 |
//!   | 256 B   | 0.23 / 0.32 | 0.25 / 0.60 | 0.28 / 1.06 |
//!   | 512 B   | 0.37 / 0.35 | 0.44 / 0.70 | 0.55 / 1.34 |
//!   | 1 KiB   | 0.85 / 0.35 | 0.72 / 0.79 | 0.86 / 1.18 |
//!   | 2 KiB   | 1.21 / 0.31 | 1.24 / 0.61 | 1.78 / 1.75 |
//!   | 4 KiB   | 3.07 / 0.57 | 1.66 / 0.49 | 1.73 / 0.85 |
//!   | 64 KiB  | 3.16 / 0.39 | 3.72 / 0.97 | 3.66 / 0.93 |
//!   | 1 MiB   | 3.45 / 0.47 | 2.52 / 0.81 | 3.74 / 1.28 |
//!
//!   (preads / covering). A pread costs about a microsecond of system
//!   call, the time to read about 2 KiB more from the page cache: the
//!   covering read wins where the gap it reads instead is at most about
//!   2 KiB (64 B to 1 KiB segments at 1/2, to 512 B at 1/4, to 256 B at
//!   1/8) and loses from 4 KiB segments on, where the pread's fixed cost
//!   is small against its bytes and the covering read copies them twice.
//!   Cold files (not measured: dropping the page cache needs root) favour
//!   covering reads more, a seek costing far more than a system call.
//!   The covering reads of this table went through the buffer. Mapped
//!   (`reader.rs`, the usual way now), a covering read skips the buffer's
//!   copy and touches only the pages holding segments, so the gap it
//!   spans costs nothing but page-table entries, and the limits are
//!   [`SHORT_SEGMENT`] = [`MAX_GAP`] = 64 KiB. Measured with `wm bench
//!   shard --section snapshot` (4 ranks at once, a 2 KiB segment of every
//!   8 KiB row, unverified, quiet 2-core machine): each rank at 0.53-0.96
//!   of its `pread` floor with the old limits (4 KiB segments, 2 KiB
//!   gaps: one `pread` per row), 0.73-2.28 with these (four runs). A covering read
//!   that cannot be mapped (no guard slot, `mmap` refused) reads the gaps
//!   too, through the buffer: slower, still correct.

use crate::plan::Segment;
use std::ops::Range;

/// Segments shorter than this may share a covering read (mapped: see the
/// module doc).
pub const SHORT_SEGMENT: u64 = 64 << 10;
/// The largest gap a covering read reads over between two short segments.
pub const MAX_GAP: u64 = 64 << 10;

/// One read of an entry's tensor: bytes `span` (tensor offsets), which hold
/// segments `segs` (indices into the entry's segments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    pub span: Range<u64>,
    pub segs: Range<usize>,
    /// Read into a buffer and copied out (a covering read); otherwise the
    /// one segment is read straight where it goes.
    pub covering: bool,
}

/// The reads of an entry whose segments are `segs` (in source order) in a
/// tensor of `nbytes` bytes; `blocks`: the block size when the bytes must
/// be checked against block sums.
pub fn plan_reads(segs: &[Segment], nbytes: u64, blocks: Option<u64>) -> Vec<Read> {
    let mut out: Vec<Read> = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        let end = s.source + s.len;
        let span = match blocks {
            Some(b) => s.source / b * b..end.div_ceil(b).saturating_mul(b).min(nbytes),
            None => s.source..end,
        };
        let joins = |last: &Read| match blocks {
            Some(_) => span.start <= last.span.end,
            None => {
                let prev = &segs[last.segs.end - 1];
                s.len < SHORT_SEGMENT
                    && prev.len < SHORT_SEGMENT
                    && s.source - (prev.source + prev.len) <= MAX_GAP
            }
        };
        match out.last_mut() {
            Some(last) if joins(last) => {
                last.span.end = last.span.end.max(span.end);
                last.segs.end = i + 1;
                last.covering = true;
            }
            _ => out.push(Read {
                span,
                segs: i..i + 1,
                covering: blocks.is_some(),
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` segments of `len` bytes every `stride` bytes from `start`.
    fn rows(start: u64, len: u64, stride: u64, n: u64) -> Vec<Segment> {
        (0..n)
            .map(|i| Segment {
                source: start + i * stride,
                wanted: i * len,
                param: i * len,
                len,
            })
            .collect()
    }

    #[test]
    fn short_close_segments_share_a_covering_read() {
        // 512 B of every 2 KiB (gap 1536): one read of the span.
        let r = plan_reads(&rows(100, 512, 2048, 8), 1 << 20, None);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].span.clone(), r[0].segs.clone(), r[0].covering),
            (100..100 + 7 * 2048 + 512, 0..8, true)
        );
    }

    #[test]
    fn long_or_far_segments_are_read_one_by_one() {
        // Gap just over the limit.
        let r = plan_reads(&rows(0, 512, 512 + MAX_GAP + 1, 4), 1 << 20, None);
        assert_eq!(r.len(), 4);
        assert!(r.iter().all(|r| !r.covering && r.segs.len() == 1));
        // Long segments with no gap at all are still separate: the pread
        // costs little against their bytes.
        let r = plan_reads(&rows(0, SHORT_SEGMENT, SHORT_SEGMENT + 8, 4), 1 << 20, None);
        assert_eq!(r.len(), 4);
    }

    #[test]
    fn verified_slices_read_the_blocks_covering_them() {
        // A row slice from 1.5 blocks to 3.25 blocks of a 5.5-block tensor.
        let b = 4096;
        let segs = rows(b + b / 2, b * 7 / 4, 0, 1);
        let r = plan_reads(&segs, b * 11 / 2, Some(b));
        assert_eq!((r[0].span.clone(), r[0].covering), (b..4 * b, true));
        // Columns of rows in different blocks: blocks merge when they touch,
        // the last one ends with the tensor.
        let segs = rows(100, 10, b, 6);
        let r = plan_reads(&segs, b * 11 / 2, Some(b));
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].span.clone(), r[0].segs.clone()),
            (0..b * 11 / 2, 0..6)
        );
        // Far apart: a read per block.
        let r = plan_reads(&rows(0, 10, 3 * b, 2), 10 * b, Some(b));
        assert_eq!(
            r.iter().map(|r| r.span.clone()).collect::<Vec<_>>(),
            [0..b, 3 * b..4 * b]
        );
    }
}
