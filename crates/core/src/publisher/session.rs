//! One engine rank's session after its handshake: the version it asked
//! for, its manifest, the requests it wants (checked), then its buckets over IPC
//! (`ipc`) or the network (`net`), both through the one streamer
//! (`streamer`).

use super::buffers::BufferPool;
use super::config::PublisherConfig;
use super::handshake::Admitted;
use super::offer::{pick, Offer};
use super::shard::shard_for;
use super::shard::Shard;
use super::stats::SessionStats;
use super::streamer::SessionIo;
use super::{deltas, ipc, net, quantize};
use crate::quant::Scheme;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::wire::{check_requests, DeltaBase, Frame, Request};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Serve an admitted engine its version, to the end of the session.
pub(super) fn run(
    admitted: Admitted,
    offers: &[Arc<Offer>],
    cfg: &PublisherConfig,
    pool: &BufferPool,
) -> Result<SessionStats> {
    let start = Instant::now();
    let Admitted {
        mut conn,
        rank,
        gpu_id,
        version,
        base,
        bytes_key,
    } = admitted;
    let hello = (rank, gpu_id.as_str(), version.as_str(), base.as_str());
    let r = serve(
        &mut conn,
        offers,
        hello,
        bytes_key.as_ref(),
        cfg,
        pool,
        start,
    );
    let r = r.map_err(|e| engine_reason(&mut conn).unwrap_or(e));
    if let Err(e) = &r {
        conn.send_error(e);
    }
    r.map(|stats| SessionStats {
        total: start.elapsed(),
        ..stats
    })
}

/// The engine's own reason, when it gave up (an ERROR frame waiting) and
/// this side then failed writing to it: the engine's is the cause.
fn engine_reason(conn: &mut Conn) -> Option<Error> {
    if !conn.readable() {
        return None;
    }
    match conn.recv(Instant::now() + Duration::from_millis(100)) {
        Err(e) if e.message.contains(" reports: ") => Some(e),
        _ => None,
    }
}

/// The session after the handshake: `hello` is the engine's rank, GPU id
/// and wanted version; `bytes_key` (network sessions only): buckets go over
/// UCX, their digests keyed with it when the engine asks.
fn serve(
    conn: &mut Conn,
    offers: &[Arc<Offer>],
    (rank, gpu_id, wanted_version, held): (u32, &str, &str, &str),
    bytes_key: Option<&[u8; 32]>,
    cfg: &PublisherConfig,
    pool: &BufferPool,
    start: Instant,
) -> Result<SessionStats> {
    let session_deadline = start + cfg.session_timeout;
    let step = |d: Duration| (Instant::now() + d).min(session_deadline);
    let offer = pick(offers, wanted_version, rank)?;
    let hashing = Instant::now();
    let mut shard =
        shard_for(offer, rank, gpu_id, cfg).map_err(|e| e.context(format!("rank {rank}")))?;
    let hash = if shard.hashed > 0 {
        hashing.elapsed()
    } else {
        Duration::ZERO
    };
    let have = shard.manifest.version.clone().unwrap_or_default();
    let base_shard = deltas::base_shard(offers, held, (rank, gpu_id), &shard, cfg)?;
    conn.send(&Frame::Manifest {
        version: have.clone(),
        tensors: shard.manifest.tensors.to_vec(),
        base_kept: base_shard.is_some(),
    })?;
    let (mut want, base, quant) = take_want(conn, &shard, step(cfg.bucket_timeout))?;
    let tensors = want.len() as u64;
    let quantizing = Instant::now();
    let (quantized, images) = match quant.is_empty() {
        true => Default::default(),
        false => quantize::serve(
            conn,
            (offer, &mut shard),
            &mut want,
            &quant,
            (cfg.pack_threads(), &|| step(cfg.bucket_timeout)),
        )?,
    };
    let (deltas, messages) = match &base {
        Some(base) => deltas::serve(
            conn,
            (base_shard.as_ref(), offer),
            (&shard, &mut want, &images),
            base,
            (cfg, bytes_key.is_some()),
        )?,
        None => Default::default(),
    };
    let mut stats = SessionStats {
        rank,
        version: have,
        tensors,
        hashed: shard.hashed,
        hash,
        bytes: deltas.bytes,
        delta_runs: deltas.runs,
        delta_cached: deltas.cached,
        delta_bytes: deltas.bytes,
        quantized,
        quantize: quantizing.elapsed(),
        ..Default::default()
    };
    let ack_deadline = || step(cfg.bucket_timeout);
    let mut io = SessionIo {
        conn,
        cfg,
        pool,
        ack_deadline: &ack_deadline,
        stats: &mut stats,
    };
    match bytes_key {
        Some(key) => net::stream(&mut io, key, &mut shard, (&want, &messages))?,
        None => ipc::stream(&mut io, &mut shard, &want)?,
    }
    Ok(stats)
}

/// WANT's requests, base and quantized requests.
type Want = (Vec<Request>, Option<DeltaBase>, Vec<(u32, Scheme)>);

/// WANT before `deadline`: its requests, each checked against this rank's
/// tensors before anything is planned or packed, its base and its
/// quantized requests.
fn take_want(conn: &mut Conn, shard: &Shard, deadline: Instant) -> Result<Want> {
    let (want, base, quant) = match conn.recv(deadline)? {
        Frame::Want {
            requests,
            base,
            quant,
        } => (requests, base, quant),
        other => return Err(Error::peer(format!("expected WANT, got {}", other.name()))),
    };
    let sizes: Vec<u64> = shard.manifest.tensors.iter().map(|t| t.nbytes).collect();
    check_requests(&want, &sizes)?;
    Ok((want, base, quant))
}
