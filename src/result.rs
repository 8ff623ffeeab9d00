//! Result codes, result text and the library version.
//!
//! `wm_result` is defined here, at the C boundary, with the core's codes
//! (`weight_manager_core::wm_result`) and numbers: the core's
//! errors are translated at the boundary (`From`), and
//! `enums::tests::every_variant_has_the_cores_number` checks every number.

use std::ffi::c_char;
use weight_manager_core::wm_result as CoreResult;

/// ==========================================================================
/// RESULTS AND CONVENTIONS: result codes and the enums.
/// ==========================================================================
///
/// Outcome of every fallible call. `WM_OK` is 0; the others are fixed forever.
/// cbindgen:rename-all=None
#[repr(u32)]
#[expect(non_camel_case_types, reason = "the C name of the result codes")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum wm_result {
    /// Success.
    WM_OK = 0,
    /// A required pointer argument was NULL.
    WM_ERR_NULL_ARGUMENT = 1,
    /// An argument is out of range or malformed (unknown enum value, bad flag bits, bad name).
    WM_ERR_INVALID_ARGUMENT = 2,
    /// A struct's `struct_size` is not one this library knows.
    WM_ERR_STRUCT_SIZE = 3,
    /// The call is not allowed in the manager's current state.
    WM_ERR_STATE = 4,
    /// Another update or clear is running on this manager.
    WM_ERR_BUSY = 5,
    /// A file, directory, tensor or version was not found.
    WM_ERR_NOT_FOUND = 6,
    /// An operating-system I/O call failed.
    WM_ERR_IO = 7,
    /// Source data is malformed (bad safetensors header, misaligned tensor, duplicate name).
    WM_ERR_FORMAT = 8,
    /// The source does not match the registered params (unknown, missing, dtype or shape).
    WM_ERR_MISMATCH = 9,
    /// A tensor's bytes do not match its checksum.
    WM_ERR_CHECKSUM = 10,
    /// A bounded wait ran out.
    WM_ERR_TIMEOUT = 11,
    /// The feature or source is not available in this build or on this machine.
    WM_ERR_UNSUPPORTED = 12,
    /// No version was given by the request nor found in the source.
    WM_ERR_NO_VERSION = 13,
    /// Memory could not be allocated or mapped.
    WM_ERR_OUT_OF_MEMORY = 14,
    /// An engine callback reported failure.
    WM_ERR_CALLBACK = 15,
    /// The update was stopped: the progress callback asked to, the handle
    /// was destroyed while it ran, or a clear or an abort dropped the
    /// version it staged.
    WM_ERR_CANCELLED = 16,
    /// A peer process died or broke the protocol.
    WM_ERR_PEER = 17,
    /// A Rust panic was caught at the C boundary; the handle may be unusable.
    WM_ERR_PANIC = 18,
    /// The handle is not a live manager (never created, or already destroyed).
    WM_ERR_INVALID_HANDLE = 19,
    /// The network peer failed the shared-secret challenge (or has no secret).
    WM_ERR_AUTH = 20,
}

mirror!(
    wm_result,
    CoreResult,
    u32,
    [
        WM_OK,
        WM_ERR_NULL_ARGUMENT,
        WM_ERR_INVALID_ARGUMENT,
        WM_ERR_STRUCT_SIZE,
        WM_ERR_STATE,
        WM_ERR_BUSY,
        WM_ERR_NOT_FOUND,
        WM_ERR_IO,
        WM_ERR_FORMAT,
        WM_ERR_MISMATCH,
        WM_ERR_CHECKSUM,
        WM_ERR_TIMEOUT,
        WM_ERR_UNSUPPORTED,
        WM_ERR_NO_VERSION,
        WM_ERR_OUT_OF_MEMORY,
        WM_ERR_CALLBACK,
        WM_ERR_CANCELLED,
        WM_ERR_PEER,
        WM_ERR_PANIC,
        WM_ERR_INVALID_HANDLE,
        WM_ERR_AUTH,
    ]
);

impl From<weight_manager_core::Error> for wm_result {
    fn from(e: weight_manager_core::Error) -> wm_result {
        e.code.into()
    }
}

/// ==========================================================================
/// CONSTANTS: the version, limits, update flags.
/// ==========================================================================
///
/// Library version; matches Cargo.toml (tested).
pub const WM_VERSION_MAJOR: u32 = 0;
pub const WM_VERSION_MINOR: u32 = 2;
pub const WM_VERSION_PATCH: u32 = 0;

/// ==========================================================================
/// RESULTS AND CONVENTIONS: the version, result and state text.
/// ==========================================================================
///
/// The library's version as a static NUL-terminated string (the crate's
/// version, "0.2.0" in this release).
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
            Some(r) => CoreResult::from(r).text().as_ptr().cast(),
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
        crate::enums::wm_state::from_raw(state)
            .map_or(c"UNKNOWN", |s| weight_manager_core::State::from(s).c_name())
            .as_ptr()
    })
}
