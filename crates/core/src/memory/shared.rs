//! Shared host buffers for the IPC path: anonymous memory files (memfd)
//! passed between processes as file descriptors.
//!
//! - Nothing is named in /dev/shm: the memory goes away when the last
//!   process holding it closes or exits, crashes included.
//! - The sender allocates every page when it creates a buffer, on every
//!   core (`SharedBuffer::reserve`), so a full /dev/shm is an
//!   out-of-memory error at creation, never a SIGBUS on first write.
//! - The sender seals the file against shrinking and growing; the receiver
//!   refuses a buffer without those seals, so no peer can truncate a buffer
//!   under the other and turn its next read into SIGBUS.
//! - The sender also seals it against writes by anyone else
//!   (`F_SEAL_FUTURE_WRITE`, Linux 5.1+): its own mapping, made before the
//!   seal, still writes, but no peer can map the file writable or `write`
//!   it, even by reopening `/proc/<pid>/fd/N`. An engine the socket admits
//!   may read a published version, never change what the next engine
//!   reads.
//! - The receiver maps a buffer without faulting it in, and faults in
//!   ([`SharedBuffer::populate`]) only the windows a bucket reads: a peer of
//!   the same uid is trusted with the bytes, not with the engine's memory,
//!   and a sparse file announced at 1 TiB costs address space, not RSS
//!   (reading a hole of a memfd allocates a page, charged to the reader).
//!
//! What an engine keeps mapped between sessions, and where CUDA IPC
//! buffers join host buffers, is `memory::kept_mappings`.

use crate::result::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// A memfd mapped read-write (sender) or read-only (receiver).
#[derive(Debug)]
pub struct SharedBuffer {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    /// The file's identity (device, inode): a descriptor received again for
    /// the same file is the same memory, already mapped.
    pub(super) file: (u64, u64),
    /// A received buffer: one bit per [`POPULATE_CHUNK`] faulted in already
    /// (empty for the sender's own buffers).
    populated: Vec<AtomicU64>,
}

/// [`SharedBuffer::populate`] faults in, and remembers, whole chunks of
/// this many bytes.
const POPULATE_CHUNK: u64 = 64 << 10;

// SAFETY: a memfd and its mapping, owned by this value and not tied to a
// thread; unmapped once, on drop.
unsafe impl Send for SharedBuffer {}
// SAFETY: the bytes are reached only through `ptr()` (raw), in unsafe code
// that follows the protocol (who writes when); the &self methods only advise
// the kernel (`reserve`, `populate`) or set bits atomically (`populated`).
unsafe impl Sync for SharedBuffer {}

/// Sealed when a buffer is made: its size.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
/// Sealed once the sender's own writes through the file are done
/// ([`SharedBuffer::seal_writes`]): others' writes, and the seals.
const FINAL_SEALS: libc::c_int = libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;

impl SharedBuffer {
    /// A new zeroed buffer of `len` bytes, every page reserved, sealed.
    pub fn create(what: &str, len: usize) -> Result<SharedBuffer> {
        let b = Self::create_unreserved(what, len)?;
        b.seal_writes(what)?;
        b.reserve(what)?;
        Ok(b)
    }

    /// Seal the buffer against writes by anyone but this mapping (and its
    /// seals against change): after the sender's last `pwrite`, before the
    /// descriptor goes to any peer. A kernel older than 5.1 knows no
    /// `F_SEAL_FUTURE_WRITE`: the seals are then closed without it.
    pub(crate) fn seal_writes(&self, what: &str) -> Result<()> {
        let raw = self.fd.as_raw_fd();
        // SAFETY: fcntl on our own descriptor.
        let mut rc = unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, FINAL_SEALS) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // SAFETY: as above.
            rc = unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SEAL) };
        }
        match rc {
            0 => Ok(()),
            _ => Err(Error::io(
                format!("{what}: sealing against writes"),
                std::io::Error::last_os_error(),
            )),
        }
    }

    /// A new buffer of `len` bytes, sealed against resizing, with no page
    /// allocated yet. The caller writes every page with `pwrite` on
    /// [`SharedBuffer::fd`] before anyone maps it (a full /dev/shm is then
    /// an error of that write, not a SIGBUS of a reader), then seals it
    /// ([`SharedBuffer::seal_writes`]) before handing it to any peer, and
    /// faults the pages into this process's mapping (made here, before the
    /// seal) with [`SharedBuffer::reserve`] before copying into it: the
    /// kernel does not zero a page a write fills, so this costs one pass
    /// over the bytes where [`SharedBuffer::create`] and a copy cost two.
    pub fn create_unreserved(what: &str, len: usize) -> Result<SharedBuffer> {
        let name = std::ffi::CString::new("wm-bucket").expect("no NUL");
        // SAFETY: libc calls on our own descriptor.
        unsafe {
            let raw =
                libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            if raw < 0 {
                return Err(Error::io(
                    format!("{what}: memfd_create"),
                    std::io::Error::last_os_error(),
                ));
            }
            let fd = OwnedFd::from_raw_fd(raw);
            if libc::ftruncate(raw, len as libc::off_t) != 0 {
                return Err(Error::io(
                    format!("{what}: sizing {len} bytes"),
                    std::io::Error::last_os_error(),
                ));
            }
            if libc::fcntl(raw, libc::F_ADD_SEALS, SEALS) != 0 {
                return Err(Error::io(
                    format!("{what}: sealing"),
                    std::io::Error::last_os_error(),
                ));
            }
            let file = file_identity(&fd).map_err(|e| Error::io(format!("{what}: stat"), e))?;
            Self::map(fd, len, libc::PROT_READ | libc::PROT_WRITE, file, what)
        }
    }

    /// Allocate and map every page of a new buffer, on every core: a full
    /// /dev/shm is then a clear error here, never a SIGBUS in a later copy,
    /// and the first buckets take no page faults. One `fallocate` did the
    /// reserving before, but it runs on one core under the file's lock and
    /// then the pages still had to be mapped: measured on the 2-core test
    /// machine, 0.47-0.56 s per GiB against 0.34 s for a populate on both
    /// cores (the kernel zeroes every new page either way; more cores
    /// share that out further). Kernels without `MADV_POPULATE_WRITE`
    /// (before 5.14) get the `fallocate`. Pages already written (a buffer
    /// from [`SharedBuffer::create_unreserved`]) are only mapped, so that
    /// a later copy into the buffer takes no page faults either.
    pub(crate) fn reserve(&self, what: &str) -> Result<()> {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let no_room = |e: std::io::Error| match e.raw_os_error() {
            Some(libc::ENOSPC | libc::ENOMEM | libc::EFAULT) => Error::out_of_memory(format!(
                "{what}: no room for {} bytes of shared memory",
                self.len
            )),
            _ => Error::io(format!("{what}: reserving {} bytes", self.len), e),
        };
        let threads = crate::memory::copy::default_threads();
        let step = self
            .len
            .div_ceil(threads)
            .next_multiple_of(super::page_size())
            .max(1);
        let p = crate::memory::SendPtr(self.ptr);
        let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.len)
                .step_by(step)
                .map(|at| {
                    let len = step.min(self.len - at);
                    s.spawn(move || {
                        let p = p;
                        // SAFETY: a range of our own read-write mapping.
                        let rc =
                            unsafe { libc::madvise(p.0.add(at).cast(), len, MADV_POPULATE_WRITE) };
                        match rc {
                            0 => Ok(()),
                            _ => Err(std::io::Error::last_os_error()),
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Ok(())))
                .collect()
        });
        match results.into_iter().find_map(std::result::Result::err) {
            None => Ok(()),
            Some(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // SAFETY: fallocate on our own descriptor.
                let rc =
                    unsafe { libc::fallocate(self.fd.as_raw_fd(), 0, 0, self.len as libc::off_t) };
                match rc {
                    0 => Ok(()),
                    _ => Err(no_room(std::io::Error::last_os_error())),
                }
            }
            Some(e) => Err(no_room(e)),
        }
    }

    /// Map a buffer received from a peer, read-only, after checking that it
    /// is sealed against shrinking and holds at least `len` bytes.
    pub fn receive(fd: OwnedFd, len: usize, what: &str) -> Result<SharedBuffer> {
        // SAFETY: fcntl/fstat on a descriptor we own.
        unsafe {
            let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
            if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
                return Err(Error::peer(format!(
                    "{what}: the shared buffer is not sealed against shrinking; refusing it (it could SIGBUS)"
                )));
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(Error::io(
                    format!("{what}: stat"),
                    std::io::Error::last_os_error(),
                ));
            }
            if (st.st_size as u64) < len as u64 {
                return Err(Error::peer(format!(
                    "{what}: the shared buffer holds {} bytes, the peer announced {len}",
                    st.st_size
                )));
            }
            let mut b = Self::map(
                fd,
                len,
                libc::PROT_READ,
                (st.st_dev as u64, st.st_ino as u64),
                what,
            )?;
            let chunks = (len as u64).div_ceil(POPULATE_CHUNK);
            b.populated = (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect();
            Ok(b)
        }
    }

    /// `file`: the descriptor's (device, inode), which the caller has stat'ed.
    unsafe fn map(
        fd: OwnedFd,
        len: usize,
        prot: libc::c_int,
        file: (u64, u64),
        what: &str,
    ) -> Result<SharedBuffer> {
        if len == 0 {
            return Ok(SharedBuffer {
                fd,
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len,
                file,
                populated: Vec::new(),
            });
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(Error::out_of_memory(format!(
                "{what}: mapping {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        if prot & libc::PROT_WRITE != 0 {
            // The sender's own buffer (`reserve` maps every page next):
            // huge pages cut TLB misses when copying through it; they take
            // effect where the kernel's shmem_enabled allows `advise`. A
            // receiver does not ask: the peer's file may be sparse, and
            // there a huge page would be 2 MiB allocated per hole read.
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
        }
        Ok(SharedBuffer {
            fd,
            ptr: p.cast(),
            len,
            file,
            populated: Vec::new(),
        })
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

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Fault in the byte ranges `windows` (start, end) of a received
    /// buffer, which the caller checked lie in it, widened to whole
    /// [`POPULATE_CHUNK`]s: one call per run of chunks rather than one
    /// fault per 4 KiB during the copy. Only these chunks: the rest of the
    /// buffer stays unmapped. Chunks faulted in once are remembered and
    /// skipped: a buffer mapped again for the next session (the mappings
    /// are kept) has its pages mapped already, and asking again cost as much
    /// as a third of the copy (a page-table walk per page, on the applying
    /// thread). A kernel without `MADV_POPULATE_READ` just faults during
    /// the copy.
    pub fn populate(&self, windows: impl IntoIterator<Item = (u64, u64)>) {
        let len = self.len as u64;
        for (start, end) in page_runs(windows, POPULATE_CHUNK) {
            let (mut c, last) = (
                start / POPULATE_CHUNK,
                end.min(len).div_ceil(POPULATE_CHUNK),
            );
            while c < last {
                let first = c;
                while c < last && !self.mark_populated(c) {
                    c += 1;
                }
                if c > first {
                    self.madvise_populate(first * POPULATE_CHUNK, (c * POPULATE_CHUNK).min(len));
                }
                c += 1;
            }
        }
    }

    /// Note chunk `c` as faulted in; true when it was already.
    fn mark_populated(&self, c: u64) -> bool {
        let Some(word) = self.populated.get((c / 64) as usize) else {
            return true; // not a received buffer: nothing to fault in
        };
        let bit = 1u64 << (c % 64);
        word.fetch_or(bit, Ordering::Relaxed) & bit != 0
    }

    /// `MADV_POPULATE_READ` of bytes `[start, end)` (page aligned at the start).
    fn madvise_populate(&self, start: u64, end: u64) {
        const MADV_POPULATE_READ: libc::c_int = 22;
        // SAFETY: advice on a page-aligned range of our own mapping.
        unsafe {
            libc::madvise(
                self.ptr.add(start as usize).cast(),
                (end - start) as usize,
                MADV_POPULATE_READ,
            )
        };
    }
}

/// `windows` widened to whole pages (of `page` bytes), sorted, and merged
/// where they touch.
fn page_runs(windows: impl IntoIterator<Item = (u64, u64)>, page: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = windows
        .into_iter()
        .filter(|(s, e)| e > s)
        .map(|(s, e)| (s / page * page, e.saturating_add(page - 1) / page * page))
        .collect();
    runs.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (s, e) in runs {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: our own mapping.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// Refuse shared buffers announced larger, together, than this machine's
/// memory and swap: a real publisher reserves every page of its buffers
/// (`fallocate`), so theirs always fit; only a sparse file can be larger,
/// and mapping it would still eat the engine's address space (the mappings
/// are kept for the next sessions).
pub fn check_announced(sizes: &[u64]) -> Result<()> {
    let total = sizes.iter().fold(0u64, |a, &n| a.saturating_add(n));
    let machine = machine_memory();
    if total > machine {
        return Err(Error::peer(format!(
            "the publisher announced shared buffers of {total} bytes ({sizes:?}), more than \
             this machine's {machine} bytes of memory and swap; refusing them"
        )));
    }
    Ok(())
}

/// Bytes of RAM and swap (u64::MAX if the kernel does not say).
fn machine_memory() -> u64 {
    // SAFETY: sysinfo is integers (and padding); all zeroes is a valid value.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: sysinfo fills the struct we pass, a live local.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return u64::MAX;
    }
    let unit = u64::from(info.mem_unit.max(1));
    (info.totalram as u64)
        .saturating_add(info.totalswap as u64)
        .saturating_mul(unit)
}

pub(super) fn file_identity(fd: &OwnedFd) -> std::io::Result<(u64, u64)> {
    // SAFETY: fstat on a descriptor we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((st.st_dev as u64, st.st_ino as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_buffers_cross_a_descriptor_copy() {
        let a = SharedBuffer::create("test", 1 << 20).unwrap();
        unsafe { std::ptr::write_bytes(a.ptr(), 0x5a, a.len()) };
        let dup = a.fd().try_clone().unwrap();
        let b = SharedBuffer::receive(dup, 1 << 20, "test").unwrap();
        assert_eq!(unsafe { *b.ptr().add(12345) }, 0x5a);
        // Shrinking is refused by the seal.
        assert_ne!(unsafe { libc::ftruncate(a.fd().as_raw_fd(), 10) }, 0);
        // Nobody else writes: no writable mapping, no write(), not even
        // through the file reopened read-write; the sender's own mapping,
        // made before the seal, still writes.
        let fd = a.fd().as_raw_fd();
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_FUTURE_WRITE, 0, "{seals:#x}");
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 4096, rw, libc::MAP_SHARED, fd, 0) };
        assert_eq!(p, libc::MAP_FAILED);
        let reopened = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{fd}"));
        if let Ok(f) = reopened {
            use std::os::unix::fs::FileExt;
            assert!(f.write_at(b"x", 0).is_err());
        }
        unsafe { *a.ptr().add(12345) = 7 };
        assert_eq!(unsafe { *b.ptr().add(12345) }, 7);
        // A buffer announced larger than it is, or unsealed, is refused.
        let e = SharedBuffer::receive(a.fd().try_clone().unwrap(), 2 << 20, "t").unwrap_err();
        assert!(e.message.contains("announced"));
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), 0) };
        unsafe { libc::ftruncate(raw, 4096) };
        let e = SharedBuffer::receive(unsafe { OwnedFd::from_raw_fd(raw) }, 4096, "t").unwrap_err();
        assert!(e.message.contains("not sealed"));
    }

    #[test]
    fn buffers_larger_than_the_machine_are_refused() {
        check_announced(&[1 << 30, 4096]).unwrap();
        let e = check_announced(&[1 << 50]).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_PEER);
        assert!(e.message.contains("1125899906842624 bytes"), "{e}");
        assert!(check_announced(&[u64::MAX, 2]).is_err());
    }

    #[test]
    fn windows_merge_into_page_runs() {
        let runs = page_runs([(5000, 5100), (0, 10), (4096, 4200), (9000, 9000)], 4096);
        assert_eq!(runs, vec![(0, 8192)]);
        let runs = page_runs([(0, 1), (3 * 4096 + 1, 3 * 4096 + 2)], 4096);
        assert_eq!(runs, vec![(0, 4096), (3 * 4096, 4 * 4096)]);
    }

    /// A received buffer is mapped, not faulted in: a sparse 1 GiB file
    /// whose first 8 KiB are read costs those pages only.
    #[test]
    fn a_received_buffer_faults_in_only_the_windows_read() {
        let len = 1usize << 30;
        let raw = unsafe {
            libc::memfd_create(
                c"sparse".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert_eq!(unsafe { libc::ftruncate(raw, len as libc::off_t) }, 0);
        assert_eq!(unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, SEALS) }, 0);
        let b = SharedBuffer::receive(fd, len, "sparse").unwrap();
        b.populate([(0, 8192)]);
        // The chunk is remembered (the next populate skips it); the next
        // one was not touched.
        assert!(b.mark_populated(0));
        assert!(!b.mark_populated(1));
        let page = crate::memory::page_size();
        let mut vec = vec![0u8; len / page];
        assert_eq!(
            unsafe { libc::mincore(b.ptr().cast(), len, vec.as_mut_ptr()) },
            0
        );
        let resident = vec.iter().filter(|v| **v & 1 != 0).count() * page;
        assert!(
            (8192..=4 << 20).contains(&resident),
            "{resident} bytes resident"
        );
    }
}
