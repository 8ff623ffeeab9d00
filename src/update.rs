//! Updates and clears.

use super::manager::wm_manager;
use super::{check_struct_size, code_of, fill_chars, opt_path, opt_str};
use crate::enums::wm_source;
use crate::result::wm_result;
use std::ffi::{c_char, c_void, CString};
use std::time::Duration;
use weight_manager_core::DeltaMode;
use weight_manager_core::SourceKind;
use weight_manager_core::{Error, Result};
use weight_manager_core::{Hooks, Mode, Progress, TensorView};
use weight_manager_core::{UpdateRequest, UpdateStats};

/// `wm_update_request.flags`: verify every tensor's xxh3-128 checksum.
pub const WM_UPDATE_VERIFY_CHECKSUMS: u32 = 1;
/// `wm_update_request.flags`: write params in place (no staging memory; a
/// failure after bytes moved leaves the manager FAILED). Default: atomic.
pub const WM_UPDATE_IN_PLACE: u32 = 2;
/// `wm_update_request.flags`: skip source tensors that are not registered
/// params (with a warning) instead of failing. Only a one-to-one update
/// (one source of whole tensors, every param registered whole) refuses
/// them; a sharded update (several sources, placed shards, or params with
/// pieces) never reads tensors no piece names, and needs no flag.
pub const WM_UPDATE_SKIP_UNKNOWN: u32 = 4;
/// `wm_update_request.flags`: on the network sources (rdma, gdr), which
/// verify checksums by default, do not.
pub const WM_UPDATE_SKIP_NETWORK_CHECKSUMS: u32 = 8;
/// `wm_update_request.flags`: take no deltas; every run comes whole.
/// Default: an update over the network (rdma, gdr) after a successful one
/// names the version the params hold, and a publisher that keeps it sends
/// each run as its changes where that is under half its bytes
/// (`wm_update_delta_stats`).
pub const WM_UPDATE_WHOLE: u32 = 16;
/// `wm_update_request.flags`: take deltas over IPC too. Not the default:
/// on one node the whole copy runs at memory speed, and a delta's passes
/// cost more than the bytes they save (README "Deltas between steps").
/// With `WM_UPDATE_WHOLE` too: `WM_ERR_INVALID_ARGUMENT`.
pub const WM_UPDATE_DELTAS: u32 = 32;
const KNOWN_FLAGS: u32 = WM_UPDATE_VERIFY_CHECKSUMS
    | WM_UPDATE_IN_PLACE
    | WM_UPDATE_SKIP_UNKNOWN
    | WM_UPDATE_SKIP_NETWORK_CHECKSUMS
    | WM_UPDATE_WHOLE
    | WM_UPDATE_DELTAS;

/// Most sources one update may name (`location`, `locations` and the
/// lists of `@FILE` locations together).
pub const WM_MAX_SOURCES: usize = 4096;
const _: () = assert!(WM_MAX_SOURCES == weight_manager_core::MAX_SOURCES);

/// Size of the version buffers in `wm_update_stats` and `wm_status` (a
/// version is at most 255 bytes plus the NUL).
pub const WM_VERSION_BUF: usize = 256;
const _: () = assert!(WM_VERSION_BUF == weight_manager_core::MAX_VERSION_LEN + 1);

/// ==========================================================================
/// UPDATE AND CLEAR: the request, progress, per-tensor views, statistics.
/// ==========================================================================
///
/// Progress of an update, passed to the progress callback.
#[repr(C)]
pub struct wm_progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: u64,
    pub tensors_total: u64,
}

/// One whole source tensor for the per-tensor callback: all of a global
/// tensor, or the shard of it a trainer rank serves (`global_shape`,
/// `offset`). Every pointer is valid only during the call.
#[repr(C)]
pub struct wm_tensor_view {
    /// NUL-terminated name.
    pub name: *const c_char,
    /// A `wm_dtype`.
    pub dtype: u32,
    pub ndim: usize,
    pub shape: *const u64,
    /// The tensor's `len` bytes, read-only (zero-copy they are the
    /// publisher's, mapped read-only: a write faults), valid during the
    /// call only: host memory when `device` is -1, else a
    /// CUDA device address valid on GPU `device` (zero-copy from a trainer's
    /// CUDA IPC buffer; copy it with cudaMemcpy, do not dereference it).
    pub data: *const c_void,
    pub len: usize,
    /// -1: `data` is host memory; otherwise the CUDA device ordinal (in
    /// this process) whose memory `data` is.
    pub device: i32,
    /// The global tensor `name` this tensor is a shard of: its shape
    /// (`ndim` entries), and the offset per dimension where this tensor's
    /// box (of `shape`) starts in it. A whole tensor: `global_shape` equals
    /// `shape` and `offset` is all zeros. Valid during the call only.
    pub global_shape: *const u64,
    pub offset: *const u64,
}

/// Called on the updating thread after each batch; return 0 to go on, any
/// other value to cancel the update (`WM_ERR_CANCELLED`).
pub type wm_progress_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, progress: *const wm_progress) -> i32>;

/// Called on the updating thread with each tensor once it arrived whole (and
/// verified, when asked); return 0 on success, any other value to fail the
/// update (`WM_ERR_CALLBACK`). With a tensor callback every source tensor goes
/// to it and registered params are not written: the engine does its own
/// copies (sharding, fused QKV). In atomic mode callbacks run only after every
/// tensor arrived and verified.
pub type wm_tensor_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, tensor: *const wm_tensor_view) -> i32>;

/// What to update from and how. Fill with `wm_update_request_init`.
/// Growable: `struct_size` first.
#[repr(C)]
pub struct wm_update_request {
    /// `sizeof(wm_update_request)`; set by `wm_update_request_init`.
    pub struct_size: u32,
    /// A `wm_source` (default `WM_SOURCE_SNAPSHOT`).
    pub source: u32,
    /// `WM_UPDATE_*` bits (default 0: atomic, no verification).
    pub flags: u32,
    /// Snapshot: model directory or file; NULL: the config's `model_dir`.
    /// ipc: the publisher's socket path. rdma, gdr: the publisher's `host:port`.
    pub location: *const c_char,
    /// Version name (1 to 255 bytes); NULL: the source's own (`version.yaml`;
    /// for ipc, rdma and gdr: the publisher's latest).
    pub version: *const c_char,
    /// Bound on the whole update in milliseconds; 0: 600000. It bounds what
    /// the library waits for; the engine's own callbacks are not cut short
    /// (a deadline passed while one ran fails the update after it returns,
    /// except at an atomic commit, which hands every tensor over once begun).
    /// An rdma or gdr update that runs out of time (or fails) mid-transfer
    /// then takes up to 2 s more to cancel the receives it posted, so that
    /// no byte lands after it returns.
    pub timeout_ms: u64,
    /// Optional.
    pub progress_callback: wm_progress_callback,
    pub progress_user_data: *mut c_void,
    /// Optional; see `wm_tensor_callback`.
    pub tensor_callback: wm_tensor_callback,
    pub tensor_user_data: *mut c_void,
    /// More sources, after `location` (if set): `nlocations` strings, each
    /// a location as above. Several publishers (one per trainer rank, each
    /// serving its shards) serve one version together, and the engine
    /// pulls from all of them at once. A location `@PATH` names a file
    /// listing locations, one per line (blank lines and lines starting with
    /// `#` skipped; a `#` later in a line is part of its location). At most
    /// `WM_MAX_SOURCES` in all. NULL with 0: none. Read during the call only.
    pub locations: *const *const c_char,
    pub nlocations: usize,
}

/// Statistics of one update.
#[repr(C)]
pub struct wm_update_stats {
    /// Caller sets `sizeof(wm_update_stats)`.
    pub struct_size: u32,
    /// This rank's number.
    pub rank: u32,
    /// Source tensors (or pieces of them) the update moved.
    pub tensors: u64,
    /// Bytes the params took: the size of the params the update filled (a
    /// quantized param's FP8 bytes and its scales, whatever dtype its runs
    /// carried; with deltas, the params' size too: the wire's is in
    /// `wm_update_delta_stats`).
    pub bytes: u64,
    /// Sync cost: receiving source bytes, checksums included.
    pub sync_ns: u64,
    /// Update cost: committing staged bytes into params, callbacks.
    pub update_ns: u64,
    /// Total cost: the whole call.
    pub total_ns: u64,
    /// Planning, within `total_ns` (near 0 when the last plan was reused).
    pub plan_ns: u64,
    /// 1: the last update's plan was reused (the sources' layouts and the
    /// registry had not changed); 0: planned anew.
    pub plan_reused: u32,
    /// How many sources the update read from (`wm_update_source_bytes`
    /// gives the bytes of each).
    pub sources: u32,
    /// The version now in the params, NUL-terminated.
    pub version: [c_char; WM_VERSION_BUF],
}

/// ==========================================================================
/// UPDATE AND CLEAR: new weights in, weight memory out.
/// ==========================================================================
///
/// Fill `request` with defaults (snapshot from the config's model_dir,
/// atomic, no verification, 600 s) and set `struct_size`.
///
/// NULL: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_update_request_init(request: *mut wm_update_request) -> wm_result {
    ffi_guard!({
        check_null!(request);
        request.write(wm_update_request {
            struct_size: std::mem::size_of::<wm_update_request>() as u32,
            source: wm_source::Snapshot as u32,
            flags: 0,
            location: std::ptr::null(),
            version: std::ptr::null(),
            timeout_ms: 0,
            progress_callback: None,
            progress_user_data: std::ptr::null_mut(),
            tensor_callback: None,
            tensor_user_data: std::ptr::null_mut(),
            locations: std::ptr::null(),
            nlocations: 0,
        });
        wm_result::WM_OK
    })
}

pub(crate) fn stats_to_c(s: &UpdateStats) -> wm_update_stats {
    let mut out = wm_update_stats {
        struct_size: std::mem::size_of::<wm_update_stats>() as u32,
        rank: s.rank,
        tensors: s.tensors,
        bytes: s.bytes,
        sync_ns: s.sync.as_nanos() as u64,
        update_ns: s.update.as_nanos() as u64,
        total_ns: s.total.as_nanos() as u64,
        plan_ns: s.plan_time.as_nanos() as u64,
        plan_reused: s.plan_reused as u32,
        sources: s.source_bytes.len() as u32,
        version: [0; WM_VERSION_BUF],
    };
    fill_chars(&mut out.version, &s.version);
    out
}

/// The request `r` describes, without its callbacks (the caller adds them
/// as hooks, or refuses them).
pub(crate) unsafe fn request_from_c<'h>(r: &wm_update_request) -> Result<UpdateRequest<'h>> {
    check_struct_size(
        "wm_update_request",
        r.struct_size,
        std::mem::size_of::<wm_update_request>(),
    )?;
    let source = wm_source::from_raw(r.source)
        .map(SourceKind::from)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "wm_update_request.source {} is not a wm_source",
                r.source
            ))
        })?;
    if r.flags & !KNOWN_FLAGS != 0 {
        return Err(Error::invalid_argument(format!(
            "wm_update_request.flags has unknown bits 0x{:x}",
            r.flags & !KNOWN_FLAGS
        )));
    }
    let flag = |bit: u32| r.flags & bit != 0;
    Ok(UpdateRequest {
        source,
        locations: locations_from_c(r)?,
        version: opt_str(r.version, "wm_update_request.version")?,
        verify: flag(WM_UPDATE_VERIFY_CHECKSUMS),
        skip_network_checksums: flag(WM_UPDATE_SKIP_NETWORK_CHECKSUMS),
        mode: match flag(WM_UPDATE_IN_PLACE) {
            true => Mode::InPlace,
            false => Mode::Atomic,
        },
        skip_unknown: flag(WM_UPDATE_SKIP_UNKNOWN),
        deltas: match (flag(WM_UPDATE_WHOLE), flag(WM_UPDATE_DELTAS)) {
            (true, true) => {
                return Err(Error::invalid_argument(
                    "wm_update_request.flags: WM_UPDATE_WHOLE and WM_UPDATE_DELTAS together",
                ))
            }
            (true, false) => DeltaMode::Off,
            (false, true) => DeltaMode::On,
            (false, false) => DeltaMode::Auto,
        },
        timeout: match r.timeout_ms {
            0 => weight_manager_core::defaults::UPDATE_TIMEOUT,
            ms => Duration::from_millis(ms),
        },
        hooks: Hooks::default(),
    })
}

/// `location`, then the `locations` list.
unsafe fn locations_from_c(r: &wm_update_request) -> Result<Vec<std::path::PathBuf>> {
    if r.locations.is_null() && r.nlocations != 0 {
        return Err(Error::null_argument(format!(
            "wm_update_request.locations is NULL but nlocations is {}",
            r.nlocations
        )));
    }
    if r.nlocations > WM_MAX_SOURCES {
        return Err(Error::invalid_argument(format!(
            "wm_update_request.nlocations is {}, more than {WM_MAX_SOURCES}",
            r.nlocations
        )));
    }
    let mut out: Vec<_> = opt_path(r.location).into_iter().collect();
    for i in 0..r.nlocations {
        let p = *r.locations.add(i);
        out.push(opt_path(p).ok_or_else(|| {
            Error::null_argument(format!("wm_update_request.locations[{i}] is NULL"))
        })?);
    }
    Ok(out)
}

/// Update the params from a source. Blocks until the update finished, failed
/// or timed out (`timeout_ms`). The whole plan is checked before any byte
/// moves. On success `*out_stats` (optional: NULL to skip; else its
/// `struct_size` must be set) receives the statistics; on failure it is not
/// written, the reason is in `wm_last_error`, and `wm_status` tells what was
/// left (atomic: old weights and version; in-place after bytes moved: FAILED).
/// One case commits first: an update the control signal asked for, in a
/// group, whose finishing barrier (after this rank's commit) fails because
/// another rank died returns that error ("the update was applied on rank
/// R, but the group did not finish it"), and `wm_status` then names the
/// new version (NORMAL); the controller hears the failure. An update the
/// signal asked for after this rank saw its group stop is refused before
/// any byte moves (`WM_ERR_PEER`).
///
/// `request` and its strings are read during the call only; callbacks run on
/// the calling thread. `WM_ERR_BUSY` if another update, clear or registration runs.
#[no_mangle]
pub unsafe extern "C" fn wm_update(
    manager: *mut wm_manager,
    request: *const wm_update_request,
    out_stats: *mut wm_update_stats,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        if request.is_null() {
            return code_of(&m, Err(Error::null_argument("wm_update: request is NULL")));
        }
        if let Err(e) = check_stats_size(out_stats) {
            return code_of(&m, Err(e));
        }
        let r = &*request;
        let mut req = match request_from_c(r) {
            Ok(c) => c,
            Err(e) => return code_of(&m, Err(e)),
        };
        let mut progress = progress_hook(r);
        let mut tensor = tensor_hook(r);
        req.hooks = Hooks {
            progress: progress.as_mut().map(|f| f as _),
            tensor: tensor.as_mut().map(|f| f as _),
        };
        let updated = m.update(req);
        if updated.is_ok() {
            m.forget_dropped_stage();
        }
        // The update recorded its error on the manager already.
        stats_out(updated.map_err(|e| e.code.into()), out_stats)
    })
}

/// `out_stats`, when given, must have this library's size.
///
/// # Safety
/// `out_stats` is NULL or readable.
pub(crate) unsafe fn check_stats_size(out_stats: *const wm_update_stats) -> Result<()> {
    match out_stats.is_null() {
        true => Ok(()),
        false => check_struct_size(
            "wm_update_stats",
            (*out_stats).struct_size,
            std::mem::size_of::<wm_update_stats>(),
        ),
    }
}

/// Write the statistics of a call that succeeded to `out_stats` (optional);
/// the call's code either way.
///
/// # Safety
/// `out_stats` is NULL or writable (its size checked: `check_stats_size`).
pub(crate) unsafe fn stats_out(
    r: std::result::Result<UpdateStats, wm_result>,
    out_stats: *mut wm_update_stats,
) -> wm_result {
    match r {
        Ok(stats) => {
            if !out_stats.is_null() {
                out_stats.write(stats_to_c(&stats));
            }
            wm_result::WM_OK
        }
        Err(code) => code,
    }
}

/// The engine's progress callback as the applier's hook (non-zero: cancel).
fn progress_hook(r: &wm_update_request) -> Option<impl FnMut(&Progress) -> bool> {
    r.progress_callback.map(|cb| {
        let user = r.progress_user_data;
        move |p: &Progress| {
            let cp = wm_progress {
                bytes_done: p.bytes_done,
                bytes_total: p.bytes_total,
                tensors_done: p.tensors_done,
                tensors_total: p.tensors_total,
            };
            // SAFETY: the engine's callback, called as documented.
            unsafe { cb(user, &cp) == 0 }
        }
    })
}

/// The engine's per-tensor callback as the applier's hook.
fn tensor_hook(
    r: &wm_update_request,
) -> Option<impl FnMut(&TensorView) -> std::result::Result<(), String>> {
    r.tensor_callback.map(|cb| {
        let user = r.tensor_user_data;
        move |t: &TensorView| -> std::result::Result<(), String> {
            let name =
                CString::new(t.name).map_err(|_| "tensor name holds a NUL byte".to_string())?;
            let view = wm_tensor_view {
                name: name.as_ptr(),
                dtype: t.dtype as u32,
                ndim: t.shape.len(),
                shape: t.shape.as_ptr(),
                data: match t.device {
                    Some(d) => d.ptr as *const c_void,
                    None => t.data.as_ptr().cast(),
                },
                len: t.device.map_or(t.data.len(), |d| d.len),
                device: t.device.map_or(-1, |d| d.ordinal),
                global_shape: t.global_shape.as_ptr(),
                offset: t.offset.as_ptr(),
            };
            // SAFETY: the engine's callback, called as documented.
            match unsafe { cb(user, &view) } {
                0 => Ok(()),
                rc => Err(format!("callback returned {rc}")),
            }
        }
    })
}

/// Release the weights' memory: library-owned params give back their
/// physical pages and keep their addresses (they read as zeros until the next
/// update); engine-owned params go to the release callback, if any. The
/// state becomes CLEARED and the version is forgotten; the next `wm_update`
/// brings memory back. Clearing when already CLEARED is a no-op.
///
/// Blocks for the release only. `WM_ERR_BUSY` if an update or clear runs.
#[no_mangle]
pub unsafe extern "C" fn wm_clear(manager: *mut wm_manager) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let r = m.clear().map(|_| ());
        code_of(&m, r)
    })
}
