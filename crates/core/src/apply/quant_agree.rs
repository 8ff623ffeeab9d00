//! Agreeing the amax of the blocks of params the publishers quantize
//! (`quantize.rs`): which blocks of its param each request touches, the
//! publishers' amax of them, and the agreed (largest) one.

use super::Applier;
use crate::plan::Target;
use crate::quant::blocks::{walk, BlockRuns, Placed};
use crate::quant::Scheme;
use crate::result::{Error, Result};
use std::sync::Arc;

/// A request the publishers quantize: its scheme, and per block it
/// touches (in `quant::blocks::touched` order) its param's block (shared
/// with the plan, which keeps them for its next update).
pub struct QuantRequest {
    pub scheme: Scheme,
    target: usize,
    pub blocks: Arc<BlockRuns>,
}

impl Applier<'_, '_> {
    /// When plan entry `t` goes to a param the publishers quantize: its
    /// request's blocks. Err: a global block that falls in two of the
    /// param's blocks (pieces off the block grid; registration and the
    /// plan refuse those).
    pub fn quant_request(&self, t: usize) -> Result<Option<QuantRequest>> {
        let e = &self.plan.entries[t];
        let Target::Param(i) = e.target else {
            return Ok(None);
        };
        // Targets are in param order (the plan's).
        let Ok(k) = self.quant.targets.binary_search_by_key(&i, |q| q.param) else {
            return Ok(None);
        };
        if !self.quant.targets[k].on_wire {
            return Ok(None);
        }
        let q = &self.quant.targets[k];
        let blocks = self.plan.quant_blocks(t, || {
            let placed = Placed::of(&e.meta);
            let segments = (self.plan.segments(t).iter()).map(|s| (s.source, s.len, s.param));
            let mut spans = Spans::default();
            walk(q.scheme, placed, segments, |dst, _, _, g| {
                spans.add(g, param_block(q.scheme, &q.shape, dst));
            });
            spans.in_block_order().map_err(|g| {
                Error::mismatch(format!(
                    "param '{}': block {g} of tensor '{}' falls in two of its blocks",
                    q.name, e.meta.name
                ))
            })
        })?;
        Ok(Some(QuantRequest {
            scheme: q.scheme,
            target: k,
            blocks,
        }))
    }

    /// A publisher's amax of the blocks of request `r` (one per block,
    /// checked by the caller to be as many, finite, not negative).
    pub fn offer_amax(&mut self, r: &QuantRequest, amax: &[f32]) {
        let (agreed, seen) = &mut self.quant.agreed[r.target];
        for (b, &a) in r.blocks.iter().zip(amax) {
            agreed[b] = agreed[b].max(a);
            seen[b] = true;
        }
    }

    /// The agreed amax of request `r`'s blocks, once every publisher
    /// offered theirs.
    pub fn agreed_amax(&self, r: &QuantRequest) -> Vec<f32> {
        let agreed = &self.quant.agreed[r.target].0;
        r.blocks.iter().map(|b| agreed[b]).collect()
    }

    /// Target `k`'s agreed amax, every block reported.
    pub(super) fn agreed_for(&self, k: usize) -> Result<Vec<f32>> {
        let (agreed, seen) = &self.quant.agreed[k];
        match seen.iter().position(|s| !s) {
            None => Ok(agreed.clone()),
            Some(b) => Err(Error::peer(format!(
                "param '{}': no publisher reported the amax of its block {b}",
                self.quant.targets[k].name
            ))),
        }
    }
}

/// A request's (global block, param block) pairs as its walk meets them,
/// kept as spans where both go up by one (a row of MXFP8 blocks is one
/// span), so a large request costs a few words per row, not per block.
#[derive(Default)]
struct Spans(Vec<(u64, usize, usize)>);

impl Spans {
    fn add(&mut self, g: u64, p: usize) {
        if let Some((g0, p0, n)) = self.0.last_mut() {
            let (last_g, last_p) = (*g0 + *n as u64 - 1, *p0 + *n - 1);
            if (g, p) == (last_g, last_p) {
                return;
            }
            if (g, p) == (last_g + 1, last_p + 1) {
                *n += 1;
                return;
            }
        }
        self.0.push((g, p, 1));
    }

    /// The param blocks in global block order, each global block once; Err
    /// names a global block met with two param blocks.
    fn in_block_order(mut self) -> std::result::Result<BlockRuns, u64> {
        self.0.sort_unstable();
        let apart = self.0.windows(2).all(|w| w[0].0 + w[0].2 as u64 <= w[1].0);
        if apart {
            let blocks = self.0.iter().flat_map(|&(_, p, n)| p..p + n);
            return Ok(blocks.collect());
        }
        // Spans meeting the same blocks again (128x128 blocks, met by each
        // of their rows): pair by pair, as few as such blocks are.
        let mut pairs: Vec<(u64, usize)> = (self.0.iter())
            .flat_map(|&(g, p, n)| (0..n).map(move |k| (g + k as u64, p + k)))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        if let Some(w) = pairs.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(w[0].0);
        }
        Ok(pairs.into_iter().map(|(_, p)| p).collect())
    }
}

/// The block of a `shape` param (its scales' row-major index) holding its
/// element `e`.
fn param_block(scheme: Scheme, shape: &[u64], e: u64) -> usize {
    let n = shape.len();
    let Some((bh, bw)) = scheme.block_dims() else {
        return 0;
    };
    let cols = shape.last().copied().unwrap_or(1).max(1);
    // A 1-D param is one row.
    let rows = if n < 2 { 1 } else { shape[n - 2].max(1) };
    if n < 2 && bh > 1 {
        return 0;
    }
    let (r, c) = (e / cols % rows, e % cols);
    let batch = e / cols / rows;
    let (srows, scols) = (rows.div_ceil(bh), cols.div_ceil(bw));
    ((batch * srows + r / bh) * scols + c / bw) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A [2, 3, 70] param: MXFP8 blocks are 32 along each row (3 a row),
    /// 128x128 blocks one per matrix.
    #[test]
    fn a_params_blocks_follow_its_scales_row_major() {
        let shape = [2, 3, 70];
        let e = |b: u64, r: u64, c: u64| (b * 3 + r) * 70 + c;
        assert_eq!(param_block(Scheme::Mxfp8, &shape, e(0, 0, 31)), 0);
        assert_eq!(param_block(Scheme::Mxfp8, &shape, e(0, 0, 32)), 1);
        assert_eq!(param_block(Scheme::Mxfp8, &shape, e(0, 2, 69)), 8);
        assert_eq!(param_block(Scheme::Mxfp8, &shape, e(1, 1, 64)), 9 + 3 + 2);
        assert_eq!(param_block(Scheme::Fp8Block128, &shape, e(1, 2, 69)), 1);
        assert_eq!(param_block(Scheme::Fp8Tensor, &shape, e(1, 2, 69)), 0);
        assert_eq!(param_block(Scheme::Mxfp8, &[100], 99), 3);
    }

    /// Spans give each global block's param block once, in global order,
    /// as runs: rows met in any order, blocks met again, and a global
    /// block met with two param blocks refused.
    #[test]
    fn spans_list_param_blocks_in_global_order() {
        let mut s = Spans::default();
        // A column half of MXFP8 rows (global 8 a row, param 4), rows met
        // backwards, one block met twice.
        for r in (0..3u64).rev() {
            for c in 0..4 {
                s.add(r * 8 + 4 + c, (r * 4 + c) as usize);
                s.add(r * 8 + 4 + c, (r * 4 + c) as usize);
            }
        }
        let runs = s.in_block_order().unwrap();
        assert_eq!(runs.iter().collect::<Vec<_>>(), (0..12).collect::<Vec<_>>());
        assert_eq!(runs, (0..12).collect::<BlockRuns>());
        // 128x128 blocks met by two rows each: overlapping spans.
        let mut s = Spans::default();
        for _row in 0..2 {
            s.add(0, 0);
            s.add(1, 1);
        }
        s.add(5, 2);
        assert_eq!(
            s.in_block_order().unwrap().iter().collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let mut s = Spans::default();
        s.add(3, 0);
        s.add(4, 1);
        s.add(4, 2);
        assert_eq!(s.in_block_order().unwrap_err(), 4);
    }
}
