//! Patching deltas onto their bases in host memory, entries in parallel:
//! each entry's base is read from its param a window at a time into where
//! its new bytes land (the atomic arena; in place, a host param itself, so
//! nothing is copied), patched there and hashed while the window is in
//! cache. A GPU param's base (atomic mode) is read back from the GPU a
//! window at a time. An entry landing in several pieces (a column split's
//! rows) goes through a window buffer and is scattered from it.

use crate::checksum::Checksum;
use crate::delta::{DeltaError, Patcher, CHUNK, WINDOW_CHUNKS};
use crate::memory::cuda_ipc::download;
use crate::memory::SendPtr;
use crate::plan::Segment;

/// Where an entry's base is.
#[derive(Clone, Copy, Debug)]
pub(super) enum Base {
    /// A host param: the entry's segments in it.
    Host(SendPtr),
    /// A GPU param holding the entry's bytes as one run at device address
    /// `at`.
    Device { at: u64, ordinal: i32 },
}

/// One entry's delta and where its bytes are.
pub(super) struct PatchJob<'d> {
    pub delta: &'d [u8],
    pub esize: usize,
    /// The entry's bytes.
    pub total: u64,
    /// Its base, and (a host param) the entry's segments in it.
    pub base: Base,
    pub segs: &'d [Segment],
    /// Where its new bytes land: pieces in order, joined.
    pub dst: Vec<(SendPtr, usize)>,
    /// `dst` is the base itself (in place): nothing to copy.
    pub in_place: bool,
}

/// Patch every job on up to `threads` threads: per job, the elements it
/// rewrote and the xxh3-128 of its new bytes.
pub(super) fn patch_all(jobs: &[PatchJob], threads: usize) -> Vec<Result<(u64, u128), DeltaError>> {
    crate::parallel::map(jobs, threads, "patching deltas", patch_one)
}

fn patch_one(j: &PatchJob) -> Result<(u64, u128), DeltaError> {
    let mut patcher = Patcher::new(j.delta, j.esize)?;
    let mut hash = Checksum::default();
    let window = (CHUNK * WINDOW_CHUNKS * j.esize) as u64;
    let single = j.dst.len() == 1;
    let mut buf = match single {
        true => Vec::new(),
        false => vec![0u8; window.min(j.total) as usize],
    };
    let mut out = Scatter::new(&j.dst);
    let mut at = 0;
    while at < j.total {
        let n = window.min(j.total - at) as usize;
        let w: &mut [u8] = match single {
            // SAFETY: `dst` is where the applier lands this entry's
            // `total` bytes (range-checked), written by this job only.
            true => unsafe { std::slice::from_raw_parts_mut(j.dst[0].0 .0.add(at as usize), n) },
            false => &mut buf[..n],
        };
        if !(single && j.in_place) {
            read_base(j, at, w)?;
        }
        patcher.patch(w)?;
        hash.update(w);
        if !single {
            out.write(w);
        }
        at += n as u64;
    }
    Ok((patcher.finish()? * j.esize as u64, hash.digest()))
}

/// Bytes `[at, at + out.len())` of the job's entry as its param holds them.
fn read_base(j: &PatchJob, at: u64, out: &mut [u8]) -> Result<(), DeltaError> {
    let base = match j.base {
        Base::Host(p) => p,
        Base::Device { at: run, ordinal } => {
            // SAFETY: the entry's run of the GPU param (checked by the plan
            // against its size), into a window of the entry's bytes.
            return unsafe { download(ordinal, out.as_mut_ptr(), run + at, out.len()) }
                .map_err(|e| DeltaError(format!("reading its base back from GPU {ordinal}: {e}")));
        }
    };
    let mut i = j.segs.partition_point(|s| s.wanted + s.len <= at);
    let mut done = 0usize;
    while done < out.len() {
        let s = &j.segs[i];
        let from = at + done as u64 - s.wanted;
        let n = ((s.len - from) as usize).min(out.len() - done);
        // SAFETY: the plan checked every segment against its param's size;
        // in place a window is read before it is written back, and the
        // entries' segments do not overlap.
        let src = unsafe { std::slice::from_raw_parts(base.0.add((s.param + from) as usize), n) };
        out[done..done + n].copy_from_slice(src);
        done += n;
        i += 1;
    }
    Ok(())
}

/// Bytes written front to back into pieces.
struct Scatter<'p> {
    pieces: &'p [(SendPtr, usize)],
    /// The piece written next, and how much of it is written.
    i: usize,
    filled: usize,
}

impl<'p> Scatter<'p> {
    fn new(pieces: &'p [(SendPtr, usize)]) -> Scatter<'p> {
        Scatter {
            pieces,
            i: 0,
            filled: 0,
        }
    }

    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (at, len) = self.pieces[self.i];
            let n = (len - self.filled).min(bytes.len());
            // SAFETY: the pieces are where the applier lands this entry's
            // bytes, `total` in all; this job alone writes them.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at.0.add(self.filled), n) };
            bytes = &bytes[n..];
            self.filled += n;
            if self.filled == len {
                (self.i, self.filled) = (self.i + 1, 0);
            }
        }
    }
}
