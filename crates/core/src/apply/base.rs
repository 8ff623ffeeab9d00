//! Deltas land here: the bytes an entry's param holds now are the base a
//! delta applies onto. [`Applier::base_fingerprints`] hashes them (the
//! engine names them in WANT, so a param written by anything since is
//! noticed); [`Applier::apply_delta`] reads them a window at a time, patches
//! the window and hands it on as any source's chunk, so atomic staging,
//! in-place writes, verification and progress are the ones every update
//! uses. In atomic mode the params keep the old bytes until the commit; in
//! place each window is written back where it was read.
//!
//! Only host params have a base here: a device param's would have to be
//! read back from the GPU first, so its entries go whole.

use super::{Applier, Chunk};
use crate::checksum::Checksum;
use crate::delta::{Patcher, CHUNK, WINDOW_CHUNKS};
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::registry::Dest;
use crate::result::{Error, Result};

/// What the deltas of an update did (`wm_update_stats`' delta fields).
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

impl Applier<'_, '_> {
    /// The param memory of entry `t`, when it has a base here (a host
    /// param, and bytes to patch).
    fn host_param(&self, t: usize) -> Option<SendPtr> {
        let e = &self.plan.entries[t];
        match (e.target, self.landing.params[t]) {
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

    /// Apply `delta` (elements of `esize` bytes) onto entry `t`'s base: the
    /// new bytes must hash to `sum`, which is checked before the entry's
    /// last window is handed on whether or not the update verifies (a
    /// wrong base would otherwise go unnoticed). Returns the bytes it
    /// rewrote. `origin` names the source in errors.
    pub fn apply_delta(
        &mut self,
        origin: &str,
        t: usize,
        delta: &[u8],
        esize: usize,
        sum: u128,
    ) -> Result<u64> {
        let name = self.plan.entries[t].meta.name.clone();
        let bad =
            |why: String| Error::peer(format!("{origin}: the delta of tensor '{name}': {why}"));
        let base = self
            .host_param(t)
            .ok_or_else(|| bad("its param has no base here".into()))?;
        if self.verifies() && !self.plan.takes_all(t) {
            self.expect_checksum(t, sum)?;
        }
        let total = self.plan.entries[t].bytes;
        let mut patcher = Some(Patcher::new(delta, esize).map_err(|e| bad(e.0))?);
        let mut rewritten = 0;
        let mut hash = Checksum::default();
        let window = (CHUNK * WINDOW_CHUNKS * esize) as u64;
        let mut buf = vec![0u8; window.min(total) as usize];
        let mut at = 0;
        while at < total {
            let n = window.min(total - at);
            let w = &mut buf[..n as usize];
            self.read_base(base, t, at, w);
            let p = patcher.as_mut().expect("until the last window");
            p.patch(w).map_err(|e| bad(e.0))?;
            hash.update(w);
            if at + n == total {
                let elems = patcher
                    .take()
                    .expect("once")
                    .finish()
                    .map_err(|e| bad(e.0))?;
                rewritten = elems * esize as u64;
                if hash.digest() != sum {
                    return Err(Error::checksum(format!(
                        "{origin}: tensor '{name}': its delta does not give the new version's \
                         bytes (checksum mismatch)"
                    )));
                }
                self.tally_delta(delta.len() as u64, total, rewritten);
            }
            let chunk = Chunk {
                tensor: t,
                offset: at,
                len: n as usize,
                src: CopySource::Memory(SendPtr(w.as_mut_ptr())),
            };
            self.apply_batch(origin, &[chunk])?;
            at += n;
        }
        Ok(rewritten)
    }

    /// Bytes `[at, at + out.len())` of entry `t` as its param holds them.
    fn read_base(&self, base: SendPtr, t: usize, at: u64, out: &mut [u8]) {
        let segs = self.plan.segments(t);
        let mut i = segs.partition_point(|s| s.wanted + s.len <= at);
        let mut done = 0usize;
        while done < out.len() {
            let s = &segs[i];
            let from = at + done as u64 - s.wanted;
            let n = ((s.len - from) as usize).min(out.len() - done);
            // SAFETY: as in `fingerprint`; in place, the window is read
            // before it is written back.
            let src =
                unsafe { std::slice::from_raw_parts(base.0.add((s.param + from) as usize), n) };
            out[done..done + n].copy_from_slice(src);
            done += n;
            i += 1;
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

    /// What the deltas of this update did so far.
    pub fn deltas(&self) -> &DeltaTally {
        &self.deltas
    }
}
