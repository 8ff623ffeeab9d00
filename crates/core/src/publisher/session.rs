//! One engine rank's session after its handshake: the version it asked
//! for, its manifest, the requests it wants (checked), then its buckets over IPC
//! (`ipc`) or the network (`net`), both through the one streamer
//! (`streamer`).

use super::buffers::Pools;
use super::config::PublisherConfig;
use super::handshake::Admitted;
use super::offer::{pick, Offer};
use super::quantize_behind::{Behind, ImageToMake};
use super::shard::shard_for;
use super::shard::Shard;
use super::stats::SessionStats;
use super::streamer::SessionIo;
use super::{deltas, engine_link, ipc, net, quantize};
use crate::quant::Scheme;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::wire::{check_requests, BucketEntry, DeltaBase, Frame, Request};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Serve an admitted engine its version, to the end of the session.
pub(super) fn run(
    admitted: Admitted,
    offers: &[Arc<Offer>],
    cfg: &PublisherConfig,
    pool: &Pools,
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
    // The serve's error names the engine (the engine was told the bare
    // reason): "acknowledged bucket 1, expected 0" named nobody.
    let r = r.map_err(|e| match e.message.contains(conn.peer()) {
        true => e,
        false => e.context(conn.peer()),
    });
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
    pool: &Pools,
    start: Instant,
) -> Result<SessionStats> {
    let session_deadline = start + cfg.session_timeout;
    let step = |d: Duration| (Instant::now() + d).min(session_deadline);
    let offer = pick(offers, wanted_version, rank)?;
    let ((mut shard, hash), engine) = shard_and_engine(
        conn,
        offer,
        (rank, gpu_id),
        (bytes_key, step(cfg.bucket_timeout)),
        cfg,
    )?;
    let have = shard.manifest.version.clone().unwrap_or_default();
    let base_shard = deltas::base_shard(offers, held, (rank, gpu_id), &shard, cfg)?;
    conn.send(&Frame::Manifest {
        version: have.clone(),
        tensors: shard.manifest.tensors.to_vec(),
        base_kept: base_shard.is_some(),
    })?;
    let (mut want, base, quant) = take_want(conn, &shard, step(cfg.bucket_timeout))?;
    let quantizing = Instant::now();
    let served = match quant.is_empty() {
        true => Default::default(),
        false => quantize::serve(
            conn,
            (offer, &mut shard, &pool.images),
            &mut want,
            &quant,
            (cfg.pack_threads(), &|| step(cfg.bucket_timeout)),
        )?,
    };
    let stats = SessionStats {
        rank,
        version: have,
        tensors: want.len() as u64,
        hashed: shard.hashed,
        hash,
        quantized: served.read_bytes,
        quantize: quantizing.elapsed(),
        ..Default::default()
    };
    let delivery = Delivery {
        shard,
        want,
        base,
        base_shard,
        images: served.images,
        engine,
    };
    let bucket_deadline = || step(cfg.bucket_timeout);
    deliver(
        (conn, offer),
        delivery,
        (served.made, served.to_make),
        (bytes_key, cfg, pool, &bucket_deadline),
        stats,
    )
}

/// What a session sends once WANT is answered as far as quantizing goes.
struct Delivery {
    shard: Shard,
    want: Vec<Request>,
    base: Option<DeltaBase>,
    base_shard: Option<deltas::BaseShard>,
    /// The quantized requests' images.
    images: quantize::Images,
    /// Over the network: the engine's worker, reached.
    engine: Option<engine_link::EngineLink>,
}

/// This rank's shard (its tensors hashed where they must be, and how long
/// that took) and, over the network (`bytes_key`), the engine's worker
/// reached meanwhile, by `deadline`: the engine sends READY right after
/// the challenge.
fn shard_and_engine(
    conn: &mut Conn,
    offer: &Offer,
    (rank, gpu_id): (u32, &str),
    (bytes_key, deadline): (Option<&[u8; 32]>, Instant),
    cfg: &PublisherConfig,
) -> Result<((Shard, Duration), Option<engine_link::EngineLink>)> {
    let timed_shard = || {
        let hashing = Instant::now();
        let shard =
            shard_for(offer, rank, gpu_id, cfg).map_err(|e| e.context(format!("rank {rank}")))?;
        let hash = match shard.hashed {
            0 => Duration::ZERO,
            _ => hashing.elapsed(),
        };
        Ok((shard, hash))
    };
    if bytes_key.is_none() {
        return Ok((timed_shard()?, None));
    }
    let (shard, engine) = std::thread::scope(|s| {
        let shard = s.spawn(timed_shard);
        let engine = engine_link::reach(conn, deadline);
        let shard = shard.join().unwrap_or_else(|_| {
            Err(Error::new(
                crate::result::wm_result::WM_ERR_PANIC,
                "the thread hashing the session's tensors panicked",
            ))
        });
        (shard, engine)
    });
    Ok((shard?, Some(engine?)))
}

/// How a session's bytes go out: the network key (None: IPC), the
/// publisher's config and pools, and the deadline of the next bucket.
type Link<'a> = (
    Option<&'a [u8; 32]>,
    &'a PublisherConfig,
    &'a Pools,
    &'a dyn Fn() -> Instant,
);

/// The deltas, then the buckets of `d`; `stats` filled in. The FP8 images
/// in host memory (`to_make`; `made` says which of the images are) are made
/// while the buckets before them go out (`quantize_behind.rs`); the scope
/// joins their maker whatever happens.
fn deliver(
    (conn, offer): (&mut Conn, &Offer),
    mut d: Delivery,
    (made, to_make): (Vec<bool>, Vec<(usize, ImageToMake)>),
    link: Link,
    stats: SessionStats,
) -> Result<SessionStats> {
    let (cfg, pool) = (link.1, link.2);
    let behind = Behind::new(d.shard.manifest.tensors.len(), made);
    let stats = std::thread::scope(|s| {
        if !to_make.is_empty() {
            let (behind, threads) = (&behind, cfg.pack_threads());
            s.spawn(move || behind.run(to_make, |image| image.make(offer, threads)));
        }
        let r = send(conn, offer, &mut d, &behind, link, stats);
        if r.is_err() {
            behind.stop();
        }
        r
    });
    // A clean session's images go back to the pool once the maker is done
    // with them; a failed session's are freed (a send of one may still be
    // draining when the network session gave up).
    match &stats {
        Ok(_) => pool.images.give_back(d.shard.take_images(), offer.elements),
        Err(_) => drop(d.shard.take_images()),
    }
    let mut stats = stats?;
    stats.quantize += behind.waited();
    Ok(stats)
}

/// [`deliver`]'s sending: DELTAS (once the images the base fingerprinted
/// are made: deltas are taken between whole images), then the buckets,
/// each once the images it holds are made.
fn send(
    conn: &mut Conn,
    offer: &Offer,
    d: &mut Delivery,
    behind: &Behind,
    (bytes_key, cfg, pool, bucket_deadline): Link,
    stats: SessionStats,
) -> Result<SessionStats> {
    let (deltas, messages) = match &d.base {
        Some(base) => {
            let fingerprinted = (base.fingerprints.iter())
                .filter_map(|&(k, _)| d.want.get(k as usize))
                .map(|q| q.tensor as usize);
            behind.wait_for(fingerprinted, bucket_deadline())?;
            deltas::serve(
                conn,
                (d.base_shard.as_ref(), offer),
                (&d.shard, &mut d.want, &d.images),
                base,
                (cfg, bytes_key.is_some()),
            )?
        }
        None => Default::default(),
    };
    let mut stats = SessionStats {
        bytes: deltas.bytes,
        delta_runs: deltas.runs,
        delta_cached: deltas.cached,
        delta_bytes: deltas.bytes,
        ..stats
    };
    let want = &d.want;
    let ready = |entries: &[BucketEntry]| {
        let tensors = entries
            .iter()
            .map(|e| want[e.request as usize].tensor as usize);
        behind.wait_for(tensors, bucket_deadline())
    };
    let mut io = SessionIo {
        conn,
        cfg,
        pool,
        ack_deadline: bucket_deadline,
        images_ready: &ready,
        stats: &mut stats,
    };
    match bytes_key {
        Some(key) => {
            let engine = (d.engine.take())
                .ok_or_else(|| Error::state("a network session's engine worker is reached once"))?;
            net::stream(&mut io, (key, engine), &mut d.shard, (want, &messages))?
        }
        None => ipc::stream(&mut io, &mut d.shard, want)?,
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
