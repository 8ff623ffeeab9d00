//! Parameter registration: engine-owned and library-owned memory.

use super::manager::wm_manager;
use super::{check_struct_size, code_of, opt_str};
use crate::manager::Manager;
use crate::registry::{MemoryKind, ParamSpec};
use crate::result::{wm_result, Error, Result};
use crate::tensor::{DType, MAX_NDIM};
use std::ffi::{c_char, c_void};

/// Describes one param. Fill with `wm_param_desc_init`, then set fields.
/// Growable: `struct_size` first.
#[repr(C)]
pub struct wm_param_desc {
    /// `sizeof(wm_param_desc)`; set by `wm_param_desc_init`.
    pub struct_size: u32,
    /// A `wm_dtype`.
    pub dtype: u32,
    /// A `wm_memory` (default `WM_MEMORY_HOST`).
    pub memory: u32,
    /// CUDA device ordinal for `WM_MEMORY_DEVICE`; ignored for host memory.
    pub device_ordinal: i32,
    /// NUL-terminated UTF-8 name, unique per manager; copied.
    pub name: *const c_char,
    /// `ndim` dimensions; copied. May be NULL when `ndim` is 0 (a scalar).
    pub shape: *const u64,
    /// At most `WM_MAX_NDIM`.
    pub ndim: usize,
}

/// Most dimensions a param may have.
pub const WM_MAX_NDIM: usize = 8;
const _: () = assert!(WM_MAX_NDIM == MAX_NDIM);

/// Fill `desc` with defaults (host memory, f32 scalar, no name) and set `struct_size`.
///
/// NULL `desc`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_param_desc_init(desc: *mut wm_param_desc) -> wm_result {
    ffi_guard!({
        check_null!(desc);
        desc.write(wm_param_desc {
            struct_size: std::mem::size_of::<wm_param_desc>() as u32,
            dtype: DType::F32 as u32,
            memory: MemoryKind::Host as u32,
            device_ordinal: -1,
            name: std::ptr::null(),
            shape: std::ptr::null(),
            ndim: 0,
        });
        wm_result::WM_OK
    })
}

unsafe fn spec_from_c(d: &wm_param_desc) -> Result<ParamSpec> {
    check_struct_size(
        "wm_param_desc",
        d.struct_size,
        std::mem::size_of::<wm_param_desc>(),
    )?;
    let name = opt_str(d.name, "wm_param_desc.name")?
        .ok_or_else(|| Error::null_argument("wm_param_desc.name is NULL"))?;
    let dtype = DType::from_raw(d.dtype).ok_or_else(|| {
        Error::invalid_argument(format!(
            "param '{name}': dtype {} is not a wm_dtype",
            d.dtype
        ))
    })?;
    let memory = MemoryKind::from_raw(d.memory).ok_or_else(|| {
        Error::invalid_argument(format!(
            "param '{name}': memory {} is not a wm_memory",
            d.memory
        ))
    })?;
    if d.ndim > MAX_NDIM {
        return Err(Error::invalid_argument(format!(
            "param '{name}': ndim {} is more than {MAX_NDIM}",
            d.ndim
        )));
    }
    if d.ndim > 0 && d.shape.is_null() {
        return Err(Error::null_argument(format!(
            "param '{name}': shape is NULL with ndim {}",
            d.ndim
        )));
    }
    let shape = if d.ndim == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(d.shape, d.ndim).to_vec()
    };
    Ok(ParamSpec {
        name,
        dtype,
        shape,
        memory,
        device_ordinal: d.device_ordinal,
        pieces: Vec::new(),
    })
}

/// Register engine-owned memory as a param: `len` bytes at `data`, which must
/// equal the size of dtype x shape.
///
/// Ownership: the engine keeps `data`; it must stay valid until `wm_destroy`
/// (or until the release callback hands it back). The library writes into it
/// during updates and never frees it. `data` may be NULL only for a
/// zero-byte param. Allowed only before the first update or clear
/// (`WM_ERR_STATE` after); `WM_ERR_BUSY` while an update runs. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_register_param(
    manager: *mut wm_manager,
    desc: *const wm_param_desc,
    data: *mut c_void,
    len: usize,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        if desc.is_null() {
            return code_of(
                &m,
                Err(Error::null_argument("wm_register_param: desc is NULL")),
            );
        }
        let r = spec_from_c(&*desc).and_then(|spec| m.register(&spec, data.cast(), len));
        code_of(&m, r)
    })
}

/// Allocate a library-owned param. On success `*out_data` receives its
/// address and `*out_len` its byte size; both are unchanged on failure.
///
/// Ownership: the library owns the memory; the address stays valid, and the
/// same, until `wm_destroy` — across clears (which release the physical pages)
/// and updates (which bring them back). Memory reads as zeros after a clear.
///
/// `WM_MEMORY_DEVICE`: `*out_data` is a CUDA device address on GPU
/// `device_ordinal`, reserved with CUDA virtual memory management: a clear
/// unmaps and releases the GPU memory behind it (reported in
/// `wm_status_info.device_bytes_freed`), the next update maps fresh memory
/// at the same address, so CUDA graphs that captured it stay valid. Without
/// a usable driver or device: `WM_ERR_UNSUPPORTED` saying which.
/// Allowed only before the first update or clear. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_allocate_param(
    manager: *mut wm_manager,
    desc: *const wm_param_desc,
    out_data: *mut *mut c_void,
    out_len: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(out_data, out_len);
        let m = try_handle!(manager);
        if desc.is_null() {
            return code_of(
                &m,
                Err(Error::null_argument("wm_allocate_param: desc is NULL")),
            );
        }
        match spec_from_c(&*desc).and_then(|spec| Manager::allocate(&m, &spec)) {
            Ok((p, n)) => {
                *out_data = p.cast();
                *out_len = n;
                wm_result::WM_OK
            }
            Err(e) => m.record_error(e).code,
        }
    })
}
