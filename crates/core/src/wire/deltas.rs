//! Delta frames (protocol 6): the base an engine names in WANT, the
//! publisher's verdict per run (DELTAS), and the deltas themselves (DELTA).
//!
//! An engine whose params hold a version names it in WANT with, per
//! request it could take as a delta, the xxh3-128 of the bytes its params
//! hold there now (the request's bytes, as a bucket would bring them). A
//! publisher that keeps that version answers with DELTAS right after WANT:
//! for each of those requests, whether it comes as a delta (its length and
//! the xxh3-128 of the new bytes it gives) or whole (the fingerprint
//! differs, or the delta is no smaller). Over IPC the deltas follow as
//! DELTA frames, in DELTAS order, each request's cut into pieces of at most
//! [`DELTA_PIECE`] bytes; over the network each is one UCX message
//! ([`delta_tag`]), sent after READY and before the first BUCKET. The
//! requests sent as deltas are then absent from the buckets. Everything
//! else is as without a base.

use super::fields::{In, Out};
use super::want::MAX_REQUESTS;
use crate::result::{try_vec, Error, Result};

/// The version an engine's params hold, and the fingerprint of each
/// request's bytes there (`(request, xxh3-128)`, requests increasing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaBase {
    pub version: String,
    pub fingerprints: Vec<(u32, u128)>,
}

/// How a request that named a fingerprint comes.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunVerdict {
    /// As a delta of `len` bytes giving bytes whose xxh3-128 is `sum`.
    Delta = 0,
    /// Whole: the engine's bytes are not the base's.
    Differs = 1,
    /// Whole: the delta would be no smaller.
    NotSmaller = 2,
    /// Whole: the publisher holds nothing of the base to diff this request
    /// against: the base version has no tensor of its name, dtype, shape
    /// and placement (the layout changed), or, for a quantized request, no
    /// image (the FP8 bytes this publisher made for it at the base
    /// version) is kept.
    BaseNotHeld = 3,
}

/// One request's verdict in DELTAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaRun {
    pub request: u32,
    pub verdict: RunVerdict,
    /// Delta bytes (0 unless `Delta`).
    pub len: u64,
    /// xxh3-128 of the request's new bytes (0 unless `Delta`).
    pub sum: u128,
}

/// The largest DELTA piece a publisher sends.
pub const DELTA_PIECE: usize = 4 << 20;

/// The UCX tag of the message carrying request `request`'s delta: above
/// every bucket message's ([`super::message_tag`]).
pub fn delta_tag(request: u32) -> u64 {
    (u32::MAX as u64) << 32 | request as u64
}

pub(super) fn encode_base(o: &mut Out, base: &Option<DeltaBase>) {
    let Some(b) = base else {
        return o.u8(0);
    };
    o.u8(1);
    o.str(&b.version);
    o.u32(b.fingerprints.len() as u32);
    for (k, sum) in &b.fingerprints {
        o.u32(*k);
        o.0.extend_from_slice(&sum.to_le_bytes());
    }
}

/// WANT's base, its requests numbered below `requests` and increasing.
pub(super) fn decode_base(i: &mut In, requests: usize) -> Result<Option<DeltaBase>> {
    match i.u8()? {
        0 => return Ok(None),
        1 => {}
        f => return Err(Error::peer(format!("wire: WANT's base flag {f}"))),
    }
    let version = i.str()?;
    let n = i.count(4 + 16, "fingerprints")?;
    let mut fingerprints = try_vec(n.min(MAX_REQUESTS), "wire: WANT's fingerprints")?;
    for _ in 0..n {
        let k = i.u32()?;
        let sum = u128::from_le_bytes(i.take(16)?.try_into().expect("16"));
        if k as usize >= requests || fingerprints.last().is_some_and(|&(p, _)| p >= k) {
            return Err(Error::peer(format!(
                "wire: WANT's base: a fingerprint for request #{k} (of {requests}, increasing)"
            )));
        }
        fingerprints.push((k, sum));
    }
    Ok(Some(DeltaBase {
        version,
        fingerprints,
    }))
}

pub(super) fn encode_deltas(o: &mut Out, kept: bool, runs: &[DeltaRun]) {
    o.u8(kept as u8);
    o.u32(runs.len() as u32);
    for r in runs {
        o.u32(r.request);
        o.u8(r.verdict as u8);
        o.u64(r.len);
        o.0.extend_from_slice(&r.sum.to_le_bytes());
    }
}

pub(super) fn decode_deltas(i: &mut In) -> Result<(bool, Vec<DeltaRun>)> {
    let kept = match i.u8()? {
        0 => false,
        1 => true,
        f => return Err(Error::peer(format!("wire: DELTAS' kept flag {f}"))),
    };
    let n = i.count(4 + 1 + 8 + 16, "delta runs")?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let request = i.u32()?;
        let verdict = match i.u8()? {
            0 => RunVerdict::Delta,
            1 => RunVerdict::Differs,
            2 => RunVerdict::NotSmaller,
            3 => RunVerdict::BaseNotHeld,
            v => return Err(Error::peer(format!("wire: DELTAS: verdict {v}"))),
        };
        runs.push(DeltaRun {
            request,
            verdict,
            len: i.u64()?,
            sum: u128::from_le_bytes(i.take(16)?.try_into().expect("16")),
        });
    }
    Ok((kept, runs))
}
