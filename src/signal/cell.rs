//! A control cell: one little-endian int32 in a POSIX shared-memory object,
//! laid out exactly like FastDeploy's `model_weights_status.<suffix>`
//! (SPEC.md), so an existing controller can share it.
//!
//! The object is opened if it exists and created zeroed (NORMAL) with mode
//! 0600 otherwise. Its size is checked before mapping: a shorter object would
//! turn a read into SIGBUS.

use crate::result::{Error, Result};
use crate::state::State;
use std::ffi::CString;
use std::sync::atomic::{AtomicI32, Ordering};

pub struct ControlCell {
    name: String,
    word: *const AtomicI32,
    map_len: usize,
}

// SAFETY: the mapping is shared memory accessed only through an atomic.
unsafe impl Send for ControlCell {}
unsafe impl Sync for ControlCell {}

/// Check a shared-memory object name: 1..=200 bytes, no '/' or NUL.
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.contains('\0') {
        return Err(Error::invalid_argument(format!(
            "control cell name '{name}' must be 1 to 200 bytes with no '/' or NUL"
        )));
    }
    Ok(())
}

impl ControlCell {
    pub fn open_or_create(name: &str) -> Result<ControlCell> {
        check_name(name)?;
        let c_name = CString::new(format!("/{name}")).expect("checked for NUL");
        let what = format!("control cell /dev/shm/{name}");
        // SAFETY: plain libc calls on a checked name and our own fd.
        unsafe {
            let fd = libc::shm_open(c_name.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600);
            if fd < 0 {
                return Err(Error::io(
                    format!("opening {what}"),
                    std::io::Error::last_os_error(),
                ));
            }
            let close = |e: Error| {
                libc::close(fd);
                e
            };
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                return Err(close(Error::io(
                    format!("stat {what}"),
                    std::io::Error::last_os_error(),
                )));
            }
            if st.st_size == 0 && libc::ftruncate(fd, 4) != 0 {
                return Err(close(Error::io(
                    format!("sizing {what}"),
                    std::io::Error::last_os_error(),
                )));
            } else if st.st_size > 0 && st.st_size < 4 {
                return Err(close(Error::format(format!(
                    "{what} is {} bytes, too small for an int32",
                    st.st_size
                ))));
            }
            let map_len = 4;
            let p = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            if p == libc::MAP_FAILED {
                return Err(Error::io(
                    format!("mapping {what}"),
                    std::io::Error::last_os_error(),
                ));
            }
            Ok(ControlCell {
                name: name.to_string(),
                word: p as *const AtomicI32,
                map_len,
            })
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn load(&self) -> i32 {
        // SAFETY: word points into our live 4-byte shared mapping.
        unsafe { (*self.word).load(Ordering::Acquire) }
    }

    /// The cell's value as a state; anything but the four SPEC.md values is an error.
    pub fn read_state(&self) -> Result<State> {
        let raw = self.load();
        State::from_raw(raw).filter(|s| s.is_signal()).ok_or_else(|| {
            Error::format(format!(
                "control cell /dev/shm/{} holds {raw}, which is not NORMAL(0), UPDATING(1), CLEARING(-1) or CLEARED(-2)",
                self.name
            ))
        })
    }

    /// Set the cell from `expected` to `new`; returns the value found when it
    /// was not `expected`. Never writes back a value read earlier.
    pub fn compare_exchange(&self, expected: i32, new: i32) -> std::result::Result<(), i32> {
        // SAFETY: as in load.
        unsafe { (*self.word).compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire) }
            .map(|_| ())
    }

    /// Remove the shared-memory object's name (mappings stay valid).
    pub fn unlink(name: &str) -> Result<()> {
        check_name(name)?;
        let c_name = CString::new(format!("/{name}")).expect("checked for NUL");
        // SAFETY: plain libc call on a checked name.
        if unsafe { libc::shm_unlink(c_name.as_ptr()) } != 0 {
            return Err(Error::io(
                format!("unlinking /dev/shm/{name}"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

impl Drop for ControlCell {
    fn drop(&mut self) {
        // SAFETY: we own this mapping.
        unsafe { libc::munmap(self.word as *mut libc::c_void, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_round_trip_and_bad_values() {
        let name = format!("wm_test_cell_{}", std::process::id());
        let a = ControlCell::open_or_create(&name).unwrap();
        let b = ControlCell::open_or_create(&name).unwrap();
        assert_eq!(a.read_state().unwrap(), State::Normal);
        a.compare_exchange(0, 1).unwrap();
        assert_eq!(b.read_state().unwrap(), State::Updating);
        assert_eq!(b.compare_exchange(0, -1), Err(1));
        b.compare_exchange(1, 7).unwrap();
        assert!(a.read_state().unwrap_err().message.contains("holds 7"));
        ControlCell::unlink(&name).unwrap();
        assert!(check_name("a/b").is_err());
    }
}
