//! Agreeing the amax of the blocks of params the publishers quantize
//! (`quantize.rs`): which blocks of its param each request touches, the
//! publishers' amax of them, and the agreed (largest) one.

use super::Applier;
use crate::plan::Target;
use crate::quant::blocks::{walk, Placed};
use crate::quant::Scheme;
use crate::result::{Error, Result};

/// A request the publishers quantize: its scheme, and per block it
/// touches (in `quant::blocks::touched` order) its param's block.
pub struct QuantRequest {
    pub scheme: Scheme,
    target: usize,
    pub blocks: Vec<usize>,
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
            let mut pairs: Vec<(u64, usize)> = Vec::new();
            walk(q.scheme, placed, segments, |dst, _, _, g| {
                if pairs.last().is_none_or(|p| p.0 != g) {
                    pairs.push((g, param_block(q.scheme, &q.shape, dst)));
                }
            });
            pairs.sort_unstable();
            pairs.dedup();
            if let Some(w) = pairs.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(Error::mismatch(format!(
                    "param '{}': block {} of tensor '{}' falls in two of its blocks",
                    q.name, w[0].0, e.meta.name
                )));
            }
            Ok(pairs.into_iter().map(|p| p.1).collect())
        })?;
        Ok(Some(QuantRequest {
            scheme: q.scheme,
            target: k,
            blocks: blocks.to_vec(),
        }))
    }

    /// A publisher's amax of the blocks of request `r` (one per block,
    /// checked by the caller to be as many, finite, not negative).
    pub fn offer_amax(&mut self, r: &QuantRequest, amax: &[f32]) {
        let (agreed, seen) = &mut self.quant.agreed[r.target];
        for (&b, &a) in r.blocks.iter().zip(amax) {
            agreed[b] = agreed[b].max(a);
            seen[b] = true;
        }
    }

    /// The agreed amax of request `r`'s blocks, once every publisher
    /// offered theirs.
    pub fn agreed_amax(&self, r: &QuantRequest) -> Vec<f32> {
        let agreed = &self.quant.agreed[r.target].0;
        r.blocks.iter().map(|&b| agreed[b]).collect()
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
}
