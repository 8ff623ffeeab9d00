//! From a box two layouts share to the byte ranges that move.
//!
//! The common part of a piece and a shard is a box; in the shard's bytes
//! and in the param's it is contiguous only along the dimensions it spans
//! whole on both sides. So it is cut into blocks: one block when it spans
//! every inner dimension whole (a split along the outermost dimension),
//! otherwise one block per "row" of the innermost dimension it does not
//! span whole. The blocks along the dimension just outside that one are
//! equally spaced on both sides and make one strided [`Run`]; dimensions
//! further out give one run per index.

use super::region::{Dims, Lined, Region};
use super::{Run, Segment, Target};
use crate::tensor::MAX_NDIM;
use std::collections::TryReserveError;

/// Row-major byte strides of a tensor of `shape` with `esize`-byte elements.
fn strides(shape: &[u64], esize: u64) -> Dims {
    let mut s = [esize; MAX_NDIM];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The runs moving `common` (global coordinates, a part of both the piece
/// and `shard`, all padded to the piece's rank) from a shard into
/// `target`, each handed to `emit` (`Run::entry` is 0, set later). Every
/// box here lives on the stack: this runs for every common box, and
/// allocates nothing.
pub(super) fn push_runs(
    common: &Region,
    shard: &Region,
    piece: &Lined,
    esize: u64,
    target: Target,
    mut emit: impl FnMut(Run),
) {
    let ndim = common.ndim();
    let src_shape = &shard.len[..ndim];
    let dst_shape = &piece.param_shape[..ndim];
    let (mut src_off, mut dst_off): (Dims, Dims) = Default::default();
    for d in 0..ndim {
        src_off[d] = common.offset[d] - shard.offset[d];
        dst_off[d] = piece.in_param[d] + common.offset[d] - piece.global.offset[d];
    }
    let (ss, ds) = (strides(src_shape, esize), strides(dst_shape, esize));
    // The innermost dimension `k` not spanned whole on both sides; the
    // block is `common.len[k]` of its rows (all of the inner dimensions).
    let mut k = ndim.saturating_sub(1);
    while k > 0 && common.len[k] == src_shape[k] && common.len[k] == dst_shape[k] {
        k -= 1;
    }
    let block = if ndim == 0 {
        esize
    } else {
        common.len[k] * ss[k]
    };
    let start = |off: &Dims, strides: &Dims, idx: &Dims| -> u64 {
        (0..ndim).map(|d| (off[d] + idx[d]) * strides[d]).sum()
    };
    // Dimension `k - 1` (if any) is the run's rows; those outside it are
    // walked index by index.
    let (rows, rows_dim) = if k == 0 {
        (1, None)
    } else {
        (common.len[k - 1], Some(k - 1))
    };
    let outer = rows_dim.unwrap_or(0);
    // Indexes of the dimensions outside the rows; those inside stay 0.
    let mut idx: Dims = [0; MAX_NDIM];
    loop {
        let (src, dst) = (start(&src_off, &ss, &idx), start(&dst_off, &ds, &idx));
        emit(Run {
            entry: 0,
            target,
            source: src..src + block,
            param: dst..dst + block,
            rows,
            source_stride: rows_dim.map_or(block, |d| ss[d]),
            param_stride: rows_dim.map_or(block, |d| ds[d]),
        });
        // Next index of the dimensions outside the rows (an odometer).
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < common.len[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Put found runs (`Run::entry` their shard's number, below `shards`) in
/// (shard, param, source offset, param offset) order, in place: a counting
/// sort by shard moves each run once, where a comparison sort of 36,000
/// runs of 80 bytes spends most of a plan's assembly moving them. Runs
/// arrive in param order, so only a shard met by several pieces needs its
/// few runs sorted.
pub(super) fn order_by_shard(runs: &mut [Run], shards: usize) {
    let index = |i: usize| u32::try_from(i).expect("a plan's runs are numbered in 32 bits");
    // `place[s]`: where shard s's runs start, then (while placing) where
    // its next one goes.
    let mut place = vec![0u32; shards + 1];
    for r in runs.iter() {
        place[r.entry + 1] += 1;
    }
    for s in 0..shards {
        place[s + 1] += place[s];
    }
    let mut to: Vec<u32> = runs
        .iter()
        .map(|r| {
            let at = place[r.entry];
            place[r.entry] += 1;
            at
        })
        .collect();
    // Each swap puts one run where it belongs.
    for i in 0..runs.len() {
        while to[i] != index(i) {
            let j = to[i] as usize;
            runs.swap(i, j);
            to.swap(i, j);
        }
    }
    let param = |t: Target| match t {
        Target::Param(p) => p,
        _ => usize::MAX,
    };
    for same in runs.chunk_by_mut(|a, b| a.entry == b.entry) {
        if same.len() > 1 {
            same.sort_unstable_by_key(|r| (param(r.target), r.source.start, r.param.start));
        }
    }
}

/// Sort `runs` by entry then source offset and join single blocks that
/// follow on from each other on both sides.
#[cfg(test)]
pub(super) fn sort_and_merge(runs: &mut Vec<Run>) {
    runs.sort_by_key(|r| (r.entry, r.source.start));
    merge_ordered(runs);
}

/// Join single blocks of `runs` (in entry then source offset order) that
/// follow on from each other on both sides.
pub(super) fn merge_ordered(runs: &mut Vec<Run>) {
    debug_assert!(runs.is_sorted_by_key(|r| (r.entry, r.source.start)));
    // Merged in place: `kept` runs are `runs[..kept]`.
    let mut kept = 0;
    for i in 0..runs.len() {
        if kept > 0 && follows(&runs[kept - 1], &runs[i]) {
            let end = (runs[i].source.end, runs[i].param.end);
            let last = &mut runs[kept - 1];
            (last.source.end, last.param.end) = end;
        } else {
            runs.swap(kept, i);
            kept += 1;
        }
    }
    runs.truncate(kept);
}

/// `r` is a single block that follows on from single block `last` on both
/// sides, for the same entry and target.
fn follows(last: &Run, r: &Run) -> bool {
    last.entry == r.entry
        && last.target == r.target
        && last.rows == 1
        && r.rows == 1
        && last.source.end == r.source.start
        && last.param.end == r.param.start
}

/// Every block of `runs` (one entry's), in source order, joined where
/// contiguous on both sides, with its place in the entry's received bytes.
/// Fallible: a run's rows are announced by the source's geometry (the plan
/// bounds them against the param's bytes first, `Plan::check_blocks`).
pub(super) fn segments(runs: &[Run]) -> Result<Vec<Segment>, TryReserveError> {
    let rows: u64 = runs.iter().map(|r| r.rows).fold(0, u64::saturating_add);
    let rows = usize::try_from(rows).unwrap_or(usize::MAX);
    let mut out: Vec<Segment> = Vec::new();
    // Runs in source order whose blocks do not interleave (each ends
    // before the next starts, as any one strided run's rows do) are
    // walked straight into the segments; interleaved ones are listed and
    // sorted first, at 24 more bytes a block while it lasts.
    if runs
        .windows(2)
        .all(|w| source_end(&w[0]) <= w[1].source.start)
    {
        out.try_reserve_exact(rows)?;
        let mut wanted = 0;
        for block in runs.iter().flat_map(blocks) {
            join(&mut out, &mut wanted, block);
        }
        return Ok(out);
    }
    let mut listed: Vec<(u64, u64, u64)> = Vec::new();
    listed.try_reserve_exact(rows)?;
    listed.extend(runs.iter().flat_map(blocks));
    listed.sort_unstable();
    out.try_reserve_exact(rows)?;
    let mut wanted = 0;
    for block in listed {
        join(&mut out, &mut wanted, block);
    }
    Ok(out)
}

/// One past the last source byte run `r` reads.
fn source_end(r: &Run) -> u64 {
    r.source.end + r.rows.saturating_sub(1) * r.source_stride
}

/// The blocks of run `r`: (source, param, length) each, in order.
fn blocks(r: &Run) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    let len = r.source.end - r.source.start;
    (0..r.rows).map(move |i| {
        (
            r.source.start + i * r.source_stride,
            r.param.start + i * r.param_stride,
            len,
        )
    })
}

/// Append block `(source, param, len)` to `out`, joined to the last
/// segment where it follows on from it on both sides; `wanted` is where
/// it starts among the entry's received bytes.
fn join(out: &mut Vec<Segment>, wanted: &mut u64, (source, param, len): (u64, u64, u64)) {
    match out.last_mut() {
        Some(s) if s.source + s.len == source && s.param + s.len == param => s.len += len,
        _ => out.push(Segment {
            source,
            wanted: *wanted,
            param,
            len,
        }),
    }
    *wanted += len;
}

#[cfg(test)]
mod tests {
    use super::super::region::Span;
    use super::*;
    use crate::pieces::Piece;
    use crate::tensor_box::TensorBox;

    fn runs_for(piece: &Piece, param: &[u64], shard: &TensorBox) -> Vec<Run> {
        let a = Lined::new(piece, param);
        let extra = a.ndim() - shard.ndim();
        let shard = Span::of_box(shard).padded(extra);
        let common = a.global.span().intersect(shard.span()).unwrap();
        let mut out = Vec::new();
        push_runs(&common, &shard, &a, 2, Target::Param(0), |r| out.push(r));
        sort_and_merge(&mut out);
        out
    }

    fn b(offset: &[u64], len: &[u64]) -> TensorBox {
        TensorBox {
            offset: offset.to_vec(),
            len: len.to_vec(),
        }
    }

    #[test]
    fn found_runs_go_in_shard_then_param_then_offset_order() {
        let run = |shard: usize, param: usize, at: u64| Run {
            entry: shard,
            target: Target::Param(param),
            source: at..at + 4,
            param: 0..4,
            rows: 1,
            source_stride: 4,
            param_stride: 4,
        };
        let mut runs = vec![
            run(2, 0, 0),
            run(0, 1, 8),
            run(1, 0, 0),
            run(0, 0, 4),
            run(0, 1, 0),
        ];
        order_by_shard(&mut runs, 4);
        let order: Vec<(usize, Target, u64)> = runs
            .iter()
            .map(|r| (r.entry, r.target, r.source.start))
            .collect();
        let p = Target::Param;
        assert_eq!(
            order,
            [
                (0, p(0), 4),
                (0, p(1), 0),
                (0, p(1), 8),
                (1, p(0), 0),
                (2, p(0), 0)
            ]
        );
    }

    #[test]
    fn a_row_split_is_one_block() {
        // Param: rows 2..6 of [8, 4]; shard: rows 4..8.
        let runs = runs_for(
            &Piece::narrow("w", &[8, 4], 0, 2, 4),
            &[4, 4],
            &b(&[4, 0], &[4, 4]),
        );
        assert_eq!(runs.len(), 1);
        assert_eq!(
            (runs[0].source.clone(), runs[0].param.clone(), runs[0].rows),
            (0..16, 16..32, 1)
        );
    }

    /// A strided run, `rows` blocks of `len` bytes.
    fn strided(source: u64, param: u64, len: u64, rows: u64, strides: (u64, u64)) -> Run {
        Run {
            entry: 0,
            target: Target::Param(0),
            source: source..source + len,
            param: param..param + len,
            rows,
            source_stride: strides.0,
            param_stride: strides.1,
        }
    }

    /// Runs whose rows interleave in the tensor (two column ranges of one
    /// shard, into different places of the param) come out in source
    /// order, as runs that do not (walked without listing): each block's
    /// place among the received bytes follows the tensor's order.
    #[test]
    fn segments_follow_the_tensor_whether_runs_interleave_or_not() {
        // Rows of 16 bytes: bytes 0..4 of each to param 100.., 8..12 to 200...
        let interleaved = [
            strided(0, 100, 4, 3, (16, 4)),
            strided(8, 200, 4, 3, (16, 4)),
        ];
        let got: Vec<(u64, u64, u64, u64)> = segments(&interleaved)
            .unwrap()
            .iter()
            .map(|s| (s.source, s.wanted, s.param, s.len))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 100, 4),
                (8, 4, 200, 4),
                (16, 8, 104, 4),
                (24, 12, 204, 4),
                (32, 16, 108, 4),
                (40, 20, 208, 4)
            ]
        );
        // One after the other: rows back to back on both sides join.
        let apart = [strided(0, 0, 4, 3, (4, 4)), strided(12, 100, 4, 2, (8, 8))];
        let got: Vec<(u64, u64, u64, u64)> = segments(&apart)
            .unwrap()
            .iter()
            .map(|s| (s.source, s.wanted, s.param, s.len))
            .collect();
        assert_eq!(got, [(0, 0, 0, 12), (12, 12, 100, 4), (20, 16, 108, 4)]);
    }

    #[test]
    fn a_column_split_is_a_strided_run_of_rows() {
        // Param: columns 2..4 of [3, 4] (a [3, 2] param); shard: all of it.
        let runs = runs_for(
            &Piece::narrow("w", &[3, 4], 1, 2, 2),
            &[3, 2],
            &b(&[0, 0], &[3, 4]),
        );
        assert_eq!(runs.len(), 1);
        let r = &runs[0];
        assert_eq!((r.source.clone(), r.param.clone(), r.rows), (4..8, 0..4, 3));
        assert_eq!((r.source_stride, r.param_stride), (8, 4));
        let segs = segments(&runs).unwrap();
        assert_eq!(segs.len(), 3);
        assert_eq!(
            (segs[2].source, segs[2].wanted, segs[2].param, segs[2].len),
            (20, 8, 8, 4)
        );
    }

    #[test]
    fn a_stacked_piece_lands_at_its_row() {
        // k [2, 4] placed at row 8 of a fused [12, 4] param: one block at byte 64.
        let k = Piece {
            at: vec![8, 0],
            ..Piece::whole("k", &[2, 4])
        };
        let runs = runs_for(&k, &[12, 4], &b(&[0, 0], &[2, 4]));
        assert_eq!(
            (runs[0].source.clone(), runs[0].param.clone(), runs[0].rows),
            (0..16, 64..80, 1)
        );
    }

    #[test]
    fn three_dims_walk_the_outer_index() {
        // Experts 1..3 of [4, 2, 6], columns 0..3: per expert a strided run of 2 rows.
        let p = Piece {
            global: b(&[1, 0, 0], &[2, 2, 3]),
            tensor: "e".into(),
            at: vec![0, 0, 0],
        };
        let runs = runs_for(&p, &[2, 2, 3], &b(&[0, 0, 0], &[4, 2, 6]));
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[1].source.start, runs[1].param.start, runs[1].rows),
            (48, 12, 2)
        );
    }
}
