//! One engine rank's session: handshake (and, over the network, the
//! challenge), manifest, buckets, acknowledgements.

use super::{Content, HostTensor, Offer, Published, PublisherConfig};
use crate::manifest::{Manifest, TensorMeta};
use crate::memory::copy::{copy_all, default_threads, hash_all, CopyJob, CopySource};
use crate::memory::cuda_ipc::ExportedDeviceBuffer;
use crate::memory::pool::Pool;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::source::snapshot::checksums::hash_file_ranges;
use crate::source::snapshot::regular_file::open_regular;
use crate::source::snapshot::{SnapshotLocation, SnapshotSource};
use crate::source::Source;
use crate::transport::auth::{self, Secret};
use crate::transport::conn::{Conn, Stream};
use crate::transport::seal::Role;
use crate::transport::unix::check_peer_uid;
use crate::wire::{BucketEntry, CudaBuffer, Frame, ALIGN};
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The publisher's bucket buffers, kept between sessions.
pub(super) type BufferPool = Pool<SharedBuffer>;

/// `n` bucket buffers of at least `len` bytes, pooled ones first.
pub(super) fn take_buffers(pool: &BufferPool, n: usize, len: usize) -> Result<Vec<SharedBuffer>> {
    pool.take(n, len, |i| {
        SharedBuffer::create(&format!("bucket buffer {i}"), len)
    })
}

/// What one session did.
#[derive(Clone, Debug, Default)]
pub struct SessionStats {
    pub rank: u32,
    pub version: String,
    pub tensors: u64,
    pub bytes: u64,
    pub buckets: u64,
    /// Bytes hashed for this session's manifest, and the time it took
    /// before the manifest could go out: 0 when every checksum was known
    /// (a published version, `wm_checksums.json`, or live tensors an
    /// earlier session of the same serve call hashed).
    pub hashed: u64,
    pub hash: Duration,
    /// Time spent packing buckets into the shared buffers.
    pub pack: Duration,
    /// Time spent waiting for the engine's acknowledgements.
    pub wait: Duration,
    pub total: Duration,
}

/// Where one shard's tensor bytes come from.
enum ShardBytes {
    Memory(Vec<SendPtr>),
    Files {
        source: Box<SnapshotSource>,
        open: HashMap<PathBuf, File>,
    },
}

pub(super) struct Shard {
    pub(super) manifest: Manifest,
    bytes: ShardBytes,
    /// The published version's buffer, which every tensor of the shard
    /// lies in (None: live tensors or files, packed per session).
    published: Option<Published>,
    /// Bytes hashed to build the manifest.
    hashed: u64,
}

impl Shard {
    /// Where each tensor's bytes already are in this process's memory
    /// (published copies, or tensors the trainer added), so they can be sent
    /// without packing; None for a shard read from files.
    pub(super) fn in_memory(&self) -> Option<&[SendPtr]> {
        match &self.bytes {
            ShardBytes::Memory(ptrs) => Some(ptrs),
            ShardBytes::Files { .. } => None,
        }
    }
}

fn shard_for(offer: &Offer, rank: u32, gpu_id: &str, cfg: &PublisherConfig) -> Result<Shard> {
    let version = offer.version.clone();
    match &offer.content {
        Content::Dir(dir) => {
            let loc = SnapshotLocation {
                model_dir: dir.clone(),
                fallback_dir: None,
                rank,
                gpu_id: gpu_id.to_string(),
            };
            let source = SnapshotSource::open(&loc, &cfg.logger)?;
            let mut manifest = source.manifest().clone();
            let hashed = if cfg.checksums {
                fill_missing_checksums(&source, &mut manifest)?
            } else {
                0
            };
            if version.is_some() {
                manifest.version = version;
            }
            Ok(Shard {
                manifest,
                bytes: ShardBytes::Files {
                    source: Box::new(source),
                    open: HashMap::new(),
                },
                published: None,
                hashed,
            })
        }
        Content::Tensors(all) => {
            // This rank's tensors, with their index in the content.
            let mine: Vec<(usize, &HostTensor)> = all
                .iter()
                .enumerate()
                .filter(|(_, t)| t.rank.is_none_or(|r| r == rank))
                .collect();
            if let (Some((_, t)), None) = (
                mine.iter().find(|(_, t)| t.device.is_some()),
                &offer.published,
            ) {
                return Err(Error::invalid_argument(format!(
                    "tensor '{}' is GPU memory: GPU tensors are served once published \
                     (publish copies them into a buffer engines read)",
                    t.name
                )));
            }
            // Hash what has no checksum yet: published copies have theirs,
            // live tensors another session of this serve call may have
            // hashed. The lock is held while hashing, so sessions wanting
            // the same tensors wait for the sums instead of hashing again.
            let mut known = offer.live_sums.lock();
            let todo: Vec<(usize, &HostTensor)> = mine
                .iter()
                .copied()
                .filter(|(i, t)| cfg.checksums && t.checksum.is_none() && !known.contains_key(i))
                .collect();
            let regions: Vec<(SendPtr, usize)> =
                todo.iter().map(|(_, t)| (t.data, t.len)).collect();
            // SAFETY: add_tensor's contract keeps the memory valid and unchanged.
            let fresh = unsafe { hash_all(&regions, default_threads()) };
            known.extend(todo.iter().map(|(i, _)| *i).zip(fresh));
            let tensors = mine
                .iter()
                .map(|(i, t)| TensorMeta {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    nbytes: t.len as u64,
                    checksum: t.checksum.or_else(|| known.get(i).copied()),
                })
                .collect();
            drop(known);
            Ok(Shard {
                manifest: Manifest { tensors, version },
                bytes: ShardBytes::Memory(mine.iter().map(|(_, t)| t.data).collect()),
                published: offer.published.clone(),
                hashed: regions.iter().map(|(_, n)| *n as u64).sum(),
            })
        }
    }
}

/// Hash the tensors a snapshot has no `wm_checksums.json` entry for, so the
/// engine can verify them (the network paths verify by default). Returns
/// the bytes hashed.
fn fill_missing_checksums(source: &SnapshotSource, manifest: &mut Manifest) -> Result<u64> {
    let todo: Vec<usize> = (0..manifest.tensors.len())
        .filter(|&i| manifest.tensors[i].checksum.is_none())
        .collect();
    if todo.is_empty() {
        return Ok(0);
    }
    let paths: Vec<&std::path::Path> = source.files().collect();
    let files = paths
        .iter()
        .map(|p| open_regular(p))
        .collect::<Result<Vec<File>>>()?;
    let ranges: Vec<(usize, u64, u64)> = todo
        .iter()
        .map(|&t| {
            let (path, offset) = source.tensor_location(t);
            let fi = paths
                .iter()
                .position(|p| *p == path)
                .expect("a file of the source");
            (fi, offset, manifest.tensors[t].nbytes)
        })
        .collect();
    let handles: Vec<&File> = files.iter().collect();
    let sums = hash_file_ranges(&handles, &ranges, default_threads(), &|_, _| {});
    for ((&t, r), &(fi, _, _)) in todo.iter().zip(sums).zip(&ranges) {
        let sum = r.map_err(|e| Error::io(format!("hashing {}", paths[fi].display()), e))?;
        manifest.tensors[t].checksum = Some(sum);
    }
    Ok(ranges.iter().map(|&(_, _, n)| n).sum())
}

/// Smallest bucket the ramp starts and ends with.
const RAMP_MIN: u64 = 16 << 20;

/// Pack `want` (manifest indices) into buckets of at most `bucket` bytes.
///
/// Buckets ramp up and down: the first is `RAMP_MIN` and each next may hold
/// twice as much, and near the end a bucket closes once it holds as much as
/// is left. The engine waits for the first bucket to be packed and the
/// publisher for the last to be applied, with nothing to overlap either:
/// with 512 MiB buckets throughout, that idle time was a ninth of a 4 GiB
/// update. The ramp only closes buckets early; a tensor is split only where
/// it does not fit in a whole bucket, as without it.
pub(super) fn plan_buckets(
    manifest: &Manifest,
    want: &[u32],
    bucket: usize,
) -> Vec<(Vec<BucketEntry>, u64)> {
    let bucket = bucket as u64;
    let mut left: u64 = want
        .iter()
        .map(|&t| manifest.tensors[t as usize].nbytes)
        .sum();
    let mut out: Vec<(Vec<BucketEntry>, u64)> = Vec::new();
    let mut cur: Vec<BucketEntry> = Vec::new();
    let mut used = 0u64;
    for &t in want {
        let n = manifest.tensors[t as usize].nbytes;
        let mut done = 0u64;
        while done < n || (n == 0 && done == 0) {
            let head = RAMP_MIN.checked_shl(out.len() as u32).unwrap_or(u64::MAX);
            let ramp_full = used >= head || (used >= RAMP_MIN && used >= left);
            let at = used.next_multiple_of(ALIGN);
            if !cur.is_empty()
                && (ramp_full || at >= bucket || (at + (n - done) > bucket && n - done <= bucket))
            {
                out.push((std::mem::take(&mut cur), used));
                used = 0;
                continue;
            }
            let len = (n - done).min(bucket - at);
            cur.push(BucketEntry {
                tensor: t,
                tensor_offset: done,
                len,
                buffer_offset: at,
            });
            used = at + len;
            done += len;
            left -= len;
            if n == 0 {
                break;
            }
        }
    }
    if !cur.is_empty() {
        out.push((cur, used));
    }
    out
}

/// An engine's connection that finished its handshake in time: its HELLO
/// read and, over the network, both proofs checked and the frames sealed.
/// Only such a connection counts as one of the engines a serve call waits
/// for (`accept`).
pub(super) struct Admitted {
    conn: Conn,
    rank: u32,
    gpu_id: String,
    version: String,
    /// Network sessions: the key of the bucket bytes' digests (None: IPC).
    bytes_key: Option<[u8; 32]>,
}

impl Admitted {
    /// Turn the engine away (best effort: it is told why).
    pub(super) fn refuse(mut self, e: &Error) {
        self.conn.send_error(e);
    }
}

/// Read the engine's HELLO and, with a `secret` (a network publisher), run
/// the challenge, all within `cfg.handshake_timeout`: a connection that
/// does not is dropped, having cost one thread and no buffers.
pub(super) fn handshake(
    stream: Stream,
    secret: Option<&Secret>,
    cfg: &PublisherConfig,
) -> Result<Admitted> {
    let deadline = Instant::now() + cfg.handshake_timeout;
    let who = match &stream {
        Stream::Unix(s) => {
            check_peer_uid(s, cfg.allow_other_uids, "an engine")?;
            "an engine".to_string()
        }
        Stream::Tcp(s) => match s.peer_addr() {
            Ok(a) => format!("the engine at {a}"),
            Err(_) => "an engine".to_string(),
        },
    };
    let mut conn = Conn::new(stream, who);
    let hello = match conn.recv(deadline) {
        Ok(f @ Frame::Hello { .. }) => f,
        Ok(other) => Err(Error::peer(format!("expected HELLO, got {}", other.name())))?,
        Err(e) => return Err(e.context("before its handshake")),
    };
    let Frame::Hello {
        rank,
        gpu_id,
        version,
        ..
    } = &hello
    else {
        unreachable!("matched above")
    };
    conn.set_peer(format!("engine rank {rank} ({})", conn.peer()));
    let mut bytes_key = None;
    if let Some(secret) = secret {
        match authenticate(&mut conn, secret, &hello.encode(), deadline) {
            Ok(key) => bytes_key = Some(key),
            Err(e) => {
                conn.send_error(&e);
                return Err(e);
            }
        }
    }
    Ok(Admitted {
        rank: *rank,
        gpu_id: gpu_id.clone(),
        version: version.clone(),
        conn,
        bytes_key,
    })
}

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
        bytes_key,
    } = admitted;
    let hello = (rank, gpu_id.as_str(), version.as_str());
    let r = serve(
        &mut conn,
        offers,
        hello,
        bytes_key.as_ref(),
        cfg,
        pool,
        start,
    );
    if let Err(e) = &r {
        conn.send_error(e);
    }
    r.map(|stats| SessionStats {
        total: start.elapsed(),
        ..stats
    })
}

/// The publisher's side of the challenge (see `transport::auth`): a wrong
/// answer is refused before any manifest moves; a right one seals the
/// connection's frames with keys bound to `hello` (its encoding). Returns
/// the session's key for bucket-byte digests.
fn authenticate(
    conn: &mut Conn,
    secret: &Secret,
    hello: &[u8],
    deadline: Instant,
) -> Result<[u8; 32]> {
    let mine = auth::nonce()?;
    conn.send(&Frame::Challenge { nonce: mine })?;
    let (mac, theirs) = match conn.recv(deadline)? {
        Frame::Proof { mac, nonce } => (mac, nonce),
        other => return Err(Error::peer(format!("expected PROOF, got {}", other.name()))),
    };
    if !secret.check_engine_proof(&mine, &theirs, &mac) {
        return Err(Error::auth(format!(
            "authentication failed: {} does not hold this publisher's shared secret",
            conn.peer()
        )));
    }
    conn.send(&Frame::Proof {
        mac: secret.publisher_proof(&theirs, &mine),
        nonce: [0; 32],
    })?;
    let keys = secret.session_keys(&mine, &theirs, hello);
    conn.secure(&keys, Role::Publisher);
    Ok(keys.bytes)
}

/// The offer a rank asked for: by name, or the newest for "" and "latest".
fn pick<'a>(offers: &'a [Arc<Offer>], wanted: &str, rank: u32) -> Result<&'a Offer> {
    let found = if wanted.is_empty() || wanted == "latest" {
        offers.last()
    } else {
        offers
            .iter()
            .rev()
            .find(|o| o.version.as_deref() == Some(wanted))
    };
    found.map(|o| &**o).ok_or_else(|| {
        let names: Vec<String> = offers
            .iter()
            .map(|o| format!("'{}'", o.version.as_deref().unwrap_or("")))
            .collect();
        Error::not_found(format!(
            "rank {rank} asked for version '{wanted}'; this publisher serves {}",
            names.join(", ")
        ))
    })
}

/// The session after the handshake: `hello` is the engine's rank, GPU id
/// and wanted version; `bytes_key` (network sessions only): buckets go over
/// UCX, their digests keyed with it when the engine asks.
fn serve(
    conn: &mut Conn,
    offers: &[Arc<Offer>],
    (rank, gpu_id, wanted_version): (u32, &str, &str),
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
    conn.send(&Frame::Manifest {
        version: have.clone(),
        tensors: shard.manifest.tensors.clone(),
    })?;
    let want = match conn.recv(step(cfg.bucket_timeout))? {
        Frame::Want { tensors } => tensors,
        other => return Err(Error::peer(format!("expected WANT, got {}", other.name()))),
    };
    let n_tensors = shard.manifest.tensors.len();
    let mut seen = vec![false; n_tensors];
    for &t in &want {
        if t as usize >= n_tensors || std::mem::replace(&mut seen[t as usize], true) {
            return Err(Error::peer(format!(
                "rank {rank} wants tensor #{t} twice or out of range"
            )));
        }
    }
    let mut stats = SessionStats {
        rank,
        version: have,
        tensors: want.len() as u64,
        hashed: shard.hashed,
        hash,
        ..Default::default()
    };
    if let Some(key) = bytes_key {
        let net = super::net::NetSession {
            conn,
            key,
            cfg,
            pool,
        };
        net.stream_buckets(&mut shard, &want, &step, &mut stats)?;
        return Ok(stats);
    }
    if let (Some(Published::Device(_)), Some(_)) = (&shard.published, &cfg.corrupt_tensor) {
        return Err(Error::invalid_argument(
            "the corrupt-tensor test option does not apply to a GPU version",
        ));
    }
    if let (Some(published), None) = (shard.published.clone(), &cfg.corrupt_tensor) {
        let (base, handover) = match &published {
            Published::Host(b) => (b.ptr() as u64, Handover::Shared(vec![&**b])),
            Published::Device(d) => (d.ptr(), Handover::Cuda(d)),
        };
        let buckets = windows(&shard, base, &want, cfg.bucket_size);
        let no_packing = |_: usize, _: &[BucketEntry]| Ok(0);
        stream_buckets(
            conn,
            &buckets,
            handover,
            cfg.buffers,
            no_packing,
            cfg,
            &step,
            &mut stats,
        )?;
        return Ok(stats);
    }
    let buckets = plan_buckets(&shard.manifest, &want, cfg.bucket_size);
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = cfg.buffers.min(buckets.len()).max(1);
    let buffers = take_buffers(pool, n_buf, largest)?;
    let threads = cfg.pack_threads();
    let pack = |i: usize, entries: &[BucketEntry]| {
        let buf = &buffers[i % n_buf];
        fill(&mut shard, entries, buf.ptr(), threads)?;
        if let Some(victim) = &cfg.corrupt_tensor {
            corrupt(&shard.manifest, entries, buf.ptr(), victim);
        }
        Ok((i % n_buf) as u32)
    };
    let views = Handover::Shared(buffers.iter().collect());
    let r = stream_buckets(conn, &buckets, views, n_buf, pack, cfg, &step, &mut stats);
    // A clean session's buffers serve the next one; a failed session's are
    // freed at once (the engine may be gone, or still mapping them).
    if r.is_ok() {
        pool.give_back(buffers);
    }
    r.map(|()| stats)
}

/// Buckets of a published version: planned as for packing (so each holds
/// at most `bucket` bytes, ramping up and down), but every entry points at
/// its bytes where they already are in the version's buffer (at `base`, a
/// host or a device address).
fn windows(shard: &Shard, base: u64, want: &[u32], bucket: usize) -> Vec<(Vec<BucketEntry>, u64)> {
    let ptrs = shard.in_memory().expect("a published shard is in memory");
    // Whole multiples of the alignment, so split tensors' pieces stay aligned.
    let bucket = (bucket as u64 / ALIGN * ALIGN) as usize;
    let mut buckets = plan_buckets(&shard.manifest, want, bucket);
    for (entries, _) in &mut buckets {
        for e in entries {
            let start = ptrs[e.tensor as usize].0 as u64 - base;
            e.buffer_offset = start + e.tensor_offset;
        }
    }
    buckets
}

/// The buffers a session hands over: shared host memory (descriptors), or
/// a GPU buffer (its CUDA IPC handle).
enum Handover<'a> {
    Shared(Vec<&'a SharedBuffer>),
    Cuda(&'a ExportedDeviceBuffer),
}

impl Handover<'_> {
    /// Each buffer's whole length (pooled ones may be larger than this
    /// session needs): the same file always maps the same way, so an engine
    /// can keep its mapping from one session to the next.
    fn send(&self, conn: &mut Conn) -> Result<()> {
        match self {
            Handover::Shared(buffers) => {
                let fds: Vec<i32> = buffers.iter().map(|b| b.fd().as_raw_fd()).collect();
                let sizes = buffers.iter().map(|b| b.len() as u64).collect();
                conn.send_with_fds(&Frame::Buffers { sizes }, &fds)
            }
            Handover::Cuda(d) => conn.send(&Frame::CudaBuffers {
                buffers: vec![CudaBuffer {
                    handle: d.handle(),
                    size: d.len() as u64,
                }],
            }),
        }
    }
}

/// Hand the buffers over, then announce bucket after bucket, `pack`ing each
/// first (it returns the buffer the bucket is in). Up to `in_flight`
/// buckets are unacknowledged at a time: a buffer is refilled only once the
/// engine acknowledged the bucket that was in it.
#[allow(clippy::too_many_arguments)]
fn stream_buckets(
    conn: &mut Conn,
    buckets: &[(Vec<BucketEntry>, u64)],
    buffers: Handover,
    in_flight: usize,
    mut pack: impl FnMut(usize, &[BucketEntry]) -> Result<u32>,
    cfg: &PublisherConfig,
    step: &dyn Fn(Duration) -> Instant,
    stats: &mut SessionStats,
) -> Result<()> {
    buffers.send(conn)?;
    let mut acked = 0u64;
    let mut wait_ack = |conn: &mut Conn, stats: &mut SessionStats| -> Result<()> {
        let t = Instant::now();
        match conn.recv(step(cfg.bucket_timeout))? {
            Frame::Ack { seq } if seq == acked => acked += 1,
            Frame::Ack { seq } => {
                return Err(Error::peer(format!(
                    "acknowledged bucket {seq}, expected {acked}"
                )))
            }
            other => return Err(Error::peer(format!("expected ACK, got {}", other.name()))),
        }
        stats.wait += t.elapsed();
        Ok(())
    };
    let in_flight = in_flight.max(1);
    for (i, (entries, _)) in buckets.iter().enumerate() {
        if i >= in_flight {
            wait_ack(conn, stats)?;
        }
        let t = Instant::now();
        let buffer = pack(i, entries)?;
        stats.pack += t.elapsed();
        stats.bytes += entries.iter().map(|e| e.len).sum::<u64>();
        conn.send(&Frame::Bucket {
            seq: i as u64,
            buffer,
            entries: entries.clone(),
        })?;
    }
    for _ in buckets.len().saturating_sub(in_flight)..buckets.len() {
        wait_ack(conn, stats)?;
    }
    conn.send(&Frame::End {
        buckets: buckets.len() as u64,
    })?;
    stats.buckets = buckets.len() as u64;
    Ok(())
}

/// Copy the entries' bytes into the bucket buffer at `base` (which holds
/// every entry's range).
pub(super) fn fill(
    shard: &mut Shard,
    entries: &[BucketEntry],
    base: *mut u8,
    threads: usize,
) -> Result<()> {
    let dst = |e: &BucketEntry| SendPtr(base.wrapping_add(e.buffer_offset as usize));
    match &mut shard.bytes {
        ShardBytes::Memory(ptrs) => {
            let jobs: Vec<CopyJob> = entries
                .iter()
                .map(|e| CopyJob {
                    src: CopySource::Memory(SendPtr(
                        ptrs[e.tensor as usize]
                            .0
                            .wrapping_add(e.tensor_offset as usize),
                    )),
                    dst: dst(e),
                    len: e.len as usize,
                    tag: e.tensor as usize,
                })
                .collect();
            // SAFETY: entries lie inside the buffer (planned from its size) and
            // inside their tensors; the trainer keeps tensors unchanged.
            unsafe { copy_all(&jobs, threads) }.map_err(|e| e.error)
        }
        ShardBytes::Files { source, open } => {
            for e in entries {
                let (path, _) = source.tensor_location(e.tensor as usize);
                if !open.contains_key(path) {
                    let f = open_regular(path)?;
                    open.insert(path.to_path_buf(), f);
                }
            }
            let jobs: Vec<CopyJob> = entries
                .iter()
                .map(|e| {
                    let (path, offset) = source.tensor_location(e.tensor as usize);
                    CopyJob {
                        src: CopySource::File {
                            file: &open[path],
                            offset: offset + e.tensor_offset,
                        },
                        dst: dst(e),
                        len: e.len as usize,
                        tag: e.tensor as usize,
                    }
                })
                .collect();
            // SAFETY: as above; file reads are bounds-checked by pread.
            unsafe { copy_all(&jobs, threads) }.map_err(|e| e.error)
        }
    }
}

/// Test only: flip the lowest bit of the first byte of `victim` in this bucket.
pub(super) fn corrupt(manifest: &Manifest, entries: &[BucketEntry], base: *mut u8, victim: &str) {
    for e in entries {
        if manifest.tensors[e.tensor as usize].name == victim && e.tensor_offset == 0 && e.len > 0 {
            // SAFETY: inside the entry's range in our own buffer.
            unsafe { *base.add(e.buffer_offset as usize) ^= 1 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    /// GPU tensors are served only from a published version's buffer: a
    /// live one is refused by name (a session never reads device memory as
    /// host memory).
    #[test]
    fn live_gpu_tensors_are_refused_by_name() {
        let gpu_tensor = HostTensor {
            name: "layers.0.w".into(),
            dtype: DType::F32,
            shape: vec![4],
            data: SendPtr(0x7000_0000_0000 as *mut u8),
            len: 16,
            rank: None,
            checksum: None,
            device: Some(0),
        };
        let offer = Offer::new(Some("1".into()), Content::Tensors(vec![gpu_tensor]));
        let e = shard_for(&offer, 0, "0", &PublisherConfig::default())
            .err()
            .expect("refused");
        assert_eq!(e.code, crate::wm_result::WM_ERR_INVALID_ARGUMENT);
        assert!(
            e.message.contains("'layers.0.w' is GPU memory") && e.message.contains("published"),
            "{e}"
        );
    }

    #[test]
    fn buckets_align_split_and_fill() {
        let t = |n: u64| TensorMeta {
            name: format!("t{n}"),
            dtype: DType::U8,
            shape: vec![n],
            nbytes: n,
            checksum: None,
        };
        let m = Manifest {
            tensors: vec![t(100), t(300), t(2500), t(10)],
            version: None,
        };
        let b = plan_buckets(&m, &[0, 1, 2, 3], 1024);
        // Every entry aligned, inside its bucket, every tensor covered once.
        let mut covered = vec![0u64; 4];
        for (entries, used) in &b {
            assert!(*used <= 1024);
            for e in entries {
                assert_eq!(e.buffer_offset % ALIGN, 0);
                assert!(e.buffer_offset + e.len <= 1024);
                assert_eq!(e.tensor_offset, covered[e.tensor as usize]);
                covered[e.tensor as usize] += e.len;
            }
        }
        assert_eq!(covered, vec![100, 300, 2500, 10]);
        assert!(b.len() >= 4, "{b:?}");
        assert!(plan_buckets(&m, &[], 1024).is_empty());
    }

    #[test]
    fn buckets_ramp_up_and_down_without_splitting_tensors() {
        const MIB: u64 = 1 << 20;
        let m = Manifest {
            tensors: (0..64)
                .map(|i| TensorMeta {
                    name: format!("t{i}"),
                    dtype: DType::U8,
                    shape: vec![64 * MIB],
                    nbytes: 64 * MIB,
                    checksum: None,
                })
                .collect(),
            version: None,
        };
        let want: Vec<u32> = (0..64).collect();
        let b = plan_buckets(&m, &want, 512 << 20);
        let sizes: Vec<u64> = b.iter().map(|(_, used)| used.div_ceil(MIB)).collect();
        // Up from one tensor, full 512 MiB buckets, down to one tensor.
        assert_eq!(sizes[..5], [64, 64, 64, 128, 256], "{sizes:?}");
        assert_eq!(sizes[sizes.len() - 3..], [256, 128, 64], "{sizes:?}");
        assert!(
            sizes.iter().filter(|&&s| s == 512).count() >= 5,
            "{sizes:?}"
        );
        assert_eq!(sizes.iter().sum::<u64>(), 64 * 64);
        // No tensor is split: each lies whole in one bucket.
        for (entries, _) in &b {
            assert!(entries.iter().all(|e| e.len == 64 * MIB));
        }
    }
}
