//! Deltas land here: the bytes an entry's param holds now are the base a
//! delta applies onto. [`Applier::base_fingerprints`] hashes them (the
//! engine names them in WANT, so a param written by anything since is
//! noticed); [`Applier::apply_deltas`] patches them where the entries'
//! bytes land (`patch.rs`) and accounts for them as any source's landed
//! bytes, so atomic staging, in-place writes and progress are the ones
//! every update uses. In atomic mode the params keep the old bytes until
//! the commit; in place the params are patched where they are.
//!
//! Only host params have a base here: a device param's would have to be
//! read back from the GPU first, so its entries go whole. An FP8 param
//! quantized by the publishers has its FP8 bytes as the base (elements of
//! one byte); its scales are written whole at every commit from the
//! agreed amax, so they need none.

use super::patch::{patch_all, PatchJob};
use super::{Applier, Chunk};
use crate::checksum::Checksum;
use crate::delta;
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::registry::Dest;
use crate::result::{Error, Result};

/// One delta for [`Applier::apply_deltas`]: plan entry `entry`'s new
/// bytes as a delta (elements of `esize` bytes) whose result hashes to
/// `sum`.
pub struct DeltaJob<'d> {
    pub entry: usize,
    pub delta: &'d [u8],
    pub esize: usize,
    pub sum: u128,
}

/// What the deltas of an update did (`wm_delta_stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaTally {
    /// Entries (an entry's bytes from one source: a request) sent as deltas.
    pub runs_delta: u64,
    /// Delta bytes received.
    pub delta_bytes: u64,
    /// Bytes of the requests sent as deltas (what whole would have moved).
    pub covered_bytes: u64,
    /// Bytes the deltas rewrote in the params (a chunk sent whole counts
    /// every byte).
    pub rewritten_bytes: u64,
    /// Entries that named a base (sent a fingerprint), and those whose
    /// bytes the publisher found not to be the base's.
    pub asked: u64,
    pub base_differs: u64,
    /// A publisher asked for deltas does not keep the base.
    pub base_not_kept: bool,
}

/// The xxh3-128 of entry `t`'s bytes in its host param at `base`.
fn fingerprint(plan: &Plan, t: usize, base: SendPtr) -> u128 {
    let mut hash = Checksum::default();
    for s in plan.segments(t) {
        // SAFETY: the plan checked every segment against its param's
        // registered size; nothing writes the params before the update
        // starts.
        hash.update(unsafe {
            std::slice::from_raw_parts(base.0.add(s.param as usize), s.len as usize)
        });
    }
    hash.digest()
}

/// The element size of entry deltas: an FP8 param's elements are bytes,
/// whatever its source's dtype.
pub fn delta_element_size(plan: &Plan, entry: usize, request_bytes: u64) -> usize {
    let e = &plan.entries[entry];
    match e.target {
        Target::Param(i) if plan.quantized(i).is_some() => 1,
        _ => delta::element_size(e.meta.dtype.size(), request_bytes),
    }
}

impl Applier<'_, '_> {
    /// The param memory of entry `t`, when it has a base here (a host
    /// param, and bytes to patch).
    fn host_param(&self, t: usize) -> Option<SendPtr> {
        let e = &self.plan.entries[t];
        match (e.target, self.landing.params[t]) {
            // Quantized here, a param's runs bring its source's bytes, not
            // the FP8 it holds; quantized by the publishers, they bring
            // FP8 bytes like those it holds, and deltas patch those.
            (Target::Param(i), _) if self.plan.quantized(i).is_some_and(|q| !q.on_wire) => None,
            (Target::Param(_), Some(Dest::Host(p))) if e.bytes > 0 => Some(p),
            _ => None,
        }
    }

    /// Per entry of `entries`: the xxh3-128 of the bytes its param holds
    /// where the entry's bytes land (its segments in order), None without a
    /// base. Hashed on the applier's threads.
    pub fn base_fingerprints(&self, entries: &[usize]) -> Vec<Option<u128>> {
        let plan = self.plan;
        let jobs: Vec<(usize, Option<SendPtr>)> =
            entries.iter().map(|&t| (t, self.host_param(t))).collect();
        let per = jobs.len().div_ceil(self.opts.threads.max(1)).max(1);
        std::thread::scope(|s| {
            let hashing: Vec<_> = jobs
                .chunks(per)
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .map(|&(t, base)| Some(fingerprint(plan, t, base?)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hashing
                .into_iter()
                .flat_map(|j| j.join().expect("hashing does not panic"))
                .collect()
        })
    }

    /// Apply each delta onto its entry's base (patched in parallel,
    /// `patch.rs`). Every delta is checked before any byte is written; each
    /// result must hash to its delta's `sum`, checked whether or not the
    /// update verifies (a wrong base would otherwise go unnoticed), and
    /// that check stands for the applier's own (so the bytes are hashed
    /// once). In place, a result that fails its checksum was written: the
    /// update then fails as any in-place failure after a write. `origin`
    /// names the source in errors.
    pub fn apply_deltas(&mut self, origin: &str, deltas: &[DeltaJob]) -> Result<()> {
        for d in deltas {
            self.check_delta(origin, d)?;
        }
        let in_place = self.landing.in_place();
        let mut jobs = Vec::with_capacity(deltas.len());
        for d in deltas {
            let total = self.plan.entries[d.entry].bytes;
            let dst = self
                .landing
                .receive_scatter(d.entry, 0, total as usize, usize::MAX)?;
            jobs.push(PatchJob {
                delta: d.delta,
                esize: d.esize,
                total,
                base: self.host_param(d.entry).expect("checked"),
                segs: self.plan.segments(d.entry),
                dst: dst.ok_or_else(|| Error::unsupported("a delta into GPU memory"))?,
                in_place,
            });
        }
        let done = patch_all(&jobs, self.opts.threads);
        for ((d, job), r) in deltas.iter().zip(&jobs).zip(done) {
            let name = &self.plan.entries[d.entry].meta.name;
            let (rewritten, got) =
                r.map_err(|e| Error::peer(format!("{origin}: the delta of tensor '{name}': {e}")))?;
            if got != d.sum {
                return Err(Error::checksum(format!(
                    "{origin}: tensor '{name}': its delta does not give the new version's bytes \
                     (checksum mismatch)"
                )));
            }
            let landed = Chunk {
                tensor: d.entry,
                offset: 0,
                len: job.total as usize,
                src: CopySource::Memory(job.dst[0].0),
            };
            // Checked just above: the applier need not hash it again.
            let verifying = std::mem::replace(&mut self.verifier.on, false);
            let r = self.account_landed(origin, &[landed]);
            self.verifier.on = verifying;
            r?;
            self.tally_delta(d.delta.len() as u64, job.total, rewritten);
        }
        Ok(())
    }

    /// Before any byte is written: the delta's entry has a base here, the
    /// delta is well formed for its bytes, and (verifying) an entry taking
    /// all of its tensor is promised the manifest's checksum.
    fn check_delta(&self, origin: &str, d: &DeltaJob) -> Result<()> {
        let e = &self.plan.entries[d.entry];
        let bad = |why: String| {
            Error::peer(format!(
                "{origin}: the delta of tensor '{}': {why}",
                e.meta.name
            ))
        };
        if self.host_param(d.entry).is_none() {
            return Err(bad("its param has no base here".into()));
        }
        delta::check(d.delta, e.bytes as usize, d.esize).map_err(|x| bad(x.0))?;
        // A quantized entry's manifest checksum is its source's (bf16),
        // not the FP8 bytes': its SUMS are what vouch for those.
        let fp8 = matches!(e.target, Target::Param(i) if self.plan.quantized(i).is_some());
        match e.meta.checksum {
            Some(c) if self.verifies() && self.plan.takes_all(d.entry) && !fp8 && c != d.sum => {
                Err(bad("its checksum is not the manifest's".into()))
            }
            _ => Ok(()),
        }
    }

    fn tally_delta(&mut self, delta: u64, covered: u64, rewritten: u64) {
        let d = &mut self.deltas;
        d.runs_delta += 1;
        d.delta_bytes += delta;
        d.covered_bytes += covered;
        d.rewritten_bytes += rewritten;
    }

    /// A publisher's answer to a base named for `asked` requests: whether
    /// it keeps it, and for how many the engine's bytes were not the base's.
    pub fn note_base(&mut self, kept: bool, asked: u64, differs: u64) {
        self.deltas.base_not_kept |= !kept;
        self.deltas.asked += asked;
        self.deltas.base_differs += differs;
    }
}
