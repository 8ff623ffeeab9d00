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
//!
//! A quantized request's bytes are this session's FP8 image: its base is
//! the image kept with the base version for the same request
//! (`kept_images.rs`), its elements are bytes, and without a kept image it
//! comes whole (verdict `NoBaseImage`).

use super::config::PublisherConfig;
use super::delta_cache::{self, DeltaCache, Encoded};
use super::offer::{Offer, Published};
use super::quantize::Images;
use super::shard::{shard_for, Shard};
use crate::checksum::Checksum;
use crate::delta::{self, CHUNK, WINDOW_CHUNKS};
use crate::manifest::TensorMeta;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::result::Result;
use crate::tensor::DType;
use crate::transport::conn::Conn;
use crate::wire::{DeltaBase, DeltaRun, Frame, Request, RunVerdict, DELTA_PIECE};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// What the deltas of one session came to.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DeltaTally {
    /// Requests sent as deltas, and their delta bytes.
    pub runs: u64,
    pub bytes: u64,
    /// Runs another session of the version had encoded already.
    pub cached: u64,
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
) -> Result<Option<BaseShard>> {
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
    Ok(on_host(&base).is_some().then(|| BaseShard {
        offer: offer.clone(),
        shard: base,
    }))
}

/// The version an engine's params hold, as this publisher keeps it.
pub(super) struct BaseShard {
    offer: Arc<Offer>,
    shard: Shard,
}

/// Deltas a network session sends as UCX messages once the engine's worker
/// is known: (request, delta).
pub(super) type Messages = Vec<(u32, Arc<Vec<u8>>)>;

/// Answer WANT's `base` for the requests `want` of `shard` (the new
/// version) against `base_shard` (HELLO's base, when kept): send DELTAS,
/// then the deltas as DELTA frames (IPC), or return them to go as UCX
/// messages (`messages`: the network); empty the requests they cover. A
/// WANT naming another base than HELLO's is answered as not kept.
pub(super) fn serve(
    conn: &mut Conn,
    (held, offer): (Option<&BaseShard>, &Offer),
    (shard, want, images): (&Shard, &mut [Request], &Images),
    base: &DeltaBase,
    (cfg, messages): (&PublisherConfig, bool),
) -> Result<(DeltaTally, Messages)> {
    let kept = held.filter(|b| b.shard.manifest.version.as_deref() == Some(base.version.as_str()));
    let (Some(held), Some(new)) = (kept, on_host(shard)) else {
        conn.send(&Frame::Deltas {
            kept: false,
            runs: Vec::new(),
        })?;
        return Ok(Default::default());
    };
    let jobs = jobs(base, (held, new), (shard, want, images));
    let cache = (&offer.deltas, &held.offer);
    let done = encode_all(&jobs, want, cache, cfg.pack_threads());
    let runs: Vec<DeltaRun> = done.iter().map(|(r, ..)| *r).collect();
    conn.send(&Frame::Deltas { kept: true, runs })?;
    let mut tally = DeltaTally {
        cached: done.iter().filter(|d| d.2).count() as u64,
        ..Default::default()
    };
    let mut later = Messages::new();
    for (run, bytes, _) in done {
        if run.verdict != RunVerdict::Delta {
            continue;
        }
        match messages {
            true => later.push((run.request, bytes)),
            false => {
                for piece in bytes.chunks(DELTA_PIECE) {
                    conn.send(&Frame::Delta {
                        request: run.request,
                        bytes: piece.to_vec(),
                    })?;
                }
            }
        }
        let q = &mut want[run.request as usize];
        (q.runs, q.sums) = (Vec::new(), false);
        tally.runs += 1;
        tally.bytes += run.len;
    }
    Ok((tally, later))
}

/// A job per request `base` fingerprinted: a quantized one against the
/// image kept for it (`images`), any other against the base's tensor of
/// the same name and shape.
fn jobs(
    base: &DeltaBase,
    (held, new): (&BaseShard, &[SendPtr]),
    (shard, want, images): (&Shard, &[Request], &Images),
) -> Vec<Job> {
    let base_shard = &held.shard;
    let old = on_host(base_shard).expect("checked by base_shard");
    // Each base tensor by what must match (the first of equals), found
    // once: a search per request would cost requests x tensors.
    let mut by_key = HashMap::with_capacity(base_shard.manifest.tensors.len());
    for (b, meta) in base_shard.manifest.tensors.iter().enumerate() {
        by_key.entry(key(meta)).or_insert(b);
    }
    base.fingerprints
        .iter()
        .map(|&(k, fingerprint)| {
            let q = &want[k as usize];
            let t = q.tensor as usize;
            if let Ok(i) = images.binary_search_by_key(&k, |(r, _)| *r) {
                return image_job(
                    (k, fingerprint),
                    q,
                    new[t],
                    held.offer.images.get(&images[i].1),
                );
            }
            let meta = &shard.manifest.tensors[t];
            let was = by_key.get(&key(meta)).copied();
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
                image: None,
            }
        })
        .collect()
}

/// Quantized request `k` (all of its image at `new`) against the image
/// kept for the same request of the base version (`kept`, when it is one
/// of the request's size): FP8 bytes, elements of one byte.
fn image_job(
    (request, fingerprint): (u32, u128),
    q: &Request,
    new: SendPtr,
    kept: Option<Arc<HostRegion>>,
) -> Job {
    let kept = kept.filter(|i| i.len() as u64 == q.bytes());
    Job {
        request,
        fingerprint,
        new: (new, None, false),
        old: kept.as_ref().map(|i| (SendPtr(i.ptr()), None)),
        esize: 1,
        image: Some(kept),
    }
}

/// A shard's tensors, when every one lies in host memory.
fn on_host(shard: &Shard) -> Option<&[SendPtr]> {
    match shard.published {
        Some(Published::Device(_)) => None,
        _ => shard.in_memory(),
    }
}

/// The same tensor in both versions: name, dtype, shape and placement.
/// What a base tensor shares with the new one it is diffed against: name,
/// dtype, shape and placement.
type Key<'a> = (&'a str, DType, &'a [u64], Option<(&'a [u64], &'a [u64])>);

fn key(t: &TensorMeta) -> Key<'_> {
    let placement = (t.placement.as_ref()).map(|p| (&p.global_shape[..], &p.offset[..]));
    (&t.name, t.dtype, &t.shape, placement)
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
    /// A quantized request: the base's image kept for it, if any (held
    /// while encoding).
    image: Option<Option<Arc<HostRegion>>>,
}

/// The cache a version's sessions share, and the base offer it is for.
type Cache<'c> = (&'c DeltaCache, &'c Arc<Offer>);

/// A run's verdict, its delta (empty unless a delta) and whether another
/// session had encoded it.
type Answer = (DeltaRun, Arc<Vec<u8>>, bool);

/// Every job's verdict and delta, in order, on up to `threads` threads.
fn encode_all(jobs: &[Job], want: &[Request], cache: Cache, threads: usize) -> Vec<Answer> {
    let per = jobs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .chunks(per)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|j| answer(j, want, cache))
                        .collect::<Vec<_>>()
                })
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
fn answer(j: &Job, want: &[Request], (cache, base): Cache) -> Answer {
    let q = &want[j.request as usize];
    let whole = |verdict| {
        let run = DeltaRun {
            request: j.request,
            verdict,
            len: 0,
            sum: 0,
        };
        (run, Arc::default(), false)
    };
    // The base holds nothing to diff against: no image of a quantized
    // request, or no tensor of this one's name, shape and placement (the
    // layout changed). Not the engine's bytes: they may be the base's.
    let Some((old, old_sum)) = j.old else {
        return whole(RunVerdict::BaseNotHeld);
    };
    let (new, new_sum, all) = j.new;
    let known_base = if all { old_sum } else { None };
    if q.bytes() == 0 {
        return whole(RunVerdict::NotSmaller);
    }
    if known_base.is_some_and(|s| s != j.fingerprint) {
        return whole(RunVerdict::Differs);
    }
    let known = (known_base, new_sum.filter(|_| all));
    // A session's image is its own (freed with the session, its address
    // reused): not named in the cache.
    let (cell, cached) = match j.image {
        Some(_) => (
            Arc::new(OnceLock::from(encode(j.esize, (old, new), q, known))),
            false,
        ),
        None => {
            let key = delta_cache::key(base, (old.0 as usize, new.0 as usize), j.esize, &q.runs);
            cache.get_or_encode(base, key, || encode(j.esize, (old, new), q, known))
        }
    };
    let encoded = cell.get().expect("encoded");
    let Some((sum, delta)) = &encoded.delta else {
        return whole(RunVerdict::NotSmaller);
    };
    if known_base.or(encoded.base_sum) != Some(j.fingerprint) {
        return whole(RunVerdict::Differs);
    }
    let run = DeltaRun {
        request: j.request,
        verdict: RunVerdict::Delta,
        len: delta.len() as u64,
        sum: *sum,
    };
    (run, delta.clone(), cached)
}

/// Encode request `q` of the tensors at `old` and `new` (elements of
/// `esize` bytes), hashing what `known` (the base's and the new bytes'
/// sums) does not give; gives up once the delta is not under half the
/// bytes read (a version of other bytes costs one window, not both
/// versions).
fn encode(
    esize: usize,
    (old, new): (SendPtr, SendPtr),
    q: &Request,
    known: (Option<u128>, Option<u128>),
) -> Encoded {
    let (mut base_hash, mut new_hash) = (Checksum::default(), Checksum::default());
    let mut out = Vec::new();
    let window = (CHUNK * WINDOW_CHUNKS * esize) as u64;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut at = 0;
    while at < q.bytes() {
        let n = window.min(q.bytes() - at);
        let o = gather(old, q, at, n, &mut a);
        let w = gather(new, q, at, n, &mut b);
        if known.0.is_none() {
            base_hash.update(o);
        }
        if known.1.is_none() {
            new_hash.update(w);
        }
        delta::encode(o, w, esize, &mut out);
        at += n;
        if !delta::worth_sending(out.len() as u64, at) {
            return Encoded {
                base_sum: None,
                delta: None,
            };
        }
    }
    let base_sum = known.0.is_none().then(|| base_hash.digest());
    let sum = known.1.unwrap_or_else(|| new_hash.digest());
    Encoded {
        base_sum,
        delta: Some((sum, Arc::new(out))),
    }
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
