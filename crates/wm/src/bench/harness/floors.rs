//! The floors `wm bench` measures its figures against: plain fast loops
//! with no library logic in them (memcpy, `pread`, faulting in fresh
//! memory), and the mapped read beside them, each on a given number of
//! threads taking 8 MiB pieces from a shared counter.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::copy::copy_bytes;

/// Pieces of 8 MiB handed out from a shared counter to `threads` threads:
/// the fastest plain way to move bytes on this machine, with no library
/// logic in it, so it is the floor.
const PIECE: usize = 8 << 20;

pub(crate) fn pieces_in_parallel(
    len: usize,
    threads: usize,
    work: impl Fn(usize, usize) -> std::io::Result<()> + Sync,
) -> Result<Duration, String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let start = i * PIECE;
                    if start >= len {
                        return Ok(());
                    }
                    work(start, PIECE.min(len - start))?;
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("floor thread"))
            .collect()
    });
    for r in results {
        r.map_err(|e| format!("floor: {e}"))?;
    }
    Ok(t.elapsed())
}

#[derive(Clone, Copy)]
struct Addr(usize);

/// The fastest plain copy of `src` into `dst` on `threads` threads, of
/// three: glibc's `memcpy` of one contiguous share per thread (its
/// streaming path), glibc's `memcpy` of 8 MiB pieces handed out in turn
/// (cached stores), and 8 MiB pieces with AVX2 streaming stores (the
/// library's `copy_bytes`: glibc's `rep movsb` slows to a third when the
/// destination sits just ahead of the source modulo 4 KiB, as a heap
/// param does behind page-aligned staging). Which wins depends on the
/// machine and the buffers' offsets: the floor is the fastest way, so all
/// run.
pub(crate) fn memcpy_floor(src: &[u8], dst: &mut [u8], threads: usize) -> Result<Duration, String> {
    let share = src.len().div_ceil(threads.max(1)).max(1);
    let glibc = |d: &mut [u8], s: &[u8]| d.copy_from_slice(s);
    // SAFETY: two slices of one length that do not overlap.
    let stream =
        |d: &mut [u8], s: &[u8]| unsafe { copy_bytes(d.as_mut_ptr(), s.as_ptr(), s.len()) };
    Ok(memcpy_split(src, dst, share, threads, glibc)
        .min(memcpy_split(src, dst, 8 << 20, threads, glibc))
        .min(memcpy_split(src, dst, 8 << 20, threads, stream)))
}

/// `src` into `dst` with `copy` in pieces of `piece` bytes, `threads`
/// threads taking the next piece in turn.
fn memcpy_split(
    src: &[u8],
    dst: &mut [u8],
    piece: usize,
    threads: usize,
    copy: impl Fn(&mut [u8], &[u8]) + Sync,
) -> Duration {
    let pieces = std::sync::Mutex::new(dst.chunks_mut(piece).zip(src.chunks(piece)));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let next = pieces.lock().unwrap_or_else(|e| e.into_inner()).next();
                let Some((d, c)) = next else { break };
                copy(d, c);
            });
        }
    });
    t.elapsed()
}

/// Fault in `len` bytes of fresh anonymous memory (the kernel zeroes
/// every page) with `MADV_POPULATE_WRITE` in 8 MiB pieces on `threads`
/// threads: what memory that was never used costs before a byte lands.
pub(crate) fn fresh_memory_floor(len: usize, threads: usize) -> Result<Duration, String> {
    // SAFETY: a fresh private mapping, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mapping {len} bytes failed"));
    }
    let base = Addr(p as usize);
    let t = pieces_in_parallel(len, threads, move |start, n| {
        let base = base;
        const MADV_POPULATE_WRITE: i32 = 23;
        // SAFETY: the piece is inside the mapping made above.
        match unsafe { libc::madvise((base.0 + start) as *mut _, n, MADV_POPULATE_WRITE) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    });
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(p, len) };
    t
}

pub(crate) fn read_floor(
    file: &File,
    offset: u64,
    dst: &mut [u8],
    threads: usize,
) -> Result<Duration, String> {
    let d = Addr(dst.as_mut_ptr() as usize);
    pieces_in_parallel(dst.len(), threads, move |start, len| {
        let d = d;
        // SAFETY: pieces are disjoint ranges inside dst, which outlives the scope.
        let buf = unsafe { std::slice::from_raw_parts_mut((d.0 + start) as *mut u8, len) };
        file.read_exact_at(buf, offset + start as u64)
    })
}

/// [`read_floor`] through mappings: each piece mapped (page-aligned),
/// copied, unmapped.
pub(crate) fn mapped_read(
    file: &File,
    offset: u64,
    dst: &mut [u8],
    threads: usize,
) -> Result<Duration, String> {
    use std::os::fd::AsRawFd;
    let (d, fd) = (Addr(dst.as_mut_ptr() as usize), file.as_raw_fd());
    pieces_in_parallel(dst.len(), threads, move |start, len| {
        let d = d;
        let at = offset + start as u64;
        let skip = (at % 4096) as usize;
        // SAFETY: a fresh read-only mapping of the bench's own file, which
        // nobody truncates; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + skip,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                (at - skip as u64) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the piece is inside dst and the mapping holds its bytes.
        unsafe {
            weight_manager_core::internals::memory::copy::copy_bytes(
                (d.0 + start) as *mut u8,
                (p as *const u8).add(skip),
                len,
            );
            libc::munmap(p, len + skip);
        }
        Ok(())
    })
}
