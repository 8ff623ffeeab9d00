//! The parallel copier: every byte an update moves goes through here.
//!
//! Jobs are split into pieces of at most [`PIECE`] bytes and handed to
//! `threads` workers from one shared counter, a group of consecutive pieces
//! of about [`CLAIM`] bytes at a time, so a few large tensors and many
//! small ones (4 KiB blocks of a column split) both keep every core busy
//! without a shared counter step per block. File pieces are read with `pread`
//! straight into the destination: one copy from the page cache, and a file
//! truncated under us is a short read (an error), never the SIGBUS a mapped
//! read would raise.

use super::SendPtr;
use crate::result::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Largest piece one worker copies at a time.
pub(crate) const PIECE: usize = 8 << 20;
/// Below this many bytes in total, copying runs on the calling thread: a
/// thread start costs more than the copy.
pub(crate) const PARALLEL_MIN: usize = 4 << 20;

/// Where a job's bytes come from.
#[derive(Clone, Copy)]
pub enum CopySource<'a> {
    /// Memory the caller keeps valid and unchanged during the copy.
    Memory(SendPtr),
    /// A file range starting at `offset`.
    File { file: &'a File, offset: u64 },
    /// GPU memory at device address `ptr`, valid in the context of GPU
    /// `ordinal` (CUDA IPC buckets); copied to host with `cuMemcpyDtoH`.
    Device { ptr: u64, ordinal: i32 },
}

impl CopySource<'_> {
    /// The same source `n` bytes further on.
    pub fn advanced(self, n: u64) -> Self {
        match self {
            CopySource::Memory(p) => CopySource::Memory(SendPtr(p.0.wrapping_add(n as usize))),
            CopySource::File { file, offset } => CopySource::File {
                file,
                offset: offset + n,
            },
            CopySource::Device { ptr, ordinal } => CopySource::Device {
                ptr: ptr + n,
                ordinal,
            },
        }
    }
}

/// Copy `len` bytes from `src` to `dst`. `tag` comes back with an error so the
/// caller can name the tensor.
#[derive(Clone, Copy)]
pub struct CopyJob<'a> {
    pub src: CopySource<'a>,
    pub dst: SendPtr,
    pub len: usize,
    pub tag: usize,
}

/// A failed job: its tag and what went wrong.
#[derive(Debug)]
pub struct CopyError {
    pub tag: usize,
    pub error: Error,
}

/// Number of worker threads copies use: one per core. Asked once: the
/// answer reads the cgroup's CPU quota files, half a millisecond each
/// session paid before its manifest.
pub fn default_threads() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

/// A worker takes consecutive pieces until they hold at least this many
/// bytes: small enough to spread a batch over the threads, large enough
/// that taking a group costs nothing beside copying it.
const CLAIM: usize = 256 << 10;

/// `jobs` in pieces of at most [`PIECE`] bytes (the jobs themselves when
/// none is longer).
fn split<'j, 'a>(jobs: &'j [CopyJob<'a>]) -> std::borrow::Cow<'j, [CopyJob<'a>]> {
    if jobs.iter().all(|j| j.len <= PIECE) {
        return std::borrow::Cow::Borrowed(jobs);
    }
    let mut pieces = Vec::with_capacity(jobs.len());
    for job in jobs {
        let mut done = 0;
        loop {
            let len = (job.len - done).min(PIECE);
            let src = match job.src {
                CopySource::Memory(p) => CopySource::Memory(SendPtr(p.0.wrapping_add(done))),
                CopySource::File { file, offset } => CopySource::File {
                    file,
                    offset: offset + done as u64,
                },
                CopySource::Device { ptr, ordinal } => CopySource::Device {
                    ptr: ptr + done as u64,
                    ordinal,
                },
            };
            pieces.push(CopyJob {
                src,
                dst: SendPtr(job.dst.0.wrapping_add(done)),
                len,
                tag: job.tag,
            });
            done += len;
            if done >= job.len {
                break;
            }
        }
    }
    std::borrow::Cow::Owned(pieces)
}

/// Where each group of consecutive `pieces` a worker takes at once ends.
fn claims(pieces: &[CopyJob]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut bytes = 0;
    for (i, p) in pieces.iter().enumerate() {
        bytes += p.len;
        if bytes >= CLAIM {
            ends.push(i + 1);
            bytes = 0;
        }
    }
    if bytes > 0 {
        ends.push(pieces.len());
    }
    ends
}

/// Pieces at least this large use streaming stores (see [`copy_bytes`]).
const STREAM_MIN: usize = 1 << 20;

/// Where nothing on this core reads the copy soon (a bucket the engine
/// reads from another process, a version buffer), streaming stores start
/// at a page ([`copy_all_streaming`], `hashing::Hashed::Source`): a column
/// split's 4 KiB blocks gathered into a bucket ran at 8.7-9.2 GB/s
/// streamed against 7.0-7.6 with glibc's memcpy (one core here), and the
/// IPC column half at 0.40-0.44 of memcpy against 0.29-0.34 (alternating
/// builds). Not for every copy: bytes packed and then hashed where they
/// are (a snapshot's blocks packed for the network) must stay in cache.
pub(crate) const PACK_STREAM_MIN: usize = 4 << 10;

/// Whether this CPU has AVX2 (for streaming copies), asked once.
#[cfg(target_arch = "x86_64")]
static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Copy `len` bytes. Large copies on x86-64 with AVX2 use 32-byte loads and
/// non-temporal stores: glibc's memcpy (`rep movsb`) slows to a third of its
/// speed when the destination sits a few hundred bytes ahead of the source
/// modulo 4 KiB, which is exactly a page-aligned bucket copied into a heap
/// param that starts 16 bytes into its page (measured here: 3.5-5 GB/s
/// against 14 GB/s). Streaming stores run at full speed for any offsets and
/// do not evict the cache for bytes nobody reads soon.
///
/// # Safety
/// `src..src+len` readable, `dst..dst+len` writable, not overlapping.
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    copy_streaming_from(dst, src, len, STREAM_MIN)
}

/// [`copy_bytes`], streaming from `stream_min` bytes on.
///
/// # Safety
/// As [`copy_bytes`].
unsafe fn copy_streaming_from(dst: *mut u8, src: *const u8, len: usize, stream_min: usize) {
    match len >= stream_min {
        true => copy_streaming(dst, src, len),
        false => std::ptr::copy_nonoverlapping(src, dst, len),
    }
}

/// [`copy_bytes`] with streaming stores whatever the length (a chunk of a
/// large copy), where the CPU has them.
///
/// # Safety
/// As [`copy_bytes`].
pub(super) unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2")) {
            return stream_copy(dst, src, len);
        }
    }
    std::ptr::copy_nonoverlapping(src, dst, len);
}

/// A copy with plain stores (its bytes stay in cache): AVX2 loads and
/// stores where the CPU has them, as glibc's `memcpy` slows down for the
/// offsets [`copy_bytes`] describes.
///
/// # Safety
/// As [`copy_bytes`].
pub(super) unsafe fn copy_plain(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2")) {
            return avx2_copy::<false>(dst, src, len);
        }
    }
    std::ptr::copy_nonoverlapping(src, dst, len);
}

/// The AVX2 copy: 32-byte loads, and streaming stores (`STREAM`, the
/// destination aligned to 32 bytes first, as they need) or plain ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_copy<const STREAM: bool>(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::*;
    let head = match STREAM {
        true => ((32 - (dst as usize & 31)) & 31).min(len),
        false => 0,
    };
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (dst, src, len) = (dst.add(head), src.add(head), len - head);
    let mut i = 0;
    while i + 128 <= len {
        let v: [__m256i; 4] =
            std::array::from_fn(|k| _mm256_loadu_si256(src.add(i + 32 * k) as *const __m256i));
        for (k, v) in v.into_iter().enumerate() {
            let to = dst.add(i + 32 * k) as *mut __m256i;
            match STREAM {
                true => _mm256_stream_si256(to, v),
                false => _mm256_storeu_si256(to, v),
            }
        }
        i += 128;
    }
    if STREAM {
        // Order the streaming stores before anything that follows (the
        // caller's checksum, acknowledgement or commit).
        _mm_sfence();
    }
    std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
}

/// Streaming stores of [`avx2_copy`].
///
/// # Safety
/// As [`copy_bytes`]; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    avx2_copy::<true>(dst, src, len)
}

fn run_piece(job: &CopyJob, stream_min: usize) -> Result<()> {
    // Only `copy_all` runs pieces (sub-ranges of its jobs): its caller
    // guarantees dst..dst+len is writable, not written by another job, and a
    // memory or device source readable for len until it returns.
    match job.src {
        // SAFETY: as above; `src` is device memory of GPU `ordinal`.
        CopySource::Device { ptr, ordinal } => unsafe {
            crate::memory::cuda_ipc::download(ordinal, job.dst.0, ptr, job.len)?;
        },
        // SAFETY: as above; the source stays unchanged while the destination
        // is written, so the two cannot overlap.
        CopySource::Memory(src) => unsafe {
            copy_streaming_from(job.dst.0, src.0, job.len, stream_min);
        },
        CopySource::File { file, offset } => {
            // SAFETY: as above: dst..dst+len is writable mapped memory that no
            // other job touches while this slice lives.
            let dst = unsafe { std::slice::from_raw_parts_mut(job.dst.0, job.len) };
            let mut done = 0;
            while done < dst.len() {
                match file.read_at(&mut dst[done..], offset + done as u64) {
                    Ok(0) => {
                        return Err(Error::format(format!(
                            "file ended at byte {} while {} more bytes were expected \
                             (was it truncated or replaced after the plan was made?)",
                            offset + done as u64,
                            dst.len() - done
                        )))
                    }
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!("read at byte {}", offset + done as u64),
                            e,
                        ))
                    }
                }
            }
        }
    }
    Ok(())
}

/// Copy the jobs out of GPU memory that are runs of equally spaced blocks
/// of one width (a strided part's rows: `memory::strided`), one 2D copy
/// per run, on this thread; the other jobs are left for the workers (a
/// single block, a large tensor among them, is split into pieces there).
///
/// # Safety
/// As for [`copy_all`].
unsafe fn copy_device_runs<'j, 'a>(
    jobs: &'j [CopyJob<'a>],
) -> std::result::Result<std::borrow::Cow<'j, [CopyJob<'a>]>, CopyError> {
    let gpu = |j: &CopyJob| match j.src {
        CopySource::Device { ptr, ordinal } if j.len > 0 => Some((ordinal, ptr)),
        _ => None,
    };
    if !jobs.iter().any(|j| gpu(j).is_some()) {
        return Ok(std::borrow::Cow::Borrowed(jobs));
    }
    let mut rest = Vec::with_capacity(jobs.len());
    let mut i = 0;
    while i < jobs.len() {
        let Some((ordinal, _)) = gpu(&jobs[i]) else {
            rest.push(jobs[i]);
            i += 1;
            continue;
        };
        // The device jobs from here on, of this GPU, none empty.
        let n = jobs[i..]
            .iter()
            .take_while(|j| gpu(j).is_some_and(|(o, _)| o == ordinal))
            .count();
        let group = &jobs[i..i + n];
        let blocks = group.iter().map(|j| {
            let src = gpu(j).map_or(0, |(_, p)| p);
            ((), (j.dst.0 as u64, src, j.len))
        });
        let mut k = 0;
        for ((), run) in super::strided::runs(blocks) {
            if run.height == 1 {
                rest.push(group[k]);
            } else {
                super::cuda_ipc::download_2d(ordinal, &run).map_err(|error| CopyError {
                    tag: group[k].tag,
                    error,
                })?;
            }
            k += run.height;
        }
        i += n;
    }
    Ok(std::borrow::Cow::Owned(rest))
}

/// Run every job on up to `threads` threads; the first failure stops the rest.
///
/// # Safety
/// Every job's destination must be writable for its length, no two jobs may
/// write the same byte, and memory sources must stay valid and unchanged until
/// this returns.
pub unsafe fn copy_all(jobs: &[CopyJob], threads: usize) -> std::result::Result<(), CopyError> {
    copy_all_from(jobs, threads, STREAM_MIN)
}

/// [`copy_all`] for copies nothing on this core reads soon (packing a
/// bucket): memory copies stream their stores from [`PACK_STREAM_MIN`].
///
/// # Safety
/// As [`copy_all`].
pub unsafe fn copy_all_streaming(
    jobs: &[CopyJob],
    threads: usize,
) -> std::result::Result<(), CopyError> {
    copy_all_from(jobs, threads, PACK_STREAM_MIN)
}

/// [`copy_all`], memory copies streaming from `stream_min` bytes.
///
/// # Safety
/// As [`copy_all`].
unsafe fn copy_all_from(
    jobs: &[CopyJob],
    threads: usize,
    stream_min: usize,
) -> std::result::Result<(), CopyError> {
    let jobs = copy_device_runs(jobs)?;
    let total: usize = jobs.iter().map(|j| j.len).sum();
    let pieces = split(&jobs);
    let run = |group: &[CopyJob]| {
        group.iter().try_for_each(|p| {
            run_piece(p, stream_min).map_err(|error| CopyError { tag: p.tag, error })
        })
    };
    if threads <= 1 || total < PARALLEL_MIN {
        return run(&pieces);
    }
    let ends = claims(&pieces);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error = parking_lot::Mutex::new(None);
    let work = || {
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&end) = ends.get(i) else { break };
            let start = if i == 0 { 0 } else { ends[i - 1] };
            if let Err(e) = run(&pieces[start..end]) {
                failed.store(true, Ordering::Relaxed);
                first_error.lock().get_or_insert(e);
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads.min(ends.len()) {
            s.spawn(work);
        }
        work();
    });
    match first_error.into_inner() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn copies_memory_and_files_in_pieces() {
        let n = PIECE * 2 + 12345;
        let src: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&src).unwrap();
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; n - 10];
        let jobs = [
            CopyJob {
                src: CopySource::Memory(SendPtr(src.as_ptr() as *mut u8)),
                dst: SendPtr(a.as_mut_ptr()),
                len: n,
                tag: 0,
            },
            CopyJob {
                src: CopySource::File {
                    file: &f,
                    offset: 10,
                },
                dst: SendPtr(b.as_mut_ptr()),
                len: n - 10,
                tag: 1,
            },
        ];
        unsafe { copy_all(&jobs, 2) }.unwrap();
        assert_eq!(a, src);
        assert_eq!(&b[..], &src[10..]);
    }

    /// Thousands of 4 KiB jobs (every other block of the destination, the
    /// shape of a column split) on two threads: each lands exactly, the
    /// blocks between stay untouched.
    #[test]
    fn many_small_jobs_in_claimed_groups_land_exactly() {
        const BLOCK: usize = 4096;
        let blocks = 3000;
        let src: Vec<u8> = (0..blocks * BLOCK).map(|i| (i * 13 % 251) as u8).collect();
        let mut dst = vec![0u8; 2 * blocks * BLOCK];
        let jobs: Vec<CopyJob> = (0..blocks)
            .map(|k| CopyJob {
                src: CopySource::Memory(SendPtr(src[k * BLOCK..].as_ptr() as *mut u8)),
                dst: SendPtr(dst[2 * k * BLOCK..].as_mut_ptr()),
                len: BLOCK,
                tag: k,
            })
            .collect();
        assert!(
            claims(&jobs).len() > 1,
            "the jobs are taken in several groups"
        );
        unsafe { copy_all(&jobs, 2) }.unwrap();
        for k in 0..blocks {
            let (row, gap) = dst[2 * k * BLOCK..2 * (k + 1) * BLOCK].split_at(BLOCK);
            assert_eq!(row, &src[k * BLOCK..(k + 1) * BLOCK], "block {k}");
            assert!(gap.iter().all(|b| *b == 0), "gap after block {k}");
        }
    }

    #[test]
    fn streaming_copy_handles_any_offsets_and_lengths() {
        let src: Vec<u8> = (0..(3 << 20) + 77).map(|i| (i * 31 % 253) as u8).collect();
        for (s_off, d_off, len) in [
            (0, 16, 2 << 20),
            (5, 0, (2 << 20) + 77),
            (64, 3, (1 << 20) + 1),
            (0, 0, 100),
        ] {
            let mut dst = vec![0u8; len + 64];
            unsafe { copy_bytes(dst.as_mut_ptr().add(d_off), src.as_ptr().add(s_off), len) };
            assert_eq!(
                &dst[d_off..d_off + len],
                &src[s_off..s_off + len],
                "{s_off} {d_off} {len}"
            );
            assert!(
                dst[..d_off].iter().all(|b| *b == 0) && dst[d_off + len..].iter().all(|b| *b == 0)
            );
        }
    }

    #[test]
    fn short_file_is_an_error_with_its_tag() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[1u8; 100]).unwrap();
        let mut dst = vec![0u8; 200];
        let jobs = [CopyJob {
            src: CopySource::File {
                file: &f,
                offset: 0,
            },
            dst: SendPtr(dst.as_mut_ptr()),
            len: 200,
            tag: 42,
        }];
        let e = unsafe { copy_all(&jobs, 2) }.unwrap_err();
        assert_eq!(e.tag, 42);
        assert!(e.error.message.contains("truncated"), "{}", e.error.message);
    }
}
