//! Checksums: every entry a batch completes is checked before it is used.
//! An entry that moves its whole tensor is checked against the manifest's
//! xxh3-128 (computed where the tensor was written or published: it
//! catches corruption anywhere after). An entry that moves part of a
//! tensor (a slice for a sharded param) is checked against the xxh3-128 of
//! exactly the bytes it receives, which its source hands over with
//! [`Verifier::expect_checksum`] (a publisher hashes the slice it serves; a
//! snapshot hashes what it read after checking it against the file's block
//! sums). Every check hashes the bytes where they landed, so a fault in the
//! landing or a source changed under the copy is caught too. Bytes the
//! applier copies out of memory (a bucket, a mapped file) are hashed as
//! they are copied, each chunk right after it is written, while it is in
//! cache ([`Verifier::copy_hashing`]); bytes a source landed itself are
//! hashed where they landed, right after (still in cache); a file's bytes
//! read into place are hashed there, in the order received.
//! An entry a source wrote straight into GPU memory (gdr) is hashed there
//! once complete ([`Verifier::landed_on_device`]).

use super::landing::Landing;
use crate::checksum::Checksum;
use crate::memory::copy::{copy_all, CopyError, CopyJob, CopySource, PARALLEL_MIN};
use crate::memory::hashing::{copy_hashing, each, hash_all, Hashed};
use crate::memory::SendPtr;
use crate::plan::Plan;
use crate::result::{Error, Result};
use std::collections::HashMap;

/// Where an entry landed on a GPU: its ordinal and the runs (device
/// address, bytes) in the order its bytes came.
type DeviceRuns = (i32, Vec<(u64, u64)>);

/// One entry's copies in a batch (source, destination, length, in the
/// order its bytes come), with its running hash.
type HashedRun = (usize, Checksum, Vec<(SendPtr, SendPtr, usize)>);

/// An update's checksums: running hashes and the sums to check them by.
pub(super) struct Verifier<'p> {
    plan: &'p Plan,
    /// Whether this update verifies at all.
    pub on: bool,
    threads: usize,
    /// gdr: per entry, where its bytes landed on the GPU so far (runs
    /// that follow on merged), hashed there once the entry is complete.
    on_device: HashMap<usize, DeviceRuns>,
    /// Hashing on a GPU failed once this update (no NVRTC, a compile or
    /// driver error): later entries are read back without trying again.
    no_device_hash: bool,
    /// Running hashes of tensors arriving in several chunks.
    hashing: HashMap<usize, Box<Checksum>>,
    /// Per entry that moves part of its tensor: the checksum of the bytes
    /// it receives, as its source computed them (`expect_checksum`).
    slice_sums: HashMap<usize, u128>,
}

impl<'p> Verifier<'p> {
    pub fn new(plan: &'p Plan, on: bool, threads: usize) -> Verifier<'p> {
        Verifier {
            plan,
            on,
            threads,
            on_device: HashMap::new(),
            no_device_hash: false,
            hashing: HashMap::new(),
            slice_sums: HashMap::new(),
        }
    }

    fn name(&self, t: usize) -> &str {
        &self.plan.entries[t].meta.name
    }

    /// The bytes entry `entry` receives (its segments back to back) must
    /// hash to `sum` (xxh3-128). Only entries that move part of their
    /// tensor take one (the others have the manifest's); a source that
    /// verifies slices calls this before the entry's last byte is applied.
    pub fn expect_checksum(&mut self, entry: usize, sum: u128) -> Result<()> {
        match self.plan.entries.get(entry) {
            Some(_) if !self.plan.takes_all(entry) => {
                self.slice_sums.insert(entry, sum);
                Ok(())
            }
            Some(e) => Err(Error::peer(format!(
                "a slice checksum for tensor '{}', all of which moves (its own checksum applies)",
                e.meta.name
            ))),
            None => Err(Error::peer(format!(
                "a slice checksum for entry #{entry} of {}",
                self.plan.entries.len()
            ))),
        }
    }

    /// Add each of `chunks` (entry, bytes, length: the next bytes of the
    /// entry, in order) to its entry's running hash, looked up once per
    /// run of the same entry.
    pub fn hash_chunks(&mut self, chunks: &[(usize, SendPtr, usize)]) {
        for run in chunks.chunk_by(|a, b| a.0 == b.0) {
            let hash = self.hashing.entry(run[0].0).or_default();
            for &(_, at, len) in run {
                // SAFETY: the chunk's bytes are in place (landed or just
                // copied) and nothing writes them during the batch.
                hash.update(unsafe { std::slice::from_raw_parts(at.0, len) });
            }
        }
    }

    /// Copy `copies` (entry, source, destination, length: each entry's in
    /// the order its bytes come) and add the bytes they land to their
    /// entries' running hashes: each entry's on one thread, copied and
    /// hashed a chunk at a time (`copy_hashing`: the destination hashed
    /// while the copy left it in cache, where a copy and then a hash read
    /// it again from memory). With fewer entries than threads (in a batch
    /// worth spreading) the copies run first on every thread and the
    /// hashing after: one long entry copied on one thread would hold the
    /// batch back.
    ///
    /// # Safety
    /// As `copy_all` for memory sources: every source readable and
    /// unchanged, every destination writable, no byte written twice.
    pub unsafe fn copy_hashing(
        &mut self,
        copies: &[(usize, SendPtr, SendPtr, usize)],
        threads: usize,
    ) -> std::result::Result<(), CopyError> {
        if copies.is_empty() {
            return Ok(());
        }
        // Entries in the order first seen, each with its copies in order.
        let mut slot: HashMap<usize, usize> = HashMap::new();
        let mut runs: Vec<HashedRun> = Vec::new();
        for &(t, src, dst, len) in copies {
            let i = *slot.entry(t).or_insert_with(|| {
                let h = self.hashing.remove(&t).map(|h| *h).unwrap_or_default();
                runs.push((t, h, Vec::new()));
                runs.len() - 1
            });
            runs[i].2.push((src, dst, len));
        }
        let total: usize = copies.iter().map(|c| c.3).sum();
        let threads = if total < PARALLEL_MIN { 1 } else { threads };
        let fused = threads <= 1 || runs.len() >= threads;
        if !fused {
            let jobs: Vec<CopyJob> = (copies.iter())
                .map(|&(tag, src, dst, len)| CopyJob {
                    src: CopySource::Memory(src),
                    dst,
                    len,
                    tag,
                })
                .collect();
            // SAFETY: the caller's promise.
            unsafe { copy_all(&jobs, threads) }?;
        }
        let sums = each(&runs, threads, |(_, h, copies)| {
            let mut h = h.clone();
            for &(src, dst, len) in copies {
                // SAFETY: the caller's promise; not fused, the bytes were
                // just copied.
                unsafe {
                    match fused {
                        true => copy_hashing(dst.0, src.0, len, &mut h, Hashed::Destination),
                        false => h.update(std::slice::from_raw_parts(dst.0, len)),
                    }
                }
            }
            h
        });
        for ((t, ..), h) in runs.iter().zip(sums) {
            self.hashing.insert(*t, Box::new(h));
        }
        Ok(())
    }

    /// gdr: the next `len` bytes of entry `t` landed at device address
    /// `at` of GPU `ordinal`; they are hashed where they are once the
    /// entry is complete ([`Verifier::verify`]).
    pub fn landed_on_device(&mut self, t: usize, (at, ordinal): (u64, i32), len: usize) {
        let (_, runs) = self.on_device.entry(t).or_insert((ordinal, Vec::new()));
        match runs.last_mut() {
            Some((start, n)) if *start + *n == at => *n += len as u64,
            _ => runs.push((at, len as u64)),
        }
    }

    /// The digests of complete entries that landed on GPUs: on the GPU
    /// (`delta::device::checksums`, XXH3-128 where the bytes are) when an
    /// entry is one run of device memory, else (several runs: a column
    /// slice; or no NVRTC) read back run by run and hashed here.
    fn device_digests(&mut self, origin: &str, tensors: &[usize]) -> Result<Vec<(usize, u128)>> {
        let mine: Vec<(usize, DeviceRuns)> = tensors
            .iter()
            .filter_map(|t| self.on_device.remove(t).map(|r| (*t, r)))
            .collect();
        let one_run: Vec<(usize, (u64, u64), i32)> = (mine.iter())
            .filter(|(_, (_, runs))| runs.len() == 1 && !self.no_device_hash)
            .map(|(t, (g, runs))| (*t, runs[0], *g))
            .collect();
        let mut out = Vec::with_capacity(mine.len());
        let mut on_gpu = std::collections::HashSet::new();
        for (t, sum) in crate::delta::device::checksums_by_gpu(&one_run) {
            match sum {
                Ok(sum) => {
                    out.push((t, sum));
                    on_gpu.insert(t);
                }
                Err(_) => self.no_device_hash = true,
            }
        }
        for (t, (g, runs)) in mine.iter().filter(|(t, _)| !on_gpu.contains(t)) {
            out.push((*t, self.read_back_digest(origin, *t, *g, runs)?));
        }
        Ok(out)
    }

    /// Entry `t`'s bytes (device `runs` of GPU `ordinal`, in order) read
    /// back a bounded piece at a time and hashed.
    fn read_back_digest(
        &self,
        origin: &str,
        t: usize,
        ordinal: i32,
        runs: &[(u64, u64)],
    ) -> Result<u128> {
        const PIECE: u64 = 8 << 20;
        let mut hash = Checksum::default();
        let mut buf = Vec::new();
        for &(at, len) in runs {
            let mut done = 0;
            while done < len {
                let n = PIECE.min(len - done);
                buf.resize(n as usize, 0);
                // SAFETY: the device range was range-checked by the landing
                // and the source wrote it; `buf` holds n bytes.
                unsafe {
                    crate::memory::cuda_ipc::download(
                        ordinal,
                        buf.as_mut_ptr(),
                        at + done,
                        buf.len(),
                    )
                }
                .map_err(|e| {
                    e.context(format!("{origin}: reading tensor '{}' back", self.name(t)))
                })?;
                hash.update(&buf);
                done += n;
            }
        }
        Ok(hash.digest())
    }

    /// Check the checksums of `tensors`, all complete (when verifying),
    /// where `landing` received them.
    pub fn verify(&mut self, origin: &str, tensors: &[usize], landing: &mut Landing) -> Result<()> {
        if !self.on || tensors.is_empty() {
            return Ok(());
        }
        let mut on_device = std::collections::HashSet::new();
        for (t, got) in self.device_digests(origin, tensors)? {
            self.check_checksum(origin, t, got)?;
            on_device.insert(t);
        }
        let mut whole = Vec::with_capacity(tensors.len());
        for &t in tensors.iter().filter(|t| !on_device.contains(*t)) {
            match self.hashing.remove(&t) {
                Some(h) => self.check_checksum(origin, t, h.digest())?,
                None => whole.push(t),
            }
        }
        let regions: Vec<(SendPtr, usize)> = whole
            .iter()
            .map(|&t| {
                // Entries not hashed chunk by chunk arrived whole in one
                // chunk and move whole (`batch`): one span.
                let n = self.plan.entries[t].bytes;
                Ok((landing.receive_spans(t, 0, n)?[0].dst, n as usize))
            })
            .collect::<Result<_>>()?;
        // SAFETY: the regions were fully written and nothing writes them now.
        let got = unsafe { hash_all(&regions, self.threads) };
        for (&t, got) in whole.iter().zip(got) {
            self.check_checksum(origin, t, got)?;
        }
        Ok(())
    }

    pub fn check_checksum(&self, origin: &str, t: usize, got: u128) -> Result<()> {
        let (want, what) = match self.plan.takes_all(t) {
            true => (self.plan.entries[t].meta.checksum, ""),
            false => (
                self.slice_sums.get(&t).copied(),
                " (the part this rank takes)",
            ),
        };
        if want != Some(got) {
            return Err(Error::checksum(format!(
                "tensor '{}'{what} from {origin}: checksum mismatch (expected {}, got {})",
                self.name(t),
                want.map_or("none".into(), crate::manifest::checksum_hex),
                crate::manifest::checksum_hex(got)
            )));
        }
        Ok(())
    }
}
