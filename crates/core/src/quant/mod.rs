//! Quantization of bf16/f16/f32 weights to FP8 E4M3, bit for bit as
//! PyTorch computes the stated reference expressions on the CPU.
//!
//! 128x128 blocks and one scale per tensor: the widely used reference
//! (DeepGEMM's `per_block_cast_to_fp8`; the same with one block for the
//! whole tensor):
//!
//! ```text
//! x         = the source element widened to f32 (bf16 and f16 exactly)
//! amax      = max(|x|) over the block, in f32, clamped below at 1e-4
//! q         = e4m3(x * (448 / amax))      f32 multiply, PyTorch's cast
//! scale_inv = amax / 448                  dequantized = e4m3 value * scale_inv
//! ```
//!
//! Two details make it PyTorch's and not merely close: `448 / amax` is
//! `amax.reciprocal() * 448` (how `float / tensor` runs in PyTorch: two
//! roundings, not one division), and the cast to E4M3 is PyTorch's
//! ([`e4m3::from_f32`]: nearest even, saturating at 448). The product is
//! taken in f32 in both schemes: per tensor the PyTorch expression is
//! `(x.float() * (448.0 / amax)).to(torch.float8_e4m3fn)`; written without
//! `.float()`, a 0-dimensional `amax` would leave the product in bf16 and
//! round twice.
//!
//! MXFP8 (OCP Microscaling v1.0): blocks of 32 consecutive elements along
//! the last dimension, each with a power-of-two scale stored as an E8M0
//! byte (`2^(byte - 127)`), its exponent the OCP rule (torchao's `to_mx`,
//! FLOOR mode, computes the same):
//!
//! ```text
//! amax  = max(|x|) over the 32 elements, in f32 (no floor)
//! e     = clamp(floor(log2(amax)) - 8, -127, 127)   8: E4M3's largest exponent;
//!         floor(log2) is amax's f32 exponent field - 127 (0 and subnormals: -127)
//! q     = e4m3(x / 2^e)                 saturating at 448 (the OCP clamp)
//! scale = the byte e + 127              dequantized = e4m3 value * 2^e
//! ```
//!
//! `x / 2^e` is computed as `x * 2^-e`: both are the exact product rounded
//! once, so they are the same f32. (torchao divides by at least 2^-126
//! where e is -127, a block whose amax is below 2^-118: its bytes there
//! would not dequantize to the source; this rule's do.)
//!
//! Schemes: blocks of 128 x 128 over a 2-D `[M, N]` tensor (scales `[ceil(M /
//! 128), ceil(N / 128)]`, edge blocks partial: the DeepSeek-V3 and Kimi-K2
//! checkpoint format), one scale per tensor, and MXFP8 (scales `[...,
//! ceil(N / 32)]`, one byte each; the last block of a row partial). A NaN
//! or an infinity in the source is refused naming the element: a diverged
//! trainer must not reach an engine.
//!
//! The scale of a block is a function of its amax only (in every scheme),
//! so a block split over several holders (trainer ranks) is quantized by
//! each from the block's agreed amax: [`block_amax`] gives a holder's
//! partial amax, the maximum of the partials is the block's, and
//! [`quantize_with`] quantizes a holder's part with it.

pub mod bands;
pub mod blocks;
mod cast;
pub mod device;
pub mod e4m3;
mod kernels;
mod lut;
pub mod params;
mod scheme;

pub use cast::{segment_quantize, SegmentCaster};
pub use scheme::Scheme;

use crate::tensor::DType;

/// Block edge of the block-scaled scheme (crate-internal like every
/// constant here: cbindgen would export a public one to the C header).
pub(crate) const BLOCK: usize = 128;
/// The floor of a block's amax (an all-zero block gets scale 1e-4 / 448).
pub(crate) const AMAX_FLOOR: f32 = 1e-4;
/// Bytes of source rows [`quantize`] takes at once for MXFP8 (both passes,
/// amax then the cast, over them while they are in cache): measured on
/// the 2-core CI machine (1 MiB of second-level cache a core), 2 MiB ran
/// at 0.60 of memcpy on one core, 256 KiB at 0.48-0.55, 64 KiB at
/// 0.47-0.50.
const MX_BAND_BYTES: usize = 2 << 20;
/// Elements of one MXFP8 block (along the last dimension).
pub(crate) const MX_BLOCK: usize = 32;
/// Row-major source elements: `rows` x `cols` of `dtype` (bf16, f16 or
/// f32, little-endian) in `bytes`.
#[derive(Clone, Copy, Debug)]
pub struct Source<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

/// Why a tensor cannot be quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantError {
    /// Element `index` (row-major) is NaN or infinite.
    NonFinite { index: usize, value: f32 },
    /// Not a dtype this quantizes from, or sizes that disagree.
    Invalid(String),
    /// The source's bytes changed between finding the amax and casting
    /// (checked where the source is not the caller's own memory: a file's
    /// mapping): from flattened row `row` on, a block's amax differs.
    Changed { row: usize },
}

/// Each block's amax over the part `src` holds (unclamped; 0 for a block
/// the part does not touch), for a part whose element `[0, 0]` is element
/// `origin` of the whole tensor of `[rows, cols]` (`whole`): `out` has the
/// scales' shape of the whole tensor, row-major.
pub fn block_amax(
    scheme: Scheme,
    src: Source,
    origin: [usize; 2],
    whole: [usize; 2],
    out: &mut [f32],
) -> Result<(), QuantError> {
    let [srows, scols] = scheme.scales_shape(whole[0], whole[1]);
    check(src, out.len(), srows * scols)?;
    let (bh, bw) = scheme.block(whole[0], whole[1]);
    match src.dtype {
        DType::Bf16 => amax_of::<Bf16>(src, origin, (bh, bw, scols), out),
        DType::F16 => amax_of::<F16>(src, origin, (bh, bw, scols), out),
        _ => amax_of::<F32>(src, origin, (bh, bw, scols), out),
    }
}

/// Quantize the part `src` (at `origin` of the whole `[rows, cols]`
/// tensor) with the blocks' agreed `amax` (the whole tensor's scales'
/// shape, before the floor): its E4M3 bytes into `fp8` (one per element of
/// the part), and every block's scale ([`Scheme::scale`]: `scale_inv`, or
/// MXFP8's `2^e`) into `scale_inv`.
pub fn quantize_with(
    scheme: Scheme,
    src: Source,
    (origin, whole): ([usize; 2], [usize; 2]),
    amax: &[f32],
    fp8: &mut [u8],
    scale_inv: &mut [f32],
) -> Result<(), QuantError> {
    let [srows, scols] = scheme.scales_shape(whole[0], whole[1]);
    check(src, amax.len(), srows * scols)?;
    if fp8.len() != src.rows * src.cols || scale_inv.len() != amax.len() {
        return Err(QuantError::Invalid(format!(
            "{} fp8 bytes and {} scales for {} elements and {} blocks",
            fp8.len(),
            scale_inv.len(),
            src.rows * src.cols,
            amax.len()
        )));
    }
    let mut factor = vec![0f32; amax.len()];
    scheme.factors_and_scales(amax, &mut factor, scale_inv);
    let (bh, bw) = scheme.block(whole[0], whole[1]);
    let geometry = (origin, bh, bw, scols);
    match src.dtype {
        DType::Bf16 => cast::scale_into::<Bf16>(src, geometry, &factor, fp8),
        DType::F16 => cast::scale_into::<F16>(src, geometry, &factor, fp8),
        _ => cast::scale_into::<F32>(src, geometry, &factor, fp8),
    }
    Ok(())
}

/// Quantize a whole `[rows, cols]` tensor: [`block_amax`] then
/// [`quantize_with`].
pub fn quantize(
    scheme: Scheme,
    src: Source,
    fp8: &mut [u8],
    scale_inv: &mut [f32],
) -> Result<(), QuantError> {
    let whole = [src.rows, src.cols];
    let mut amax = vec![0f32; scale_inv.len()];
    if scheme == Scheme::Fp8Tensor || src.rows <= BLOCK {
        block_amax(scheme, src, [0, 0], whole, &mut amax)?;
        return quantize_with(scheme, src, ([0, 0], whole), &amax, fp8, scale_inv);
    }
    // Blocks: a band of 128 rows at a time, so the second pass reads the
    // band from cache, not memory (0.44 of memcpy per core before).
    check(
        src,
        scale_inv.len(),
        scheme.scales_shape(src.rows, src.cols).iter().product(),
    )?;
    if fp8.len() != src.rows * src.cols {
        return Err(QuantError::Invalid(format!(
            "{} fp8 bytes for {} elements",
            fp8.len(),
            src.rows * src.cols
        )));
    }
    let row_bytes = src.cols * src.dtype.size();
    // A band starts on the block grid (128 rows; MXFP8's blocks are one
    // row), so it is a tensor of its own with its own rows of the scales:
    // its factors are worked out for its blocks alone, not for all.
    // MXFP8's bands are the rows of MX_BAND_BYTES (at most 128).
    let (bh, _) = scheme.block(src.rows, src.cols);
    let band_rows = match bh {
        1 => (MX_BAND_BYTES / row_bytes.max(1)).clamp(1, BLOCK),
        _ => BLOCK,
    };
    let bands = src
        .bytes
        .chunks(band_rows * row_bytes)
        .zip(fp8.chunks_mut(band_rows * src.cols));
    let scols = scheme.scales_shape(src.rows, src.cols)[1];
    for (k, (bytes, q)) in bands.enumerate() {
        let band = Source {
            bytes,
            rows: bytes.len() / row_bytes,
            ..src
        };
        let (first, n) = (k * band_rows / bh * scols, band.rows.div_ceil(bh) * scols);
        let (a, s) = (
            &mut amax[first..first + n],
            &mut scale_inv[first..first + n],
        );
        let own = [band.rows, src.cols];
        // A band's element index counts from the band: from the tensor here.
        block_amax(scheme, band, [0, 0], own, a).map_err(|e| match e {
            QuantError::NonFinite { index, value } => QuantError::NonFinite {
                index: index + k * band_rows * src.cols,
                value,
            },
            other => other,
        })?;
        quantize_with(scheme, band, ([0, 0], own), a, q, s)?;
    }
    Ok(())
}

/// The largest `|x|` of `xs` (elements of `dtype`, bf16, f16 or f32),
/// Err with the index of the first NaN or infinity.
pub fn segment_amax(dtype: DType, xs: &[u8]) -> Result<f32, usize> {
    let bits = match dtype {
        DType::Bf16 => kernels::abs_bits_max::<Bf16>(xs),
        DType::F16 => kernels::abs_bits_max::<F16>(xs),
        _ => kernels::abs_bits_max::<F32>(xs),
    };
    if bits < 0x7f80_0000 {
        return Ok(f32::from_bits(bits));
    }
    let size = dtype.size();
    let read = |x: &[u8]| match dtype {
        DType::Bf16 => Bf16::read(x),
        DType::F16 => F16::read(x),
        _ => F32::read(x),
    };
    Err(xs
        .chunks_exact(size)
        .position(|x| !read(x).is_finite())
        .unwrap_or(0))
}

fn check(src: Source, scales: usize, want: usize) -> Result<(), QuantError> {
    if !matches!(src.dtype, DType::Bf16 | DType::F16 | DType::F32) {
        return Err(QuantError::Invalid(format!(
            "FP8 quantization takes bf16, f16 or f32, not {}",
            src.dtype
        )));
    }
    let need = src
        .rows
        .checked_mul(src.cols)
        .and_then(|n| n.checked_mul(src.dtype.size()));
    if need != Some(src.bytes.len()) || scales != want {
        return Err(QuantError::Invalid(format!(
            "{} bytes for [{}, {}] {} and {scales} scales (want {want})",
            src.bytes.len(),
            src.rows,
            src.cols,
            src.dtype
        )));
    }
    Ok(())
}

/// A source element type, widened to f32 exactly.
trait Element {
    const SIZE: usize;
    /// Cast by table where the CPU can (`lut`): bf16 only.
    const TABLES: bool = false;
    fn read(b: &[u8]) -> f32;
    /// The f32 bits of a 16-bit element's `|x|` bits `h` (its magnitude's
    /// order kept): for the amax taken on 16-bit lanes. Only 16-bit
    /// elements are taken that way.
    fn widen_abs16(h: u16) -> u32 {
        Self::read(&h.to_le_bytes()).to_bits() & 0x7fff_ffff
    }
}

struct Bf16;
struct F16;
struct F32;

impl Element for Bf16 {
    const SIZE: usize = 2;
    const TABLES: bool = true;
    #[inline]
    fn read(b: &[u8]) -> f32 {
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    }
}

impl Element for F16 {
    const SIZE: usize = 2;
    #[inline]
    fn read(b: &[u8]) -> f32 {
        f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Element for F32 {
    const SIZE: usize = 4;
    #[inline]
    fn read(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    /// Not a 16-bit element (never taken): NaN's bits, were it ever,
    /// so nothing is quantized with it.
    fn widen_abs16(_: u16) -> u32 {
        u32::MAX
    }
}

/// IEEE half to single, exactly (subnormals, infinities and NaN kept).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let (exp, man) = (((h >> 10) & 0x1f) as u32, (h & 0x3ff) as u32);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24, exact in f32.
            let v = m as f32 * 2f32.powi(-24);
            sign | v.to_bits()
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Per row of the part, the running amax of each block it crosses (on
/// bit patterns: [`kernels::abs_bits_max`]).
fn amax_of<E: Element>(
    src: Source,
    origin: [usize; 2],
    (bh, bw, scols): (usize, usize, usize),
    out: &mut [f32],
) -> Result<(), QuantError> {
    let row_bytes = src.cols * E::SIZE;
    let mut bits = Vec::new();
    for (r, row) in src
        .bytes
        .chunks_exact(row_bytes.max(1))
        .enumerate()
        .take(src.rows)
    {
        let brow = (origin[0] + r) / bh;
        let mut c = 0;
        while c < src.cols {
            let b = (origin[1] + c) / bw;
            let end = ((b + 1) * bw - origin[1]).min(src.cols);
            let whole = whole_blocks(bw, end - c, src.cols - c);
            if whole > 1 {
                // The row's whole blocks from here at once.
                bits.resize(whole, 0);
                let xs = &row[c * E::SIZE..(c + whole * bw) * E::SIZE];
                match bw {
                    MX_BLOCK => kernels::abs_bits_max_each::<E, MX_BLOCK>(xs, &mut bits),
                    _ => kernels::abs_bits_max_each::<E, BLOCK>(xs, &mut bits),
                }
                // One pass (vectorized) over the blocks: their largest
                // bits say whether any is non-finite, found after.
                let slots = &mut out[brow * scols + b..brow * scols + b + whole];
                let mut top = 0;
                for (slot, &m) in slots.iter_mut().zip(&bits) {
                    *slot = max_abs(*slot, m);
                    top = top.max(m);
                }
                if top >= 0x7f80_0000 {
                    let k = bits.iter().position(|&m| m >= 0x7f80_0000).unwrap_or(0);
                    let at = c + k * bw;
                    return Err(non_finite::<E>(row, at..at + bw, r * src.cols));
                }
                c += whole * bw;
                continue;
            }
            let m = kernels::abs_bits_max::<E>(&row[c * E::SIZE..end * E::SIZE]);
            if m >= 0x7f80_0000 {
                return Err(non_finite::<E>(row, c..end, r * src.cols));
            }
            let slot = &mut out[brow * scols + b];
            *slot = max_abs(*slot, m);
            c = end;
        }
    }
    Ok(())
}

/// How many whole blocks of `bw` columns a row's run starting on a block
/// boundary (`first`: the columns left in its block, `left`: in the row)
/// holds, for the block widths whose kernels take a row's blocks in one
/// call (MXFP8's 32 and 128): a call per block cost as much as a block's
/// work. 0 for other widths (one scale per tensor: one run per row).
fn whole_blocks(bw: usize, first: usize, left: usize) -> usize {
    match bw {
        MX_BLOCK | BLOCK if first == bw => left / bw,
        _ => 0,
    }
}

/// The larger of `|slot|` and the finite magnitude of bits `m`, compared
/// as bits (the order of finite magnitudes): a float maximum's NaN
/// handling kept the loop over an MXFP8 row's blocks scalar.
#[inline(always)]
fn max_abs(slot: f32, m: u32) -> f32 {
    f32::from_bits((slot.to_bits() & 0x7fff_ffff).max(m))
}

fn non_finite<E: Element>(row: &[u8], cols: std::ops::Range<usize>, base: usize) -> QuantError {
    let c = cols
        .clone()
        .find(|&c| !E::read(&row[c * E::SIZE..]).is_finite())
        .unwrap_or(cols.start);
    QuantError::NonFinite {
        index: base + c,
        value: E::read(&row[c * E::SIZE..]),
    }
}

#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod mx_tests;
#[cfg(test)]
mod tests;
