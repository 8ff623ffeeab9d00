//! Reading plan entries from one open file of the snapshot, as
//! `reads.rs` says: a segment read alone goes straight from the file to
//! its destination (the applier's parallel copier does the pread); a
//! covering read brings in one bounded window at a time ([`WINDOW_BYTES`],
//! never a whole large tensor at once), checked against its block sums
//! when it has them, and the applier copies the segments out of it.
//!
//! Which read where: segments are read through mapped windows of the
//! file (`mapped.rs`, under the SIGBUS guard), and the applier's copier
//! threads copy them out, one copy from the page cache, as PyTorch's
//! `load_file` does. A segment read alone of at least [`MAP_MIN`] is
//! mapped in windows of [`MAP_WINDOW`]; a covering read maps its window
//! (no copy into a buffer, and only the pages holding segments are
//! touched). Shorter segments read alone, and any window that cannot be
//! mapped (no free guard slot, `mmap` failed), are read with `pread`.
//!
//! Measured on the 2-core machine while two builds shared it (1 GiB in
//! the page cache, 2 threads, best of 5, GB/s, runs apart by load; `wm
//! bench snapshot` prints a mapped read beside its `pread` floor in every
//! run):
//!
//! | file written in         | into       | `pread`  | mmap 8 MiB | mmap 32 MiB |
//! |-------------------------|------------|----------|------------|-------------|
//! | 64 MiB writes           | 4 KiB pages| 7.5-9.8  | 9.1-10.7   | 10.3-11.5   |
//! | 64 MiB writes           | huge pages | 9.3-12.2 | 10.7-15.0  | 11.2-18.8   |
//! | small writes (a pipe)   | 4 KiB pages| 8.9-13.2 | 6.9-12.3   | 6.8-11.8    |
//! | small writes (a pipe)   | huge pages | 12.9-14.1| 11.8-12.8  | 11.9-13.1   |
//!
//! A mapped read pays for a page-table entry per page, set up on the first
//! touch and torn down at `munmap` (`perf`: `exc_page_fault`,
//! `unmap_page_range`, rmap and memcg accounting); a page cache filled by
//! large writes (a trainer's safetensors file) or by readahead holds large
//! folios, mapped many pages per fault (a quarter of the faults per GiB),
//! so the mapping wins by 1.1-1.7x; a file written in small pieces is in
//! 4 KiB pages and `pread` wins by 5-25% there. `MADV_SEQUENTIAL`,
//! `MADV_WILLNEED` and 2 MiB windows did not help; `MAP_POPULATE` helped a
//! little where each thread maps its own piece, but here one thread maps
//! and populating would serialize the page-table work, so it is not used.
//! Covering reads (one thread, GB/s of wanted bytes; `pread` into the
//! buffer then copied out): 64 B of every 128 B 2.61 / 3.18 mapped, 512 B
//! of every 4 KiB 0.77 / 1.07, 4 KiB of every 8 KiB 2.47 / 2.87.
//!
//! A whole tensor quantized here in place, unverified, is mapped whole and
//! handed to the applier, which quantizes from the mapping (no copy).
//!
//! A file truncated under a mapped window: the SIGBUS guard puts zero
//! pages over it and marks it faulted; the batch pointing into it fails
//! with an error naming the file (checked after the batch is applied, and
//! before a block sum mismatch is reported), like a short `pread`.
//!
//! A verified slice: every block read is checked against its sum, and the
//! xxh3-128 of the entry's wanted bytes (its segments in order) is worked
//! out from the checked blocks and handed to the applier
//! (`Applier::expect_checksum`) before the entry's last byte is applied;
//! the applier hashes what lands and compares. Bytes of the tensor outside
//! the blocks a rank reads are not read, so corruption there is not seen
//! by that rank (the rank reading them sees it).

use super::reads::{plan_reads, Read};
use super::BATCH_BYTES;
use crate::apply::{Applier, Chunk, FileCheck};
use crate::checkpoint::block_sums::BlockSums;
use crate::checkpoint::regular_file::FileStamp;
use crate::checksum::Checksum;
use crate::memory::copy::CopySource;
use crate::memory::mapped_file::MappedWindow;
use crate::memory::SendPtr;
use crate::plan::{Plan, Segment};
use crate::result::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// A covering read's window, and the covering bytes a batch holds at most
/// (mapped or in the buffer): a multiple of every block size
/// (`block_sums::MAX_BLOCK_SIZE` at most).
pub(crate) const WINDOW_BYTES: u64 = 8 << 20;

/// Segments read alone from this long on are mapped: an `mmap`, a guard
/// slot and an `munmap` cost microseconds, small against the ~100 us a
/// MiB takes (not measured; shorter segments keep `pread`, which the
/// 10,000-small-tensor row of `wm bench snapshot` measures).
const MAP_MIN: u64 = 1 << 20;
/// The mapped window of a segment read alone (32 MiB measured ahead of
/// 8 MiB; a batch holds `BATCH_BYTES / MAP_WINDOW` guard slots at most).
const MAP_WINDOW: u64 = 32 << 20;

/// Hands one file's planned bytes to the applier, batch by batch.
pub(super) struct FileReader<'f> {
    file: &'f File,
    shown: &'f str,
    /// Its path and its stamp when the plan was made: a tensor quantized
    /// from the mapping is read after the file's last check, so the
    /// applier checks the stamp again once it has read it.
    planned: (&'f Path, FileStamp),
    batch: Vec<Chunk<'f>>,
    batch_bytes: u64,
    /// Covering reads that could not be mapped land here; its length never
    /// changes once allocated (chunks of the pending batch point into it).
    buf: Vec<u8>,
    used: usize,
    /// Mapped windows the pending batch's chunks point into.
    maps: Vec<MappedWindow>,
    /// Covering bytes among them.
    mapped: usize,
}

impl<'f> FileReader<'f> {
    pub(super) fn new(
        file: &'f File,
        shown: &'f str,
        planned: (&'f Path, FileStamp),
    ) -> FileReader<'f> {
        FileReader {
            file,
            shown,
            planned,
            batch: Vec::new(),
            batch_bytes: 0,
            buf: Vec::new(),
            used: 0,
            maps: Vec::new(),
            mapped: 0,
        }
    }

    /// Read entry `e`, whose tensor starts at byte `at` of the file;
    /// `sums`: its block sums, when what is read must be checked.
    pub(super) fn entry(
        &mut self,
        applier: &mut Applier,
        plan: &Plan,
        (e, at): (usize, u64),
        sums: Option<&BlockSums>,
    ) -> Result<()> {
        let segs = plan.segments(e);
        let nbytes = plan.entries[e].meta.nbytes;
        if sums.is_none() && applier.quantizes_from_file(e) {
            // Quantized from the mapping, not copied (`apply/quantize.rs`).
            let s = segs[0];
            if let Some(w) = MappedWindow::map(self.file, at + s.source, s.len as usize) {
                crate::memory::mapped_file::count_read(s.len);
                let unchanged = self.unchanged_check()?;
                return applier.quantize_from_file(self.shown, e, w, unchanged);
            }
        }
        let mut wanted = sums.map(|_| Checksum::default());
        for r in plan_reads(segs, nbytes, sums.map(|s| s.block)) {
            if r.covering {
                self.covering(applier, plan, (e, at), (&r, segs), sums, &mut wanted)?;
            } else {
                self.segment(applier, e, at, segs[r.segs.start])?;
            }
        }
        if let Some(h) = wanted {
            applier.expect_checksum(e, h.digest())?;
        }
        Ok(())
    }

    /// A segment read alone: mapped window by window when it is at least
    /// [`MAP_MIN`] long, else (or where a window cannot be mapped) read
    /// with `pread` by the copier, straight into its destination.
    fn segment(&mut self, applier: &mut Applier, e: usize, at: u64, s: Segment) -> Result<()> {
        let mut done = 0;
        while done < s.len {
            let n = (s.len - done).min(MAP_WINDOW);
            let offset = at + s.source + done;
            let window = match s.len >= MAP_MIN {
                true => MappedWindow::map(self.file, offset, n as usize),
                false => None,
            };
            let src = match window {
                Some(w) => {
                    let start = w.bytes().as_ptr();
                    crate::memory::mapped_file::count_read(n);
                    self.maps.push(w);
                    CopySource::Memory(SendPtr(start as *mut u8))
                }
                None => CopySource::File {
                    file: self.file,
                    offset,
                },
            };
            self.push(applier, e, (s.wanted + done, n), src)?;
            done += n;
        }
        Ok(())
    }

    /// One covering read, window by window.
    fn covering(
        &mut self,
        applier: &mut Applier,
        plan: &Plan,
        (e, at): (usize, u64),
        (r, segs): (&Read, &[Segment]),
        sums: Option<&BlockSums>,
        wanted: &mut Option<Checksum>,
    ) -> Result<()> {
        let mut next = r.segs.start;
        let mut from = r.span.start;
        let name = &plan.entries[e].meta.name;
        let shown = self.shown;
        let what = || format!("tensor '{name}' in {shown}");
        while from < r.span.end {
            let to = (from + WINDOW_BYTES).min(r.span.end);
            let (start, mapped) = self.window(applier, (at, from, to), sums, &what)?;
            // SAFETY: the window holds `to - from` bytes and stays until the
            // batch pointing into it is applied (`flush`).
            let bytes = unsafe { std::slice::from_raw_parts(start, (to - from) as usize) };
            // The segments in this window, in order.
            while next < r.segs.end && segs[next].source + segs[next].len <= from {
                next += 1;
            }
            let batched = self.batch_bytes;
            for s in segs[next..r.segs.end].iter().take_while(|s| s.source < to) {
                let (lo, hi) = (s.source.max(from), (s.source + s.len).min(to));
                let part = &bytes[(lo - from) as usize..(hi - from) as usize];
                if let Some(h) = wanted.as_mut() {
                    h.update(part);
                }
                self.batch.push(Chunk {
                    tensor: e,
                    offset: s.wanted + (lo - s.source),
                    len: part.len(),
                    src: CopySource::Memory(SendPtr(part.as_ptr() as *mut u8)),
                });
                self.batch_bytes += part.len() as u64;
            }
            if mapped && sums.is_none() {
                // Only the segments are read out of a mapped window that is
                // not checked (a checked one counted itself).
                crate::memory::mapped_file::count_read(self.batch_bytes - batched);
            }
            from = to;
        }
        Ok(())
    }

    /// Bring in bytes `from..to` of the tensor at byte `at` of the file,
    /// checked against `sums`: mapped when it can be, else read into the
    /// buffer (applying the pending batch first when the batch's covering
    /// bytes would pass [`WINDOW_BYTES`]); returns where they start, and
    /// whether they are mapped.
    fn window(
        &mut self,
        applier: &mut Applier,
        (at, from, to): (u64, u64, u64),
        sums: Option<&BlockSums>,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<(*const u8, bool)> {
        applier.check_deadline()?;
        let len = (to - from) as usize;
        if self.used + self.mapped + len > WINDOW_BYTES as usize {
            self.flush(applier)?;
        }
        if let Some(w) = MappedWindow::map(self.file, at + from, len) {
            let checked = match sums {
                Some(s) => {
                    crate::memory::mapped_file::count_read(len as u64);
                    in_pieces(len, s.block, |k, n| {
                        s.check((from + k as u64) / s.block, &w.bytes()[k..k + n], what)
                    })
                }
                None => Ok(()),
            };
            let (start, faulted) = (w.bytes().as_ptr(), w.faulted());
            self.maps.push(w);
            self.mapped += len;
            if faulted {
                return Err(self.truncated());
            }
            return checked.map(|()| (start, true));
        }
        if self.buf.is_empty() {
            self.buf = vec![0u8; WINDOW_BYTES as usize];
        }
        let i = self.used;
        self.used += len;
        read_checked(self.file, &mut self.buf[i..i + len], (at, from), sums, what)?;
        Ok((self.buf[i..].as_ptr(), false))
    }

    /// Err when the file changed since the plan was made (its stamp),
    /// for a read after the file's last check.
    fn unchanged_check(&self) -> Result<FileCheck> {
        let (path, planned) = (self.planned.0.to_path_buf(), self.planned.1);
        let file = (self.file.try_clone())
            .map_err(|e| Error::io(format!("reopening {}", self.shown), e))?;
        Ok(Box::new(move || {
            let now = FileStamp::of(&file, &path)?;
            planned.check(&now, &path, "before it was quantized")
        }))
    }

    /// A mapped window faulted: the file shrank while it was read.
    fn truncated(&self) -> Error {
        Error::format(format!(
            "{} was truncated while it was read (a mapped read ran past its end; \
             was it truncated or replaced after the plan was made?)",
            self.shown
        ))
    }

    fn push(
        &mut self,
        applier: &mut Applier,
        tensor: usize,
        (offset, len): (u64, u64),
        src: CopySource<'f>,
    ) -> Result<()> {
        self.batch.push(Chunk {
            tensor,
            offset,
            len: len as usize,
            src,
        });
        self.batch_bytes += len;
        if self.batch_bytes >= BATCH_BYTES {
            self.flush(applier)?;
        }
        Ok(())
    }

    /// Apply the pending batch; the buffer and the windows are free again
    /// after. A window that faulted fails the batch naming the file, even
    /// when the zeros it read failed it first (a checksum mismatch).
    pub(super) fn flush(&mut self, applier: &mut Applier) -> Result<()> {
        let applied = match self.batch.is_empty() {
            true => Ok(()),
            false => applier.apply_batch(self.shown, &self.batch),
        };
        let faulted = self.maps.iter().any(MappedWindow::faulted);
        self.batch.clear();
        self.maps.clear();
        self.batch_bytes = 0;
        self.used = 0;
        self.mapped = 0;
        match faulted {
            true => Err(self.truncated()),
            false => applied,
        }
    }
}

/// Below this a covering window is read, or checked, on the calling thread.
const PARALLEL_PIECE: u64 = 1 << 20;

/// Fill `buf` with the tensor's bytes from byte `from` (the tensor starts
/// at byte `at` of `file`) and check them against `sums` (`from` is then a
/// block boundary), in pieces as [`in_pieces`] runs them.
fn read_checked(
    file: &File,
    buf: &mut [u8],
    (at, from): (u64, u64),
    sums: Option<&BlockSums>,
    what: &(dyn Fn() -> String + Sync),
) -> Result<()> {
    let base = SendPtr(buf.as_mut_ptr());
    in_pieces(buf.len(), sums.map_or(1, |s| s.block), |k, n| {
        let base = &base;
        // SAFETY: `in_pieces` hands out disjoint ranges of `buf`.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(k), n) };
        let start = from + k as u64;
        file.read_exact_at(part, at + start)
            .map_err(|e| Error::io(format!("reading {}", what()), e))?;
        match sums {
            Some(s) => s.check(start / s.block, part, what),
            None => Ok(()),
        }
    })
}

/// Run `work(start, len)` over `len` bytes in pieces of at least
/// [`PARALLEL_PIECE`] (whole blocks of `block`) on up to one thread per
/// core, each thread taking a run of whole pieces: a verified slice is
/// read and hashed as widely as the applier copies.
fn in_pieces(
    len: usize,
    block: u64,
    work: impl Fn(usize, usize) -> Result<()> + Sync,
) -> Result<()> {
    let piece = PARALLEL_PIECE.div_ceil(block) * block;
    let pieces = (len as u64).div_ceil(piece) as usize;
    let threads = crate::memory::copy::default_threads().clamp(1, pieces.max(1));
    let per = pieces.div_ceil(threads) * piece as usize;
    if threads == 1 {
        return work(0, len);
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = (0..len)
            .step_by(per)
            .map(|k| scope.spawn(move || work(k, per.min(len - k))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("read thread"))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}
