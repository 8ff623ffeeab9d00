//! The engine's side of deltas (protocol in `wire::deltas`): WANT names the
//! version the params hold with a fingerprint per request that could come
//! as a delta (a host param's bytes; `Applier::base_fingerprints`), then,
//! before any bucket, DELTAS says how each comes and the deltas follow:
//! DELTA frames over IPC, UCX messages over the network (received by
//! `net::deltas` once the worker is up), applied onto their params' bases a
//! batch at a time (`Applier::apply_deltas`, which checks each result's
//! checksum).
//!
//! Nothing the publisher says is trusted: a request it names must be one
//! that asked, once, in order; a delta may be at most its request's bytes
//! (the one allocation, made when it is announced); a piece must belong to
//! the delta being received and fit what is left of it.

use super::publisher_link::{unexpected, PublisherLink};
use crate::apply::{delta_element_size, Applier, DeltaJob};
use crate::plan::Plan;
use crate::result::{try_vec, Error, Result};
use crate::wire::{DeltaRun, Frame, RunVerdict};

/// Take DELTAS and the deltas after WANT named a base, and apply them.
pub(super) fn take(link: &mut PublisherLink, plan: &Plan, applier: &mut Applier) -> Result<()> {
    let deadline = applier.deadline();
    let (kept, runs) = match link.recv_awaiting(deadline, "DELTAS", false)? {
        Frame::Deltas { kept, runs } => (kept, runs),
        other => return Err(unexpected(&link.conn, "DELTAS", &other)),
    };
    check_runs(link, kept, &runs)?;
    let differs = runs.iter().filter(|r| r.verdict == RunVerdict::Differs);
    let asked = link.asked_base().len() as u64;
    // Nothing of the base held for a request (a quantized one's image, or
    // its tensor as the base laid it out): the base, as this publisher can
    // diff it, is not kept.
    let no_image = runs.iter().any(|r| r.verdict == RunVerdict::BaseNotHeld);
    applier.note_base(kept && !no_image, asked, differs.count() as u64);
    let due: Vec<DeltaRun> = runs
        .into_iter()
        .filter(|r| r.verdict == RunVerdict::Delta)
        .collect();
    if link.deltas_by_message() {
        // Over the network they come as UCX messages, after READY.
        link.set_pending_deltas(due);
        return Ok(());
    }
    for batch in batches(&due) {
        let mut received = Vec::with_capacity(batch.len());
        for run in batch {
            received.push(receive(link, run, deadline)?);
        }
        apply(link, plan, applier, (batch, &received))?;
    }
    Ok(())
}

/// The deltas `due` in batches received before they are patched (in
/// parallel): at most [`BATCH`] bytes of deltas, or one delta.
pub(super) fn batches(due: &[DeltaRun]) -> impl Iterator<Item = &[DeltaRun]> {
    let mut rest = due;
    std::iter::from_fn(move || {
        let (mut n, mut bytes) = (0, 0u64);
        while n < rest.len() && (n == 0 || bytes + rest[n].len <= BATCH) {
            bytes += rest[n].len;
            n += 1;
        }
        let (batch, tail) = rest.split_at(n);
        rest = tail;
        (!batch.is_empty()).then_some(batch)
    })
}

/// Patch the deltas of `runs` (`received`, in order) onto their params.
pub(super) fn apply(
    link: &PublisherLink,
    plan: &Plan,
    applier: &mut Applier,
    (runs, received): (&[DeltaRun], &[Vec<u8>]),
) -> Result<()> {
    let jobs: Vec<DeltaJob> = runs
        .iter()
        .zip(received)
        .map(|(run, delta)| {
            let entry = link.entry_of(run.request).expect("checked");
            DeltaJob {
                entry,
                delta,
                esize: delta_element_size(plan, entry, link.request_bytes(run.request)),
                sum: run.sum,
            }
        })
        .collect();
    applier.apply_deltas(link.conn.peer(), &jobs)
}

/// Deltas received before a batch is patched: a bound on what the deltas
/// hold in memory at once, whatever a publisher sends.
const BATCH: u64 = 256 << 20;

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

/// Request `run`'s delta, piece after piece.
fn receive(
    link: &mut PublisherLink,
    run: &DeltaRun,
    deadline: std::time::Instant,
) -> Result<Vec<u8>> {
    let len = run.len as usize;
    let mut delta = try_vec(len, "a delta")?;
    while delta.len() < len {
        match link.recv_awaiting(deadline, "DELTA", true)? {
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
    Ok(delta)
}
