//! POSIX shared-memory objects (`/dev/shm/<name>`), mapped read-write.
//!
//! Sizes are checked before mapping and the pages reserved with `fallocate`
//! (on creation and on attach), so a short object or a full /dev/shm is an
//! error, never a SIGBUS on first access. An object shrunk later, under a
//! live mapping, is caught by [`sigbus`] and reported by
//! [`SharedMapping::check`].

use crate::memory::sigbus;
use crate::result::{Error, Result};
use std::ffi::CString;

pub struct SharedMapping {
    ptr: *mut u8,
    len: usize,
    /// Its slot in the SIGBUS guard; `None` only when every slot is taken.
    guard: Option<usize>,
}

// SAFETY: a shared mapping owned by this value, not tied to a thread;
// unmapped (and its guard slot freed) once, on drop.
unsafe impl Send for SharedMapping {}
// SAFETY: the &self methods read only process-local guard flags; the mapped
// bytes are reached through `ptr()` (raw), which the signal code reads and
// writes only as atomics.
unsafe impl Sync for SharedMapping {}

/// Check a shared-memory object name: 1..=200 bytes, no '/' or NUL.
pub fn check_name(name: &str) -> Result<()> {
    // "." and ".." name /dev/shm itself and its parent, never an object.
    let dots = name == "." || name == "..";
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.contains('\0') || dots {
        return Err(Error::invalid_argument(format!(
            "shared-memory name '{name}' must be 1 to 200 bytes with no '/' or NUL, and not '.' or '..'"
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
    /// Create a new zeroed object; `Ok(None)` if one of that name exists.
    CreateNew,
    /// Open an existing object only; `Ok(None)` if absent or shorter than `len`.
    Existing,
}

impl SharedMapping {
    /// Open `/dev/shm/<name>` and map its first `len` bytes. The pages are
    /// reserved (fallocate) before mapping: a full /dev/shm is
    /// `WM_ERR_OUT_OF_MEMORY` here, never a SIGBUS later, and an object this
    /// call created is removed again when it fails.
    pub fn open(name: &str, len: usize, mode: OpenMode) -> Result<Option<SharedMapping>> {
        let cname = c_name(name)?;
        let what = format!("/dev/shm/{name}");
        let Some((fd, created)) = open_fd(&cname, &what, mode)? else {
            return Ok(None);
        };
        let mapped = size_and_map(fd, len, mode, &what);
        // SAFETY: our own descriptor; the mapping keeps the object alive.
        unsafe { libc::close(fd) };
        if created && !matches!(mapped, Ok(Some(_))) {
            // SAFETY: plain libc call on a checked name.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
        }
        mapped
    }

    /// Whether an access through `ptr` faulted because the object shrank
    /// under this mapping (see [`sigbus`]); callers check after each access.
    /// A load of a process-local flag: no syscall, no allocation.
    #[inline]
    pub fn faulted(&self) -> bool {
        self.guard.is_some_and(sigbus::faulted)
    }

    /// [`Self::faulted`] as an error naming the object (`what`).
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        if !self.faulted() {
            return Ok(());
        }
        Err(Error::format(format!(
            "{} was truncated or lost its pages while mapped (someone shrank it, or /dev/shm ran out of memory); its contents are gone",
            what()
        )))
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

/// Open the object's descriptor; `Ok(None)` for a missing `Existing` one.
/// Also says whether this call created it.
fn open_fd(cname: &CString, what: &str, mode: OpenMode) -> Result<Option<(i32, bool)>> {
    // SAFETY: libc calls on a checked name.
    unsafe {
        if mode != OpenMode::Existing {
            let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            if fd >= 0 {
                return Ok(Some((fd, true)));
            }
            if *libc::__errno_location() != libc::EEXIST {
                return Err(os_err(format!("creating {what}")));
            }
            if mode == OpenMode::CreateNew {
                return Ok(None);
            }
        }
        let fd = libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0o600);
        if fd >= 0 {
            return Ok(Some((fd, false)));
        }
        if mode == OpenMode::Existing && *libc::__errno_location() == libc::ENOENT {
            return Ok(None);
        }
        Err(os_err(format!("opening {what}")))
    }
}

/// Check (or, for a new empty object, set) the size, reserve the first `len`
/// bytes' pages and map them.
fn size_and_map(fd: i32, len: usize, mode: OpenMode, what: &str) -> Result<Option<SharedMapping>> {
    // SAFETY: libc calls on our own descriptor.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return Err(os_err(format!("stat {what}")));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::format(format!("{what} is not a regular file")));
        }
        let size = st.st_size as usize;
        if size < len && (size != 0 || mode == OpenMode::Existing) {
            if mode == OpenMode::Existing {
                return Ok(None);
            }
            return Err(Error::format(format!(
                "{what} is {size} bytes, expected at least {len}"
            )));
        }
        // Mode 0 fills holes and extends a new (empty) object to `len`; the
        // contents of an existing one are kept.
        if libc::fallocate(fd, 0, 0, len as libc::off_t) != 0 {
            let unsupported = *libc::__errno_location() == libc::EOPNOTSUPP;
            // Without fallocate (not tmpfs) the size is still set; a fault
            // on a page the filesystem cannot supply is caught by `sigbus`.
            if !unsupported || (size < len && libc::ftruncate(fd, len as libc::off_t) != 0) {
                return Err(os_err(format!("reserving {len} bytes of {what}")));
            }
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(os_err(format!("mapping {what}")));
        }
        let guard = sigbus::register(p as usize, len);
        Ok(Some(SharedMapping {
            ptr: p.cast(),
            len,
            guard,
        }))
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        if let Some(slot) = self.guard {
            sigbus::unregister(slot);
        }
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

/// Whether process `pid` is alive: it exists (signal 0 probe) and is not
/// a zombie (a killed rank whose parent has not reaped it yet answers
/// signal 0 but runs no more: waiting for it would last the whole timeout).
/// When process `pid` started (`/proc/PID/stat`'s 22nd field, in clock
/// ticks since boot): with its pid, it names one process, where a pid
/// alone may have been given to another since. None when it cannot tell.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let end = stat.iter().rposition(|&b| b == b')')?;
    let fields = String::from_utf8_lossy(&stat[end + 1..]).into_owned();
    // The state is the 3rd field, the first after the name.
    fields.split_ascii_whitespace().nth(19)?.parse().ok()
}

pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    // SAFETY: kill with signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    !exited(pid)
}

/// Whether `/proc` says process `pid` exited (dead, or a zombie with no
/// thread left: a leader thread that exited while others run shows Z too);
/// false when it cannot tell.
fn exited(pid: u32) -> bool {
    let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The fields follow the command's name, which may hold any byte but
    // ends at the last ')': the state first, the thread count 18th.
    let Some(end) = stat.iter().rposition(|&b| b == b')') else {
        return false;
    };
    let fields = String::from_utf8_lossy(&stat[end + 1..]);
    let mut fields = fields.split_ascii_whitespace();
    let state = fields.next();
    let threads = fields.nth(16).and_then(|n| n.parse::<u64>().ok());
    match state {
        Some("X") => true,
        Some("Z") => threads.is_some_and(|n| n <= 1),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_that_exited_unreaped_is_not_alive() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited, not yet reaped: a zombie, which signal 0 still finds.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pid_alive(pid) && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!pid_alive(pid), "a zombie counted as alive");
        // SAFETY: signal 0 only probes.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, 0) }, 0);
        child.wait().unwrap();
    }
}
