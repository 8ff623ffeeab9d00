//! Parameter registration: engine-owned and library-owned memory.

use super::manager::wm_manager;
use super::{check_struct_size, code_of, opt_str, shape_arg};
use crate::enums::{wm_dtype, wm_memory, wm_quant_scheme};
use crate::result::wm_result;
use std::ffi::{c_char, c_void};
use weight_manager_core::Manager;
use weight_manager_core::TensorBox;
use weight_manager_core::{DType, MAX_NDIM};
use weight_manager_core::{Error, Result};
use weight_manager_core::{MemoryKind, ParamSpec};
use weight_manager_core::{Piece, MAX_PIECES_PER_PARAM};

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
    /// What the param holds of which global tensors: `npieces` pieces,
    /// copied at registration. NULL with `npieces` 0 (the default): all of
    /// the global tensor named like the param, of the param's shape. The
    /// pieces must cover every element of the param exactly once, and no
    /// two may hold the same element of one global tensor
    /// (`WM_ERR_INVALID_ARGUMENT` naming the param and the piece
    /// otherwise), and be at most `WM_MAX_PIECES` (checked before any is
    /// read). Checking them costs `O(n log n)` in `npieces`.
    pub pieces: *const wm_piece,
    pub npieces: usize,
}

/// ==========================================================================
/// PARAMS: describing the engine's weights.
/// ==========================================================================
///
/// One piece of a param: the box (`offset`, `len` per dimension, `ndim`
/// dimensions) of global tensor `tensor`, placed in the param starting at
/// `param_offset` (one entry per param dimension). The box and the param
/// line up at their last dimension; a dimension only one side has counts
/// as length 1 on the other (a `[out, in]` expert tensor stacks into a
/// `[experts, out, in]` param at `{e, 0, 0}`). Fill with `wm_piece_init`
/// or `wm_piece_narrow`. Growable: `struct_size` first.
#[repr(C)]
pub struct wm_piece {
    /// `sizeof(wm_piece)`; set by the init functions.
    pub struct_size: u32,
    /// NUL-terminated UTF-8 name of the global tensor; borrowed until the
    /// registration that uses the piece returns (then copied).
    pub tensor: *const c_char,
    /// Dimensions of the box (the global tensor's rank), at most
    /// `WM_MAX_NDIM`.
    pub ndim: usize,
    pub offset: [u64; WM_MAX_NDIM],
    pub len: [u64; WM_MAX_NDIM],
    /// Where the box starts in the param, per param dimension.
    pub param_offset: [u64; WM_MAX_NDIM],
}

/// ==========================================================================
/// PARAMS: register the engine's weights (or let the library allocate them).
/// ==========================================================================
///
/// Fill `piece` with zeros (no tensor, a scalar box at the param's start)
/// and set `struct_size`.
///
/// NULL `piece`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_piece_init(piece: *mut wm_piece) -> wm_result {
    ffi_guard!({
        check_null!(piece);
        piece.write(empty_piece());
        wm_result::WM_OK
    })
}

fn empty_piece() -> wm_piece {
    wm_piece {
        struct_size: std::mem::size_of::<wm_piece>() as u32,
        tensor: std::ptr::null(),
        ndim: 0,
        offset: [0; WM_MAX_NDIM],
        len: [0; WM_MAX_NDIM],
        param_offset: [0; WM_MAX_NDIM],
    }
}

/// Fill `piece` with global tensor `tensor` (of `global_shape`, `ndim`
/// dimensions) narrowed to `[start, start + length)` along `dim`: the
/// common tensor-parallel split. It starts at the param's start; set
/// `param_offset` afterwards to stack it after other pieces. `tensor` is
/// borrowed, not copied (see `wm_piece.tensor`).
///
/// `*piece` is written only on success. NULL `piece`, `tensor` or
/// `global_shape` (with `ndim` > 0): `WM_ERR_NULL_ARGUMENT`; `ndim` over
/// `WM_MAX_NDIM`, `dim` not below `ndim`, or the range past the
/// dimension's end: `WM_ERR_INVALID_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_piece_narrow(
    piece: *mut wm_piece,
    tensor: *const c_char,
    global_shape: *const u64,
    ndim: usize,
    dim: usize,
    start: u64,
    length: u64,
) -> wm_result {
    ffi_guard!({
        check_null!(piece, tensor);
        if ndim > 0 && global_shape.is_null() {
            return wm_result::WM_ERR_NULL_ARGUMENT;
        }
        if ndim > WM_MAX_NDIM || dim >= ndim {
            return wm_result::WM_ERR_INVALID_ARGUMENT;
        }
        let shape = std::slice::from_raw_parts(global_shape, ndim);
        if start.checked_add(length).is_none_or(|end| end > shape[dim]) {
            return wm_result::WM_ERR_INVALID_ARGUMENT;
        }
        let mut p = empty_piece();
        p.tensor = tensor;
        p.ndim = ndim;
        p.len[..ndim].copy_from_slice(shape);
        (p.offset[dim], p.len[dim]) = (start, length);
        piece.write(p);
        wm_result::WM_OK
    })
}

/// The pieces of param `name` (of `param_ndim` dimensions) from C.
unsafe fn pieces_from_c(d: &wm_param_desc, name: &str) -> Result<Vec<Piece>> {
    if d.npieces == 0 {
        return Ok(Vec::new());
    }
    if d.pieces.is_null() {
        return Err(Error::null_argument(format!(
            "param '{name}': pieces is NULL but npieces is {}",
            d.npieces
        )));
    }
    if d.npieces > WM_MAX_PIECES {
        return Err(Error::invalid_argument(format!(
            "param '{name}': npieces {} is more than the {WM_MAX_PIECES} one param may have",
            d.npieces
        )));
    }
    let bad =
        |i: usize, why: &str| Error::invalid_argument(format!("param '{name}': piece {i}: {why}"));
    let mut out = Vec::with_capacity(d.npieces.min(1 << 16));
    for (i, p) in std::slice::from_raw_parts(d.pieces, d.npieces)
        .iter()
        .enumerate()
    {
        check_struct_size("wm_piece", p.struct_size, std::mem::size_of::<wm_piece>())
            .map_err(|e| e.context(format!("param '{name}': piece {i}")))?;
        // Named like every NULL pointer field (`WM_ERR_NULL_ARGUMENT`), and
        // a name that is not UTF-8 with its param and piece.
        let tensor = opt_str(p.tensor, "wm_piece.tensor")
            .map_err(|e| e.context(format!("param '{name}': piece {i}")))?
            .ok_or_else(|| {
                Error::null_argument(format!("param '{name}': piece {i}: tensor is NULL"))
            })?;
        if p.ndim > WM_MAX_NDIM {
            return Err(bad(
                i,
                &format!("ndim {} is more than {WM_MAX_NDIM}", p.ndim),
            ));
        }
        out.push(Piece {
            tensor,
            global: TensorBox {
                offset: p.offset[..p.ndim].to_vec(),
                len: p.len[..p.ndim].to_vec(),
            },
            at: p.param_offset[..d.ndim.min(WM_MAX_NDIM)].to_vec(),
        });
    }
    Ok(out)
}

/// Most dimensions a param may have.
pub const WM_MAX_NDIM: usize = 8;

/// Most pieces one param may have (`wm_param_desc.npieces`).
pub const WM_MAX_PIECES: usize = 1 << 20;
const _: () = assert!(WM_MAX_PIECES == MAX_PIECES_PER_PARAM);
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
            dtype: wm_dtype::F32 as u32,
            memory: wm_memory::Host as u32,
            device_ordinal: -1,
            name: std::ptr::null(),
            shape: std::ptr::null(),
            ndim: 0,
            pieces: std::ptr::null(),
            npieces: 0,
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
    let dtype = wm_dtype::from_raw(d.dtype)
        .map(DType::from)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "param '{name}': dtype {} is not a wm_dtype",
                d.dtype
            ))
        })?;
    let memory = wm_memory::from_raw(d.memory)
        .map(MemoryKind::from)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "param '{name}': memory {} is not a wm_memory",
                d.memory
            ))
        })?;
    let shape = shape_arg(d.shape, d.ndim, &format!("param '{name}'"))?.to_vec();
    Ok(ParamSpec {
        pieces: pieces_from_c(d, &name)?,
        name,
        dtype,
        shape,
        memory,
        device_ordinal: d.device_ordinal,
    })
}

/// Register engine-owned memory as a param: `len` bytes at `data`, which must
/// equal the size of dtype x shape.
///
/// Ownership: the engine keeps `data`; it must stay valid until `wm_destroy`
/// (or until the release callback hands it back). The library writes into it
/// during updates and never frees it. `data` may be NULL only for a
/// zero-byte param. A param's memory holds one tensor's bytes: memory that
/// shares a byte with a param registered before (host memory, or the same
/// GPU's) is `WM_ERR_INVALID_ARGUMENT` naming both (register a tied weight
/// once, under one name). Allowed until the first update that succeeds or
/// writes a param (one refused or failed before writing, a mistyped path
/// say, leaves registration open; so does an aborted stage) or the first
/// clear: `WM_ERR_STATE` after; `WM_ERR_BUSY` while an update runs.
/// Thread-safe: registrations on several threads take turns.
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

/// One param of a batch registered with `wm_register_params`: what
/// `wm_register_param` takes, as one element. Fixed (it does not grow: a
/// later field would come as a new struct), so no `struct_size`; `desc`
/// carries its own.
#[repr(C)]
pub struct wm_param_registration {
    /// The param; read during the call only.
    pub desc: *const wm_param_desc,
    /// Its memory, `len` bytes: as `wm_register_param`'s `data` and `len`.
    pub data: *mut c_void,
    pub len: usize,
}

/// Register the `count` params of the array `params`, each as
/// `wm_register_param` would, or none of them: a param refused (checked as
/// `wm_register_param` checks, against the params registered before and
/// the ones before it in the array) fails the call, its error naming its
/// index (from 0) when `count` > 1 ("param 2 of the 3 registered together (none
/// was registered): param 'w': ..."), and the params registered before the
/// call stay as they were. For an engine registering a whole model at
/// once: a refused param does not leave the others registered, so the
/// engine can fix it and register them all again. `count` 0 registers
/// nothing (`params` may then be NULL), and is refused where any
/// registration is (`WM_ERR_STATE`, `WM_ERR_BUSY`).
///
/// Codes as `wm_register_param`; NULL `params` with `count` > 0, or a NULL
/// `desc` in it: `WM_ERR_NULL_ARGUMENT`.
///
/// Ownership: `params`, each descriptor and its arrays are read during the
/// call only; each param's memory as for `wm_register_param` (the engine
/// keeps it, valid until `wm_destroy`). Allowed while `wm_register_param`
/// is (`WM_ERR_STATE` after); `WM_ERR_BUSY` while an update runs.
/// Thread-safe: registrations on several threads take turns.
#[no_mangle]
pub unsafe extern "C" fn wm_register_params(
    manager: *mut wm_manager,
    params: *const wm_param_registration,
    count: usize,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let regs = crate::c_array(params, count, "wm_register_params: params");
        // An empty batch too is refused where registering is (busy,
        // closed): the state is checked whatever the count.
        let r = regs
            .and_then(|regs| registrations(regs))
            .and_then(|batch| m.register_all(&batch));
        code_of(&m, r)
    })
}

/// The batch of `wm_register_params`, each descriptor read and checked on
/// its own (a refusal names its place, as the batch's does).
///
/// # Safety
/// Each `desc` is NULL or valid, with its arrays.
unsafe fn registrations(
    regs: &[wm_param_registration],
) -> Result<Vec<(ParamSpec, *mut u8, usize)>> {
    let mut batch = Vec::new();
    for (k, r) in regs.iter().enumerate() {
        let spec = match r.desc.is_null() {
            true => Err(Error::null_argument("wm_register_params: a desc is NULL")),
            false => spec_from_c(&*r.desc),
        };
        let spec = spec.map_err(|e| ParamSpec::refused_among(e, k, regs.len()))?;
        batch.push((spec, r.data.cast(), r.len));
    }
    Ok(batch)
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
/// Allowed while `wm_register_param` is. Thread-safe.
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
            Err(e) => m.record_error(e).code.into(),
        }
    })
}

/// Declare that registered param `weight` holds its global tensors
/// quantized with `scheme` (a `wm_quant_scheme`), its scales in
/// registered param `scales`. Every update then fills `weight`
/// (`WM_DTYPE_F8E4M3`) and `scales` (`WM_DTYPE_F32` scale_inv, or
/// `WM_DTYPE_U8` E8M0 bytes for `WM_QUANT_SCHEME_MXFP8`; the scheme's
/// scales shape, registered without pieces) from the global bf16, f16 or f32
/// tensors, and commits both together: publishers (IPC, rdma) quantize
/// before sending (one byte per element on the wire; each block's amax is
/// agreed across publishers first, so a block split over trainer ranks
/// gets one scale); a snapshot is read as it is, verified against its
/// (bf16) checksums when the update verifies (`WM_UPDATE_VERIFY_CHECKSUMS`),
/// and quantized by the engine. From publishers that keep the
/// version the params hold, the FP8 bytes come as deltas of the FP8 bytes
/// the param holds (README "Deltas of FP8 params"); the scales are written
/// whole at every commit. Both params live in host memory, or both on
/// one GPU (device params): there the FP8 bytes are written by a CUDA
/// kernel compiled at run time by NVRTC (`WM_NVRTC_LIB`, else
/// `libnvrtc.so`), bit for bit the same; without NVRTC an update that must
/// quantize on the GPU fails with `WM_ERR_UNSUPPORTED`. A trainer's GPU
/// version is quantized on its GPU the same way. A weight with no elements
/// is refused. The rule, bit for bit PyTorch's: amax =
/// max(|x|) over the block in f32, at least 1e-4; q = e4m3(x * (448 /
/// amax)); scale_inv = amax / 448 (dequantized = q * scale_inv). MXFP8
/// (blocks of 32 along the last dimension): amax = max(|x|) in f32; e =
/// clamp(floor(log2(amax)) - 8, -127, 127), floor(log2) taken from amax's
/// f32 exponent field (-127 for 0 and subnormals); q = e4m3(x / 2^e),
/// saturating at 448; scale byte = e + 127 (dequantized = q * 2^e). A NaN or
/// infinity fails the update (`WM_ERR_FORMAT`, naming the tensor and the
/// element); atomic, every param keeps its old bytes.
///
/// With `WM_QUANT_SCHEME_FP8_BLOCK128`, `weight` has at least 2
/// dimensions and each piece starts at a multiple of 128 on the last two,
/// in the global tensor and in the param, and a length that is not a
/// multiple of 128 ends the param (and, checked when planning, the global
/// tensor). With `WM_QUANT_SCHEME_FP8_TENSOR` the param holds all of its
/// global tensor. With `WM_QUANT_SCHEME_MXFP8` the same holds of the last
/// dimension alone, at multiples of 32 (any rows). Errors name the param
/// and what is wrong:
/// `WM_ERR_NOT_FOUND` (not registered), `WM_ERR_INVALID_ARGUMENT` (dtype,
/// shape, a piece cutting a block, a param declared twice, the weight
/// and its scales in different places). Nothing changes on error. Allowed while `wm_register_param`
/// is (`WM_ERR_STATE` after). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_quantize_param(
    manager: *mut wm_manager,
    weight: *const c_char,
    scales: *const c_char,
    scheme: u32,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let r = (|| {
            let w = opt_str(weight, "weight")?
                .ok_or_else(|| Error::null_argument("wm_quantize_param: weight is NULL"))?;
            let s = opt_str(scales, "scales")?
                .ok_or_else(|| Error::null_argument("wm_quantize_param: scales is NULL"))?;
            let scheme = wm_quant_scheme::from_raw(scheme).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "param '{w}': scheme {scheme} is not a wm_quant_scheme"
                ))
            })?;
            m.quantize(&w, &s, scheme.into())
        })();
        code_of(&m, r)
    })
}
