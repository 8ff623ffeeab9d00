//! The C boundary, and nothing else: pointer checks, struct sizes, integer
//! enums, the panic guard, and translation to and from the Rust API. Every
//! rule of the library lives in the plain Rust modules.
//!
//! Conventions (after rustls-ffi):
//! - every exported function body is wrapped in `ffi_guard!` (or
//!   `ffi_guard_or!` when it does not return `wm_result`); a panic becomes
//!   `WM_ERR_PANIC` and never unwinds into C. `tests/header.rs`
//!   (`every_export_uses_the_panic_guard`) checks that every `#[no_mangle]`
//!   function does this.
//! - outputs are written only on success.
//! - a handle is a key into a table of live objects, never reused: a
//!   destroyed or made-up handle is `WM_ERR_INVALID_HANDLE`, not a
//!   use-after-free, and destroy waits for calls in flight (`handles.rs`).
//! - a create-style call that fails leaves its reason for
//!   `wm_last_create_error` on the calling thread (there is no handle).
//!
//! Files (a new C function goes in the file of its handle, then the header
//! is regenerated: `WM_BLESS=1 cargo test --test header`): `result.rs`
//! (codes, version), `enums.rs` (the C enums), `manager.rs` (config,
//! init, error text, destroy),
//! `params.rs` (registration), `update.rs` (update, clear), `stage.rs`
//! (two-phase updates: stage, commit, abort), `status.rs`
//! (status, signal), `controller.rs` (the controller's handle),
//! `publisher.rs` (the trainer's publisher: create; `publisher/tensors.rs` what it
//! serves, `publisher/serve.rs` publish, serve, destroy), `handles.rs` (the
//! handle tables).

#![expect(
    non_camel_case_types,
    reason = "the C names (wm_result, wm_config, ...) are the header's"
)]
#![expect(
    clippy::missing_safety_doc,
    reason = "each export's doc comment states its C contract (ownership, NULL, threads): that is its safety section, written for C readers"
)]
#![cfg_attr(not(test), warn(clippy::undocumented_unsafe_blocks))]

pub(crate) use handles::HandleTable;
use result::wm_result;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use weight_manager_core::Manager;
use weight_manager_core::{Error, Result};

/// Run an exported function's body; a panic becomes `WM_ERR_PANIC`.
macro_rules! ffi_guard {
    ($body:block) => {
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(
            || -> $crate::result::wm_result { $body },
        )) {
            Ok(r) => r,
            Err(_) => $crate::result::wm_result::WM_ERR_PANIC,
        }
    };
}

/// Like [`ffi_guard!`] for functions that return a value: a panic gives `$default`.
macro_rules! ffi_guard_or {
    ($default:expr, $body:block) => {
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(r) => r,
            Err(_) => $default,
        }
    };
}

/// Return `WM_ERR_NULL_ARGUMENT` from the enclosing function if `$p` is NULL.
macro_rules! check_null {
    ($($p:expr),+) => {
        $(if $p.is_null() { return $crate::result::wm_result::WM_ERR_NULL_ARGUMENT; })+
    };
}

/// `check_null!` for create-style calls: a NULL argument is also why the
/// call failed for `wm_last_create_error` (not an earlier call's reason).
macro_rules! check_null_create {
    ($($p:ident),+) => {
        $(if $p.is_null() {
            $crate::LAST_CREATE_ERROR
                .with(|t| *t.borrow_mut() = format!("'{}' is NULL", stringify!($p)));
            return $crate::result::wm_result::WM_ERR_NULL_ARGUMENT;
        })+
    };
}

/// Resolve a manager handle or return its error code from the enclosing function.
macro_rules! try_handle {
    ($p:expr) => {
        try_get!($crate::MANAGERS, $p)
    };
}

/// Resolve a handle of `$table` or return its error code.
macro_rules! try_get {
    ($table:expr, $p:expr) => {
        match $table.get($p as *const std::ffi::c_void) {
            Ok(h) => h,
            Err(code) => return code,
        }
    };
}

/// One C enum mirroring a core enum: `ALL`, `from_raw`, and conversions both ways.
macro_rules! mirror {
    ($c:ident, $core:ident, $raw:ty, [$($v:ident),+ $(,)?]) => {
        impl $c {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$c] = &[$($c::$v),+];

            /// The variant with number `raw`, if there is one.
            pub fn from_raw(raw: $raw) -> Option<$c> {
                Self::ALL.iter().copied().find(|v| *v as $raw == raw)
            }
        }
        impl From<$core> for $c {
            fn from(v: $core) -> $c {
                match v {
                    $($core::$v => $c::$v),+
                }
            }
        }
        impl From<$c> for $core {
            fn from(v: $c) -> $core {
                match v {
                    $($c::$v => $core::$v),+
                }
            }
        }
    };
}

// Module order is the header's order (cbindgen emits functions in module
// order, each file's in source order): results and conventions, the
// engine, params, update, status, controller, the trainer's publisher.
// Blank lines apart, so that rustfmt (reorder_modules) keeps the order.
pub mod result;

pub mod enums;

pub mod manager;

pub mod params;

pub mod update;

pub mod stage;

pub mod status;

pub mod controller;

pub mod publisher;

mod handles;

/// Where it always was (it is the engine section's, in `manager.rs`).
pub use manager::wm_last_create_error;

/// A library object behind a C handle, with the text of its last failure
/// (per handle, so two threads with two handles each read their own). The manager keeps its own, because
/// `wm_status` reports it too.
pub(crate) struct Handled<T> {
    pub(crate) value: T,
    last_error: parking_lot::Mutex<Option<Error>>,
}

impl<T> Handled<T> {
    pub(crate) fn new(value: T) -> Handled<T> {
        Handled {
            value,
            last_error: parking_lot::Mutex::new(None),
        }
    }

    /// `r` with its error turned into a code, the error remembered.
    pub(crate) fn code<R>(&self, r: Result<R>) -> std::result::Result<R, wm_result> {
        r.map_err(|e| {
            let code = e.code.into();
            *self.last_error.lock() = Some(e);
            code
        })
    }

    /// [`Handled::code`] for calls with no output.
    pub(crate) fn result(&self, r: Result<()>) -> wm_result {
        self.code(r).err().unwrap_or(wm_result::WM_OK)
    }

    pub(crate) fn last_error_text(&self) -> String {
        self.last_error
            .lock()
            .as_ref()
            .map(|e| e.message.clone())
            .unwrap_or_default()
    }
}

pub(crate) static MANAGERS: HandleTable<EngineHandle> = HandleTable::new();

/// What a manager handle holds: the manager (shared with the thread of a
/// staged update) and the version staged on it, if any (`stage.rs`).
pub(crate) struct EngineHandle {
    manager: std::sync::Arc<Manager>,
    staged: parking_lot::Mutex<Option<StageSlot>>,
}

/// A handle's two-phase slot (`stage.rs`). `Staging` holds the slot while
/// a `wm_stage` runs, so that other calls answer at once instead of
/// waiting for a staging that may wait on a stalled trainer.
pub(crate) enum StageSlot {
    Staging,
    Staged(weight_manager_core::Staged),
}

impl EngineHandle {
    pub(crate) fn new(manager: Manager) -> EngineHandle {
        EngineHandle {
            manager: std::sync::Arc::new(manager),
            staged: parking_lot::Mutex::new(None),
        }
    }
}

impl std::ops::Deref for EngineHandle {
    type Target = Manager;
    fn deref(&self) -> &Manager {
        &self.manager
    }
}

thread_local! {
    /// Why this thread's last create-style call failed ("" after a success).
    pub(crate) static LAST_CREATE_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// The outcome of a create-style call (`wm_init`, `wm_publisher_create*`,
/// `wm_controller_open`): on success the handle is published into `*out`;
/// on failure the reason is kept for `wm_last_create_error`.
///
/// # Safety
/// `out` is writable (checked non-NULL by the caller).
pub(crate) unsafe fn created<T, H>(
    table: &HandleTable<T>,
    made: Result<T>,
    out: *mut *mut H,
) -> wm_result {
    let (code, text) = match made {
        Ok(value) => {
            *out = table.publish(value).cast();
            (wm_result::WM_OK, String::new())
        }
        Err(e) => (e.code.into(), e.message),
    };
    LAST_CREATE_ERROR.with(|t| *t.borrow_mut() = text);
    code
}

/// The code of `r`, recording its error on the handle.
pub(crate) fn code_of(m: &Manager, r: Result<()>) -> wm_result {
    match r {
        Ok(()) => wm_result::WM_OK,
        Err(e) => m.record_error(e).code.into(),
    }
}

/// Check a growable struct's `struct_size` against the sizes this library
/// accepts (every size the struct has had; one so far).
pub(crate) fn check_struct_size(what: &str, got: u32, want: usize) -> Result<()> {
    if got as usize != want {
        return Err(Error::struct_size(format!(
            "{what}.struct_size is {got}, this library's {what} is {want} bytes \
             (set it to sizeof({what}){})",
            // Structs the caller fills have an _init that sets it; output
            // structs (stats, status) have none.
            match what.ends_with("stats") || what.ends_with("info") {
                true => "",
                false => ", or call its _init function",
            }
        )));
    }
    Ok(())
}

/// Read an optional C string (NULL gives None).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(crate) unsafe fn opt_str(p: *const c_char, what: &str) -> Result<Option<String>> {
    if p.is_null() {
        return Ok(None);
    }
    CStr::from_ptr(p)
        .to_str()
        .map(|s| Some(s.to_string()))
        .map_err(|_| Error::invalid_argument(format!("{what} is not valid UTF-8")))
}

/// A shape from C: `ndim` dims at `shape` (NULL only with `ndim` 0), of
/// `what` ("param 'w'", "tensor 'w'") in errors: the engine's params and
/// the publisher's tensors say the same.
///
/// # Safety
/// `shape` is NULL or holds `ndim` values that outlive `'a`.
pub(crate) unsafe fn shape_arg<'a>(
    shape: *const u64,
    ndim: usize,
    what: &str,
) -> Result<&'a [u64]> {
    if ndim > weight_manager_core::MAX_NDIM {
        return Err(Error::invalid_argument(format!(
            "{what}: ndim {ndim} is more than {}",
            weight_manager_core::MAX_NDIM
        )));
    }
    if ndim > 0 && shape.is_null() {
        return Err(Error::null_argument(format!(
            "{what}: shape is NULL with ndim {ndim}"
        )));
    }
    Ok(match ndim {
        0 => &[],
        _ => std::slice::from_raw_parts(shape, ndim),
    })
}

/// The `count` elements at `ptr` of a call taking an array (`what`, as
/// "wm_register_params: params"): empty when `count` is 0 (`ptr` may then
/// be NULL); NULL with a count is `WM_ERR_NULL_ARGUMENT`, and a count whose
/// bytes could not exist is refused before anything is read.
///
/// # Safety
/// `ptr` is NULL or holds `count` elements that outlive `'a`.
pub(crate) unsafe fn c_array<'a, T>(ptr: *const T, count: usize, what: &str) -> Result<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::null_argument(format!(
            "{what} is NULL with a count of {count}"
        )));
    }
    if count > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Error::invalid_argument(format!(
            "{what}: {count} elements do not fit in memory"
        )));
    }
    Ok(std::slice::from_raw_parts(ptr, count))
}

/// Read an optional C path (NULL gives None; any bytes allowed).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(crate) unsafe fn opt_path(p: *const c_char) -> Option<PathBuf> {
    (!p.is_null()).then(|| PathBuf::from(OsStr::from_bytes(CStr::from_ptr(p).to_bytes())))
}

/// The `*_last_error` calls: copy `text` into `buf` (`len` bytes with the
/// NUL), truncated to fit, and store the bytes written without the NUL.
///
/// # Safety
/// `buf` holds `len` bytes and `out_written` is writable (both checked non-NULL).
pub(crate) unsafe fn copy_text_out(
    text: &str,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    if buf.is_null() || out_written.is_null() {
        return wm_result::WM_ERR_NULL_ARGUMENT;
    }
    if len == 0 {
        return wm_result::WM_ERR_INVALID_ARGUMENT;
    }
    let dst = std::slice::from_raw_parts_mut(buf, len);
    fill_chars(dst, text);
    *out_written = dst.iter().position(|c| *c == 0).unwrap_or(0);
    wm_result::WM_OK
}

/// Copy `s` into a fixed C char array, truncating at a UTF-8 boundary, NUL-terminated.
pub(crate) fn fill_chars(dst: &mut [c_char], s: &str) {
    let max = dst.len().saturating_sub(1);
    let mut n = s.len().min(max);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    for (d, b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = *b as c_char;
    }
    if let Some(d) = dst.get_mut(n) {
        *d = 0;
    }
}

#[cfg(test)]
mod tests {
    use crate::result::wm_result;

    #[test]
    fn guard_turns_panics_into_codes() {
        let r = ffi_guard!({
            if std::hint::black_box(true) {
                panic!("boom");
            }
            wm_result::WM_OK
        });
        assert_eq!(r, wm_result::WM_ERR_PANIC);
        let v: u32 = ffi_guard_or!(7, {
            if std::hint::black_box(true) {
                panic!("boom");
            }
            1
        });
        assert_eq!(v, 7);
    }

    #[test]
    fn fill_chars_truncates_on_char_boundary() {
        let mut buf = [1 as std::ffi::c_char; 4];
        super::fill_chars(&mut buf, "aé€");
        assert_eq!(
            buf[..4].iter().map(|c| *c as u8).collect::<Vec<_>>(),
            vec![b'a', 0xc3, 0xa9, 0]
        );
    }
}
