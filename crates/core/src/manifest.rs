//! What a source offers: every tensor's name, dtype, shape, byte size and
//! (when known) checksum, plus the version it names. Every source produces
//! one before any byte moves; the plan is made from it.

use crate::result::{Error, Result};
use crate::tensor::{shape_text, DType, MAX_NDIM};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    /// xxh3-128 of the tensor's bytes, when the source has one.
    pub checksum: Option<u128>,
    /// Where these bytes sit in the global tensor `name` when the source
    /// holds only a shard of it; None: the whole tensor (`shape` is the
    /// global shape).
    pub placement: Option<Placement>,
}

/// A shard's place in its global tensor: the global shape, and the offset
/// of the shard's box in it per dimension (the box's lengths are the
/// shard's own `shape`). The shard's bytes are its box, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub global_shape: Vec<u64>,
    pub offset: Vec<u64>,
}

impl TensorMeta {
    /// The global tensor's shape (the shard's own shape when it is whole).
    pub fn global_shape(&self) -> &[u64] {
        self.placement
            .as_ref()
            .map_or(&self.shape, |p| &p.global_shape)
    }

    /// The shard's offset in the global tensor (all zeros when whole).
    pub fn offset(&self) -> Vec<u64> {
        self.placement
            .as_ref()
            .map_or_else(|| vec![0; self.shape.len()], |p| p.offset.clone())
    }
}

#[cfg(test)]
impl TensorMeta {
    /// A whole tensor without a checksum, for tests.
    pub(crate) fn whole(name: &str, dtype: crate::tensor::DType, shape: &[u64]) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            nbytes: crate::tensor::byte_size(name, dtype, shape).unwrap(),
            checksum: None,
            placement: None,
        }
    }
}

impl Placement {
    /// Check that a shard of box lengths `shape` fits this placement: as
    /// many dimensions as the global shape (at most `MAX_NDIM`), and per
    /// dimension `offset + length <= global` without overflow. The error
    /// names `tensor` (the global tensor) and says which dimension is wrong;
    /// its code is INVALID_ARGUMENT (callers that read the placement from a
    /// peer or a file turn it into theirs).
    pub fn check(&self, tensor: &str, shape: &[u64]) -> Result<()> {
        let bad = |why: String| {
            Error::invalid_argument(format!("tensor '{tensor}': shard placement: {why}"))
        };
        let (g, o) = (&self.global_shape, &self.offset);
        if g.len() > MAX_NDIM || o.len() != g.len() || shape.len() != g.len() {
            return Err(bad(format!(
                "global shape {} and offset {} must both have the shard's {} dimensions \
                 (at most {MAX_NDIM})",
                shape_text(g),
                shape_text(o),
                shape.len()
            )));
        }
        for (d, ((&off, &len), &glob)) in o.iter().zip(shape).zip(g).enumerate() {
            if off.checked_add(len).is_none_or(|end| end > glob) {
                return Err(bad(format!(
                    "dimension {d}: offset {off} + length {len} runs past the global {glob} \
                     (shard {} at {} in {})",
                    shape_text(shape),
                    shape_text(o),
                    shape_text(g)
                )));
            }
        }
        Ok(())
    }

    /// Whether the box covers the whole global tensor (a whole tensor
    /// written as a shard).
    pub fn is_whole(&self, shape: &[u64]) -> bool {
        self.offset.iter().all(|&o| o == 0) && shape == self.global_shape.as_slice()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifest {
    pub tensors: Tensors,
    /// The version the source names, if any (snapshot: `version.yaml`).
    pub version: Option<String>,
}

impl Manifest {
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }
}

/// A manifest's tensors, shared rather than copied: a plan's entries
/// refer to them ([`SharedMeta`]), so planning 80,000 shards copies no
/// name, shape or placement. Reads are a `Vec`'s; a write to a list that
/// something else still shares copies it first (so a plan never sees a
/// manifest change under it).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tensors(Arc<Vec<TensorMeta>>);

impl Tensors {
    /// Both are the same list (not merely equal ones).
    pub fn same(&self, other: &Tensors) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Deref for Tensors {
    type Target = Vec<TensorMeta>;

    fn deref(&self) -> &Vec<TensorMeta> {
        &self.0
    }
}

impl DerefMut for Tensors {
    fn deref_mut(&mut self) -> &mut Vec<TensorMeta> {
        Arc::make_mut(&mut self.0)
    }
}

impl From<Vec<TensorMeta>> for Tensors {
    fn from(v: Vec<TensorMeta>) -> Tensors {
        Tensors(Arc::new(v))
    }
}

impl FromIterator<TensorMeta> for Tensors {
    fn from_iter<I: IntoIterator<Item = TensorMeta>>(iter: I) -> Tensors {
        Tensors::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl<'a> IntoIterator for &'a Tensors {
    type Item = &'a TensorMeta;
    type IntoIter = std::slice::Iter<'a, TensorMeta>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl fmt::Debug for Tensors {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Tensor `index` of a manifest's [`Tensors`], sharing the list: cloning
/// or dropping one is a reference count, and it reads as the
/// [`TensorMeta`] itself (`meta.name`, `meta.checksum`).
#[derive(Clone)]
pub struct SharedMeta {
    tensors: Tensors,
    index: usize,
}

impl SharedMeta {
    /// Tensor `index` of `tensors`. Panics when `index` is out of range
    /// (a plan only names tensors it found in the list).
    pub fn new(tensors: &Tensors, index: usize) -> SharedMeta {
        assert!(index < tensors.len(), "tensor {index} of {}", tensors.len());
        SharedMeta {
            tensors: tensors.clone(),
            index,
        }
    }

    /// This refers into `tensors` itself (the same list, not an equal one).
    pub fn is_in(&self, tensors: &Tensors) -> bool {
        self.tensors.same(tensors)
    }
}

impl Deref for SharedMeta {
    type Target = TensorMeta;

    fn deref(&self) -> &TensorMeta {
        &self.tensors[self.index]
    }
}

/// A tensor on its own (a list of one).
impl From<TensorMeta> for SharedMeta {
    fn from(meta: TensorMeta) -> SharedMeta {
        SharedMeta {
            tensors: Tensors::from(vec![meta]),
            index: 0,
        }
    }
}

impl fmt::Debug for SharedMeta {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        (**self).fmt(f)
    }
}

impl PartialEq for SharedMeta {
    fn eq(&self, other: &SharedMeta) -> bool {
        **self == **other
    }
}

impl Eq for SharedMeta {}

/// Checksum as written in files and messages: 32 lower-case hex digits.
pub fn checksum_hex(c: u128) -> String {
    format!("{c:032x}")
}

pub fn parse_checksum_hex(s: &str) -> Option<u128> {
    if s.len() != 32 {
        return None;
    }
    u128::from_str_radix(s, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(global: &[u64], offset: &[u64]) -> Placement {
        Placement {
            global_shape: global.to_vec(),
            offset: offset.to_vec(),
        }
    }

    fn meta(name: &str, checksum: Option<u128>) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![2],
            nbytes: 8,
            checksum,
            placement: None,
        }
    }

    #[test]
    fn shared_metadata_reads_its_tensor_and_a_write_copies_the_list() {
        let mut m = Manifest {
            tensors: vec![meta("a", Some(1)), meta("b", Some(2))].into(),
            version: None,
        };
        let b = SharedMeta::new(&m.tensors, 1);
        assert_eq!((b.name.as_str(), b.checksum), ("b", Some(2)));
        assert!(b.is_in(&m.tensors));
        // The plan's reference keeps what it saw; the manifest gets a copy.
        m.tensors[1].checksum = Some(3);
        assert_eq!(b.checksum, Some(2));
        assert_eq!(m.tensors[1].checksum, Some(3));
        assert!(!b.is_in(&m.tensors));
        // An equal list is not the same list.
        let copy = m.clone();
        assert!(copy.tensors.same(&m.tensors));
        let other: Tensors = m.tensors.iter().cloned().collect();
        assert!(other == m.tensors && !other.same(&m.tensors));
        // A tensor on its own, and its Debug being the tensor's.
        let alone = SharedMeta::from(meta("c", None));
        assert_eq!(*alone, meta("c", None));
        assert_eq!(format!("{alone:?}"), format!("{:?}", meta("c", None)));
    }

    #[test]
    fn a_placement_is_checked_against_its_box() {
        assert!(at(&[8, 4], &[4, 0]).check("w", &[4, 4]).is_ok());
        assert!(at(&[8, 4], &[8, 0]).check("w", &[0, 4]).is_ok(), "empty");
        let cases: [(Placement, &[u64], &str); 5] = [
            (
                at(&[8, 4], &[6, 0]),
                &[4, 4],
                "dimension 0: offset 6 + length 4",
            ),
            (at(&[8, 4], &[0, 1]), &[8, 4], "dimension 1"),
            (at(&[8], &[0]), &[4, 4], "2 dimensions"),
            (at(&[8, 4], &[0]), &[4, 4], "2 dimensions"),
            (at(&[u64::MAX, 4], &[u64::MAX, 0]), &[2, 4], "runs past"),
        ];
        for (p, shape, want) in cases {
            let e = p.check("layers.0.w", shape).unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_INVALID_ARGUMENT);
            assert!(e.message.contains("'layers.0.w'"), "{e}");
            assert!(e.message.contains(want), "{want}: {e}");
        }
        let nine = at(&[1; 9], &[0; 9]);
        assert!(nine
            .check("w", &[1; 9])
            .unwrap_err()
            .message
            .contains("at most 8"));
        assert!(at(&[2, 3], &[0, 0]).is_whole(&[2, 3]));
        assert!(!at(&[2, 3], &[0, 0]).is_whole(&[1, 3]));
    }
}
