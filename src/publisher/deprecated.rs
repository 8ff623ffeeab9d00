//! The deprecated positional add calls (kept for one release): each a
//! wrapper of `wm_publisher_add` (`tensors.rs`), with `wm_shard_placement`
//! for the shard calls. New code fills a `wm_tensor_desc`.

use super::tensors::{add, tensor_desc, wm_publisher_add, wm_tensor_desc};
use super::{wm_publisher, PUBLISHERS};
use crate::check_struct_size;
use crate::enums::wm_memory;
use crate::opt_str;
use crate::result::wm_result;
use std::ffi::{c_char, c_void};
use weight_manager_core::{Error, Result};

/// Where a shard sits in its global tensor (the deprecated
/// `wm_publisher_add_shard`; new code sets `wm_tensor_desc.global_shape`
/// and `offset`). Fill with `wm_shard_placement_init`, then set both
/// arrays. Growable. The arrays are read during the call only.
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

/// A descriptor from the deprecated calls' arguments.
#[expect(
    clippy::too_many_arguments,
    reason = "the deprecated calls' arguments, one for one"
)]
fn legacy_desc(
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    data: *const c_void,
    len: usize,
    device: Option<i32>,
    rank: i32,
) -> wm_tensor_desc {
    wm_tensor_desc {
        struct_size: std::mem::size_of::<wm_tensor_desc>() as u32,
        name,
        dtype,
        shape,
        ndim,
        data,
        len,
        memory: match device {
            None => wm_memory::Host,
            Some(_) => wm_memory::Device,
        } as u32,
        device_ordinal: device.unwrap_or(-1),
        rank,
        global_shape: std::ptr::null(),
        offset: std::ptr::null(),
    }
}

/// A legacy shard: the descriptor with `placement`'s arrays (NULL
/// `placement`: `WM_ERR_NULL_ARGUMENT`, naming the tensor).
///
/// # Safety
/// `placement` is NULL or a `wm_shard_placement`; `name` NULL or a C string.
unsafe fn with_placement(
    mut d: wm_tensor_desc,
    placement: *const wm_shard_placement,
) -> Result<wm_tensor_desc> {
    if placement.is_null() {
        let name = opt_str(d.name, "name")?.unwrap_or_default();
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
    d.global_shape = p.global_shape;
    d.offset = p.offset;
    Ok(d)
}

/// ==========================================================================
/// Publisher, deprecated: the positional add calls, kept for one release.
/// Each is a wrapper of wm_publisher_add; new code fills a wm_tensor_desc.
/// ==========================================================================
///
/// Deprecated (kept for one release; use `wm_tensor_desc` and
/// `wm_publisher_add`, which this calls): publish a tensor from the
/// trainer's host memory: `len` bytes at `data` (dtype x shape), for engine
/// rank `rank`, or for every rank with -1 (below -1:
/// `WM_ERR_INVALID_ARGUMENT`).
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
        let d = legacy_desc(name, dtype, shape, ndim, data, len, None, rank);
        wm_publisher_add(publisher, &d)
    })
}

/// Deprecated (kept for one release; use `wm_publisher_add` with `memory`
/// `WM_MEMORY_DEVICE`, which this calls): publish a tensor from the
/// trainer's GPU memory: `len` bytes at device address `device_ptr` of CUDA
/// device `device` (an ordinal of this process; the range is checked with
/// the driver), for engine rank `rank`, or for every rank with -1 (below
/// -1: `WM_ERR_INVALID_ARGUMENT`). Served once published, as
/// `wm_publisher_add` says.
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
        let data = device_ptr as usize as *const c_void;
        let d = legacy_desc(name, dtype, shape, ndim, data, len, Some(device), rank);
        wm_publisher_add(publisher, &d)
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

/// Deprecated (kept for one release; use `wm_publisher_add` with
/// `global_shape` and `offset` set, which this calls): publish a shard of
/// the global tensor `name` from the trainer's host memory: `len` bytes at
/// `data`, the shard's own box (dtype x shape, row-major), placed at
/// `placement->offset` in a global tensor of shape
/// `placement->global_shape` (both `ndim` values), for engine rank `rank`
/// or every rank with -1. Checked as `wm_publisher_add` says. NULL
/// `placement`: `WM_ERR_NULL_ARGUMENT`.
///
/// Ownership: as `wm_publisher_add` (`data` stays valid and unchanged while
/// `wm_publisher_serve` runs); `placement` is read during the call only.
/// Never blocks.
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
        let d = legacy_desc(name, dtype, shape, ndim, data, len, None, rank);
        legacy_shard(publisher, d, placement)
    })
}

/// Deprecated (kept for one release; use `wm_publisher_add` with `memory`
/// `WM_MEMORY_DEVICE` and `global_shape` and `offset` set, which this
/// calls): publish a shard (see `wm_publisher_add_shard`) from the
/// trainer's GPU memory: `len` bytes at device address `device_ptr` of CUDA
/// device `device`, served as device tensors are (once published).
/// Ownership: the memory stays valid until the next `wm_publisher_publish`
/// returns; `placement` is read during the call only. Never blocks (the
/// driver is asked about the range, nothing waits for the device).
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
        let data = device_ptr as usize as *const c_void;
        let d = legacy_desc(name, dtype, shape, ndim, data, len, Some(device), rank);
        legacy_shard(publisher, d, placement)
    })
}

/// The deprecated shard calls: the tensor's arguments checked, then the
/// placement's arrays into the descriptor, then what `wm_publisher_add`
/// does (the errors, in the order they always came, kept on the handle).
///
/// # Safety
/// As `wm_publisher_add`; `placement` is NULL or a `wm_shard_placement`.
unsafe fn legacy_shard(
    publisher: *mut wm_publisher,
    d: wm_tensor_desc,
    placement: *const wm_shard_placement,
) -> wm_result {
    let h = try_publisher!(publisher);
    let r = tensor_desc(d.name, d.dtype, d.shape, d.ndim, d.rank)
        .and_then(|_| with_placement(d, placement))
        .and_then(|d| add(&h.value, &d, true));
    h.result(r)
}
