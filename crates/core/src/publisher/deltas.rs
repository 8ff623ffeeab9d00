//! Deltas against the version an engine's params hold (`wire::DeltaBase`):
//! per request that named a fingerprint, the publisher checks it against
//! the base's bytes of that request, encodes the changes
//! (`crate::delta`) and sends DELTAS then the DELTA frames; requests sent
//! as deltas are emptied, so the streamer skips them.
//!
//! Both versions must lie in this process's host memory: the base a
//! published copy (immutable; a live tensor may have changed since), the
//! new one a published copy or live tensors. Otherwise DELTAS says the
//! base is not kept and everything goes whole.

use super::config::PublisherConfig;
use super::offer::{Offer, Published};
use super::shard::{shard_for, Shard};
use crate::checksum::Checksum;
use crate::delta::{self, CHUNK, WINDOW_CHUNKS};
use crate::manifest::TensorMeta;
use crate::memory::SendPtr;
use crate::result::Result;
use crate::transport::conn::Conn;
use crate::wire::{DeltaBase, DeltaRun, Frame, Request, RunVerdict, DELTA_PIECE};
use std::sync::Arc;

/// What the deltas of one session came to.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DeltaTally {
    /// Requests sent as deltas, and their delta bytes.
    pub runs: u64,
    pub bytes: u64,
}

/// The shard of version `held` (the one the engine's params hold) for
/// this rank, when this publisher can send deltas against it: a published
/// copy in host memory, and the new version's `shard` in host memory too.
pub(super) fn base_shard(
    offers: &[Arc<Offer>],
    held: &str,
    (rank, gpu_id): (u32, &str),
    shard: &Shard,
    cfg: &PublisherConfig,
) -> Result<Option<Shard>> {
    if held.is_empty() || on_host(shard).is_none() {
        return Ok(None);
    }
    let Some(offer) = offers
        .iter()
        .find(|o| o.version.as_deref() == Some(held))
        .filter(|o| matches!(o.published, Some(Published::Host(_))))
    else {
        return Ok(None);
    };
    let base = shard_for(offer, rank, gpu_id, cfg)?;
    Ok(on_host(&base).is_some().then_some(base))
}

/// Answer WANT's `base` for the requests `want` of `shard` (the new
/// version) against `base_shard` (HELLO's base, when kept): send DELTAS and
/// the deltas, and empty the requests they cover. A WANT naming another
/// base than HELLO's is answered as not kept.
pub(super) fn serve(
    conn: &mut Conn,
    base_shard: Option<&Shard>,
    (shard, want): (&Shard, &mut [Request]),
    base: &DeltaBase,
    cfg: &PublisherConfig,
) -> Result<DeltaTally> {
    let kept = base_shard.filter(|b| b.manifest.version.as_deref() == Some(base.version.as_str()));
    let (Some(base_shard), Some(new)) = (kept, on_host(shard)) else {
        conn.send(&Frame::Deltas {
            kept: false,
            runs: Vec::new(),
        })?;
        return Ok(DeltaTally::default());
    };
    let old = on_host(base_shard).expect("checked by base_shard");
    let jobs: Vec<Job> = base
        .fingerprints
        .iter()
        .map(|&(k, fingerprint)| {
            let q = &want[k as usize];
            let t = q.tensor as usize;
            let meta = &shard.manifest.tensors[t];
            let was = base_shard
                .manifest
                .tensors
                .iter()
                .position(|b| same(b, meta));
            Job {
                request: k,
                fingerprint,
                new: (
                    new[t],
                    meta.checksum,
                    q.contiguous() == Some(0) && q.bytes() == meta.nbytes,
                ),
                old: was.map(|b| (old[b], base_shard.manifest.tensors[b].checksum)),
                esize: delta::element_size(meta.dtype.size(), q.bytes()),
            }
        })
        .collect();
    let done = encode_all(&jobs, want, cfg.pack_threads());
    let runs: Vec<DeltaRun> = done.iter().map(|(r, _)| *r).collect();
    conn.send(&Frame::Deltas { kept: true, runs })?;
    let mut tally = DeltaTally::default();
    for (run, bytes) in &done {
        if run.verdict != RunVerdict::Delta {
            continue;
        }
        for piece in bytes.chunks(DELTA_PIECE) {
            conn.send(&Frame::Delta {
                request: run.request,
                bytes: piece.to_vec(),
            })?;
        }
        let q = &mut want[run.request as usize];
        (q.runs, q.sums) = (Vec::new(), false);
        tally.runs += 1;
        tally.bytes += run.len;
    }
    Ok(tally)
}

/// A shard's tensors, when every one lies in host memory.
fn on_host(shard: &Shard) -> Option<&[SendPtr]> {
    match shard.published {
        Some(Published::Device(_)) => None,
        _ => shard.in_memory(),
    }
}

/// The same tensor in both versions: name, dtype, shape and placement.
fn same(a: &TensorMeta, b: &TensorMeta) -> bool {
    a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.placement == b.placement
}

/// One request to answer.
struct Job {
    request: u32,
    fingerprint: u128,
    /// The new tensor: its bytes, its checksum, and whether the request is
    /// all of it in order (its checksum is then the request's).
    new: (SendPtr, Option<u128>, bool),
    /// The base's tensor of the same name and shape, with its checksum.
    old: Option<(SendPtr, Option<u128>)>,
    esize: usize,
}

/// Every job's verdict and delta, in order, on up to `threads` threads.
fn encode_all(jobs: &[Job], want: &[Request], threads: usize) -> Vec<(DeltaRun, Vec<u8>)> {
    let per = jobs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .chunks(per)
            .map(|part| {
                s.spawn(move || part.iter().map(|j| encode_one(j, want)).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("delta encoding does not panic"))
            .collect()
    })
}

/// One request: whole when its base differs or its delta would not be under
/// half its bytes (the engine then patches less than it receives whole, and
/// a session holds at most half its bytes in deltas).
fn encode_one(j: &Job, want: &[Request]) -> (DeltaRun, Vec<u8>) {
    let q = &want[j.request as usize];
    let whole = |verdict| DeltaRun {
        request: j.request,
        verdict,
        len: 0,
        sum: 0,
    };
    let Some((old, old_sum)) = j.old else {
        return (whole(RunVerdict::Differs), Vec::new());
    };
    if q.bytes() == 0 {
        return (whole(RunVerdict::NotSmaller), Vec::new());
    }
    let (new, new_sum, all) = j.new;
    let known_base = if all { old_sum } else { None };
    if known_base.is_some_and(|s| s != j.fingerprint) {
        return (whole(RunVerdict::Differs), Vec::new());
    }
    let mut base_hash = Checksum::default();
    let mut new_hash = Checksum::default();
    let limit = q.bytes() / 2;
    let mut out = Vec::new();
    let window = (CHUNK * WINDOW_CHUNKS * j.esize) as u64;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut at = 0;
    while at < q.bytes() {
        let n = window.min(q.bytes() - at);
        let o = gather(old, q, at, n, &mut a);
        let w = gather(new, q, at, n, &mut b);
        if known_base.is_none() {
            base_hash.update(o);
        }
        if !all || new_sum.is_none() {
            new_hash.update(w);
        }
        delta::encode(o, w, j.esize, &mut out);
        at += n;
        // Not under half so far (a new version of other bytes, typically):
        // give up after the first window rather than read both versions.
        if out.len() as u64 >= limit || out.len() as u64 * 2 > at {
            return (whole(RunVerdict::NotSmaller), Vec::new());
        }
    }
    if known_base.unwrap_or_else(|| base_hash.digest()) != j.fingerprint {
        return (whole(RunVerdict::Differs), Vec::new());
    }
    let sum = match (all, new_sum) {
        (true, Some(s)) => s,
        _ => new_hash.digest(),
    };
    let run = DeltaRun {
        request: j.request,
        verdict: RunVerdict::Delta,
        len: out.len() as u64,
        sum,
    };
    (run, out)
}

/// Request bytes `[at, at + n)` of the tensor at `t`: in place when they lie
/// in one piece, else gathered into `buf`.
fn gather<'b>(t: SendPtr, q: &Request, at: u64, n: u64, buf: &'b mut Vec<u8>) -> &'b [u8] {
    let mut pieces = q.extents(at, n);
    if let (Some((off, _, len)), None) = (pieces.clone().next(), pieces.clone().nth(1)) {
        if len == n {
            // SAFETY: the request was checked against the tensor's size;
            // the tensor stays valid and unchanged while served.
            return unsafe { std::slice::from_raw_parts(t.0.add(off as usize), n as usize) };
        }
    }
    buf.clear();
    for (off, _, len) in pieces.by_ref() {
        // SAFETY: as above.
        buf.extend_from_slice(unsafe {
            std::slice::from_raw_parts(t.0.add(off as usize), len as usize)
        });
    }
    buf
}
