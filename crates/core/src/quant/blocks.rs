//! Which quantization block of a global tensor each element of a shard
//! falls in, walked over the pieces a request reads (element offsets of
//! the shard, row-major). The publisher and the engine walk the same
//! request the same way, so both list the blocks it touches in the same
//! order: AMAX and SCALES carry one value per touched block, in that order,
//! without naming them.
//!
//! Blocks are numbered in the scales' row-major order of the global tensor
//! (`[..., ceil(M/128), ceil(N/128)]` for 128x128 blocks, `[...,
//! ceil(N/32)]` for MXFP8; 0 for one scale per tensor).

use super::{Scheme, BLOCK};

/// The edge of a 128x128 block, as the walk counts it.
pub const BLOCK_EDGE: u64 = BLOCK as u64;
use crate::manifest::TensorMeta;

/// A shard of a global tensor: its shape, where its box starts in the
/// global tensor, and the global tensor's shape (a whole tensor: offset
/// zeros, global shape its own).
#[derive(Clone, Copy, Debug)]
pub struct Placed<'a> {
    pub shape: &'a [u64],
    pub offset: &'a [u64],
    pub global: &'a [u64],
}

const ZEROS: [u64; crate::tensor::MAX_NDIM] = [0; crate::tensor::MAX_NDIM];

impl<'a> Placed<'a> {
    /// Where tensor `meta` lies in its global tensor (a tensor without a
    /// placement is all of its own).
    pub fn of(meta: &'a TensorMeta) -> Placed<'a> {
        match &meta.placement {
            Some(p) => Placed {
                shape: &meta.shape,
                offset: &p.offset,
                global: &p.global_shape,
            },
            None => Placed::whole(&meta.shape),
        }
    }
}

impl<'a> Placed<'a> {
    /// A whole tensor of `shape`: at offset zero, its own global tensor.
    pub fn whole(shape: &'a [u64]) -> Placed<'a> {
        Placed {
            shape,
            offset: &ZEROS[..shape.len()],
            global: shape,
        }
    }

    /// The global block of the shard's element `e`, and how many elements
    /// from `e` on (along the last dimension, at most `left`) share it.
    fn block_at(&self, scheme: Scheme, e: u64, left: u64) -> (u64, u64) {
        let n = self.shape.len();
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        let c = e % cols;
        let in_row = (cols - c).min(left);
        let Some((bh, bw)) = scheme.block_dims() else {
            return (0, left);
        };
        // A scalar, and a 1-D tensor with 128x128 blocks: one block (no
        // engine declares either so; a publisher asked still answers).
        if n == 0 || (n < 2 && bh > 1) {
            return (0, left);
        }
        // The shard's multi-index of `e`, then the global one.
        let mut rest = e / cols;
        let mut g = [0u64; crate::tensor::MAX_NDIM];
        g[n - 1] = c + self.offset[n - 1];
        for d in (0..n - 1).rev() {
            g[d] = rest % self.shape[d].max(1) + self.offset[d];
            rest /= self.shape[d].max(1);
        }
        let scols = self.global[n - 1].div_ceil(bw);
        // Block rows: the last but one dimension's (a 1-D tensor is one
        // row), within each matrix of the leading dimensions.
        let (row, srows) = match n {
            1 => (0, 1),
            _ => (g[n - 2] / bh, self.global[n - 2].div_ceil(bh)),
        };
        let batch = (0..n.saturating_sub(2)).fold(0, |k, d| k * self.global[d] + g[d]);
        let block = (batch * srows + row) * scols + g[n - 1] / bw;
        let to_edge = bw - g[n - 1] % bw;
        (block, in_row.min(to_edge))
    }
}

/// Block numbers in a given order, kept as runs of consecutive numbers: a
/// request's blocks as its param numbers them are a few long runs (a row
/// shard's blocks follow each other), so they take a few words instead of
/// 8 bytes a block, which MXFP8's block per 32 elements would make
/// comparable to the param itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockRuns {
    runs: Vec<(usize, usize)>,
    len: usize,
}

impl BlockRuns {
    /// Add block `b` after the others.
    pub fn push(&mut self, b: usize) {
        match self.runs.last_mut() {
            Some((first, n)) if *first + *n == b => *n += 1,
            _ => self.runs.push((b, 1)),
        }
        self.len += 1;
    }

    /// How many blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The blocks, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.runs.iter().flat_map(|&(first, n)| first..first + n)
    }
}

impl FromIterator<usize> for BlockRuns {
    fn from_iter<I: IntoIterator<Item = usize>>(blocks: I) -> BlockRuns {
        let mut out = BlockRuns::default();
        blocks.into_iter().for_each(|b| out.push(b));
        out
    }
}

/// Walk `pieces` ((shard element offset, count, destination offset): a
/// request's blocks with where each goes) cut where the global block
/// changes: `f(destination, count, shard element, block)` per cut, in
/// order.
pub fn walk(
    scheme: Scheme,
    placed: Placed,
    pieces: impl IntoIterator<Item = (u64, u64, u64)>,
    mut f: impl FnMut(u64, u64, u64, u64),
) {
    let dims = scheme.block_dims();
    let row_blocks = dims.is_some_and(|(bh, _)| placed.shape.len() >= 2 || bh == 1);
    let bw = dims.map_or(BLOCK as u64, |d| d.1);
    for (src, len, dst) in pieces {
        let mut done = 0;
        while done < len {
            // The rest of this row of the shard: its first cut found from
            // the indices, the next ones the blocks after it (the block
            // columns of a row are consecutive).
            let (mut block, mut n) = placed.block_at(scheme, src + done, len - done);
            let cols = placed.shape.last().copied().unwrap_or(1).max(1);
            let row_end = ((src + done) / cols + 1) * cols - src;
            let end = match row_blocks {
                true => row_end.min(len),
                false => done + n,
            };
            loop {
                f(dst + done, n, src + done, block);
                done += n;
                if done >= end {
                    break;
                }
                (block, n) = (block + 1, bw.min(end - done));
            }
        }
    }
}

/// The blocks `pieces` touch, increasing, each once.
///
/// A row's part touches the blocks its first element's block and its
/// columns decide, so a part with the same first block and columns as the
/// part before it (the next row of the same band: 127 of every 128 rows)
/// adds nothing and is not walked: walking and sorting every row of a
/// large tensor took longer than reading it.
pub fn touched(
    scheme: Scheme,
    placed: Placed,
    pieces: impl IntoIterator<Item = (u64, u64, u64)>,
) -> Vec<u64> {
    let cols = placed.shape.last().copied().unwrap_or(1).max(1);
    let mut out: Vec<u64> = Vec::new();
    let mut last = None;
    for (src, len, dst) in pieces {
        let mut done = 0;
        while done < len {
            let e = src + done;
            let in_row = (cols - e % cols).min(len - done);
            let part = (placed.block_at(scheme, e, in_row).0, e % cols, in_row);
            if last != Some(part) {
                walk(scheme, placed, [(e, in_row, dst + done)], |_, _, _, b| {
                    if out.last() != Some(&b) {
                        out.push(b);
                    }
                });
                last = Some(part);
            }
            done += in_row;
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The multi-index of element `e` of a `shape` tensor placed at `offset`
/// in its global tensor: its global index (for messages).
pub fn global_index(placed: Placed, e: u64) -> Vec<u64> {
    let n = placed.shape.len();
    let mut rest = e;
    let mut g = vec![0u64; n];
    for d in (0..n).rev() {
        let len = placed.shape[d].max(1);
        g[d] = rest % len + placed.offset[d];
        rest /= len;
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A [300, 256] tensor in row shards of 75: shard 1 (rows 75..150)
    /// touches block rows 0 and 1; its element at row 53 (global 128),
    /// column 130 is in block (1, 1) = 3.
    #[test]
    fn shards_walk_the_global_block_grid() {
        let placed = Placed {
            shape: &[75, 256],
            offset: &[75, 0],
            global: &[300, 256],
        };
        let all = [(0u64, 75 * 256, 0u64)];
        assert_eq!(touched(Scheme::Fp8Block128, placed, all), vec![0, 1, 2, 3]);
        let mut cuts = Vec::new();
        walk(
            Scheme::Fp8Block128,
            placed,
            [(53 * 256 + 120, 20, 7)],
            |d, n, s, b| cuts.push((d, n, s, b)),
        );
        assert_eq!(
            cuts,
            vec![(7, 8, 53 * 256 + 120, 2), (15, 12, 53 * 256 + 128, 3)]
        );
        assert_eq!(touched(Scheme::Fp8Tensor, placed, all), vec![0]);
        // MXFP8: 8 blocks a row; the shard's row 53 is global row 128, its
        // columns 120..140 cross from block 3 into block 4 at column 128.
        let mut cuts = Vec::new();
        walk(
            Scheme::Mxfp8,
            placed,
            [(53 * 256 + 120, 20, 0)],
            |d, n, _, b| cuts.push((d, n, b)),
        );
        assert_eq!(cuts, vec![(0, 8, 128 * 8 + 3), (8, 12, 128 * 8 + 4)]);
        assert_eq!(touched(Scheme::Mxfp8, placed, all).len(), 75 * 8);
        // A scalar asked for with blocks (a hostile WANT): one block.
        for scheme in [Scheme::Mxfp8, Scheme::Fp8Block128] {
            assert_eq!(touched(scheme, Placed::whole(&[]), [(0, 1, 0)]), vec![0]);
        }
        // Stacked: [2, 200, 130], blocks [2, 2, 2]; element [1, 130, 129].
        let placed = Placed {
            shape: &[2, 200, 130],
            offset: &[0, 0, 0],
            global: &[2, 200, 130],
        };
        let e = (200 + 130) * 130 + 129;
        assert_eq!(touched(Scheme::Fp8Block128, placed, [(e, 1, 0)]), vec![7]);
        assert_eq!(global_index(placed, e), vec![1, 130, 129]);
    }

    /// Skipping the rows that repeat the one before lists the same blocks
    /// as walking every element: row and column shards, stacked tensors,
    /// pieces starting and ending inside rows, one scale per tensor.
    #[test]
    fn touched_lists_what_walking_every_element_finds() {
        let every = |scheme, placed: Placed, pieces: &[(u64, u64, u64)]| {
            let mut all = Vec::new();
            walk(scheme, placed, pieces.iter().copied(), |_, _, _, b| {
                all.push(b)
            });
            all.sort_unstable();
            all.dedup();
            all
        };
        let cases: [(&[u64], &[u64], &[u64]); 4] = [
            (&[300, 256], &[0, 0], &[300, 256]),
            (&[75, 130], &[150, 126], &[300, 512]),
            (&[28, 1000], &[100, 0], &[257, 1000]),
            (&[3, 140, 300], &[1, 120, 0], &[5, 400, 300]),
        ];
        let mut rng = crate::test_rng::Rng(7);
        let mut below = |k: u64| rng.next() % k;
        for (shape, offset, global) in cases {
            let placed = Placed {
                shape,
                offset,
                global,
            };
            let n: u64 = shape.iter().product();
            let cols = shape[shape.len() - 1];
            for k in 0..40 {
                let mut pieces = Vec::new();
                for _ in 0..1 + below(3) {
                    let src = below(n);
                    let len = 1 + below(n - src);
                    pieces.push((src, len, 0));
                }
                if k % 4 == 0 {
                    // A column split's rows: one piece per row.
                    let (from, width) = (below(cols), 1 + below(cols / 2));
                    let width = width.min(cols - from);
                    pieces = (0..n / cols).map(|r| (r * cols + from, width, 0)).collect();
                }
                for scheme in [Scheme::Fp8Block128, Scheme::Fp8Tensor, Scheme::Mxfp8] {
                    assert_eq!(
                        touched(scheme, placed, pieces.iter().copied()),
                        every(scheme, placed, &pieces),
                        "{shape:?} at {offset:?} of {global:?}: {pieces:?}"
                    );
                }
            }
        }
    }
}
