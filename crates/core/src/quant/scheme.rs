//! The quantization schemes: each one's block geometry, its scales' dtype
//! and shape, and the rule from a block's agreed amax to the factor its
//! elements are multiplied by and to the scale stored for it (the rules
//! are written out in the module docs, `quant/mod.rs`).

use super::{e4m3, AMAX_FLOOR, BLOCK, MX_BLOCK};
use crate::tensor::DType;

/// E4M3's largest power of two (448 = 1.75 x 2^8): an MXFP8 block's
/// exponent is its amax's less this.
const E4M3_EMAX: i32 = 8;

/// How a tensor is quantized. Numbers are part of the C ABI
/// (`wm_quant_scheme`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// FP8 E4M3 with one f32 `scale_inv` per 128 x 128 block.
    Fp8Block128 = 1,
    /// FP8 E4M3 with one f32 `scale_inv` for the tensor.
    Fp8Tensor = 2,
    /// MXFP8: FP8 E4M3 with one E8M0 scale byte per 32 elements along the
    /// last dimension.
    Mxfp8 = 3,
}

impl Scheme {
    /// The scheme numbered `raw` (`wm_quant_scheme`), if there is one.
    pub fn from_raw(raw: u32) -> Option<Scheme> {
        [Scheme::Fp8Block128, Scheme::Fp8Tensor, Scheme::Mxfp8]
            .into_iter()
            .find(|s| *s as u32 == raw)
    }

    /// The scheme's name in messages and in Python (`fp8_block128`,
    /// `fp8_tensor`, `mxfp8`).
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Fp8Block128 => "fp8_block128",
            Scheme::Fp8Tensor => "fp8_tensor",
            Scheme::Mxfp8 => "mxfp8",
        }
    }

    /// Rows (and columns) of one block of [`Scheme::Fp8Block128`].
    pub fn block_edge() -> usize {
        BLOCK
    }

    /// Rows and columns of one block on the block grid of a tensor's last
    /// two dimensions (a 1-D tensor is one row); None: one block for the
    /// whole tensor.
    pub fn block_dims(self) -> Option<(u64, u64)> {
        match self {
            Scheme::Fp8Block128 => Some((BLOCK as u64, BLOCK as u64)),
            Scheme::Fp8Tensor => None,
            Scheme::Mxfp8 => Some((1, MX_BLOCK as u64)),
        }
    }

    /// The scales' shape for a `[rows, cols]` tensor.
    pub fn scales_shape(self, rows: usize, cols: usize) -> [usize; 2] {
        match self {
            Scheme::Fp8Tensor => [1, 1],
            _ => {
                let (bh, bw) = self.block(rows, cols);
                [rows.div_ceil(bh), cols.div_ceil(bw)]
            }
        }
    }

    /// Rows and columns of one block of a `[rows, cols]` tensor.
    pub(super) fn block(self, rows: usize, cols: usize) -> (usize, usize) {
        match self.block_dims() {
            Some((bh, bw)) => (bh as usize, bw as usize),
            None => (rows.max(1), cols.max(1)),
        }
    }

    /// A block's amax as publishers report and agree it: as found, or for
    /// MXFP8 rounded down to its power of two (0 and subnormal amax to 0),
    /// which gives the same scale and bytes (they depend on its exponent
    /// alone) and crosses the wire as one byte.
    pub fn wire_amax(self, amax: f32) -> f32 {
        match self {
            Scheme::Mxfp8 => f32::from_bits(amax.to_bits() & 0x7f80_0000),
            _ => amax,
        }
    }

    /// The dtype of the scales param: f32 `scale_inv`, or MXFP8's E8M0
    /// bytes (registered as u8).
    pub fn scale_dtype(self) -> DType {
        match self {
            Scheme::Mxfp8 => DType::U8,
            _ => DType::F32,
        }
    }

    /// What a block's elements are multiplied by before the cast, from its
    /// agreed amax. The one place the rule is written: the CPU loops and
    /// the GPU kernels (`device.rs`) both take it from here.
    pub(crate) fn factor(self, amax: f32) -> f32 {
        match self {
            Scheme::Mxfp8 => f32::from_bits(((127 - mx_exponent(amax)) as u32) << 23),
            _ => factor_of(amax),
        }
    }

    /// [`Scheme::factor`] and [`Scheme::scale`] of every block of agreed
    /// `amax`, into `factor` and `scale`: one loop per scheme (vectorized;
    /// MXFP8 has a block per 32 elements, where a call per block cost as
    /// much as the block's cast).
    pub(crate) fn factors_and_scales(self, amax: &[f32], factor: &mut [f32], scale: &mut [f32]) {
        let each = factor.iter_mut().zip(scale.iter_mut()).zip(amax);
        match self {
            Scheme::Mxfp8 => {
                for ((f, s), &a) in each {
                    (*f, *s) = (Scheme::Mxfp8.factor(a), Scheme::Mxfp8.scale(a));
                }
            }
            _ => {
                for ((f, s), &a) in each {
                    (*f, *s) = (factor_of(a), scale_inv(a));
                }
            }
        }
    }

    /// A block's scale as an f32 from its agreed amax: the dequantizing
    /// multiplier (`scale_inv`, or MXFP8's `2^e`).
    pub fn scale(self, amax: f32) -> f32 {
        match self {
            Scheme::Mxfp8 => match mx_exponent(amax) {
                -127 => f32::from_bits(1 << 22),
                e => f32::from_bits(((e + 127) as u32) << 23),
            },
            _ => scale_inv(amax),
        }
    }

    /// The scales param's bytes for blocks of agreed `amax`: each scale
    /// little-endian f32, or MXFP8's E8M0 byte (`e + 127`). `out` holds
    /// `amax.len()` scales of [`Scheme::scale_dtype`].
    pub fn write_scales(self, amax: &[f32], out: &mut [u8]) {
        match self {
            Scheme::Mxfp8 => {
                for (o, &a) in out.iter_mut().zip(amax) {
                    *o = (mx_exponent(a) + 127) as u8;
                }
            }
            _ => {
                for (o, &a) in out.chunks_exact_mut(4).zip(amax) {
                    o.copy_from_slice(&scale_inv(a).to_le_bytes());
                }
            }
        }
    }
}

/// An MXFP8 block's exponent from its amax: the amax's f32 exponent less
/// E4M3's largest, clamped to what E8M0 holds (0 and subnormal amax have
/// exponent field 0: -127).
fn mx_exponent(amax: f32) -> i32 {
    let biased = ((amax.to_bits() >> 23) & 0xff) as i32;
    (biased - 127 - E4M3_EMAX).clamp(-127, 127)
}

/// The factor of 128x128 blocks and of one scale per tensor: `448 /
/// amax` as PyTorch runs it (`amax.reciprocal() * 448`: two roundings).
fn factor_of(amax: f32) -> f32 {
    (1.0 / amax.max(AMAX_FLOOR)) * e4m3::MAX
}

/// A block's `scale_inv` from its agreed amax (128x128 blocks and one
/// scale per tensor).
fn scale_inv(amax: f32) -> f32 {
    amax.max(AMAX_FLOOR) / e4m3::MAX
}
