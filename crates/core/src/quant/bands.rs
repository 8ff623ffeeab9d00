//! A whole param quantized in bands of at most 128 rows, on several
//! threads: first every band's amax (so a NaN or an infinity is found
//! before any FP8 byte is written), then every band quantized with it.
//!
//! A param of shape `[..., M, N]` is `prod(...)` matrices of `[M, N]`.
//! With 128x128 blocks a band is up to 128 rows of one matrix, starting at
//! a multiple of 128: its blocks are the matrix's, and it has one row of
//! the scales (`[..., ceil(M/128), ceil(N/128)]`). With one scale per
//! tensor the param is `[rows, N]` (N its last dimension, rows the rest)
//! and every band shares the tensor's amax. MXFP8's blocks are 32
//! elements of one row, so any rows are a band: the param is `[rows, N]`
//! with bands of 128 rows, each with its rows' scales (`[rows,
//! ceil(N/32)]`).

use super::{block_amax, quantize_with, QuantError, Scheme, Source, BLOCK, MX_BLOCK};
use crate::tensor::DType;

/// Rows `rows` of the flattened `[all rows, cols]` param starting at row
/// `row`, whose scales start at `scale` (`scales` of them).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Band {
    pub(crate) row: usize,
    pub(crate) rows: usize,
    pub(crate) scale: usize,
    pub(crate) scales: usize,
}

impl Band {
    /// The band's rows of `wide` (of `cols` columns), a tensor of its own:
    /// its blocks are the param's.
    fn source<'a>(&self, wide: Wide<'a>, cols: usize) -> Source<'a> {
        let esize = wide.dtype.size();
        Source {
            dtype: wide.dtype,
            bytes: &wide.bytes[self.row * cols * esize..(self.row + self.rows) * cols * esize],
            rows: self.rows,
            cols,
        }
    }

    /// Its blocks' amax over `src` (its rows); a non-finite element's
    /// index counted from the param's first element.
    fn amax(&self, scheme: Scheme, src: Source, cols: usize) -> Result<Vec<f32>, QuantError> {
        let mut out = vec![0f32; self.scales];
        block_amax(scheme, src, [0, 0], [self.rows, cols], &mut out).map_err(|e| match e {
            QuantError::NonFinite { index, value } => QuantError::NonFinite {
                index: index + self.row * cols,
                value,
            },
            other => other,
        })?;
        Ok(out)
    }
}

/// The bands of a `shape` param quantized with `scheme`, and its columns.
pub(crate) fn bands(scheme: Scheme, shape: &[u64]) -> (Vec<Band>, usize) {
    let n = shape.len();
    let cols = shape.last().copied().unwrap_or(1) as usize;
    match scheme {
        Scheme::Fp8Tensor | Scheme::Mxfp8 => {
            let rows = shape[..n.saturating_sub(1)].iter().product::<u64>() as usize;
            // One scale per tensor: every band shares scale 0; MXFP8: a
            // row's scales follow the row's.
            let per_row = match scheme {
                Scheme::Mxfp8 => cols.div_ceil(MX_BLOCK),
                _ => 0,
            };
            let bands = (0..rows.div_ceil(BLOCK))
                .map(|b| {
                    let rows = BLOCK.min(rows - b * BLOCK);
                    Band {
                        row: b * BLOCK,
                        rows,
                        scale: b * BLOCK * per_row,
                        scales: if per_row == 0 { 1 } else { rows * per_row },
                    }
                })
                .collect();
            (bands, cols)
        }
        Scheme::Fp8Block128 => {
            let m = shape[n - 2] as usize;
            let matrices = shape[..n - 2].iter().product::<u64>() as usize;
            let (per, scols) = (m.div_ceil(BLOCK), cols.div_ceil(BLOCK));
            let mut out = Vec::with_capacity(matrices * per);
            for k in 0..matrices {
                for b in 0..per {
                    out.push(Band {
                        row: k * m + b * BLOCK,
                        rows: BLOCK.min(m - b * BLOCK),
                        scale: (k * per + b) * scols,
                        scales: scols,
                    });
                }
            }
            (out, cols)
        }
    }
}

/// A param's bytes as its source holds them: `shape` elements of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct Wide<'a> {
    pub dtype: DType,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

/// Every block's amax (the scales' shape, unclamped) of `wide` quantized
/// with `scheme`. Err: the first non-finite element found, as
/// `(flat index in the param, value)`.
pub fn amax(scheme: Scheme, wide: Wide, threads: usize) -> Result<Vec<f32>, QuantError> {
    let (bands, cols) = bands(scheme, wide.shape);
    let scales = bands.last().map_or(1, |b| b.scale + b.scales);
    let per_band = par_map(&bands, threads, |b| {
        b.amax(scheme, b.source(wide, cols), cols)
    });
    let mut amax = vec![0f32; scales];
    for (b, got) in bands.iter().zip(per_band) {
        for (slot, a) in amax[b.scale..b.scale + b.scales].iter_mut().zip(got?) {
            *slot = slot.max(a);
        }
    }
    Ok(amax)
}

/// Quantize `wide` with `scheme` and the amax [`amax`] found: its E4M3
/// bytes into `fp8` (one per element). The scales are the caller's to
/// write from the same amax ([`Scheme::write_scales`]). `recheck`: each
/// band's amax is found again as it is cast (its bytes in cache) and must
/// be `amax`'s, else [`QuantError::Changed`]: for a source that may be
/// written meanwhile (a file's mapping), so scales never go out with
/// bytes cast from other contents.
pub fn write(
    scheme: Scheme,
    wide: Wide,
    amax: &[f32],
    fp8: &mut [u8],
    (threads, recheck): (usize, bool),
) -> Result<(), QuantError> {
    let (bands, cols) = bands(scheme, wide.shape);
    let elements = wide.shape.iter().product::<u64>() as usize;
    let blocks = bands.last().map_or(amax.len(), |b| b.scale + b.scales);
    if fp8.len() != elements
        || blocks != amax.len()
        || wide.bytes.len() != elements * wide.dtype.size()
    {
        return Err(QuantError::Invalid(format!(
            "{} fp8 bytes and {} source bytes for {elements} elements, {} amax for {blocks} blocks",
            fp8.len(),
            wide.bytes.len(),
            amax.len()
        )));
    }
    let fp8_at = fp8.as_mut_ptr() as usize;
    let done = par_map(&bands, threads, |b| {
        let src = b.source(wide, cols);
        // SAFETY: bands are disjoint rows of the param, inside `fp8`.
        let q = unsafe {
            std::slice::from_raw_parts_mut((fp8_at as *mut u8).add(b.row * cols), b.rows * cols)
        };
        let a = &amax[b.scale..b.scale + b.scales];
        // `quantize_with` also gives the band's scales: not kept here.
        let mut scales = vec![0f32; b.scales];
        quantize_with(scheme, src, ([0, 0], [b.rows, cols]), a, q, &mut scales)?;
        recheck.then(|| b.amax(scheme, src, cols)).transpose()
    });
    let mut again = vec![0f32; amax.len()];
    for (b, got) in bands.iter().zip(done) {
        let Some(got) = got? else { continue };
        for (slot, a) in again[b.scale..b.scale + b.scales].iter_mut().zip(got) {
            *slot = slot.max(a);
        }
    }
    if !recheck {
        return Ok(());
    }
    // Bit for bit (one scale per tensor: every band folded in first).
    match (again.iter().zip(amax)).position(|(x, y)| x.to_bits() != y.to_bits()) {
        None => Ok(()),
        Some(k) => {
            let b = bands
                .iter()
                .find(|b| (b.scale..b.scale + b.scales).contains(&k));
            Err(QuantError::Changed {
                row: b.map_or(0, |b| b.row),
            })
        }
    }
}

/// `f` over every band on up to `threads` threads, results in band order.
fn par_map<T: Send>(bands: &[Band], threads: usize, f: impl Fn(&Band) -> T + Sync) -> Vec<T> {
    crate::parallel::map(bands, threads, "quantizing", f)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode, values};
    use super::*;
    use crate::test_rng::Rng;
    /// Cast with `recheck` (a file's mapping as the source), a band whose
    /// bytes are no longer those the amax was found on is refused naming its
    /// first row (one scale per tensor: the first band's), for every scheme;
    /// without it, or with the same bytes, the cast goes through.
    #[test]
    fn a_source_changed_between_amax_and_cast_is_refused_when_rechecked() {
        fn wide<'a>(shape: &'a [u64], bytes: &'a [u8]) -> Wide<'a> {
            Wide {
                dtype: DType::Bf16,
                shape,
                bytes,
            }
        }
        let mut rng = Rng(7);
        let shape = [300u64, 260];
        let bytes = encode(&values(&mut rng, (300, 260)), DType::Bf16);
        // Element [200, 5] rewritten to 1e6, above any value of the tensor.
        let mut changed = bytes.clone();
        let at = 2 * (200 * 260 + 5);
        changed[at..at + 2].copy_from_slice(&((1e6f32.to_bits() >> 16) as u16).to_le_bytes());
        for (scheme, first) in [
            (Scheme::Fp8Block128, 128),
            (Scheme::Fp8Tensor, 0),
            (Scheme::Mxfp8, 128),
        ] {
            let found = amax(scheme, wide(&shape, &bytes), 2).unwrap();
            let mut fp8 = vec![0u8; 300 * 260];
            write(scheme, wide(&shape, &bytes), &found, &mut fp8, (2, true)).unwrap();
            let e = write(scheme, wide(&shape, &changed), &found, &mut fp8, (2, true)).unwrap_err();
            match e {
                QuantError::Changed { row } => assert_eq!(row, first, "{scheme:?}"),
                other => panic!("{scheme:?}: {other:?}"),
            }
            write(scheme, wide(&shape, &changed), &found, &mut fp8, (2, false)).unwrap();
        }
    }
}
