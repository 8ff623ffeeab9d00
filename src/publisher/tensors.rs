//! What a publisher serves: whole tensors and shards of global tensors,
//! from the trainer's host or GPU memory.

use super::{wm_publisher, PUBLISHERS};
use crate::enums::wm_dtype;
use crate::{check_struct_size, opt_str};
use std::ffi::{c_char, c_void};
use weight_manager_core::manifest::Placement;
use crate::result::wm_result;
use weight_manager_core::result::Error;
use weight_manager_core::tensor::DType;

/// Where a shard sits in its global tensor (`wm_publisher_add_shard`).
/// Fill with `wm_shard_placement_init`, then set both arrays. Growable.
/// The arrays are read during the call only.
#[repr(C)]
pub struct wm_shard_placement {
    /// `sizeof(wm_shard_placement)`; set by `wm_shard_placement_init`.
    pub struct_size: u32,
    /// The global tensor's shape: one value per dimension of the shard
    /// (its `ndim`).
    pub global_shape: *const u64,
    /// Where the shard's box starts in the global tensor, per dimension
    /// (`ndim` values); the box's lengths are the shard's shape.
    pub offset: *const u64,
}

/// Publish a tensor from the trainer's host memory: `len` bytes at `data`
/// (dtype x shape), for engine rank `rank`, or for every rank with -1
/// (below -1: `WM_ERR_INVALID_ARGUMENT`).
///
/// Ownership: the trainer keeps `data`; it must stay valid and unchanged
/// while `wm_publisher_serve` runs. Names are unique per rank.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add_tensor(
    publisher: *mut wm_publisher,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    data: *const c_void,
    len: usize,
    rank: i32,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = (|| {
            let (name, dtype, shape, rank) = tensor_desc(name, dtype, shape, ndim, rank)?;
            h.value
                .add_tensor(&name, dtype, shape, data.cast(), len, rank)
        })();
        h.result(r)
    })
}

/// Publish a tensor from the trainer's GPU memory: `len` bytes at device
/// address `device_ptr` of CUDA device `device` (an ordinal of this
/// process; the range is checked with the driver), for engine rank `rank`,
/// or for every rank with -1 (below -1: `WM_ERR_INVALID_ARGUMENT`). A
/// PyTorch trainer passes `t.data_ptr()`.
///
/// GPU tensors are served once published: `wm_publisher_publish` waits for
/// the device (so kernels writing them have finished) and copies them into
/// one GPU buffer that engines on this node open by CUDA IPC handle (over
/// the network: into host memory). Engines then copy device to device.
///
/// Ownership: the trainer keeps the memory; it must stay valid until the
/// next `wm_publisher_publish` returns.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add_device_tensor(
    publisher: *mut wm_publisher,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    device_ptr: u64,
    len: usize,
    device: i32,
    rank: i32,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = (|| {
            let (name, dtype, shape, rank) = tensor_desc(name, dtype, shape, ndim, rank)?;
            h.value
                .add_device_tensor(&name, dtype, shape, device_ptr, len, device, rank)
        })();
        h.result(r)
    })
}

/// Fill `placement` with empty arrays (NULL) and set `struct_size`.
#[no_mangle]
pub unsafe extern "C" fn wm_shard_placement_init(placement: *mut wm_shard_placement) -> wm_result {
    ffi_guard!({
        check_null!(placement);
        placement.write(wm_shard_placement {
            struct_size: std::mem::size_of::<wm_shard_placement>() as u32,
            global_shape: std::ptr::null(),
            offset: std::ptr::null(),
        });
        wm_result::WM_OK
    })
}

/// Publish a shard of the global tensor `name` from the trainer's host
/// memory: `len` bytes at `data`, the shard's own box (dtype x shape,
/// row-major), placed at `placement->offset` in a global tensor of shape
/// `placement->global_shape` (both `ndim` values), for engine rank `rank`
/// or every rank with -1. Engines get the placement in their manifest and
/// take the parts their params need.
///
/// Checked now (`WM_ERR_INVALID_ARGUMENT`, naming the tensor): the box lies
/// inside the global shape, `len` is the box's byte size, and the shard
/// clashes with nothing published for that rank. One publisher may hold
/// several shards of one global tensor at different offsets (same dtype and
/// global shape); the same offset twice, or a whole tensor of that name
/// beside shards, is refused. NULL `placement`: `WM_ERR_NULL_ARGUMENT`.
///
/// Ownership: as `wm_publisher_add_tensor` (`data` stays valid and
/// unchanged while `wm_publisher_serve` runs); `placement` is read during
/// the call only. Each trainer rank may run its own publisher (its own
/// socket or address): together they serve one version. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add_shard(
    publisher: *mut wm_publisher,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    placement: *const wm_shard_placement,
    data: *const c_void,
    len: usize,
    rank: i32,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = (|| {
            let (name, dtype, shape, rank) = tensor_desc(name, dtype, shape, ndim, rank)?;
            let placement = placement_from_c(placement, ndim, &name)?;
            h.value
                .add_shard(&name, dtype, shape, &placement, data.cast(), len, rank)
        })();
        h.result(r)
    })
}

/// Publish a shard (see `wm_publisher_add_shard`) from the trainer's GPU
/// memory: `len` bytes at device address `device_ptr` of CUDA device
/// `device`, served as `wm_publisher_add_device_tensor`'s tensors are (once
/// published). Ownership: the memory stays valid until the next
/// `wm_publisher_publish` returns; `placement` is read during the call only.
/// Never blocks (the driver is asked about the range, nothing waits for
/// the device).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_add_device_shard(
    publisher: *mut wm_publisher,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    placement: *const wm_shard_placement,
    device_ptr: u64,
    len: usize,
    device: i32,
    rank: i32,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = (|| {
            let (name, dtype, shape, rank) = tensor_desc(name, dtype, shape, ndim, rank)?;
            let placement = placement_from_c(placement, ndim, &name)?;
            h.value.add_device_shard(
                &name, dtype, shape, &placement, device_ptr, len, device, rank,
            )
        })();
        h.result(r)
    })
}

/// A C placement of a shard of `ndim` dimensions (checked against the
/// shard later, by the publisher).
///
/// # Safety
/// `placement` is NULL or a `wm_shard_placement` whose arrays, when not
/// NULL, hold `ndim` values (`ndim` at most `WM_MAX_NDIM`, checked before).
unsafe fn placement_from_c(
    placement: *const wm_shard_placement,
    ndim: usize,
    name: &str,
) -> weight_manager_core::result::Result<Placement> {
    if placement.is_null() {
        return Err(Error::null_argument(format!(
            "tensor '{name}': placement is NULL"
        )));
    }
    let p = &*placement;
    check_struct_size(
        "wm_shard_placement",
        p.struct_size,
        std::mem::size_of::<wm_shard_placement>(),
    )?;
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
        global_shape: dims(p.global_shape, "global_shape")?,
        offset: dims(p.offset, "offset")?,
    })
}

/// A tensor's name, dtype, shape and rank (-1: every rank) from the C
/// arguments.
///
/// # Safety
/// `name` is NULL or a C string; `shape` holds `ndim` values when not NULL.
unsafe fn tensor_desc<'a>(
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    rank: i32,
) -> weight_manager_core::result::Result<(String, DType, &'a [u64], Option<u32>)> {
    let name = opt_str(name, "name")?.ok_or_else(|| Error::null_argument("tensor name is NULL"))?;
    let dtype = wm_dtype::from_raw(dtype).map(DType::from).ok_or_else(|| {
        Error::invalid_argument(format!("tensor '{name}': dtype {dtype} is not a wm_dtype"))
    })?;
    if ndim > weight_manager_core::tensor::MAX_NDIM || (ndim > 0 && shape.is_null()) {
        return Err(Error::invalid_argument(format!(
            "tensor '{name}': bad shape (ndim {ndim})"
        )));
    }
    let shape = if ndim == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(shape, ndim)
    };
    let rank = rank_arg(rank, &name)?;
    Ok((name, dtype, shape, rank))
}

/// A rank argument: 0 or more names one engine rank, -1 every rank;
/// anything else is refused (it is not "every rank").
fn rank_arg(rank: i32, tensor: &str) -> weight_manager_core::result::Result<Option<u32>> {
    match rank {
        -1 => Ok(None),
        r => u32::try_from(r).map(Some).map_err(|_| {
            Error::invalid_argument(format!(
                "tensor '{tensor}': rank {r} is not an engine rank (0 or more) or -1 (every rank)"
            ))
        }),
    }
}
