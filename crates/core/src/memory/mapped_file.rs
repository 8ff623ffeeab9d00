//! A window of a snapshot file read through a memory map, under the SIGBUS
//! guard (`memory::sigbus`).
//!
//! The reader (`reader.rs`) reads segments through these: the copier's
//! threads copy them, and covering reads hash their blocks, straight from
//! the page cache, with no bounce buffer, faulting in only the pages they
//! touch. A trainer that truncates the
//! file while it is mapped would otherwise kill the engine with SIGBUS; the
//! guard maps zero pages over the window instead and marks it faulted, and
//! the reader turns that into an error naming the file (as a short `pread`
//! is), before the update can commit.
//!
//! A window is mapped only when a guard slot is free: without one the
//! caller reads with `pread` instead ([`MappedWindow::map`] returns None,
//! as it does when `mmap` fails).

use crate::memory::sigbus;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes mapped for reading by this process so far (as `rchar` in
/// `/proc/self/io` counts what `pread` read): what a reader brought in.
static MAPPED: AtomicU64 = AtomicU64::new(0);

/// Bytes read out of those mappings (copied, or checked against block
/// sums): what `rchar` would have counted had they been read with `pread`.
/// A covering read maps the gaps between its segments but reads only the
/// segments, so this is less than [`mapped_bytes`] there.
static READ: AtomicU64 = AtomicU64::new(0);

/// Bytes of snapshot files this process has mapped for reading so far.
pub fn mapped_bytes() -> u64 {
    MAPPED.load(Ordering::Relaxed)
}

/// Bytes of snapshot files this process has read through mappings so far
/// (the segments copied out, the blocks checked), the mapped counterpart
/// of `rchar` in `/proc/self/io`.
pub fn mapped_read_bytes() -> u64 {
    READ.load(Ordering::Relaxed)
}

/// Count `n` bytes read out of a mapping.
pub(crate) fn count_read(n: u64) {
    READ.fetch_add(n, Ordering::Relaxed);
}

/// Bytes `[offset, offset + len)` of a file, mapped read-only and guarded;
/// unmapped on drop.
pub(crate) struct MappedWindow {
    /// The page-aligned mapping.
    base: *mut u8,
    map_len: usize,
    /// Where the wanted bytes start in the mapping.
    skip: usize,
    len: usize,
    slot: usize,
}

// SAFETY: the mapping is read-only (PROT_READ) and owned by this value; it
// is not tied to a thread, and is unmapped (and its guard slot freed) once,
// on drop.
unsafe impl Send for MappedWindow {}
// SAFETY: nothing in this process writes a read-only mapping: any thread may
// read it through `bytes()` while the value lives.
unsafe impl Sync for MappedWindow {}

impl MappedWindow {
    /// Map `len` (> 0) bytes of `file` from `offset`; None when no guard slot
    /// is free or the mapping fails (the caller reads with `pread`).
    pub(crate) fn map(file: &File, offset: u64, len: usize) -> Option<MappedWindow> {
        let page = page_size();
        let skip = (offset % page as u64) as usize;
        let map_len = skip.checked_add(len).filter(|_| len > 0)?;
        // SAFETY: a fresh read-only shared mapping of a file we hold open;
        // nothing reads it before it is registered below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                (offset - skip as u64) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let Some(slot) = sigbus::register(p as usize, map_len) else {
            // SAFETY: the mapping made above, never read.
            unsafe { libc::munmap(p, map_len) };
            return None;
        };
        MAPPED.fetch_add(len as u64, Ordering::Relaxed);
        Some(MappedWindow {
            base: p.cast(),
            map_len,
            skip,
            len,
            slot,
        })
    }

    /// The window's bytes (zeros from where the file ended, once it was
    /// truncated under us: check [`MappedWindow::faulted`] after reading).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: inside the mapping, which lives as long as self; a fault
        // on it is rescued by the guard registered in `map`.
        unsafe { std::slice::from_raw_parts(self.base.add(self.skip), self.len) }
    }

    /// Whether a read of the window faulted (the file shrank under us).
    pub(crate) fn faulted(&self) -> bool {
        sigbus::faulted(self.slot)
    }
}

impl Drop for MappedWindow {
    fn drop(&mut self) {
        sigbus::unregister(self.slot);
        // SAFETY: our mapping (or the guard's zero pages over it); nothing
        // points into it any more (chunks into it are applied before drop).
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&bytes).unwrap();
        (f, bytes)
    }

    #[test]
    fn maps_any_range_and_counts_it() {
        let (f, bytes) = file_of(5 * 4096);
        let before = mapped_bytes();
        let w = MappedWindow::map(f.as_file(), 4095, 8194).unwrap();
        assert_eq!(w.bytes(), &bytes[4095..4095 + 8194]);
        assert!(!w.faulted());
        assert!(mapped_bytes() - before >= 8194);
    }

    /// The file cut under a live mapping: reading past its new end reads
    /// zeros and marks the window faulted instead of killing the process.
    #[test]
    fn a_file_truncated_under_the_window_faults_it_not_the_process() {
        let (f, bytes) = file_of(16 * 4096);
        let w = MappedWindow::map(f.as_file(), 100, 16 * 4096 - 100).unwrap();
        f.as_file().set_len(4096).unwrap();
        // Another thread reads, as the copier's threads do.
        std::thread::scope(|s| {
            s.spawn(|| w.bytes().iter().map(|&b| b as u64).sum::<u64>());
        });
        assert!(w.faulted());
        // The guard put zero pages over the whole window.
        assert!(w.bytes().iter().all(|&b| b == 0));
        drop(w);
        // The slot is free again, the next window is not faulted.
        let w = MappedWindow::map(f.as_file(), 0, 4096).unwrap();
        assert!(!w.faulted());
        assert_eq!(w.bytes(), &bytes[..4096]);
    }
}
