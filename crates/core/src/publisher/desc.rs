//! [`TensorDesc`]: one tensor (or shard) a publisher serves, host or GPU.

use crate::manifest::Placement;
use crate::tensor::DType;

/// One tensor (or shard) for [`Publisher::add`](super::Publisher::add).
#[derive(Clone, Debug)]
pub struct TensorDesc<'a> {
    pub name: &'a str,
    pub dtype: DType,
    /// The tensor's shape (a shard: its own box's).
    pub shape: &'a [u64],
    /// The host address of its bytes, or with `device` the device address.
    pub data: u64,
    pub len: usize,
    /// None: host memory; Some(ordinal): memory of that GPU.
    pub device: Option<i32>,
    /// The engine rank it is for; None: every rank.
    pub rank: Option<u32>,
    /// None: a whole tensor; Some: a shard of a global tensor, placed there.
    pub placement: Option<Placement>,
}

/// Builders for the common cases, chained from [`TensorDesc::host`] or
/// [`TensorDesc::device`]:
///
/// ```ignore
/// // a whole host tensor, for every rank
/// TensorDesc::host("w", DType::F32, &[4], ptr, 16)
/// // for rank 1 only, a shard of a global [8] tensor at offset [4]
/// TensorDesc::host("w", DType::F32, &[4], ptr, 16).for_rank(1).shard_of(placement)
/// // 16 bytes of GPU 0's memory at device address `dptr`
/// TensorDesc::device("w", DType::F32, &[4], dptr, 16, 0)
/// ```
///
/// A descriptor only names memory, it owns nothing: the caller keeps the
/// memory valid and unchanged as [`Publisher::add`](super::Publisher::add) says (host memory while
/// sessions run, GPU memory until the next `publish` returns).
impl<'a> TensorDesc<'a> {
    /// Error `e` of descriptor `k` of the `n` added together
    /// ([`Publisher::add_all`](super::Publisher::add_all)): named by its
    /// place when there are several, and saying that none was added.
    pub fn refused_among(e: crate::result::Error, k: usize, n: usize) -> crate::result::Error {
        e.among((k, n), ("tensor", "added"))
    }

    /// A whole tensor in host memory, `len` bytes at `data`, for every
    /// rank. The memory stays the caller's: see [`Publisher::add`](super::Publisher::add).
    pub fn host(
        name: &'a str,
        dtype: DType,
        shape: &'a [u64],
        data: *const u8,
        len: usize,
    ) -> TensorDesc<'a> {
        TensorDesc {
            name,
            dtype,
            shape,
            data: data as u64,
            len,
            device: None,
            rank: None,
            placement: None,
        }
    }

    /// A whole tensor in the memory of GPU `ordinal`: `len` bytes at device
    /// address `ptr`, for every rank. The memory stays the caller's, and
    /// must stay valid until the next [`Publisher::publish`] returns (which
    /// copies it).
    pub fn device(
        name: &'a str,
        dtype: DType,
        shape: &'a [u64],
        ptr: u64,
        len: usize,
        ordinal: i32,
    ) -> TensorDesc<'a> {
        TensorDesc {
            data: ptr,
            device: Some(ordinal),
            ..TensorDesc::host(name, dtype, shape, std::ptr::null(), len)
        }
    }

    /// For engine rank `rank` only (a `u32`), or with `None` every rank.
    pub fn for_rank(self, rank: impl Into<Option<u32>>) -> TensorDesc<'a> {
        TensorDesc {
            rank: rank.into(),
            ..self
        }
    }

    /// A shard of a global tensor: this descriptor's shape is the shard's
    /// own box, placed at `placement.offset` in `placement.global_shape`.
    pub fn shard_of(self, placement: Placement) -> TensorDesc<'a> {
        TensorDesc {
            placement: Some(placement),
            ..self
        }
    }
}
