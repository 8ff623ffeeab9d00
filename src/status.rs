//! Status and the per-step signal.

use super::manager::wm_manager;
use super::update::{stats_to_c, wm_update_stats, WM_VERSION_BUF};
use super::{check_struct_size, code_of, fill_chars};
use crate::enums::wm_delta_fallback;
use crate::result::wm_result;
use std::ffi::c_char;
use weight_manager_core::Error;

/// ==========================================================================
/// STATUS AND SIGNAL
/// ==========================================================================
///
/// A snapshot of a manager's state. Growable: the caller sets `struct_size`.
#[repr(C)]
pub struct wm_status_info {
    /// Caller sets `sizeof(wm_status_info)`.
    pub struct_size: u32,
    /// A `wm_state`.
    pub state: i32,
    /// Result code of the last failed call on this handle, `WM_OK` if none
    /// since the last successful update; text via `wm_last_error`. A call
    /// refused for a bad handle says so by its return code alone (nothing
    /// is recorded on any handle), as does one refused for a NULL pointer
    /// the call writes its result through (`wm_status`'s `out_status`,
    /// `wm_update_source_bytes`'s `out_count`, `wm_update_delta_stats`'s
    /// `out_stats`, `wm_broadcast_signal`'s `out_signal`,
    /// `wm_allocate_param`'s `out_data` and `out_len`), and `wm_last_error`
    /// records nothing, whatever it refuses; every other refusal, a NULL
    /// input (a request, a descriptor, a name) or array included (such as
    /// `wm_update_source_bytes`'s `out_bytes` with a capacity), is recorded
    /// here with a text naming the argument.
    pub last_result: u32,
    /// Successful updates so far.
    pub updates: u64,
    pub params: u64,
    pub param_bytes: u64,
    /// Bytes of params holding memory now (0 after a clear).
    pub resident_bytes: u64,
    /// Version of the weights in the params; "" before the first update,
    /// after a clear, and after an update that left them half-written
    /// (`WM_STATE_FAILED`).
    pub version: [std::ffi::c_char; WM_VERSION_BUF],
    /// Statistics of the last successful update (before the first, zeros
    /// but for its `struct_size`: `sizeof(wm_update_stats)`).
    pub last_update: wm_update_stats,
    /// GPU memory freed by the last clear (library-owned device params), as
    /// the driver's free-memory query reports it; 0 without such params.
    pub device_bytes_freed: u64,
    /// GPU memory taken back by the first update after that clear, as the
    /// driver reports it.
    pub device_bytes_restored: u64,
}

/// ==========================================================================
/// STATUS AND SIGNAL: what the manager is doing, what the control cell says.
/// ==========================================================================
///
/// Read the manager's state, version, counters and last update's statistics
/// into `*out_status`, whose `struct_size` the caller sets.
///
/// Never blocks on a running update (the state then reads UPDATING).
///
/// Two-phase updates (`wm_stage`): after UPDATING, until the update ends,
/// each call also carries this rank's vote on what it staged, and the
/// signal is rank 0's decision on the votes of the step before: UPDATING
/// (keep serving; stage if not yet), `WM_STATE_COMMIT` (every rank staged
/// the same version: call `wm_commit` before the next step; every rank
/// gets it at the same step), or CLEARED (a rank failed to stage, or the
/// ranks staged different versions: every rank's staged version was
/// dropped, `wm_last_error` says which rank and why: whole on the rank
/// that failed, its result code on the others; rank 0 reported it to the
/// controller). Rank 0 decides only once it staged itself.
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_status(
    manager: *const wm_manager,
    out_status: *mut wm_status_info,
) -> wm_result {
    ffi_guard!({
        check_null!(out_status);
        let m = try_handle!(manager);
        let size = (*out_status).struct_size;
        if let Err(e) = check_struct_size(
            "wm_status_info",
            size,
            std::mem::size_of::<wm_status_info>(),
        ) {
            return code_of(&m, Err(e));
        }
        let s = m.status();
        let mut out = wm_status_info {
            struct_size: size,
            state: crate::enums::wm_state::from(s.state) as i32,
            last_result: s
                .last_error
                .as_ref()
                .map_or(wm_result::WM_OK, |e| e.code.into()) as u32,
            updates: s.updates,
            params: s.params,
            param_bytes: s.param_bytes,
            resident_bytes: s.resident_bytes,
            version: [0; WM_VERSION_BUF],
            last_update: stats_to_c(&s.last_update.unwrap_or_default()),
            device_bytes_freed: s.device_bytes_freed,
            device_bytes_restored: s.device_bytes_restored,
        };
        fill_chars(&mut out.version, s.version.as_deref().unwrap_or(""));
        out_status.write(out);
        wm_result::WM_OK
    })
}

/// The bytes the last successful update took from each of its sources
/// (the bytes of the runs each filled, in the dtype the runs carry: a
/// quantized param's are a snapshot's bf16, a publisher's FP8, its scales
/// made by the engine; with deltas, what crossed the wire is in
/// `wm_update_delta_stats`), in
/// the order the request named them (`location`, then `locations`, with
/// `@FILE` lists expanded): up to `capacity` values go to `out_bytes` and
/// the number of sources to `*out_count` (0 before any update). Call with
/// `capacity` 0 (and `out_bytes` NULL) to learn the count.
///
/// NULL `out_count`, or NULL `out_bytes` with `capacity` above 0:
/// `WM_ERR_NULL_ARGUMENT`. Never blocks on a running update. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_update_source_bytes(
    manager: *const wm_manager,
    out_bytes: *mut u64,
    capacity: usize,
    out_count: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(out_count);
        let m = try_handle!(manager);
        if out_bytes.is_null() && capacity > 0 {
            let e = Error::null_argument("wm_update_source_bytes: out_bytes is NULL");
            return code_of(&m, Err(e));
        }
        let bytes = m.status().last_update.map_or(vec![], |u| u.source_bytes);
        for (i, b) in bytes.iter().take(capacity).enumerate() {
            out_bytes.add(i).write(*b);
        }
        out_count.write(bytes.len());
        wm_result::WM_OK
    })
}

/// What the deltas of the last successful update did (all zero before the
/// first). Its own call, not fields of `wm_update_stats`: that struct sits
/// inside `wm_status_info`, so growing it would move the status fields
/// after it under 0.2 callers. Growable: `struct_size` first.
#[repr(C)]
pub struct wm_delta_stats {
    /// Caller sets `sizeof(wm_delta_stats)`.
    pub struct_size: u32,
    /// A `wm_delta_fallback`: why runs came whole (`WM_DELTA_FALLBACK_NONE`
    /// when deltas were asked for every run with a base).
    pub fallback: u32,
    /// Runs (one param piece's bytes from one source) sent as deltas, and
    /// whole.
    pub runs_delta: u64,
    pub runs_whole: u64,
    /// Bytes the sources sent: the runs sent whole plus the deltas
    /// (`wm_update_stats.bytes` is what the params took).
    pub wire_bytes: u64,
    /// Bytes the deltas rewrote in the params (every byte of a chunk of
    /// 32,768 elements the delta carried whole).
    pub rewritten_bytes: u64,
    /// The version the params held that the update named to its
    /// publishers as the base of deltas, NUL-terminated; named also when
    /// the runs came whole (`WM_DELTA_FALLBACK_NOT_KEPT`, `_DIFFERS`). ""
    /// when it named none: `_REFUSED`, `_NO_BASE`, `_NOT_ASKED`, and
    /// `_NOT_APPLICABLE` for a snapshot, keyed digests or a tensor
    /// callback.
    pub base_version: [c_char; WM_VERSION_BUF],
}

/// The delta statistics of the last successful update into `*out_stats`
/// (its `struct_size` set). Before any update: all zero, fallback NONE.
///
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`; a wrong `struct_size`:
/// `WM_ERR_STRUCT_SIZE`. Never blocks on a running update. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_update_delta_stats(
    manager: *const wm_manager,
    out_stats: *mut wm_delta_stats,
) -> wm_result {
    ffi_guard!({
        check_null!(out_stats);
        let m = try_handle!(manager);
        let size = check_struct_size(
            "wm_delta_stats",
            (*out_stats).struct_size,
            std::mem::size_of::<wm_delta_stats>(),
        );
        if let Err(e) = size {
            return code_of(&m, Err(e));
        }
        let d = m.status().last_update.map(|u| u.deltas).unwrap_or_default();
        let mut out = wm_delta_stats {
            struct_size: std::mem::size_of::<wm_delta_stats>() as u32,
            fallback: wm_delta_fallback::from(d.fallback) as u32,
            runs_delta: d.runs_delta,
            runs_whole: d.runs_whole,
            wire_bytes: d.wire_bytes,
            rewritten_bytes: d.rewritten_bytes,
            base_version: [0; WM_VERSION_BUF],
        };
        fill_chars(&mut out.base_version, &d.base_version);
        out_stats.write(out);
        wm_result::WM_OK
    })
}

/// Get the signal every rank acts on this step (a `wm_state`: NORMAL,
/// UPDATING, CLEARING or CLEARED; and COMMIT while a two-phase update is
/// voted on: see `wm_stage` and `wm_status`) into `*out_signal`.
///
/// Rank 0's control cell decides; without a cell the signal is NORMAL. Every
/// rank calls it once per step and all ranks get the same value for the same
/// step: with world_size above 1 the ranks must be in a group
/// (`wm_config.group`, its `name`): shared memory among the ranks of a node, TCP between
/// nodes. NORMAL is cheap: one shared-memory read, no syscall; any other
/// value returns only after every rank got it (a barrier, bounded by the
/// group timeout). Several ranks without a group: `WM_ERR_STATE`.
///
/// A rank that died or stopped calling: `WM_ERR_PEER` or `WM_ERR_TIMEOUT`
/// naming it, on every surviving rank, and the group stays failed (restart
/// the ranks); rank 0 then records the reason for the controller and moves a
/// pending request in the cell to CLEARED. Each rank finishes what the
/// signal asked for (`wm_update`, `wm_commit`, `wm_clear`: they end in a
/// barrier with the other ranks) before its next call: ranks out of step
/// (one finishing a clear while rank 0 asks for the signal again) stop the
/// group the same way: rank 0's call fails with `WM_ERR_STATE` naming the
/// step and the ranks, the other ranks' next calls with `WM_ERR_PEER`
/// carrying it.
/// A control cell truncated under the
/// engine: `WM_ERR_FORMAT` naming it (never a crash); a value in the cell
/// that is no state: `WM_ERR_FORMAT`.
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_broadcast_signal(
    manager: *mut wm_manager,
    out_signal: *mut i32,
) -> wm_result {
    ffi_guard!({
        check_null!(out_signal);
        let m = try_handle!(manager);
        match m.broadcast_signal() {
            Ok(s) => {
                *out_signal = crate::enums::wm_state::from(s) as i32;
                wm_result::WM_OK
            }
            Err(e) => e.code.into(),
        }
    })
}
