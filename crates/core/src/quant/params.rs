//! Quantized params: an engine declares that an F8_E4M3 param holds a
//! global bf16/f16/f32 tensor (or pieces of one) quantized, with its f32
//! `scale_inv` in another param. The rules here are the engine's alone
//! (dtypes, shapes, where pieces cut blocks inside the param), checked when
//! it declares; what needs the sources (the global tensor's dtype and
//! shape) is the plan's (`plan::cover`).
//!
//! Blocks are over the last two dimensions; leading dimensions are a batch
//! (stacked experts `[E, M, N]` have scales `[E, ceil(M/128),
//! ceil(N/128)]`). A piece lines up with the global tensor's block grid
//! when its box starts at a multiple of 128 in the tensor and in the param
//! on both of the last two dimensions, and a length that is not a multiple
//! of 128 ends at the param's edge (and, checked by the plan, at the global
//! tensor's): then the param's blocks are exactly the global tensor's, and
//! quantizing the param as a whole gives the global tensor's FP8 bytes and
//! scales.
//!
//! MXFP8's blocks are 32 elements along the last dimension: its scales are
//! `[..., ceil(N/32)]` bytes (E8M0, registered as u8), and a piece lines
//! up when it starts at a multiple of 32 of the last dimension (in the
//! tensor and in the param) and ends at one or at the param's edge; other
//! dimensions may be cut anywhere.

use super::{Scheme, BLOCK, MX_BLOCK};
use crate::pieces::Piece;
use crate::result::{Error, Result};
use crate::tensor::{shape_text, DType};

/// What a param is to quantization.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantRole {
    /// Written with its source's bytes as they are.
    #[default]
    Plain,
    /// Holds its pieces quantized with `scheme`; `scales` is the param
    /// number of its `scale_inv`.
    Weight { scheme: Scheme, scales: usize },
    /// The `scale_inv` of param `weight`: written by quantizing, read from
    /// no source.
    Scales { weight: usize },
}

/// A param as the declaration checks it.
#[derive(Clone, Copy, Debug)]
pub struct Declared<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub pieces: &'a [Piece],
    /// Registered without pieces.
    pub whole: bool,
    /// The GPU holding it (None: host memory).
    pub device: Option<i32>,
    pub role: QuantRole,
}

/// The scales' shape of a `shape` param quantized with `scheme`.
pub fn scales_shape(scheme: Scheme, shape: &[u64]) -> Vec<u64> {
    match scheme {
        Scheme::Fp8Tensor => vec![1],
        Scheme::Fp8Block128 => {
            let n = shape.len();
            let mut s = shape[..n.saturating_sub(2)].to_vec();
            s.extend(
                shape[n.saturating_sub(2)..]
                    .iter()
                    .map(|d| d.div_ceil(BLOCK as u64)),
            );
            s
        }
        Scheme::Mxfp8 => {
            let n = shape.len();
            let mut s = shape[..n.saturating_sub(1)].to_vec();
            s.extend(
                shape[n.saturating_sub(1)..]
                    .iter()
                    .map(|d| d.div_ceil(MX_BLOCK as u64)),
            );
            s
        }
    }
}

/// Check that `weight` may hold its pieces quantized with `scheme` and
/// `scales` its scale_inv. Err (`WM_ERR_INVALID_ARGUMENT`) names the param
/// and what is wrong. Both live in the same place, host memory or one GPU:
/// the quantizer writes them together (on a GPU, with its kernels).
pub fn check_declaration(weight: &Declared, scales: &Declared, scheme: Scheme) -> Result<()> {
    let bad = |p: &Declared, why: String| {
        Err(Error::invalid_argument(format!(
            "param '{}': {why}",
            p.name
        )))
    };
    for p in [weight, scales] {
        if p.role != QuantRole::Plain {
            return bad(
                p,
                "is already quantized or the scales of a quantized param".into(),
            );
        }
    }
    if weight.device != scales.device {
        let place = |d: Option<i32>| d.map_or("host memory".to_string(), |g| format!("GPU {g}"));
        return bad(
            weight,
            format!(
                "is in {} and its scales '{}' in {}: register both in the same place",
                place(weight.device),
                scales.name,
                place(scales.device)
            ),
        );
    }
    if weight.name == scales.name {
        return bad(weight, "cannot hold its own scales".into());
    }
    if weight.shape.contains(&0) {
        return bad(
            weight,
            format!(
                "has no elements ({}): nothing to quantize",
                shape_text(weight.shape)
            ),
        );
    }
    if weight.dtype != DType::F8E4m3 {
        return bad(
            weight,
            format!(
                "{} quantization writes {} params, not {}",
                scheme.name(),
                DType::F8E4m3,
                weight.dtype
            ),
        );
    }
    check_weight(weight.name, weight.shape, weight.pieces, scheme)?;
    check_scales(weight, scales, scheme)
}

/// `scales` is of the scheme's scale dtype (f32, or u8 for MXFP8) and its
/// scales shape for `weight` (one element for one scale per tensor), and
/// registered without pieces.
fn check_scales(weight: &Declared, scales: &Declared, scheme: Scheme) -> Result<()> {
    let bad = |p: &Declared, why: String| {
        Err(Error::invalid_argument(format!(
            "param '{}': {why}",
            p.name
        )))
    };
    let want = scales_shape(scheme, weight.shape);
    let one = scheme == Scheme::Fp8Tensor && scales.shape.iter().product::<u64>() == 1;
    if scales.dtype != scheme.scale_dtype() || !(one || scales.shape == want.as_slice()) {
        return bad(
            scales,
            format!(
                "the scales of '{}' ({} {}) must be {} {}, not {} {}",
                weight.name,
                scheme.name(),
                shape_text(weight.shape),
                scheme.scale_dtype(),
                shape_text(&want),
                scales.dtype,
                shape_text(scales.shape)
            ),
        );
    }
    if !scales.whole {
        return bad(
            scales,
            "scales are made by quantizing, not read from a source: register them without pieces"
                .into(),
        );
    }
    Ok(())
}

/// Check that param `name` of `shape` holding `pieces` may hold them
/// quantized with `scheme` (`WM_ERR_INVALID_ARGUMENT` naming the param,
/// the piece, the dimension and the offset): what a declaration checks of
/// the weight, also for a layout's params (`wm plan`).
pub fn check_weight(name: &str, shape: &[u64], pieces: &[Piece], scheme: Scheme) -> Result<()> {
    if scheme == Scheme::Mxfp8 && shape.is_empty() {
        return Err(Error::invalid_argument(format!(
            "param '{name}': {} quantization needs at least 1 dimension (blocks along the last)",
            scheme.name()
        )));
    }
    if scheme == Scheme::Fp8Block128 && shape.len() < 2 {
        return Err(Error::invalid_argument(format!(
            "param '{name}': {} quantization needs at least 2 dimensions (blocks over the last two), not {}",
            scheme.name(),
            shape_text(shape)
        )));
    }
    match scheme {
        Scheme::Fp8Block128 | Scheme::Mxfp8 => (pieces.iter().enumerate())
            .try_for_each(|(k, p)| check_piece_blocks((name, shape), k, p, scheme)),
        Scheme::Fp8Tensor if pieces.len() == 1 && pieces[0].global.offset.iter().all(|&o| o == 0) => {
            Ok(())
        }
        Scheme::Fp8Tensor => Err(Error::invalid_argument(format!(
            "param '{name}': one scale per tensor needs the whole global tensor in the param (one piece, at its start)"
        ))),
    }
}

/// Piece `k` of param `name` (of `shape`) starts and ends on the block
/// grid on the dimensions `scheme` blocks (the last two for 128x128
/// blocks, the last for MXFP8; a partial block only at the param's edge).
fn check_piece_blocks(
    (name, shape): (&str, &[u64]),
    k: usize,
    piece: &Piece,
    scheme: Scheme,
) -> Result<()> {
    let (nd, gd) = (shape.len(), piece.global.ndim());
    let (what, dims, b) = match scheme {
        Scheme::Mxfp8 => ("an MXFP8 block of 32", 1, MX_BLOCK as u64),
        _ => ("a 128x128 block", 2, BLOCK as u64),
    };
    let fail = |why: String| {
        Err(Error::invalid_argument(format!(
            "param '{}': piece {k} ('{}' {}) cuts {what}: {why}",
            name, piece.tensor, piece.global
        )))
    };
    if gd < dims {
        return fail(format!(
            "its global tensor must have at least {dims} dimensions"
        ));
    }
    for back in 1..=dims {
        let (d, g) = (nd - back, gd - back);
        // Offsets of the tensor are named by the tensor's dimension, those
        // of the param by the param's (stacked experts: one more).
        let (start, len, at) = (piece.global.offset[g], piece.global.len[g], piece.at[d]);
        if start % b != 0 {
            return fail(format!(
                "dimension {g} starts at offset {start} of the tensor, not a multiple of {b}"
            ));
        }
        if at % b != 0 {
            return fail(format!(
                "dimension {d} starts at offset {at} of the param, not a multiple of {b}"
            ));
        }
        if len % b != 0 && at + len != shape[d] {
            return fail(format!(
                "dimension {d} ends at offset {} of the param, inside a block (a partial block must end the param)",
                at + len
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared<'a>(
        name: &'a str,
        dtype: DType,
        shape: &'a [u64],
        pieces: &'a [Piece],
    ) -> Declared<'a> {
        Declared {
            name,
            dtype,
            shape,
            pieces,
            whole: true,
            device: None,
            role: QuantRole::Plain,
        }
    }

    /// MXFP8: u8 scales of `[..., ceil(N/32)]`, any rows, pieces on the
    /// 32-column grid.
    #[test]
    fn mxfp8_declarations_take_u8_scales_and_host_params() {
        let pieces = [Piece::whole("t", &[3, 64, 100])];
        let w = declared("w", DType::F8E4m3, &[3, 64, 100], &pieces);
        let s = declared("s", DType::U8, &[3, 64, 4], &[]);
        check_declaration(&w, &s, Scheme::Mxfp8).unwrap();
        assert_eq!(scales_shape(Scheme::Mxfp8, &[3, 64, 100]), vec![3, 64, 4]);
        assert_eq!(scales_shape(Scheme::Mxfp8, &[33]), vec![2]);
        let f = declared("f", DType::F32, &[3, 64, 4], &[]);
        let e = check_declaration(&w, &f, Scheme::Mxfp8).unwrap_err();
        assert!(e.message.contains("must be u8 [3, 64, 4], not f32"), "{e}");
        let mut cut = Piece::whole("t", &[64, 100]);
        (cut.global.offset[0], cut.global.offset[1]) = (5, 48);
        (cut.global.len[0], cut.global.len[1]) = (59, 52);
        let e = check_weight("c", &[59, 52], &[cut], Scheme::Mxfp8).unwrap_err();
        assert!(
            e.message
                .contains("cuts an MXFP8 block of 32: dimension 1 starts at offset 48"),
            "{e}"
        );
    }
}
