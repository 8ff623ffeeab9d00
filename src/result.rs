//! Result text and the library version.

use std::ffi::c_char;
use weight_manager_core::result::wm_result;

/// Library version; matches Cargo.toml (tested).
pub const WM_VERSION_MAJOR: u32 = 0;
pub const WM_VERSION_MINOR: u32 = 1;
pub const WM_VERSION_PATCH: u32 = 0;

/// The library's version as a static NUL-terminated string ("0.1.0").
///
/// Ownership: the string is static; do not free it. Thread-safe, never blocks.
#[no_mangle]
pub extern "C" fn wm_version() -> *const c_char {
    ffi_guard_or!(c"?".as_ptr(), {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    })
}

/// Static NUL-terminated text describing a result code; unknown numbers give
/// "unknown result code".
///
/// Ownership: static; do not free. Thread-safe, never blocks.
#[no_mangle]
pub extern "C" fn wm_result_text(result: u32) -> *const c_char {
    ffi_guard_or!(c"?".as_ptr(), {
        match wm_result::from_raw(result) {
            Some(r) => r.text().as_ptr().cast(),
            None => c"unknown result code".as_ptr(),
        }
    })
}

/// Static NUL-terminated name of a state value ("NORMAL", "FAILED", ...);
/// unknown values give "UNKNOWN".
///
/// Ownership: static; do not free. Thread-safe, never blocks.
#[no_mangle]
pub extern "C" fn wm_state_name(state: i32) -> *const c_char {
    ffi_guard_or!(c"?".as_ptr(), {
        weight_manager_core::state::State::from_raw(state)
            .map_or(c"UNKNOWN", weight_manager_core::state::State::c_name)
            .as_ptr()
    })
}
