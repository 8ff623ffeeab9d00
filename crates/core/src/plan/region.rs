//! Boxes of global tensors as the plan handles them: borrowed from a shard
//! or a piece ([`Span`]), or worked out on the stack ([`Region`]), so that
//! planning allocates nothing per shard, per piece or per common box.
//!
//! Every box here has at most `MAX_NDIM` dimensions: a shard's shape is
//! checked by `byte_size` (in `global.rs`) before a span of it is made, a
//! piece's box by `check_pieces` when it is registered or read.

use crate::manifest::TensorMeta;
use crate::pieces::Piece;
use crate::tensor::MAX_NDIM;
use crate::tensor_box::TensorBox;
use std::fmt;

/// Per-dimension numbers on the stack.
pub(super) type Dims = [u64; MAX_NDIM];

/// The offset of a whole tensor, in as many dimensions as it has.
static ZEROS: Dims = [0; MAX_NDIM];

/// A box borrowed from whoever describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span<'a> {
    pub offset: &'a [u64],
    pub len: &'a [u64],
}

impl<'a> Span<'a> {
    pub fn of_box(b: &'a TensorBox) -> Span<'a> {
        Span {
            offset: &b.offset,
            len: &b.len,
        }
    }

    /// The box shard `t` holds of its global tensor (all of it when it has
    /// no placement). Its shape has at most `MAX_NDIM` dimensions.
    pub fn of_shard(t: &'a TensorMeta) -> Span<'a> {
        let offset = match &t.placement {
            Some(p) => &p.offset,
            None => &ZEROS[..t.shape.len()],
        };
        Span {
            offset,
            len: &t.shape,
        }
    }

    pub fn ndim(&self) -> usize {
        self.len.len()
    }

    /// The common part of two boxes of one rank; None when it is empty.
    pub fn intersect(&self, other: Span) -> Option<Region> {
        let mut out = Region {
            ndim: self.ndim(),
            ..Region::default()
        };
        for d in 0..self.ndim() {
            let start = self.offset[d].max(other.offset[d]);
            let end = (self.offset[d] + self.len[d]).min(other.offset[d] + other.len[d]);
            if end <= start {
                return None;
            }
            (out.offset[d], out.len[d]) = (start, end - start);
        }
        Some(out)
    }

    /// A copy with `extra` leading dimensions of length 1 (offset 0), so
    /// boxes of different ranks line up at their last dimension.
    pub fn padded(&self, extra: usize) -> Region {
        let mut out = Region {
            ndim: extra + self.ndim(),
            ..Region::default()
        };
        // Element by element: a copy of a few numbers is not worth a call
        // to memcpy, and this runs for every common box.
        for d in 0..extra {
            out.len[d] = 1;
        }
        for d in 0..self.ndim() {
            (out.offset[extra + d], out.len[extra + d]) = (self.offset[d], self.len[d]);
        }
        out
    }

    /// An owned copy, for messages.
    pub fn to_box(self) -> TensorBox {
        TensorBox {
            offset: self.offset.to_vec(),
            len: self.len.to_vec(),
        }
    }
}

/// `[0:4, 2:6]`, as a [`TensorBox`] writes itself.
impl fmt::Display for Span<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.to_box().fmt(f)
    }
}

/// A box on the stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Region {
    ndim: usize,
    pub offset: Dims,
    pub len: Dims,
}

impl Region {
    pub fn span(&self) -> Span<'_> {
        Span {
            offset: &self.offset[..self.ndim],
            len: &self.len[..self.ndim],
        }
    }

    pub fn ndim(&self) -> usize {
        self.ndim
    }

    /// Elements in the box; None when the product overflows.
    pub fn volume(&self) -> Option<u64> {
        self.span()
            .len
            .iter()
            .try_fold(1u64, |v, &n| v.checked_mul(n))
    }
}

/// A piece lined up with its param, both in `ndim` dimensions (the larger
/// of the two ranks), lined up at the last: [`Piece::aligned`] on the
/// stack.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lined {
    /// The piece's box in global coordinates, padded.
    pub global: Region,
    /// Where the box starts in the param, padded.
    pub in_param: Dims,
    /// The param's shape, padded.
    pub param_shape: Dims,
}

impl Lined {
    pub fn new(piece: &Piece, param_shape: &[u64]) -> Lined {
        let global = Span::of_box(&piece.global);
        let ndim = global.ndim().max(param_shape.len());
        let extra = ndim - param_shape.len();
        let (mut in_param, mut shape) = ([0; MAX_NDIM], [1; MAX_NDIM]);
        for (d, (&at, &n)) in piece.at.iter().zip(param_shape).enumerate() {
            (in_param[extra + d], shape[extra + d]) = (at, n);
        }
        Lined {
            global: global.padded(ndim - global.ndim()),
            in_param,
            param_shape: shape,
        }
    }

    pub fn ndim(&self) -> usize {
        self.global.ndim()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Placement;
    use crate::tensor::DType;

    fn b(offset: &[u64], len: &[u64]) -> TensorBox {
        TensorBox {
            offset: offset.to_vec(),
            len: len.to_vec(),
        }
    }

    #[test]
    fn spans_intersect_and_pad_as_boxes_do() {
        let (x, y) = (b(&[0, 2], &[4, 4]), b(&[2, 0], &[4, 4]));
        let common = Span::of_box(&x).intersect(Span::of_box(&y)).unwrap();
        assert_eq!(common.span().to_box(), x.intersect(&y).unwrap());
        assert_eq!(common.volume(), Some(4));
        let apart = b(&[4, 0], &[1, 8]);
        assert!(Span::of_box(&x).intersect(Span::of_box(&apart)).is_none());
        let padded = Span::of_box(&x).padded(2);
        assert_eq!(padded.span().to_box(), x.padded(2));
        assert_eq!(Span::of_box(&x).to_string(), x.to_string());
        let scalar = b(&[], &[]);
        let s = Span::of_box(&scalar);
        assert_eq!(s.intersect(s).unwrap().volume(), Some(1));
    }

    #[test]
    fn a_shard_spans_its_placement_or_all_of_its_tensor() {
        let mut t = TensorMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![2, 3],
            nbytes: 24,
            checksum: None,
            placement: None,
        };
        assert_eq!(Span::of_shard(&t).to_box(), TensorBox::whole(&[2, 3]));
        t.placement = Some(Placement {
            global_shape: vec![8, 3],
            offset: vec![4, 0],
        });
        assert_eq!(Span::of_shard(&t).to_box(), b(&[4, 0], &[2, 3]));
    }

    #[test]
    fn a_lined_piece_matches_the_aligned_one() {
        let cases: [(&[u64], &[u64]); 3] = [
            (&[4, 3, 5], &[2, 0, 0]),
            (&[3, 5], &[0, 0]),
            (&[2, 4, 3, 5], &[1, 2, 0, 0]),
        ];
        for (param, at) in cases {
            let p = Piece {
                at: at.to_vec(),
                ..Piece::narrow("e", &[4, 3, 5], 0, 1, 1)
            };
            let (lined, aligned) = (Lined::new(&p, param), p.aligned(param));
            let n = lined.ndim();
            assert_eq!(lined.global.span().to_box(), aligned.global);
            assert_eq!(&lined.in_param[..n], &aligned.in_param.offset[..]);
            assert_eq!(&lined.param_shape[..n], &aligned.param_shape[..]);
        }
    }
}
