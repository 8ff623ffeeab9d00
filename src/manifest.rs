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
