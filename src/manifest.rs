//! What a source offers: every tensor's name, dtype, shape, byte size and
//! (when known) checksum, plus the version it names. Every source produces
//! one before any byte moves; the plan is made from it.

use crate::tensor::DType;

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
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifest {
    pub tensors: Vec<TensorMeta>,
    /// The version the source names, if any (snapshot: `version.yaml`).
    pub version: Option<String>,
}

impl Manifest {
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }
}

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
