//! What a publisher serves: whole tensors and shards of global tensors,
//! from the trainer's host or GPU memory. One growable descriptor
//! (`wm_tensor_desc`) and one call (`wm_publisher_add`); the four calls of
//! positional arguments before them stay one release as deprecated wrappers.

use super::{wm_publisher, PUBLISHERS};
use crate::enums::{wm_dtype, wm_memory};
use crate::result::wm_result;
use crate::{check_struct_size, opt_path, opt_str, shape_arg};
use std::ffi::{c_char, c_void};
use weight_manager_core::DType;
use weight_manager_core::Placement;
use weight_manager_core::TensorDesc;
use weight_manager_core::{Error, Result};

/// One tensor, or one shard of a global tensor, for `wm_publisher_add`.
/// Fill with `wm_tensor_desc_init`, then set at least `name`, `dtype`,
/// `shape`/`ndim`, `data` and `len`. Growable: `struct_size` first. Read
/// during the call only (the arrays and the name too; the bytes at `data`
/// are the trainer's, see `wm_publisher_add`).
#[repr(C)]
pub struct wm_tensor_desc {
    /// `sizeof(wm_tensor_desc)`; set by `wm_tensor_desc_init`.
    pub struct_size: u32,
    /// The tensor's name (NUL-terminated UTF-8); unique per rank. A shard:
    /// the global tensor's name.
    pub name: *const c_char,
    /// A `wm_dtype` (default `WM_DTYPE_F32`).
    pub dtype: u32,
    /// The shape, `ndim` values (at most `WM_MAX_NDIM`); a shard: its own
    /// box's. NULL only with `ndim` 0 (a scalar).
    pub shape: *const u64,
    pub ndim: usize,
    /// The bytes, row-major: an address in the trainer's host memory, or
    /// with `memory` `WM_MEMORY_DEVICE` a device address of GPU
    /// `device_ordinal` (a PyTorch trainer passes `t.data_ptr()`).
    pub data: *const c_void,
    /// Bytes at `data`: dtype size x the shape's elements.
    pub len: usize,
    /// A `wm_memory`: where `data` points (default `WM_MEMORY_HOST`).
    pub memory: u32,
    /// Device memory: the CUDA device `data` is on (an ordinal of this
    /// process). Ignored for host memory (default -1).
    pub device_ordinal: i32,
    /// The engine rank this tensor is for; -1 (default): every rank. Below
    /// -1: `WM_ERR_INVALID_ARGUMENT`.
    pub rank: i32,
    /// A shard: the global tensor's shape, `ndim` values. NULL (default),
    /// with `offset` NULL: a whole tensor.
    pub global_shape: *const u64,
    /// A shard: where its box starts in the global tensor, per dimension
    /// (`ndim` values); the box's lengths are `shape`. Set both
    /// `global_shape` and `offset`, or neither (one alone:
    /// `WM_ERR_NULL_ARGUMENT`).
    pub offset: *const u64,
}

/// ==========================================================================
/// Publisher: what it serves.
/// ==========================================================================
///
/// Fill `desc` with defaults (no name, `WM_DTYPE_F32`, a scalar, host
/// memory, every rank, a whole tensor) and set `struct_size`.
///
/// NULL `desc`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_tensor_desc_init(desc: *mut wm_tensor_desc) -> wm_result {
    ffi_guard!({
        check_null!(desc);
        desc.write(wm_tensor_desc {
            struct_size: std::mem::size_of::<wm_tensor_desc>() as u32,
            name: std::ptr::null(),
            dtype: wm_dtype::F32 as u32,
            shape: std::ptr::null(),
            ndim: 0,
            data: std::ptr::null(),
            len: 0,
            memory: wm_memory::Host as u32,
            device_ordinal: -1,
            rank: -1,
            global_shape: std::ptr::null(),
            offset: std::ptr::null(),
        });
        wm_result::WM_OK
    })
}

/// Publish the tensor (or shard) `desc` describes.
///
/// Host memory: `len` bytes at `data`, served from there by
/// `wm_publisher_serve`. Device memory (`memory` `WM_MEMORY_DEVICE`): `len`
/// bytes at device address `data` of CUDA device `device_ordinal`, the
/// range checked with the driver; served once published:
/// `wm_publisher_publish` waits for the device (so kernels writing it have
/// finished) and copies it into one GPU buffer that engines on this node
/// open by CUDA IPC handle (over the network: into host memory); engines
/// then copy device to device.
///
/// A shard (`global_shape` and `offset` set): the shard's own box (dtype x
/// shape, row-major), placed at `offset` in a global tensor of shape
/// `global_shape`; engines get the placement in their manifest and take the
/// parts their params need. One publisher may hold several shards of one
/// global tensor whose boxes do not overlap (same dtype and global shape);
/// two shards sharing an element, or a whole tensor of that name beside
/// shards, are refused. Each trainer rank may run its own publisher (its own socket or
/// address): together they serve one version.
///
/// Checked now (`WM_ERR_INVALID_ARGUMENT`, naming the tensor): the dtype,
/// memory and rank are values of their kind, the shape has at most
/// `WM_MAX_NDIM` dimensions, `len` is its byte size, a shard's box lies
/// inside its global shape, and the tensor clashes with nothing published
/// for that rank (found by the shards' offsets: a few steps a shard for
/// row, column, expert and grid splits; a tensor whose shards put many
/// offsets within one shard's reach is refused, "too fragmented to check
/// for overlaps", once the adds that went in and this one's search would
/// pass 32 n log2 n steps, at least 4,096). NULL `desc`: `WM_ERR_NULL_ARGUMENT`; NULL `name`, NULL
/// `data` with `len` > 0, or a shard with one of its two arrays NULL:
/// `WM_ERR_NULL_ARGUMENT` (kept for `wm_publisher_last_error`); a bad
/// `struct_size`: `WM_ERR_STRUCT_SIZE`.
///
/// Ownership: `desc` and its arrays are read during the call only. The
/// trainer keeps the bytes at `data`: host memory must stay valid and
/// unchanged while `wm_publisher_serve` runs; device memory until the next
/// `wm_publisher_publish` returns. Thread-safe; never blocks (the driver is
/// asked about a device range, nothing waits for the device).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add(
    publisher: *mut wm_publisher,
    desc: *const wm_tensor_desc,
) -> wm_result {
    ffi_guard!({
        check_null!(desc);
        let h = try_publisher!(publisher);
        let r = add(&h.value, &*desc, false);
        h.result(r)
    })
}

/// Publish the `count` tensors (or shards) of the array `descs`, each as
/// `wm_publisher_add` would, or none of them: a descriptor refused (checked
/// as `wm_publisher_add` checks, against what was published before and
/// against the descriptors before it; its own fields are checked for all
/// before any is compared with the others) fails the call, its error
/// naming its index (from 0) when `count` > 1 ("tensor 3 of the 10 added together
/// (none was added): tensor 'w': ..."), and what was published before the
/// call stays as it was (a
/// directory set with `wm_publisher_set_dir` too). For a trainer publishing
/// a whole model at once: a refused tensor does not leave the others
/// published. `count` 0 adds nothing (`descs` may then be NULL).
///
/// Codes as `wm_publisher_add`; NULL `descs` with `count` > 0:
/// `WM_ERR_NULL_ARGUMENT`.
///
/// Ownership: `descs`, each descriptor and its arrays are read during the
/// call only; the bytes at each `data` as for `wm_publisher_add`.
/// Thread-safe; never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add_all(
    publisher: *mut wm_publisher,
    descs: *const wm_tensor_desc,
    count: usize,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let descs = crate::c_array(descs, count, "wm_publisher_add_all: descs");
        h.result(descs.and_then(|descs| add_descs(&h.value, descs)))
    })
}

/// `wm_publisher_add` of a C descriptor: a shard when `shard` or either
/// placement array is set.
///
/// # Safety
/// `d`'s pointers are NULL or valid for what they describe.
pub(super) unsafe fn add(
    p: &weight_manager_core::Publisher,
    d: &wm_tensor_desc,
    shard: bool,
) -> Result<()> {
    let owned = owned_desc(d, shard)?;
    p.add(owned.desc())
}

/// [`add`] of every descriptor of `ds`, or of none.
///
/// # Safety
/// As [`add`], for each.
unsafe fn add_descs(p: &weight_manager_core::Publisher, ds: &[wm_tensor_desc]) -> Result<()> {
    let mut owned = Vec::new();
    // In order: a `struct_size` not this library's is refused at the first
    // descriptor, before the array is read at this library's stride.
    for (k, d) in ds.iter().enumerate() {
        let o = owned_desc(d, false).map_err(|e| TensorDesc::refused_among(e, k, ds.len()))?;
        owned.push(o);
    }
    p.add_all(owned.iter().map(OwnedDesc::desc).collect())
}

/// A C descriptor read and checked: what `TensorDesc` borrows.
struct OwnedDesc<'a> {
    name: String,
    dtype: DType,
    shape: &'a [u64],
    data: u64,
    len: usize,
    device: Option<i32>,
    rank: Option<u32>,
    placement: Option<Placement>,
}

impl OwnedDesc<'_> {
    fn desc(&self) -> TensorDesc<'_> {
        TensorDesc {
            name: &self.name,
            dtype: self.dtype,
            shape: self.shape,
            data: self.data,
            len: self.len,
            device: self.device,
            rank: self.rank,
            placement: self.placement.clone(),
        }
    }
}

/// Read C descriptor `d` (a shard when `shard` or either placement array
/// is set).
///
/// # Safety
/// As [`add`].
unsafe fn owned_desc(d: &wm_tensor_desc, shard: bool) -> Result<OwnedDesc<'_>> {
    check_struct_size(
        "wm_tensor_desc",
        d.struct_size,
        std::mem::size_of::<wm_tensor_desc>(),
    )?;
    let (name, dtype, shape, rank) = tensor_desc(d.name, d.dtype, d.shape, d.ndim, d.rank)?;
    let device = match wm_memory::from_raw(d.memory) {
        Some(wm_memory::Host) => None,
        Some(wm_memory::Device) => Some(d.device_ordinal),
        None => {
            return Err(Error::invalid_argument(format!(
                "tensor '{name}': memory {} is not a wm_memory",
                d.memory
            )))
        }
    };
    let placement = if shard || !d.global_shape.is_null() || !d.offset.is_null() {
        Some(placement_arrays(d.global_shape, d.offset, d.ndim, &name)?)
    } else {
        None
    };
    Ok(OwnedDesc {
        name,
        dtype,
        shape,
        data: d.data as u64,
        len: d.len,
        device,
        rank,
        placement,
    })
}

/// Serve the snapshot in directory `dir` instead of in-memory tensors: each
/// rank gets the files the snapshot layout rules pick for it.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_set_dir(
    publisher: *mut wm_publisher,
    dir: *const c_char,
) -> wm_result {
    ffi_guard!({
        check_null!(dir);
        let h = try_publisher!(publisher);
        h.value.set_dir(&opt_path(dir).expect("checked"));
        wm_result::WM_OK
    })
}

/// Forget every published tensor (before publishing the next version).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_clear(publisher: *mut wm_publisher) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        h.value.clear_tensors();
        wm_result::WM_OK
    })
}

/// A shard's placement from its two C arrays of `ndim` values (checked
/// against the shard later, by the publisher).
///
/// # Safety
/// The arrays, when not NULL, hold `ndim` values (`ndim` at most
/// `WM_MAX_NDIM`, checked before).
unsafe fn placement_arrays(
    global_shape: *const u64,
    offset: *const u64,
    ndim: usize,
    name: &str,
) -> Result<Placement> {
    let dims = |ptr: *const u64, what: &str| {
        if ndim > 0 && ptr.is_null() {
            return Err(Error::null_argument(format!(
                "tensor '{name}': placement {what} is NULL"
            )));
        }
        Ok(if ndim == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(ptr, ndim).to_vec()
        })
    };
    Ok(Placement {
        global_shape: dims(global_shape, "global_shape")?,
        offset: dims(offset, "offset")?,
    })
}

/// A tensor's name, dtype, shape and rank (-1: every rank) from the C
/// arguments.
///
/// # Safety
/// `name` is NULL or a C string; `shape` holds `ndim` values when not NULL.
pub(super) unsafe fn tensor_desc<'a>(
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    rank: i32,
) -> Result<(String, DType, &'a [u64], Option<u32>)> {
    let name = opt_str(name, "name")?.ok_or_else(|| Error::null_argument("tensor name is NULL"))?;
    let dtype = wm_dtype::from_raw(dtype).map(DType::from).ok_or_else(|| {
        Error::invalid_argument(format!("tensor '{name}': dtype {dtype} is not a wm_dtype"))
    })?;
    let shape = shape_arg(shape, ndim, &format!("tensor '{name}'"))?;
    let rank = rank_arg(rank, &name)?;
    Ok((name, dtype, shape, rank))
}

/// A rank argument: 0 or more names one engine rank, -1 every rank;
/// anything else is refused (it is not "every rank").
fn rank_arg(rank: i32, tensor: &str) -> Result<Option<u32>> {
    match rank {
        -1 => Ok(None),
        r => u32::try_from(r).map(Some).map_err(|_| {
            Error::invalid_argument(format!(
                "tensor '{tensor}': rank {r} is not an engine rank (0 or more) or -1 (every rank)"
            ))
        }),
    }
}
