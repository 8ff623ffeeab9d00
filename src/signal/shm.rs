//! POSIX shared-memory objects (`/dev/shm/<name>`), mapped read-write.
//!
//! Sizes are checked before mapping and set with `ftruncate` on creation, so a
//! short object is an error, never a SIGBUS on first access.

use crate::result::{Error, Result};
use std::ffi::CString;

pub struct SharedMapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory; all access goes through atomics.
unsafe impl Send for SharedMapping {}
unsafe impl Sync for SharedMapping {}

/// Check a shared-memory object name: 1..=200 bytes, no '/' or NUL.
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.contains('\0') {
        return Err(Error::invalid_argument(format!(
            "shared-memory name '{name}' must be 1 to 200 bytes with no '/' or NUL"
        )));
    }
    Ok(())
}

fn c_name(name: &str) -> Result<CString> {
    check_name(name)?;
    Ok(CString::new(format!("/{name}")).expect("checked for NUL"))
}

fn os_err(what: String) -> Error {
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOSPC) {
        Error::out_of_memory(format!("{what}: /dev/shm is full"))
    } else {
        Error::io(what, e)
    }
}

/// How to open an object.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Open it if it exists (it must be at least `len` bytes), else create it zeroed.
    OpenOrCreate,
    /// Remove any object of that name, then create a new zeroed one.
    CreateFresh,
    /// Open an existing object only; `Ok(None)` if absent or shorter than `len`.
    Existing,
}

impl SharedMapping {
    /// Open `/dev/shm/<name>` and map its first `len` bytes.
    pub fn open(name: &str, len: usize, mode: OpenMode) -> Result<Option<SharedMapping>> {
        let cname = c_name(name)?;
        let what = format!("/dev/shm/{name}");
        // SAFETY: libc calls on a checked name and our own descriptor.
        unsafe {
            let flags = match mode {
                OpenMode::OpenOrCreate => libc::O_RDWR | libc::O_CREAT,
                OpenMode::CreateFresh => {
                    libc::shm_unlink(cname.as_ptr());
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL
                }
                OpenMode::Existing => libc::O_RDWR,
            };
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            if fd < 0 {
                if mode == OpenMode::Existing && *libc::__errno_location() == libc::ENOENT {
                    return Ok(None);
                }
                return Err(os_err(format!("opening {what}")));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = os_err(format!("stat {what}"));
                libc::close(fd);
                return Err(e);
            }
            let size = st.st_size as usize;
            if size == 0 && mode != OpenMode::Existing {
                if libc::ftruncate(fd, len as libc::off_t) != 0 {
                    let e = os_err(format!("sizing {what} to {len} bytes"));
                    libc::close(fd);
                    return Err(e);
                }
            } else if size < len {
                libc::close(fd);
                if mode == OpenMode::Existing {
                    return Ok(None);
                }
                return Err(Error::format(format!(
                    "{what} is {size} bytes, expected at least {len}"
                )));
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            if p == libc::MAP_FAILED {
                return Err(os_err(format!("mapping {what}")));
            }
            Ok(Some(SharedMapping { ptr: p.cast(), len }))
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: we own this mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Remove an object's name; mappings stay valid. A missing object is fine.
pub fn unlink(name: &str) -> Result<()> {
    let cname = c_name(name)?;
    // SAFETY: plain libc call on a checked name.
    if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(Error::io(format!("unlinking /dev/shm/{name}"), e));
        }
    }
    Ok(())
}

/// Whether process `pid` is alive (signal 0 probe).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    // SAFETY: kill with signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
