//! One engine rank's session: handshake (and, over the network, the
//! challenge), manifest, buckets, acknowledgements.

use super::{Content, HostTensor, Offer, PublisherConfig};
use crate::manifest::{Manifest, TensorMeta};
use crate::memory::copy::{copy_all, default_threads, hash_all, CopyJob, CopySource};
use crate::memory::pool::Pool;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::source::snapshot::checksums::hash_file_ranges;
use crate::source::snapshot::{SnapshotLocation, SnapshotSource};
use crate::source::Source;
use crate::transport::auth::{self, Secret};
use crate::transport::conn::{Conn, Stream};
use crate::transport::unix::check_peer_uid;
use crate::wire::{BucketEntry, Frame, ALIGN};
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

fn shard_for(
    content: &Content,
    rank: u32,
    gpu_id: &str,
    version: Option<String>,
    cfg: &PublisherConfig,
) -> Result<Shard> {
    match content {
        Content::Dir(dir) => {
            let loc = SnapshotLocation {
                model_dir: dir.clone(),
                fallback_dir: None,
                rank,
                gpu_id: gpu_id.to_string(),
            };
            let source = SnapshotSource::open(&loc, &cfg.logger)?;
            let mut manifest = source.manifest().clone();
            if cfg.checksums {
                fill_missing_checksums(&source, &mut manifest)?;
            }
            if version.is_some() {
                manifest.version = version;
            }
            Ok(Shard {
                manifest,
                bytes: ShardBytes::Files {
                    source: Box::new(source),
                    open: HashMap::new(),
                },
            })
        }
        Content::Tensors(all) => {
            let mine: Vec<&HostTensor> = all
                .iter()
                .filter(|t| t.rank.is_none_or(|r| r == rank))
                .collect();
            // Hash what has no checksum yet (published copies have theirs).
            let todo: Vec<usize> = (0..mine.len())
                .filter(|&i| cfg.checksums && mine[i].checksum.is_none())
                .collect();
            let regions: Vec<(SendPtr, usize)> =
                todo.iter().map(|&i| (mine[i].data, mine[i].len)).collect();
            // SAFETY: add_tensor's contract keeps the memory valid and unchanged.
            let fresh = unsafe { hash_all(&regions, default_threads()) };
            let mut sums: Vec<Option<u128>> = mine.iter().map(|t| t.checksum).collect();
            for (&i, sum) in todo.iter().zip(fresh) {
                sums[i] = Some(sum);
            }
            let tensors = mine
                .iter()
                .enumerate()
                .map(|(i, t)| TensorMeta {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    nbytes: t.len as u64,
                    checksum: sums[i],
                })
                .collect();
            Ok(Shard {
                manifest: Manifest { tensors, version },
                bytes: ShardBytes::Memory(mine.iter().map(|t| t.data).collect()),
            })
        }
    }
}

/// Hash the tensors a snapshot has no `wm_checksums.json` entry for, so the
/// engine can verify them (the network paths verify by default).
fn fill_missing_checksums(source: &SnapshotSource, manifest: &mut Manifest) -> Result<()> {
    let todo: Vec<usize> = (0..manifest.tensors.len())
        .filter(|&i| manifest.tensors[i].checksum.is_none())
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    let paths: Vec<&std::path::Path> = source.files().collect();
    let files = paths
        .iter()
        .map(|p| File::open(p).map_err(|e| Error::io(format!("opening {}", p.display()), e)))
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
    Ok(())
}

/// Pack `want` (manifest indices) into buckets of at most `bucket` bytes.
pub(super) fn plan_buckets(
    manifest: &Manifest,
    want: &[u32],
    bucket: usize,
) -> Vec<(Vec<BucketEntry>, u64)> {
    let bucket = bucket as u64;
    let mut out: Vec<(Vec<BucketEntry>, u64)> = Vec::new();
    let mut cur: Vec<BucketEntry> = Vec::new();
    let mut used = 0u64;
    for &t in want {
        let n = manifest.tensors[t as usize].nbytes;
        let mut done = 0u64;
        while done < n || (n == 0 && done == 0) {
            let at = used.next_multiple_of(ALIGN);
            if at >= bucket || (at + (n - done) > bucket && !cur.is_empty() && n - done <= bucket) {
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

pub(super) fn run(
    stream: Stream,
    offers: &[Arc<Offer>],
    secret: Option<&Secret>,
    cfg: &PublisherConfig,
    pool: &BufferPool,
) -> Result<SessionStats> {
    let start = Instant::now();
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
    // Only network publishers hold a secret: it is what makes a session a network one.
    let r = serve(&mut conn, offers, secret, cfg, pool, start);
    if let Err(e) = &r {
        conn.send_error(e);
    }
    r
}

/// The publisher's side of the challenge (see `transport::auth`). A wrong
/// answer is logged here and refused there, before any manifest moves.
fn authenticate(
    conn: &mut Conn,
    secret: &Secret,
    deadline: Instant,
    cfg: &PublisherConfig,
) -> Result<()> {
    let mine = auth::nonce()?;
    conn.send(&Frame::Challenge { nonce: mine })?;
    let (mac, theirs) = match conn.recv(deadline)? {
        Frame::Proof { mac, nonce } => (mac, nonce),
        other => return Err(Error::peer(format!("expected PROOF, got {}", other.name()))),
    };
    if !secret.check_engine_proof(&mine, &theirs, &mac) {
        let e = Error::auth(format!(
            "authentication failed: {} does not hold this publisher's shared secret",
            conn.peer()
        ));
        cfg.logger.warn(&format!("publisher: {e}"));
        return Err(e);
    }
    conn.send(&Frame::Proof {
        mac: secret.publisher_proof(&theirs, &mine),
        nonce: [0; 32],
    })
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

fn serve(
    conn: &mut Conn,
    offers: &[Arc<Offer>],
    secret: Option<&Secret>,
    cfg: &PublisherConfig,
    pool: &BufferPool,
    start: Instant,
) -> Result<SessionStats> {
    let session_deadline = start + cfg.session_timeout;
    let step = |d: Duration| (Instant::now() + d).min(session_deadline);
    let (rank, gpu_id, wanted_version) = match conn.recv(step(cfg.bucket_timeout))? {
        Frame::Hello {
            rank,
            gpu_id,
            version,
            ..
        } => (rank, gpu_id, version),
        other => return Err(Error::peer(format!("expected HELLO, got {}", other.name()))),
    };
    conn.set_peer(format!("engine rank {rank} ({})", conn.peer()));
    if let Some(secret) = secret {
        authenticate(conn, secret, step(cfg.bucket_timeout), cfg)?;
    }
    let offer = pick(offers, &wanted_version, rank)?;
    let mut shard = shard_for(&offer.content, rank, &gpu_id, offer.version.clone(), cfg)
        .map_err(|e| e.context(format!("rank {rank}")))?;
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
        ..Default::default()
    };
    if secret.is_some() {
        super::net::stream_buckets(conn, &mut shard, &want, cfg, pool, &step, &mut stats)?;
        stats.total = start.elapsed();
        return Ok(stats);
    }
    let buckets = plan_buckets(&shard.manifest, &want, cfg.bucket_size);
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = cfg.buffers.min(buckets.len()).max(1);
    let buffers = take_buffers(pool, n_buf, largest)?;
    let r = stream_buckets(
        conn, &mut shard, &buckets, &buffers, largest, cfg, &step, &mut stats,
    );
    // A clean session's buffers serve the next one; a failed session's are
    // freed at once (the engine may be gone, or still mapping them).
    if r.is_ok() {
        pool.give_back(buffers);
    }
    r?;
    stats.total = start.elapsed();
    Ok(stats)
}

/// Hand the buffers over, then fill, announce and recycle them bucket by bucket.
#[allow(clippy::too_many_arguments)]
fn stream_buckets(
    conn: &mut Conn,
    shard: &mut Shard,
    buckets: &[(Vec<BucketEntry>, u64)],
    buffers: &[SharedBuffer],
    largest: usize,
    cfg: &PublisherConfig,
    step: &dyn Fn(Duration) -> Instant,
    stats: &mut SessionStats,
) -> Result<()> {
    let n_buf = buffers.len();
    let fds: Vec<i32> = buffers.iter().map(|b| b.fd().as_raw_fd()).collect();
    conn.send_with_fds(
        &Frame::Buffers {
            sizes: vec![largest as u64; n_buf],
        },
        &fds,
    )?;
    let threads = if cfg.threads == 0 {
        default_threads()
    } else {
        cfg.threads
    };
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
    for (i, (entries, _)) in buckets.iter().enumerate() {
        // Buffer i % n_buf is free once the engine acknowledged bucket i - n_buf.
        if i >= n_buf {
            wait_ack(conn, stats)?;
        }
        let buf = &buffers[i % n_buf];
        let t = Instant::now();
        fill(shard, entries, buf.ptr(), threads)?;
        if let Some(victim) = &cfg.corrupt_tensor {
            corrupt(&shard.manifest, entries, buf.ptr(), victim);
        }
        stats.pack += t.elapsed();
        stats.bytes += entries.iter().map(|e| e.len).sum::<u64>();
        conn.send(&Frame::Bucket {
            seq: i as u64,
            buffer: (i % n_buf) as u32,
            entries: entries.clone(),
        })?;
    }
    for _ in buckets.len().saturating_sub(n_buf)..buckets.len() {
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
                    let f = File::open(path)
                        .map_err(|err| Error::io(format!("opening {}", path.display()), err))?;
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
}
