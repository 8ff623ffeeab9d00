//! Reading plan entries from one open file of the snapshot, as
//! `reads.rs` says: a segment read alone goes straight from the file to
//! its destination (the applier's parallel copier does the pread); a
//! covering read goes through one bounded buffer ([`WINDOW_BYTES`], never
//! a whole large tensor at once), is checked against its block sums when
//! it has them, and the applier copies the segments out of it.
//!
//! A verified slice: every block read is checked against its sum, and the
//! xxh3-128 of the entry's wanted bytes (its segments in order) is worked
//! out from the checked blocks and handed to the applier
//! (`Applier::expect_checksum`) before the entry's last byte is applied;
//! the applier hashes what lands and compares. Bytes of the tensor outside
//! the blocks a rank reads are not read, so corruption there is not seen
//! by that rank (the rank reading them sees it).

use super::block_sums::BlockSums;
use super::reads::{plan_reads, Read};
use super::BATCH_BYTES;
use crate::apply::{Applier, Chunk};
use crate::checksum::Checksum;
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::{Plan, Segment};
use crate::result::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The covering-read buffer: a multiple of every block size
/// (`block_sums::MAX_BLOCK_SIZE` at most).
pub(crate) const WINDOW_BYTES: u64 = 8 << 20;

/// Hands one file's planned bytes to the applier, batch by batch.
pub(super) struct FileReader<'f> {
    file: &'f File,
    shown: &'f str,
    batch: Vec<Chunk<'f>>,
    batch_bytes: u64,
    /// Covering reads land here; its length never changes once allocated
    /// (chunks of the pending batch point into it).
    buf: Vec<u8>,
    used: usize,
}

impl<'f> FileReader<'f> {
    pub(super) fn new(file: &'f File, shown: &'f str) -> FileReader<'f> {
        FileReader {
            file,
            shown,
            batch: Vec::new(),
            batch_bytes: 0,
            buf: Vec::new(),
            used: 0,
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
        let mut wanted = sums.map(|_| Checksum::default());
        for r in plan_reads(segs, nbytes, sums.map(|s| s.block)) {
            if r.covering {
                self.covering(applier, plan, (e, at), (&r, segs), sums, &mut wanted)?;
            } else {
                let s = segs[r.segs.start];
                let src = CopySource::File {
                    file: self.file,
                    offset: at + s.source,
                };
                self.push(applier, e, (s.wanted, s.len), src)?;
            }
        }
        if let Some(h) = wanted {
            applier.expect_checksum(e, h.digest())?;
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
            let i = self.reserve(applier, to - from)?;
            let bytes = &mut self.buf[i..i + (to - from) as usize];
            read_checked(self.file, bytes, (at, from), sums, &what)?;
            let bytes = &self.buf[i..i + (to - from) as usize];
            // The segments in this window, in order.
            while next < r.segs.end && segs[next].source + segs[next].len <= from {
                next += 1;
            }
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
            from = to;
        }
        Ok(())
    }

    /// Room for `len` bytes in the buffer (applying the pending batch
    /// first when they do not fit); returns where it starts.
    fn reserve(&mut self, applier: &mut Applier, len: u64) -> Result<usize> {
        applier.check_deadline()?;
        if self.buf.is_empty() {
            self.buf = vec![0u8; WINDOW_BYTES as usize];
        }
        if self.used + len as usize > self.buf.len() {
            self.flush(applier)?;
        }
        let at = self.used;
        self.used += len as usize;
        Ok(at)
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

    /// Apply the pending batch; the buffer is free again after.
    pub(super) fn flush(&mut self, applier: &mut Applier) -> Result<()> {
        if !self.batch.is_empty() {
            applier.apply_batch(self.shown, &self.batch)?;
        }
        self.batch.clear();
        self.batch_bytes = 0;
        self.used = 0;
        Ok(())
    }
}

/// Below this a covering read is one pread on the calling thread.
const PARALLEL_PIECE: u64 = 1 << 20;

/// Fill `buf` with the tensor's bytes from byte `from` (the tensor starts
/// at byte `at` of `file`) and check them against `sums` (`from` is then a
/// block boundary), in pieces of at least [`PARALLEL_PIECE`] on up to one
/// thread per core: a verified slice is read and hashed as widely as the
/// applier copies.
fn read_checked(
    file: &File,
    buf: &mut [u8],
    (at, from): (u64, u64),
    sums: Option<&BlockSums>,
    what: &(dyn Fn() -> String + Sync),
) -> Result<()> {
    let block = sums.map_or(1, |s| s.block);
    let piece = PARALLEL_PIECE.div_ceil(block) * block;
    let pieces = (buf.len() as u64).div_ceil(piece) as usize;
    let threads = crate::memory::copy::default_threads().clamp(1, pieces.max(1));
    // Each thread takes a run of whole pieces.
    let per = pieces.div_ceil(threads) * piece as usize;
    let work = |(k, part): (usize, &mut [u8])| -> Result<()> {
        let start = from + (k * per) as u64;
        file.read_exact_at(part, at + start)
            .map_err(|e| Error::io(format!("reading {}", what()), e))?;
        match sums {
            Some(s) => s.check(start / s.block, part, what),
            None => Ok(()),
        }
    };
    if threads == 1 {
        return work((0, buf));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = buf
            .chunks_mut(per)
            .enumerate()
            .map(|job| scope.spawn(move || work(job)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("read thread"))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}
