//! The engine's side of deltas (protocol in `wire::deltas`): WANT names the
//! version the params hold with a fingerprint per request that could come
//! as a delta (a host param's bytes; `Applier::base_fingerprints`), then,
//! before any bucket, DELTAS says how each comes and the DELTA frames bring
//! the deltas, each applied onto its param's base once whole
//! (`Applier::apply_delta`, which checks the result's checksum).
//!
//! Nothing the publisher says is trusted: a request it names must be one
//! that asked, once, in order; a delta may be at most its request's bytes
//! (the one allocation, made when it is announced); a piece must belong to
//! the delta being received and fit what is left of it.

use super::publisher_link::{unexpected, PublisherLink};
use crate::apply::Applier;
use crate::delta::element_size;
use crate::plan::Plan;
use crate::result::{try_vec, Error, Result};
use crate::wire::{DeltaBase, DeltaRun, Frame, RunVerdict};

/// The base to name in WANT: `version` and the fingerprints of the requests
/// (request `k` is plan entry `entries[k]`) whose params hold a base here.
/// None when none does.
pub(super) fn base(version: String, entries: &[usize], applier: &Applier) -> Option<DeltaBase> {
    let sums = applier.base_fingerprints(entries);
    let fingerprints: Vec<(u32, u128)> = sums
        .into_iter()
        .enumerate()
        .filter_map(|(k, s)| Some((k as u32, s?)))
        .collect();
    (!fingerprints.is_empty()).then_some(DeltaBase {
        version,
        fingerprints,
    })
}

/// Take DELTAS and the deltas after WANT named a base, and apply them.
pub(super) fn take(link: &mut PublisherLink, plan: &Plan, applier: &mut Applier) -> Result<()> {
    let deadline = applier.deadline();
    let (kept, runs) = match link.conn.recv(deadline)? {
        Frame::Deltas { kept, runs } => (kept, runs),
        other => return Err(unexpected(&link.conn, "DELTAS", &other)),
    };
    check_runs(link, kept, &runs)?;
    let differs = runs.iter().filter(|r| r.verdict == RunVerdict::Differs);
    let asked = link.asked_base().len() as u64;
    applier.note_base(kept, asked, differs.count() as u64);
    let origin = link.conn.peer().to_string();
    let mut delta = Vec::new();
    for run in runs.iter().filter(|r| r.verdict == RunVerdict::Delta) {
        receive(link, run, &mut delta, deadline)?;
        let entry = link.entry_of(run.request).expect("checked");
        let esize = element_size(
            plan.entries[entry].meta.dtype.size(),
            link.request_bytes(run.request),
        );
        applier.apply_delta(&origin, entry, &delta, esize, run.sum)?;
    }
    Ok(())
}

/// DELTAS against what WANT asked: not kept, nothing listed; kept, every
/// request that named a fingerprint once, in order, a delta no longer than
/// its request's bytes.
fn check_runs(link: &PublisherLink, kept: bool, runs: &[DeltaRun]) -> Result<()> {
    let asked = link.asked_base();
    let bad = |why: String| Error::peer(format!("{}: DELTAS: {why}", link.conn.peer()));
    if !kept && !runs.is_empty() {
        return Err(bad("verdicts for a base it does not keep".into()));
    }
    if kept && runs.len() != asked.len() {
        return Err(bad(format!(
            "{} verdicts for {} requests",
            runs.len(),
            asked.len()
        )));
    }
    for (r, &(k, _)) in runs.iter().zip(asked) {
        if r.request != k {
            return Err(bad(format!("request #{} where #{k} was due", r.request)));
        }
        let most = link.request_bytes(k);
        if r.verdict == RunVerdict::Delta && (r.len == 0 || r.len > most) {
            return Err(bad(format!(
                "a delta of {} bytes for request #{k} of {most} bytes",
                r.len
            )));
        }
    }
    Ok(())
}

/// Request `run`'s delta into `delta`, piece after piece.
fn receive(
    link: &mut PublisherLink,
    run: &DeltaRun,
    delta: &mut Vec<u8>,
    deadline: std::time::Instant,
) -> Result<()> {
    delta.clear();
    let len = run.len as usize;
    if delta.capacity() < len {
        *delta = try_vec(len, "a delta")?;
    }
    while delta.len() < len {
        match link.conn.recv(deadline)? {
            Frame::Delta { request, bytes }
                if request == run.request
                    && !bytes.is_empty()
                    && bytes.len() <= len - delta.len() =>
            {
                delta.extend_from_slice(&bytes)
            }
            Frame::Delta { request, bytes } => {
                return Err(Error::peer(format!(
                    "{}: DELTA of {} bytes for request #{request} while request #{}'s has {} left",
                    link.conn.peer(),
                    bytes.len(),
                    run.request,
                    len - delta.len()
                )))
            }
            other => return Err(unexpected(&link.conn, "DELTA", &other)),
        }
    }
    Ok(())
}
