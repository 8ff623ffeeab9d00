//! Library-owned host memory at a stable address.
//!
//! A [`HostRegion`] is an anonymous private mapping. `release` hands its
//! physical pages back to the kernel with `madvise(MADV_DONTNEED)` while the
//! virtual range stays reserved, so pointers the engine captured stay valid;
//! `restore` faults the pages back in (zero-filled) before the next update
//! writes them, using `MADV_POPULATE_WRITE` where the kernel has it so the
//! update itself does not pay a page fault per 4 KiB.

use super::{page_size, SendPtr};
use crate::result::{Error, Result};
use rustix::mm::{self, Advice, MapFlags, ProtFlags};
use std::ffi::c_void;

#[derive(Debug)]
pub struct HostRegion {
    ptr: SendPtr,
    /// Bytes the user asked for.
    len: usize,
    /// Bytes mapped (len rounded up to whole pages, at least one page).
    mapped: usize,
}

impl HostRegion {
    /// Map `len` bytes of zeroed memory. `what` names the owner in errors.
    pub fn new(what: &str, len: usize) -> Result<HostRegion> {
        let page = page_size();
        let mapped = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or_else(|| Error::out_of_memory(format!("{what}: {len} bytes is too large")))?;
        // SAFETY: a fresh anonymous mapping aliases nothing.
        let ptr = unsafe {
            mm::mmap_anonymous(
                std::ptr::null_mut(),
                mapped,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| Error::out_of_memory(format!("{what}: mapping {len} bytes failed: {e}")))?;
        Ok(HostRegion {
            ptr: SendPtr(ptr.cast()),
            len,
            mapped,
        })
    }

    /// Map `len` bytes for staging and fault them in on `threads` threads,
    /// asking for transparent huge pages: a staging arena is written once from
    /// end to end, and taking its faults up front, in parallel and 2 MiB at a
    /// time, is several times cheaper than one 4 KiB fault per page during the
    /// copy.
    pub fn staging(what: &str, len: usize, threads: usize) -> Result<HostRegion> {
        let r = HostRegion::new(what, len)?;
        // SAFETY: advice on our own fresh mapping; failure only loses the hint.
        let _ = unsafe { mm::madvise(r.ptr.0.cast::<c_void>(), r.mapped, Advice::LinuxHugepage) };
        let step = r.mapped.div_ceil(threads.max(1)).next_multiple_of(2 << 20);
        let failed = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for start in (0..r.mapped).step_by(step) {
                let len = step.min(r.mapped - start);
                let p = SendPtr(r.ptr.0.wrapping_add(start));
                let failed = &failed;
                s.spawn(move || {
                    let p = p;
                    if populate_write(p.0, len).is_err() {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        if failed.into_inner() {
            return Err(Error::out_of_memory(format!(
                "{what}: faulting in {len} bytes failed"
            )));
        }
        Ok(r)
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Give the physical pages back; the address range stays mapped and reads
    /// as zeros afterwards.
    pub fn release(&self) -> Result<()> {
        // SAFETY: the range is our own mapping; DONTNEED on private anonymous
        // memory only drops its contents.
        unsafe {
            mm::madvise(
                self.ptr.0.cast::<c_void>(),
                self.mapped,
                Advice::LinuxDontNeed,
            )
        }
        .map_err(|e| Error::io("releasing host param memory (madvise)", e))
    }

    /// Bring every page back before it is written.
    pub fn restore(&self) -> Result<()> {
        populate_write(self.ptr.0, self.mapped).map_err(|err| {
            Error::out_of_memory(format!(
                "restoring {} bytes of host param memory: {err}",
                self.len
            ))
        })
    }

    /// Bytes of this region currently backed by physical memory (mincore).
    pub fn resident_bytes(&self) -> Result<usize> {
        let page = page_size();
        let mut vec = vec![0u8; self.mapped / page];
        // SAFETY: the range is our mapping and vec has one byte per page.
        let rc = unsafe { libc::mincore(self.ptr.0.cast(), self.mapped, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::io(
                "querying host param residency (mincore)",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(vec.iter().filter(|b| **b & 1 != 0).count() * page)
    }

    /// The region's bytes. The caller must make sure nothing writes them meanwhile.
    ///
    /// # Safety
    /// No concurrent writer to the region for the slice's lifetime.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr.0, self.len)
    }
}

/// Fault in `len` bytes at `p` (page aligned, our own writable mapping) with
/// `MADV_POPULATE_WRITE`, or by touching one byte per page on kernels
/// without it.
fn populate_write(p: *mut u8, len: usize) -> std::io::Result<()> {
    const MADV_POPULATE_WRITE: i32 = 23;
    // SAFETY: the caller passes a range of its own read-write mapping.
    if unsafe { libc::madvise(p.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOMEM) {
        return Err(err);
    }
    for off in (0..len).step_by(page_size()) {
        // SAFETY: off < len, inside the caller's writable mapping.
        unsafe { std::ptr::write_volatile(p.add(off), 0) };
    }
    Ok(())
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: we own the mapping and nobody uses it after drop.
        let _ = unsafe { mm::munmap(self.ptr.0.cast::<c_void>(), self.mapped) };
    }
}

// SAFETY: the region is plain memory; synchronisation of its contents is the
// manager's job (one update or clear at a time).
unsafe impl Send for HostRegion {}
unsafe impl Sync for HostRegion {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_frees_pages_and_keeps_address() {
        let r = HostRegion::new("t", 8 << 20).unwrap();
        let addr = r.ptr();
        r.restore().unwrap();
        unsafe { std::ptr::write_bytes(r.ptr(), 7, r.len()) };
        assert_eq!(r.resident_bytes().unwrap(), 8 << 20);
        r.release().unwrap();
        assert_eq!(r.resident_bytes().unwrap(), 0);
        assert_eq!(r.ptr(), addr);
        r.restore().unwrap();
        assert_eq!(r.resident_bytes().unwrap(), 8 << 20);
        assert!(unsafe { r.as_slice() }.iter().all(|b| *b == 0));
    }

    #[test]
    fn zero_length_region_is_valid() {
        let r = HostRegion::new("empty", 0).unwrap();
        assert!(r.is_empty());
        r.release().unwrap();
    }
}
