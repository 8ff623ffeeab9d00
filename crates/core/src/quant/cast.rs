//! The cast of a part's elements with their blocks' factors, row by row:
//! by tables where the CPU can (`lut`), else the arithmetic way
//! (`kernels`); and of a request's segments, block by block, for
//! publishers walking a shard.

use super::{kernels, lut, whole_blocks, Bf16, Element, Scheme, Source, BLOCK, F16, F32, MX_BLOCK};
use crate::tensor::DType;

/// Quantize `xs` (elements of `dtype`) of a block whose agreed amax is
/// `amax` into `out` (one E4M3 byte each), as [`quantize_with`] does.
pub fn segment_quantize(scheme: Scheme, dtype: DType, xs: &[u8], amax: f32, out: &mut [u8]) {
    let factor = scheme.factor(amax);
    match dtype {
        DType::Bf16 => kernels::scale_run::<Bf16>(xs, factor, out),
        DType::F16 => kernels::scale_run::<F16>(xs, factor, out),
        _ => kernels::scale_run::<F32>(xs, factor, out),
    }
}

/// [`segment_quantize`] of many segments of a request's blocks (a
/// trainer's shard, walked block by block): a bf16 block's cast table
/// (`lut`) is made at its first segment and serves its others (a row of a
/// 128x128 block is a segment: a table a segment would cost more than the
/// segment). The tables are cached by block, direct-mapped in
/// [`CASTER_SLOTS`] slots: a walk meets a block row's blocks (56 for 7,168
/// columns) over and over, then the next row's; a cache the size of the
/// request's blocks would be megabytes for an embedding. MXFP8 and
/// f16/f32 are cast as [`segment_quantize`] does.
pub struct SegmentCaster {
    slots: Vec<(usize, Option<lut::Table>)>,
}

/// Slots of a [`SegmentCaster`]'s table cache.
const CASTER_SLOTS: usize = 512;

impl SegmentCaster {
    /// For segments of `scheme` from `dtype` elements.
    pub fn new(scheme: Scheme, dtype: DType) -> SegmentCaster {
        let tables = scheme != Scheme::Mxfp8 && dtype == DType::Bf16 && lut::available();
        SegmentCaster {
            slots: vec![(usize::MAX, None); if tables { CASTER_SLOTS } else { 0 }],
        }
    }

    /// [`segment_quantize`] of `xs`, elements of block `block` (agreed
    /// amax `amax`), into `out`.
    pub fn quantize(
        &mut self,
        (scheme, dtype): (Scheme, DType),
        (block, amax): (usize, f32),
        xs: &[u8],
        out: &mut [u8],
    ) {
        if self.slots.is_empty() {
            return segment_quantize(scheme, dtype, xs, amax, out);
        }
        let slot = &mut self.slots[block % CASTER_SLOTS];
        if slot.0 != block {
            *slot = (block, lut::Table::new(scheme.factor(amax)));
        }
        match &slot.1 {
            Some(t) => lut::scale_run(xs, t, out),
            None => segment_quantize(scheme, dtype, xs, amax, out),
        }
    }
}

/// The cast tables ([`lut::Table`]) of the blocks of one block row a part
/// crosses (from block column `first`), made when a row of a new block
/// row comes: the same tables serve up to 128 rows.
struct Tables {
    brow: usize,
    first: usize,
    row: Vec<lut::Table>,
}

impl Tables {
    /// The tables of block row `brow`, whose blocks' factors are
    /// `factors`; None where a factor has none (cast the arithmetic way).
    fn of(&mut self, brow: usize, factors: &[f32]) -> Option<&[lut::Table]> {
        if brow != self.brow {
            self.brow = brow;
            self.row.clear();
            for &f in factors {
                let Some(t) = lut::Table::new(f) else {
                    self.row.clear();
                    break;
                };
                self.row.push(t);
            }
        }
        (self.row.len() == factors.len()).then_some(&self.row[..])
    }
}

/// One row of bf16 (its first column at column `col` of the tensor,
/// blocks `bw` wide) cast with its blocks' `tables` (from the row's first
/// block) into `out`: its whole 128-wide blocks in one call.
fn scale_row_by_tables(
    row: &[u8],
    (col, bw): (usize, usize),
    tables: &[lut::Table],
    out: &mut [u8],
) {
    let cols = out.len();
    let mut c = 0;
    while c < cols {
        let k = (col + c) / bw - col / bw;
        let end = (((col + c) / bw + 1) * bw - col).min(cols);
        let whole = whole_blocks(bw, end - c, cols - c);
        if bw == BLOCK && whole > 1 {
            let xs = &row[2 * c..2 * (c + whole * bw)];
            lut::scale_each::<BLOCK>(xs, &tables[k..k + whole], &mut out[c..c + whole * bw]);
            c += whole * bw;
            continue;
        }
        lut::scale_run(&row[2 * c..2 * end], &tables[k], &mut out[c..end]);
        c = end;
    }
}

/// Each element times its block's factor, cast to E4M3.
pub(super) fn scale_into<E: Element>(
    src: Source,
    (origin, bh, bw, scols): ([usize; 2], usize, usize, usize),
    factor: &[f32],
    fp8: &mut [u8],
) {
    let row_bytes = src.cols * E::SIZE;
    let rows = src
        .bytes
        .chunks_exact(row_bytes.max(1))
        .zip(fp8.chunks_exact_mut(src.cols.max(1)));
    // bf16 is cast by tables where the CPU can (`lut`): here one per
    // block of the schemes whose factors are not powers of two; MXFP8's
    // blocks share one (`lut::scale_each_mx`, below).
    let mut tables = (E::TABLES && bw != MX_BLOCK && lut::available()).then(|| Tables {
        brow: usize::MAX,
        first: origin[1] / bw,
        row: Vec::new(),
    });
    for (r, (row, out)) in rows.enumerate().take(src.rows) {
        let brow = (origin[0] + r) / bh;
        let mut c = 0;
        if let Some(tables) = tables.as_mut() {
            let last = (origin[1] + src.cols).div_ceil(bw);
            let factors = &factor[brow * scols + tables.first..brow * scols + last];
            if let Some(row_tables) = tables.of(brow, factors) {
                scale_row_by_tables(row, (origin[1], bw), row_tables, out);
                continue;
            }
        }
        while c < src.cols {
            let b = (origin[1] + c) / bw;
            let end = ((b + 1) * bw - origin[1]).min(src.cols);
            let whole = whole_blocks(bw, end - c, src.cols - c);
            if whole > 1 {
                // The row's whole blocks from here at once.
                let xs = &row[c * E::SIZE..(c + whole * bw) * E::SIZE];
                let factors = &factor[brow * scols + b..brow * scols + b + whole];
                let q = &mut out[c..c + whole * bw];
                match bw {
                    MX_BLOCK if E::TABLES => lut::scale_each_mx(xs, factors, q),
                    MX_BLOCK => kernels::scale_each::<E, MX_BLOCK>(xs, factors, q),
                    _ => kernels::scale_each::<E, BLOCK>(xs, factors, q),
                }
                c += whole * bw;
                continue;
            }
            let xs = &row[c * E::SIZE..end * E::SIZE];
            kernels::scale_run::<E>(xs, factor[brow * scols + b], &mut out[c..end]);
            c = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;
    /// A segment caster gives `segment_quantize`'s bytes, for blocks met again
    /// after others, blocks that share a cache slot (block k and k + 512, each
    /// its own amax), segments of every length, MXFP8 and f32 (no tables).
    #[test]
    fn a_segment_caster_casts_as_segment_quantize() {
        let mut rng = Rng(41);
        for (scheme, dtype) in [
            (Scheme::Fp8Block128, DType::Bf16),
            (Scheme::Fp8Tensor, DType::Bf16),
            (Scheme::Mxfp8, DType::Bf16),
            (Scheme::Fp8Block128, DType::F32),
        ] {
            let mut caster = SegmentCaster::new(scheme, dtype);
            let amax: Vec<f32> = (0..1100).map(|k| 1e-3 * (1 + k % 37) as f32).collect();
            for round in 0..3000usize {
                let block = [round % 60, 7, 7 + 512, 1024 + round % 3][round % 4];
                let n = 1 + (rng.next() as usize) % 200;
                let a = amax[block];
                let xs: Vec<u8> = (0..n)
                    .flat_map(|_| {
                        let v = (rng.next() as i32 as f32 / i32::MAX as f32) * a;
                        match dtype {
                            DType::Bf16 => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                            _ => v.to_le_bytes().to_vec(),
                        }
                    })
                    .collect();
                let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
                segment_quantize(scheme, dtype, &xs, a, &mut want);
                caster.quantize((scheme, dtype), (block, a), &xs, &mut got);
                assert_eq!(got, want, "{scheme:?} {dtype}: block {block}, {n} elements");
            }
        }
    }
}
