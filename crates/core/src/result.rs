//! Result codes and the library's error type.
//!
//! `wm_result` is the one list of outcomes shared by Rust and C. Its numbers
//! are part of the ABI: a code is never renumbered or reused, new codes are
//! appended. Rust code carries an [`Error`] (code + message naming the thing
//! that is wrong); the C boundary returns the code and keeps the message per
//! handle.

use std::fmt;

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

impl wm_result {
    /// Every code, in numeric order (used by tests and `wm_result_text`).
    pub(crate) const ALL: [wm_result; 21] = [
        wm_result::WM_OK,
        wm_result::WM_ERR_NULL_ARGUMENT,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        wm_result::WM_ERR_STRUCT_SIZE,
        wm_result::WM_ERR_STATE,
        wm_result::WM_ERR_BUSY,
        wm_result::WM_ERR_NOT_FOUND,
        wm_result::WM_ERR_IO,
        wm_result::WM_ERR_FORMAT,
        wm_result::WM_ERR_MISMATCH,
        wm_result::WM_ERR_CHECKSUM,
        wm_result::WM_ERR_TIMEOUT,
        wm_result::WM_ERR_UNSUPPORTED,
        wm_result::WM_ERR_NO_VERSION,
        wm_result::WM_ERR_OUT_OF_MEMORY,
        wm_result::WM_ERR_CALLBACK,
        wm_result::WM_ERR_CANCELLED,
        wm_result::WM_ERR_PEER,
        wm_result::WM_ERR_PANIC,
        wm_result::WM_ERR_INVALID_HANDLE,
        wm_result::WM_ERR_AUTH,
    ];

    /// The code for a raw number, if it is one.
    pub fn from_raw(raw: u32) -> Option<wm_result> {
        Self::ALL.get(raw as usize).copied()
    }

    /// Static, NUL-terminated text describing the code.
    pub fn text(self) -> &'static str {
        match self {
            wm_result::WM_OK => "ok\0",
            wm_result::WM_ERR_NULL_ARGUMENT => "a required pointer argument was NULL\0",
            wm_result::WM_ERR_INVALID_ARGUMENT => "an argument is out of range or malformed\0",
            wm_result::WM_ERR_STRUCT_SIZE => "struct_size does not match this library's struct\0",
            wm_result::WM_ERR_STATE => "not allowed in the manager's current state\0",
            wm_result::WM_ERR_BUSY => "another update, clear or registration is running\0",
            wm_result::WM_ERR_NOT_FOUND => "not found\0",
            wm_result::WM_ERR_IO => "I/O error\0",
            wm_result::WM_ERR_FORMAT => "malformed source data\0",
            wm_result::WM_ERR_MISMATCH => "source does not match the registered params\0",
            wm_result::WM_ERR_CHECKSUM => "checksum mismatch\0",
            wm_result::WM_ERR_TIMEOUT => "timed out\0",
            wm_result::WM_ERR_UNSUPPORTED => "not supported by this build or machine\0",
            wm_result::WM_ERR_NO_VERSION => "no version given or found\0",
            wm_result::WM_ERR_OUT_OF_MEMORY => "out of memory\0",
            wm_result::WM_ERR_CALLBACK => "an engine callback failed\0",
            wm_result::WM_ERR_CANCELLED => "cancelled (the progress callback, a destroy, or a clear or abort of a staged version)\0",
            wm_result::WM_ERR_PEER => "peer died or broke the protocol\0",
            wm_result::WM_ERR_PANIC => "internal panic caught at the C boundary\0",
            wm_result::WM_ERR_INVALID_HANDLE => "not a live weight_manager handle\0",
            wm_result::WM_ERR_AUTH => "authentication with the peer failed\0",
        }
    }

    /// The code's name as written in the header (`WM_ERR_IO`).
    pub fn name(self) -> String {
        format!("{self:?}")
    }
}

/// An error: what kind (the C code) and a message naming what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: wm_result,
    pub message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

macro_rules! constructors {
    ($($fn_name:ident => $code:ident),* $(,)?) => {
        impl Error {
            $(
                #[doc = concat!("An error with code `", stringify!($code), "`.")]
                pub fn $fn_name(message: impl Into<String>) -> Error {
                    Error::new(wm_result::$code, message)
                }
            )*
        }
    };
}

constructors! {
    null_argument => WM_ERR_NULL_ARGUMENT,
    invalid_argument => WM_ERR_INVALID_ARGUMENT,
    struct_size => WM_ERR_STRUCT_SIZE,
    state => WM_ERR_STATE,
    busy => WM_ERR_BUSY,
    not_found => WM_ERR_NOT_FOUND,
    format => WM_ERR_FORMAT,
    mismatch => WM_ERR_MISMATCH,
    checksum => WM_ERR_CHECKSUM,
    timeout => WM_ERR_TIMEOUT,
    unsupported => WM_ERR_UNSUPPORTED,
    no_version => WM_ERR_NO_VERSION,
    out_of_memory => WM_ERR_OUT_OF_MEMORY,
    callback => WM_ERR_CALLBACK,
    cancelled => WM_ERR_CANCELLED,
    peer => WM_ERR_PEER,
    auth => WM_ERR_AUTH,
}

impl Error {
    pub fn new(code: wm_result, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    /// An I/O error, with what was being done (`context`) in front of the OS text.
    pub fn io(context: impl fmt::Display, err: impl fmt::Display) -> Error {
        Error::new(wm_result::WM_ERR_IO, format!("{context}: {err}"))
    }

    /// This error of item `k` of the `n` a call took together, all or
    /// nothing (`item` and `verb`: "tensor", "added"): named by its place
    /// (from 0) when there are several, saying that none was taken.
    pub fn among(self, (k, n): (usize, usize), (item, verb): (&str, &str)) -> Error {
        match n {
            1 => self,
            n => self.context(format!(
                "{item} {k} of the {n} {verb} together (none was {verb})"
            )),
        }
    }

    /// The same error with more context in front of its message.
    pub fn context(self, context: impl fmt::Display) -> Error {
        Error::new(self.code, format!("{context}: {}", self.message))
    }
}

/// An empty vector with room for `n` items, or `WM_ERR_OUT_OF_MEMORY`
/// naming `what`: for a count something outside announced (already
/// checked against a bound), whose memory may still not be there: an
/// infallible allocation would abort the whole process.
pub(crate) fn try_vec<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        Error::out_of_memory(format!(
            "{what}: room for {n} items of {} bytes: {e}",
            std::mem::size_of::<T>()
        ))
    })?;
    Ok(v)
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.code.name())
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_dense_and_fixed() {
        for (i, code) in wm_result::ALL.iter().enumerate() {
            assert_eq!(*code as u32, i as u32, "{code:?}");
            assert_eq!(wm_result::from_raw(i as u32), Some(*code));
            assert!(code.text().ends_with('\0'));
        }
        assert_eq!(wm_result::from_raw(wm_result::ALL.len() as u32), None);
        assert_eq!(wm_result::WM_ERR_PANIC as u32, 18);
    }

    #[test]
    fn context_keeps_code() {
        let e = Error::checksum("tensor 'w'").context("update 7");
        assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM);
        assert_eq!(e.message, "update 7: tensor 'w'");
    }
}
