//! Deltas land here: the bytes an entry's param holds now are the base a
//! delta applies onto. [`Applier::base_fingerprints`] hashes them (the
//! engine names them in WANT, so a param written by anything since is
//! noticed); [`Applier::apply_deltas`] patches them where the entries'
//! bytes land (`patch.rs`) and accounts for them as any source's landed
//! bytes, so atomic staging, in-place writes and progress are the ones
//! every update uses. In atomic mode the params keep the old bytes until
//! the commit; in place the params are patched where they are.
//!
//! A GPU param has a base when the entry's bytes are one contiguous run
//! of it: the GPU hashes it where it is (`delta::device`). In place, the
//! delta's changes are written there by a kernel and the result hashed on
//! the GPU again, so only the delta crosses PCIe. Atomic, the new bytes
//! are staged in host memory like every device param's (uploaded at the
//! commit, or into the page swap's shadow): the base is read back into
//! the staging a window at a time and patched there. An entry spread over
//! several runs of a GPU param (a column split's rows) goes whole.
//!
//! An FP8 param quantized by the publishers has its FP8 bytes as the base
//! (elements of one byte); its scales are written whole at every commit
//! from the agreed amax, so they need none.

use super::patch::{patch_all, Base, PatchJob};
use super::{Applier, Chunk};
use crate::checksum::Checksum;
use crate::delta;
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::parallel;
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
    /// Where entry `t`'s base is, when it has one here (a host param, or
    /// one contiguous run of a GPU param, and bytes to patch).
    fn base(&self, t: usize) -> Option<Base> {
        let e = &self.plan.entries[t];
        let Target::Param(i) = e.target else {
            return None;
        };
        // Quantized here, a param's runs bring its source's bytes, not the
        // FP8 it holds; quantized by the publishers, they bring FP8 bytes
        // like those it holds, and deltas patch those.
        if e.bytes == 0 || self.plan.quantized(i).is_some_and(|q| !q.on_wire) {
            return None;
        }
        match self.landing.params[t]? {
            Dest::Host(p) => Some(Base::Host(p)),
            // The scatter kernel's positions are 32-bit: a run over 4 GiB
            // comes whole.
            Dest::Device { .. } if e.bytes > u32::MAX as u64 => None,
            Dest::Device { ptr, ordinal } => {
                let offset = self.landing.param_offset(t, 0, e.bytes).ok()?;
                Some(Base::Device {
                    at: ptr + offset,
                    ordinal,
                })
            }
        }
    }

    /// Per entry of `entries`: the xxh3-128 of the bytes its param holds
    /// where the entry's bytes land (its segments in order), None without a
    /// base. Host params hashed on the applier's threads, GPU params on
    /// their GPU (one call per GPU: the runs are hashed side by side); a
    /// GPU that cannot hash (no NVRTC to compile the kernels, say) leaves
    /// its params without a base: they come whole, as without deltas.
    pub fn base_fingerprints(&self, entries: &[usize]) -> Vec<Option<u128>> {
        let plan = self.plan;
        let bases: Vec<(usize, Option<Base>)> =
            entries.iter().map(|&t| (t, self.base(t))).collect();
        let mut found =
            parallel::map(
                &bases,
                self.opts.threads,
                "hashing bases",
                |&(t, base)| match base? {
                    Base::Host(p) => Some(fingerprint(plan, t, p)),
                    Base::Device { .. } => None,
                },
            );
        let on_device: Vec<(usize, (u64, u64), i32)> = (bases.iter().enumerate())
            .filter_map(|(k, &(t, base))| match base? {
                Base::Device { at, ordinal } => Some((k, (at, plan.entries[t].bytes), ordinal)),
                Base::Host(_) => None,
            })
            .collect();
        for (k, sum) in delta::device::checksums_by_gpu(&on_device) {
            found[k] = sum.ok();
        }
        found
    }

    /// Apply each delta onto its entry's base. Every delta is checked
    /// before any byte is written; each result must hash to its delta's
    /// `sum`, checked whether or not the update verifies (a wrong base
    /// would otherwise go unnoticed), and that check stands for the
    /// applier's own (so the bytes are hashed once). In place, a result
    /// that fails its checksum was written: the update then fails as any
    /// in-place failure after a write. `origin` names the source in errors.
    pub fn apply_deltas(&mut self, origin: &str, deltas: &[DeltaJob]) -> Result<()> {
        // In place, a GPU param's deltas are written on its GPU; all
        // others where the entry's bytes land in host memory.
        let in_place = self.landing.in_place();
        let (on_gpu, in_memory): (Vec<&DeltaJob>, Vec<&DeltaJob>) = deltas
            .iter()
            .partition(|d| in_place && matches!(self.base(d.entry), Some(Base::Device { .. })));
        // Checked before any byte is written: the form of those patched
        // here now, of those written on a GPU as they are decoded.
        self.check_deltas(origin, &in_memory, true)?;
        self.check_deltas(origin, &on_gpu, false)?;
        let decoded = self.decode_all(origin, &on_gpu)?;
        self.patch_in_memory(origin, &in_memory)?;
        self.patch_on_gpus(origin, &on_gpu, &decoded)
    }

    /// Deltas landing in host memory, patched in parallel (`patch.rs`).
    fn patch_in_memory(&mut self, origin: &str, deltas: &[&DeltaJob]) -> Result<()> {
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
                base: self.base(d.entry).expect("checked"),
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
            self.check_result(origin, d, got)?;
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

    /// In place, deltas of GPU params: decoded on the applier's threads,
    /// their changes written on each GPU at once (`delta::device`), then
    /// every result hashed there.
    fn patch_on_gpus(
        &mut self,
        origin: &str,
        deltas: &[&DeltaJob],
        decoded: &[delta::Changes],
    ) -> Result<()> {
        // None (every atomic update's case): no param byte is written, and
        // a later failure (an aborted stage) must leave the state as it was.
        if deltas.is_empty() {
            return Ok(());
        }
        let runs: Vec<(usize, (u64, u64), i32)> = (deltas.iter().enumerate())
            .map(|(k, d)| match self.base(d.entry) {
                Some(Base::Device { at, ordinal }) => {
                    (k, (at, self.plan.entries[d.entry].bytes), ordinal)
                }
                _ => unreachable!("partitioned by their base"),
            })
            .collect();
        self.landing.writes_params();
        let mut gpus: Vec<i32> = runs.iter().map(|r| r.2).collect();
        gpus.sort_unstable();
        gpus.dedup();
        for g in gpus {
            let jobs: Vec<delta::device::OnGpu> = (runs.iter().filter(|r| r.2 == g))
                .map(|&(k, (at, _), _)| delta::device::OnGpu {
                    dst: at,
                    changes: &decoded[k],
                    delta: deltas[k].delta,
                    esize: deltas[k].esize,
                })
                .collect();
            // SAFETY: each `at` is the run of the param its entry's bytes
            // land in (checked by the plan against its registered size,
            // entries never overlapping), which its delta was checked
            // against; in place, the update writes it.
            unsafe { delta::device::apply(g, &jobs) }
                .map_err(|x| x.context(format!("{origin}: deltas on GPU {g}")))?;
        }
        for (k, got) in delta::device::checksums_by_gpu(&runs) {
            let d = deltas[k];
            let name = &self.plan.entries[d.entry].meta.name;
            let got =
                got.map_err(|x| x.context(format!("{origin}: tensor '{name}': hashing it")))?;
            self.check_result(origin, d, got)?;
        }
        for (d, c) in deltas.iter().zip(decoded) {
            let e = &self.plan.entries[d.entry];
            let whole: usize = c.whole.iter().map(|w| w.1.len()).sum();
            let rewritten = (c.positions.len() * d.esize + whole) as u64;
            self.tally.accept(
                origin,
                (d.entry, e.meta.name.as_str(), e.bytes),
                0,
                e.bytes as usize,
            )?;
            self.tally.now.bytes_done += e.bytes;
            self.tally.now.tensors_done += 1;
            self.tally_delta(d.delta.len() as u64, e.bytes, rewritten);
        }
        self.tally.report(self.hooks.progress.as_deref_mut())
    }

    /// Every delta's changes as lists (`delta::list_changes`, which checks
    /// their form), decoded on the applier's threads.
    fn decode_all(&self, origin: &str, deltas: &[&DeltaJob]) -> Result<Vec<delta::Changes>> {
        let plan = self.plan;
        let decoded = parallel::map(deltas, self.opts.threads, "decoding deltas", |d| {
            delta::list_changes(d.delta, plan.entries[d.entry].bytes as usize, d.esize)
        });
        (deltas.iter().zip(decoded))
            .map(|(d, r)| {
                let name = &plan.entries[d.entry].meta.name;
                r.map_err(|x| Error::peer(format!("{origin}: the delta of tensor '{name}': {x}")))
            })
            .collect()
    }

    /// A delta's result hashes to the new version's bytes.
    fn check_result(&self, origin: &str, d: &DeltaJob, got: u128) -> Result<()> {
        match got == d.sum {
            true => Ok(()),
            false => Err(Error::checksum(format!(
                "{origin}: tensor '{}': its delta does not give the new version's bytes \
                 (checksum mismatch)",
                self.plan.entries[d.entry].meta.name
            ))),
        }
    }

    /// Before any byte is written: each delta's entry has a base here,
    /// (`form`) the delta is well formed for its bytes (checked on the
    /// applier's threads), and (verifying) an entry taking all of its
    /// tensor is promised the manifest's checksum.
    fn check_deltas(&self, origin: &str, deltas: &[&DeltaJob], form: bool) -> Result<()> {
        let plan = self.plan;
        let forms = match form {
            true => parallel::map(deltas, self.opts.threads, "checking deltas", |d| {
                delta::check(d.delta, plan.entries[d.entry].bytes as usize, d.esize)
            }),
            false => vec![Ok(()); deltas.len()],
        };
        (deltas.iter().zip(forms)).try_for_each(|(d, f)| self.check_delta(origin, d, f))
    }

    fn check_delta(
        &self,
        origin: &str,
        d: &DeltaJob,
        form: std::result::Result<(), delta::DeltaError>,
    ) -> Result<()> {
        let e = &self.plan.entries[d.entry];
        let bad = |why: String| {
            Error::peer(format!(
                "{origin}: the delta of tensor '{}': {why}",
                e.meta.name
            ))
        };
        if self.base(d.entry).is_none() {
            return Err(bad("its param has no base here".into()));
        }
        form.map_err(|x| bad(x.0))?;
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
