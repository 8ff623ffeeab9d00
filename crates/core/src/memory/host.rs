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
    /// Regions of 2 MiB or more start on a 2 MiB boundary, so that their
    /// pages can be transparent huge pages and a page swap
    /// (`memory::swap`) moves whole page-table entries of 2 MiB.
    pub fn new(what: &str, len: usize) -> Result<HostRegion> {
        let page = page_size();
        let mapped = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or_else(|| Error::out_of_memory(format!("{what}: {len} bytes is too large")))?;
        let align = if mapped >= HUGE { HUGE } else { page };
        let ptr = map_aligned(mapped, align).map_err(|e| {
            Error::out_of_memory(format!("{what}: mapping {len} bytes failed: {e}"))
        })?;
        Ok(HostRegion {
            ptr: SendPtr(ptr),
            len,
            mapped,
        })
    }

    /// Map `len` bytes for staging and fault them in on `threads` threads
    /// (see [`populate_all`]). More than the memory available now is
    /// `WM_ERR_OUT_OF_MEMORY` before a page is touched: faulting it in
    /// would have the kernel kill a process instead.
    pub fn staging(what: &str, len: usize, threads: usize) -> Result<HostRegion> {
        if let Some(free) = available().filter(|&free| len as u64 > free) {
            return Err(Error::out_of_memory(format!(
                "{what}: {len} bytes is more than the {free} bytes of memory available"
            )));
        }
        let r = HostRegion::new(what, len)?;
        populate_all(&[&r], threads, false).map_err(|e| e.context(what))?;
        Ok(r)
    }

    /// Bytes mapped: `len` rounded up to whole pages (at least one).
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    /// Give up the mapping without unmapping it (a page swap moved it).
    pub(crate) fn forget(self) {
        std::mem::forget(self);
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

    /// Ask for transparent huge pages when this region's pages are faulted
    /// in (`huge`), or for none. Always the whole region: advice on a part
    /// would split the mapping, and a page swap moves one mapping. Failure
    /// only loses the hint.
    pub fn advise_huge(&self, huge: bool) {
        let advice = match huge {
            true => Advice::LinuxHugepage,
            false => Advice::LinuxNoHugepage,
        };
        // SAFETY: advice on our own mapping.
        let _ = unsafe { mm::madvise(self.ptr.0.cast::<c_void>(), self.mapped, advice) };
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

/// Transparent huge page size on x86-64 and arm64 (4 KiB base pages).
const HUGE: usize = 2 << 20;

/// An anonymous private mapping of `len` bytes whose start is a multiple
/// of `align` (a power of two, at least a page): map `align` more and trim.
fn map_aligned(len: usize, align: usize) -> std::io::Result<*mut u8> {
    let extra = align - page_size();
    let total = len
        .checked_add(extra)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    // SAFETY: a fresh anonymous mapping aliases nothing.
    let base = unsafe {
        mm::mmap_anonymous(
            std::ptr::null_mut(),
            total,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }?
    .cast::<u8>();
    let head = base.align_offset(align).min(extra);
    let tail = extra - head;
    // SAFETY: both trimmed ranges are inside the mapping just made.
    unsafe {
        if head > 0 {
            let _ = mm::munmap(base.cast::<c_void>(), head);
        }
        if tail > 0 {
            let _ = mm::munmap(base.add(head + len).cast::<c_void>(), tail);
        }
    }
    Ok(base.wrapping_add(head))
}

/// The memory the kernel says is available now (`MemAvailable`), if it
/// says.
pub fn available() -> Option<u64> {
    meminfo("MemAvailable")
}

/// Bytes of `field` of `/proc/meminfo` ("MemTotal", "MemAvailable"), if
/// the kernel says.
pub fn meminfo(field: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = (meminfo.lines()).find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Fault in every page of `regions` on `threads` threads: staging memory
/// is written once from end to end, and taking its faults up front, in
/// parallel and many pages per call (`MADV_POPULATE_WRITE`), is cheaper
/// than one fault per 4 KiB during the copy. All regions share one pass,
/// so many small ones cost one set of threads.
///
/// `huge`: ask for transparent huge pages. Not while an update waits:
/// with the page cache full (the usual case right after a snapshot was
/// read) a huge page fault compacts memory first, and on the 2-core test
/// machine faulting in 1 GiB took 1.5-4.3 s with the hint against
/// 0.45-0.75 s without it. Ahead of time it pays: huge pages are freed
/// about 15 times faster (6 against 90 ms per GiB), which a page swap
/// does to the old pages, and read with fewer TLB misses.
pub fn populate_all(regions: &[&HostRegion], threads: usize, huge: bool) -> Result<()> {
    for r in regions.iter().filter(|_| huge) {
        r.advise_huge(true);
    }
    let ranges: Vec<(SendPtr, usize)> = regions.iter().map(|r| (r.ptr, r.mapped)).collect();
    populate_ranges(&ranges, threads)
}

/// [`populate_all`] for parts of regions, without advice: each
/// `(start, len)` is a page-aligned range of one of our own read-write
/// mappings.
pub(crate) fn populate_ranges(ranges: &[(SendPtr, usize)], threads: usize) -> Result<()> {
    let total: usize = ranges.iter().map(|r| r.1).sum();
    if total == 0 {
        return Ok(());
    }
    // Pieces of at most `step` bytes, never crossing a range's end.
    let step = total.div_ceil(threads.max(1)).next_multiple_of(HUGE);
    let pieces: Vec<(SendPtr, usize)> = ranges
        .iter()
        .flat_map(|&(p, len)| {
            (0..len)
                .step_by(step)
                .map(move |at| (SendPtr(p.0.wrapping_add(at)), step.min(len - at)))
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(pieces.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(p, len)) = pieces.get(i) else {
                    return;
                };
                if populate_write(p.0, len).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    if failed.into_inner() {
        return Err(Error::out_of_memory(format!(
            "faulting in {total} bytes of staging memory failed"
        )));
    }
    Ok(())
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

// SAFETY: the region is an anonymous mapping owned by this value, not tied to
// the thread that made it; it is unmapped once, on drop.
unsafe impl Send for HostRegion {}
// SAFETY: its bytes are reached through `ptr()` (raw) or the unsafe
// `as_slice`, whose callers keep readers and writers apart. The &self methods
// that touch them, `release` and `restore`, are the manager's, which calls
// them one update or clear at a time (through `&mut Registry`): the type does
// not enforce that.
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

    /// Staging of more than the memory available is refused before a page
    /// is touched (the kernel would kill a process instead), naming it.
    #[test]
    fn staging_beyond_the_memory_available_is_refused() {
        let free = available().expect("/proc/meminfo says MemAvailable");
        let Err(e) = HostRegion::staging("a test slot", (free as usize).saturating_mul(2), 1)
        else {
            panic!("twice the memory available was staged");
        };
        assert_eq!(
            e.code,
            crate::result::wm_result::WM_ERR_OUT_OF_MEMORY,
            "{e}"
        );
        assert!(e.message.starts_with("a test slot: "), "{e}");
        let small = HostRegion::staging("a small slot", 1 << 20, 1).unwrap();
        assert_eq!(small.len(), 1 << 20);
    }
}
