//! Boxes in a tensor's index space: an offset and a length per dimension.
//!
//! A shard (what a source holds) and a piece (what part of a global tensor
//! a param holds) are both boxes of a global tensor; the plan intersects
//! them. All arithmetic is checked: a box announced by a peer or a caller
//! whose end overflows is "not inside", never a wrapped number.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorBox {
    pub offset: Vec<u64>,
    pub len: Vec<u64>,
}

impl TensorBox {
    /// The box covering all of a tensor of `shape`.
    pub fn whole(shape: &[u64]) -> TensorBox {
        TensorBox {
            offset: vec![0; shape.len()],
            len: shape.to_vec(),
        }
    }

    pub fn ndim(&self) -> usize {
        self.len.len()
    }

    /// Elements in the box; None when the product overflows.
    pub fn volume(&self) -> Option<u64> {
        self.len.iter().try_fold(1u64, |v, &n| v.checked_mul(n))
    }

    /// The box lies inside a tensor of `shape` (same rank, every end within).
    pub fn inside(&self, shape: &[u64]) -> bool {
        self.offset.len() == shape.len()
            && self.len.len() == shape.len()
            && self
                .offset
                .iter()
                .zip(&self.len)
                .zip(shape)
                .all(|((&o, &n), &s)| o.checked_add(n).is_some_and(|end| end <= s))
    }

    /// The common part of two boxes of one rank; None when it is empty.
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        let mut out = TensorBox {
            offset: Vec::with_capacity(self.ndim()),
            len: Vec::with_capacity(self.ndim()),
        };
        for d in 0..self.ndim() {
            let start = self.offset[d].max(other.offset[d]);
            let end = (self.offset[d] + self.len[d]).min(other.offset[d] + other.len[d]);
            if end <= start {
                return None;
            }
            out.offset.push(start);
            out.len.push(end - start);
        }
        Some(out)
    }

    /// This box with `extra` leading dimensions of length 1 (offset 0), so
    /// boxes of different ranks line up at their last dimension.
    pub fn padded(&self, extra: usize) -> TensorBox {
        let mut b = TensorBox {
            offset: vec![0; extra],
            len: vec![1; extra],
        };
        b.offset.extend_from_slice(&self.offset);
        b.len.extend_from_slice(&self.len);
        b
    }
}

/// `[0:4, 2:6]`: per dimension, the half-open index range.
impl fmt::Display for TensorBox {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            let end = self.offset[d].saturating_add(self.len[d]);
            write!(f, "{}:{end}", self.offset[d])?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(offset: &[u64], len: &[u64]) -> TensorBox {
        TensorBox {
            offset: offset.to_vec(),
            len: len.to_vec(),
        }
    }

    #[test]
    fn intersection_inside_and_text() {
        let x = b(&[0, 2], &[4, 4]);
        let y = b(&[2, 0], &[4, 4]);
        assert_eq!(x.intersect(&y), Some(b(&[2, 2], &[2, 2])));
        assert_eq!(x.intersect(&b(&[4, 0], &[1, 8])), None);
        assert!(x.inside(&[4, 6]) && !x.inside(&[4, 5]) && !x.inside(&[4]));
        assert!(!b(&[u64::MAX], &[2]).inside(&[u64::MAX]));
        assert_eq!(x.to_string(), "[0:4, 2:6]");
        assert_eq!(x.volume(), Some(16));
        assert_eq!(b(&[0, 0], &[u64::MAX, 2]).volume(), None);
        assert_eq!(x.padded(1), b(&[0, 0, 2], &[1, 4, 4]));
    }
}
