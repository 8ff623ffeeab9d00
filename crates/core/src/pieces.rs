//! A param as pieces of global tensors (the engine's layout).
//!
//! A piece is a box of a named global tensor placed inside a param: the
//! whole tensor, a narrow along one dimension (a tensor-parallel split),
//! one of several tensors stacked into one param (fused QKV, gate_up), a
//! range of experts of a stacked expert tensor, or one expert of several
//! stacked into one param. The piece's box and the param line up at their
//! last dimension; a dimension only one side has counts as length 1 on the
//! other, so a `[out, in]` expert tensor stacks into a `[experts, out, in]`
//! param at `[e, 0, 0]`.
//!
//! Registration checks what the engine alone decides: every piece fits in
//! its param and the pieces cover every element of the param exactly once.
//! Whether a piece lies inside its global tensor is known only from the
//! sources, so the plan checks that.

use crate::result::{Error, Result};
use crate::tensor::{check_name, shape_text, MAX_NDIM};
use crate::tensor_box::TensorBox;

/// The most pieces one param may have (checked before any is read from a
/// caller): a bound the engine's own registration checks in `O(n log n)`.
pub const MAX_PIECES_PER_PARAM: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The global tensor's name.
    pub tensor: String,
    /// The box of the global tensor this piece holds.
    pub global: TensorBox,
    /// Where the box starts in the param, one entry per param dimension.
    pub at: Vec<u64>,
}

/// A piece lined up with its param: both in `ndim` dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlignedPiece {
    /// The piece's box in global coordinates, padded.
    pub global: TensorBox,
    /// The same box in param coordinates.
    pub in_param: TensorBox,
    /// The param's shape, padded.
    pub param_shape: Vec<u64>,
}

impl Piece {
    /// The whole of global tensor `tensor` of `shape`, as a param of that shape.
    pub fn whole(tensor: &str, shape: &[u64]) -> Piece {
        Piece {
            tensor: tensor.to_string(),
            global: TensorBox::whole(shape),
            at: vec![0; shape.len()],
        }
    }

    /// Global tensor `tensor` of `shape` narrowed to `[start, start+len)`
    /// along `dim`, at the start of the param.
    pub fn narrow(tensor: &str, shape: &[u64], dim: usize, start: u64, len: u64) -> Piece {
        let mut p = Piece::whole(tensor, shape);
        if let (Some(o), Some(n)) = (p.global.offset.get_mut(dim), p.global.len.get_mut(dim)) {
            (*o, *n) = (start, len);
        }
        p
    }

    /// Both boxes in as many dimensions as the larger of the piece and the
    /// param (`param_shape`), lined up at the last.
    pub fn aligned(&self, param_shape: &[u64]) -> AlignedPiece {
        let ndim = self.global.ndim().max(param_shape.len());
        let global = self.global.padded(ndim - self.global.ndim());
        let extra = ndim - param_shape.len();
        let mut at = vec![0; extra];
        at.extend_from_slice(&self.at);
        let mut shape = vec![1; extra];
        shape.extend_from_slice(param_shape);
        AlignedPiece {
            in_param: TensorBox {
                offset: at,
                len: global.len.clone(),
            },
            global,
            param_shape: shape,
        }
    }
}

/// The pieces of param `name` (of `shape`) fit in it and cover each of its
/// elements exactly once.
pub fn check_pieces(name: &str, shape: &[u64], pieces: &[Piece]) -> Result<()> {
    let bad = |i: usize, why: String| {
        Error::invalid_argument(format!("param '{name}': piece {i}: {why}"))
    };
    if pieces.len() > MAX_PIECES_PER_PARAM {
        return Err(Error::invalid_argument(format!(
            "param '{name}': {} pieces, more than the {MAX_PIECES_PER_PARAM} one param may have",
            pieces.len()
        )));
    }
    let mut placed = Vec::with_capacity(pieces.len());
    let mut total = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        check_name("tensor", &p.tensor).map_err(|e| bad(i, e.message))?;
        if p.global.ndim() > MAX_NDIM || p.global.offset.len() != p.global.ndim() {
            return Err(bad(
                i,
                format!("a box needs one offset and one length per dimension, at most {MAX_NDIM}"),
            ));
        }
        if p.at.len() != shape.len() {
            return Err(bad(
                i,
                format!(
                    "its place in the param has {} dimensions, the param {}",
                    p.at.len(),
                    shape.len()
                ),
            ));
        }
        // The box's end in its global tensor must be a number: a tensor's
        // sizes are u64, so an end past that names no element of any.
        let wraps =
            (p.global.offset.iter().zip(&p.global.len)).any(|(o, l)| o.checked_add(*l).is_none());
        if wraps {
            return Err(bad(
                i,
                format!(
                    "box {} of '{}' ends past 2^64 - 1 in some dimension",
                    p.global, p.tensor
                ),
            ));
        }
        let a = p.aligned(shape);
        if !a.in_param.inside(&a.param_shape) {
            return Err(bad(
                i,
                format!(
                    "box {} of '{}' placed at {} does not fit in the param's {}",
                    p.global,
                    p.tensor,
                    shape_text(&p.at),
                    shape_text(shape)
                ),
            ));
        }
        total = a
            .in_param
            .volume()
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| bad(i, "its size overflows".into()))?;
        placed.push(a.in_param);
    }
    check_disjoint(name, &placed)?;
    check_reads_once(name, pieces)?;
    let need = TensorBox::whole(shape).volume().unwrap_or(u64::MAX);
    if total != need {
        return Err(Error::invalid_argument(format!(
            "param '{name}': its pieces hold {total} of its {need} elements (every element must be in exactly one piece)"
        )));
    }
    Ok(())
}

/// No two pieces of param `name` share an element (boxes in param
/// coordinates, all of one rank): a sweep, `O(n log n)` in the pieces.
fn check_disjoint(name: &str, placed: &[TensorBox]) -> Result<()> {
    let found = crate::box_sweep::find_overlap(placed.len(), |i| {
        (&placed[i].offset[..], &placed[i].len[..])
    });
    match found {
        Ok(None) => Ok(()),
        Ok(Some((i, j))) => {
            let common = placed[i].intersect(&placed[j]).map(|c| c.to_string());
            let common = common.unwrap_or_default();
            Err(Error::invalid_argument(format!(
                "param '{name}': pieces {i} and {j} both hold {common} of the param"
            )))
        }
        Err(too) => Err(Error::invalid_argument(format!(
            "param '{name}': its {} pieces vary along three or more dimensions in a way \
             too costly to check for overlaps; register fewer, larger pieces",
            too.boxes
        ))),
    }
}

/// No two pieces of param `name` hold the same element of one global
/// tensor: a param's request for a tensor asks for distinct bytes (a
/// publisher refuses the same bytes asked twice, and a part's checksum
/// covers each byte once), so a copy of those elements is a param of its
/// own. Pieces grouped by tensor (a sort), then a sweep per group: `O(n log
/// n)` in the pieces.
fn check_reads_once(name: &str, pieces: &[Piece]) -> Result<()> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by(|&i, &j| {
        (&pieces[i].tensor, pieces[i].global.ndim(), i).cmp(&(
            &pieces[j].tensor,
            pieces[j].global.ndim(),
            j,
        ))
    });
    // Pieces of one tensor with different ranks are refused when planning.
    for group in order.chunk_by(|&i, &j| {
        pieces[i].tensor == pieces[j].tensor && pieces[i].global.ndim() == pieces[j].global.ndim()
    }) {
        let boxes = |k: usize| {
            let g = &pieces[group[k]].global;
            (&g.offset[..], &g.len[..])
        };
        let (i, j) = match crate::box_sweep::find_overlap(group.len(), boxes) {
            Ok(None) => continue,
            Ok(Some((a, b))) => (group[a].min(group[b]), group[a].max(group[b])),
            Err(too) => {
                return Err(Error::invalid_argument(format!(
                    "param '{name}': its {} pieces of '{}' vary along three or more dimensions \
                     in a way too costly to check; register fewer, larger pieces",
                    too.boxes, pieces[group[0]].tensor
                )))
            }
        };
        let (a, b) = (&pieces[i].global, &pieces[j].global);
        let common = a.intersect(b).map(|c| c.to_string()).unwrap_or_default();
        return Err(Error::invalid_argument(format!(
            "param '{name}': pieces {i} and {j} both hold {common} of tensor '{}' (a param holds \
             each element of a global tensor at most once; register the copy as a param of its own)",
            pieces[i].tensor
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_qkv_and_stacked_experts_cover_their_params() {
        // q [8, 4], k and v [2, 4], stacked along dim 0 into [12, 4].
        let qkv = [
            Piece::whole("q", &[8, 4]),
            Piece {
                at: vec![8, 0],
                ..Piece::whole("k", &[2, 4])
            },
            Piece {
                at: vec![10, 0],
                ..Piece::whole("v", &[2, 4])
            },
        ];
        check_pieces("qkv", &[12, 4], &qkv).unwrap();
        // Experts 2 and 3 of a [4, 3, 5] stacked tensor into [2, 3, 5] ...
        let range = [Piece::narrow("w", &[4, 3, 5], 0, 2, 2)];
        check_pieces("experts", &[2, 3, 5], &range).unwrap();
        // ... and two per-expert [3, 5] tensors into [2, 3, 5].
        let per_expert = [
            Piece::whole("e0", &[3, 5]).placed(&[0, 0, 0]),
            Piece::whole("e1", &[3, 5]).placed(&[1, 0, 0]),
        ];
        check_pieces("experts", &[2, 3, 5], &per_expert).unwrap();
    }

    impl Piece {
        fn placed(mut self, at: &[u64]) -> Piece {
            self.at = at.to_vec();
            self
        }
    }

    #[test]
    fn more_pieces_than_a_param_may_have_are_refused_before_any_is_read() {
        // Empty pieces (nothing allocated each): only the count is read.
        let empty = Piece {
            tensor: String::new(),
            global: TensorBox::whole(&[]),
            at: Vec::new(),
        };
        let pieces = vec![empty; MAX_PIECES_PER_PARAM + 1];
        let e = check_pieces("g", &[4], &pieces).unwrap_err();
        assert!(
            e.message
                .contains("1048577 pieces, more than the 1048576 one param may have"),
            "{e}"
        );
    }

    #[test]
    fn a_box_ending_past_u64_is_refused_at_registration() {
        let p = Piece {
            tensor: "q".into(),
            global: TensorBox {
                offset: vec![u64::MAX - 1, 0],
                len: vec![4, 4],
            },
            at: vec![0, 0],
        };
        let e = check_pieces("w", &[4, 4], &[p]).unwrap_err();
        assert!(
            e.message.contains("piece 0") && e.message.contains("ends past 2^64 - 1"),
            "{e}"
        );
    }

    #[test]
    fn gaps_overlaps_and_misfits_are_named() {
        let e = check_pieces("w", &[4, 4], &[Piece::narrow("w", &[4, 8], 1, 0, 2)]).unwrap_err();
        assert!(
            e.message.contains("pieces hold 8 of its 16 elements"),
            "{e}"
        );
        let two = [
            Piece::narrow("a", &[4, 4], 0, 0, 3),
            Piece::narrow("b", &[4, 4], 0, 0, 3).placed(&[2, 0]),
        ];
        let e = check_pieces("w", &[5, 4], &two).unwrap_err();
        assert!(
            e.message.contains("pieces 0 and 1 both hold [2:3, 0:4]"),
            "{e}"
        );
        let e =
            check_pieces("w", &[4, 4], &[Piece::whole("x", &[4, 4]).placed(&[1, 0])]).unwrap_err();
        assert!(
            e.message
                .contains("piece 0: box [0:4, 0:4] of 'x' placed at [1, 0] does not fit"),
            "{e}"
        );
        let e = check_pieces("w", &[4, 4], &[Piece::whole("x", &[4, 4]).placed(&[0])]).unwrap_err();
        assert!(e.message.contains("1 dimensions, the param 2"), "{e}");
    }

    #[test]
    fn a_param_holds_each_element_of_a_tensor_once() {
        // Rows 2:4 of t twice (a copy stacked under itself).
        let twice = [
            Piece::narrow("t", &[16, 4], 0, 2, 2),
            Piece::narrow("t", &[16, 4], 0, 2, 2).placed(&[2, 0]),
        ];
        let e = check_pieces("p", &[4, 4], &twice).unwrap_err();
        assert!(
            e.message
                .contains("pieces 0 and 1 both hold [2:4, 0:4] of tensor 't'"),
            "{e}"
        );
        // Rows 1:3 then 2:4: they share row 2; a third piece of another
        // tensor between them changes nothing.
        let shared = [
            Piece::narrow("t", &[16, 4], 0, 1, 2),
            Piece::narrow("u", &[16, 4], 0, 1, 2).placed(&[2, 0]),
            Piece::narrow("t", &[16, 4], 0, 2, 2).placed(&[4, 0]),
        ];
        let e = check_pieces("p", &[6, 4], &shared).unwrap_err();
        assert!(
            e.message
                .contains("pieces 0 and 2 both hold [2:3, 0:4] of tensor 't'"),
            "{e}"
        );
        // Distinct rows of one tensor, and the same rows of two tensors.
        let fine = [
            Piece::narrow("t", &[16, 4], 0, 4, 2),
            Piece::narrow("t", &[16, 4], 0, 0, 2).placed(&[2, 0]),
            Piece::narrow("u", &[16, 4], 0, 0, 2).placed(&[4, 0]),
        ];
        check_pieces("p", &[6, 4], &fine).unwrap();
    }
}
