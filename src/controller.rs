//! The controller's handle: ask the engine for updates and clears through
//! the control cell (the controller's protocol: `signal::controller`).

use super::{HandleTable, Handled};
use crate::enums::{wm_request_outcome, wm_state};
use crate::result::wm_result;
use std::ffi::{c_char, CStr};
use std::time::Duration;
use weight_manager_core::Controller;
use weight_manager_core::State;
use weight_manager_core::{Error, Result};

/// ==========================================================================
/// HANDLES: opaque; created and destroyed by their section's calls.
/// ==========================================================================
///
/// A controller's view of one control cell. Opaque; create with
/// `wm_controller_open`, free with `wm_controller_destroy`.
pub struct wm_controller {
    _private: [u8; 0],
}

type ControllerHandle = Handled<Controller>;

static CONTROLLERS: HandleTable<ControllerHandle> = HandleTable::new();

macro_rules! try_controller {
    ($p:expr) => {
        try_get!(CONTROLLERS, $p)
    };
}

fn state_arg(raw: i32) -> Result<State> {
    wm_state::from_raw(raw)
        .map(State::from)
        .filter(|s| s.is_signal())
        .ok_or_else(|| {
            Error::invalid_argument(format!("{raw} is not a wm_state control-word value"))
        })
}

/// ==========================================================================
/// CONTROLLER: ask the engine for updates and clears through its control cell.
/// ==========================================================================
///
/// Open (or create, zeroed) the control cell `/dev/shm/<cell_name>` and
/// return a controller handle in `*out_controller`, owned by the caller and
/// freed with `wm_controller_destroy`.
///
/// The cell's page is reserved here: a full /dev/shm is
/// `WM_ERR_OUT_OF_MEMORY` (naming /dev/shm) and leaves no object behind.
/// A cell truncated later, while open, makes the calls on this handle fail
/// with `WM_ERR_FORMAT` naming it, never a crash.
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`; a bad name: `WM_ERR_INVALID_ARGUMENT`.
/// On failure `*out_controller` is unchanged and the reason is kept for
/// `wm_last_create_error`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_open(
    cell_name: *const c_char,
    out_controller: *mut *mut wm_controller,
) -> wm_result {
    ffi_guard!({
        check_null_create!(cell_name, out_controller);
        let made = CStr::from_ptr(cell_name)
            .to_str()
            .map_err(|_| Error::invalid_argument("cell_name is not valid UTF-8"))
            .and_then(Controller::open)
            .map(ControllerHandle::new);
        super::created(&CONTROLLERS, made, out_controller)
    })
}

/// Read the control word into `*out_state` (a `wm_state`). A value that is
/// none of the four states: `WM_ERR_FORMAT`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_get(
    controller: *const wm_controller,
    out_state: *mut i32,
) -> wm_result {
    ffi_guard!({
        check_null!(out_state);
        let h = try_controller!(controller);
        match h.code(h.value.get()) {
            Ok(s) => {
                *out_state = wm_state::from(s) as i32;
                wm_result::WM_OK
            }
            Err(c) => c,
        }
    })
}

/// Store `state` (NORMAL, UPDATING, CLEARING or CLEARED) unconditionally.
/// For tools and resets; requests should use `wm_controller_request`.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_set(
    controller: *mut wm_controller,
    state: i32,
) -> wm_result {
    ffi_guard!({
        let h = try_controller!(controller);
        match h.code(state_arg(state).and_then(|s| h.value.set(s))) {
            Ok(()) => wm_result::WM_OK,
            Err(c) => c,
        }
    })
}

/// Ask the engine for `action` (`WM_STATE_UPDATING` or `WM_STATE_CLEARING`)
/// and wait up to `timeout_ms` for it to finish (protocol: `signal::controller`). On
/// `WM_OK`, `*out_outcome` is a `wm_request_outcome`: DONE, ALREADY_DONE
/// (up to date / already cleared), BUSY (the same action runs) or REFUSED
/// (the opposite action runs). The engine failing: its result code, with
/// the failing rank's reason in `wm_controller_last_error` (a rank that died:
/// `WM_ERR_PEER` naming it, and the word is left at CLEARED). The engine's
/// rank 0 gone (it created the report beside the cell, whose pid no longer
/// runs in this pid namespace): `WM_ERR_PEER` saying so, with the engine's
/// last failure, and the word moved to CLEARED. No answer in time:
/// `WM_ERR_TIMEOUT` (the word still holds the request). A report beside the
/// cell that never settles is named in the error instead of waited on. Blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_request(
    controller: *mut wm_controller,
    action: i32,
    timeout_ms: u64,
    out_outcome: *mut u32,
) -> wm_result {
    ffi_guard!({
        check_null!(out_outcome);
        let h = try_controller!(controller);
        let r =
            state_arg(action).and_then(|a| h.value.request(a, Duration::from_millis(timeout_ms)));
        match h.code(r) {
            Ok(o) => {
                *out_outcome = wm_request_outcome::from(o) as u32;
                wm_result::WM_OK
            }
            Err(c) => c,
        }
    })
}

/// Wait up to `timeout_ms` until the control word holds `state`. Blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_wait(
    controller: *mut wm_controller,
    state: i32,
    timeout_ms: u64,
) -> wm_result {
    ffi_guard!({
        let h = try_controller!(controller);
        let r =
            state_arg(state).and_then(|s| h.value.wait_for(s, Duration::from_millis(timeout_ms)));
        match h.code(r) {
            Ok(()) => wm_result::WM_OK,
            Err(c) => c,
        }
    })
}

/// Copy the text of this controller's last error into `buf` (`len` bytes
/// with the NUL), truncated to fit; `*out_written` gets the bytes written
/// without the NUL. Same rules as `wm_last_error`.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_last_error(
    controller: *const wm_controller,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(buf, out_written);
        let h = try_controller!(controller);
        let text = h.last_error_text();
        super::copy_text_out(&text, buf, len, out_written)
    })
}

/// Destroy a controller handle (the cell itself stays). NULL or already
/// destroyed: no-op. The handle is invalid to new calls at once (handle
/// values are never reused). A controller holds none of the caller's
/// memory, so nothing is cancelled: destroy waits for calls running on
/// other threads to return (a request or wait runs to its own `timeout_ms`);
/// called from inside such a call's thread it returns at once.
#[no_mangle]
pub unsafe extern "C" fn wm_controller_destroy(controller: *mut wm_controller) {
    ffi_guard_or!((), { CONTROLLERS.destroy(controller.cast(), |_| {}) })
}
