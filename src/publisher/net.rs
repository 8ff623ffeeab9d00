//! A network session's buckets, sent over UCX to the engine's worker as one
//! message per entry (entries split to at most `wire::NET_MESSAGE` bytes):
//! the engine receives each into its staging slot at the entry's buffer
//! offset (rdma), or straight into its params (gdr, `direct`).
//!
//! Buckets whose tensors are in this process's memory (published copies,
//! tensors the trainer added) are not packed at all: each entry is sent from
//! the tensor itself. Tensors read from files are packed into bucket buffers
//! first.
//!
//! The engine names the bucket size and how many buckets may be in flight
//! (READY). Bucket i is packed while buckets i-1.. are on the wire; its
//! buffer is refilled only after the engine acknowledged the bucket and
//! UCX reported the send complete.
//!
//! When READY asks for keyed digests, each BUCKET frame is followed by a
//! DIGESTS frame: the keyed BLAKE3 digest of each entry's bytes (the key is
//! the session's, `transport::auth`), computed from the bytes as packed or
//! as held, before anything could alter them on the way.

use super::session::{corrupt, fill, plan_buckets, take_buffers, BufferPool, SessionStats, Shard};
use super::PublisherConfig;
use crate::checksum::KEYED;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::ucx::Pump;
use crate::wire::{split_entries, BucketEntry, Frame, ALIGN, MAX_BUFFERS};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Largest bucket an engine may ask for.
const MAX_BUCKET: u64 = 16 << 30;

// The tag lives in `wire`, below both ends (no source <-> publisher cycle).
use crate::wire::net_tag as tag;

/// A network session after its WANT: the control connection, the key of
/// the bucket bytes' digests, and the publisher's config and buffers.
pub(super) struct NetSession<'a> {
    pub(super) conn: &'a mut Conn,
    pub(super) key: &'a [u8; KEYED],
    pub(super) cfg: &'a PublisherConfig,
    pub(super) pool: &'a BufferPool,
}

impl NetSession<'_> {
    pub(super) fn stream_buckets(
        self,
        shard: &mut Shard,
        want: &[u32],
        step: &dyn Fn(Duration) -> Instant,
        stats: &mut SessionStats,
    ) -> Result<()> {
        let NetSession {
            conn,
            key,
            cfg,
            pool,
        } = self;
        stream(conn, key, shard, want, cfg, pool, step, stats)
    }
}

/// The keyed digest of each entry's bytes, from `at(entry)`, on `threads`.
fn digests(
    key: &[u8; KEYED],
    entries: &[BucketEntry],
    at: impl Fn(&BucketEntry) -> *const u8 + Sync,
    threads: usize,
) -> Vec<[u8; KEYED]> {
    let one = |e: &BucketEntry| {
        // SAFETY: the entry's bytes are packed (or held) and unchanged
        // until their send completes.
        let bytes = unsafe { std::slice::from_raw_parts(at(e), e.len as usize) };
        crate::checksum::keyed(key, bytes)
    };
    let per = entries.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = entries
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().map(one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("hashing does not panic"))
            .collect()
    })
}

#[allow(clippy::too_many_arguments)] // the session's parts, unpacked once by NetSession
fn stream(
    conn: &mut Conn,
    key: &[u8; KEYED],
    shard: &mut Shard,
    want: &[u32],
    cfg: &PublisherConfig,
    pool: &BufferPool,
    step: &dyn Fn(Duration) -> Instant,
    stats: &mut SessionStats,
) -> Result<()> {
    // Staged or direct, the messages are the same: the engine alone decides
    // where each lands (READY's direct flag is informational).
    let (address, bucket_size, depth, keyed) = match conn.recv(step(cfg.bucket_timeout))? {
        Frame::Ready {
            address,
            bucket_size,
            depth,
            keyed,
            ..
        } => (address, bucket_size, depth as usize, keyed),
        other => return Err(Error::peer(format!("expected READY, got {}", other.name()))),
    };
    if !(ALIGN..=MAX_BUCKET).contains(&bucket_size) || depth == 0 || depth > MAX_BUFFERS {
        return Err(Error::peer(format!(
            "{} asked for buckets of {bucket_size} bytes, {depth} in flight ({ALIGN} to {MAX_BUCKET} bytes, 1 to {MAX_BUFFERS} allowed)",
            conn.peer()
        )));
    }
    let mut buckets = plan_buckets(&shard.manifest, want, bucket_size as usize);
    // One message per entry: entries no longer than a message.
    for (entries, _) in &mut buckets {
        *entries = split_entries(entries);
    }
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = depth.min(buckets.len()).max(1);
    // Tensors already in memory are sent from the tensors themselves: each
    // message is one entry, so nothing needs packing, and no bucket buffers
    // are taken. (The test-only corruption needs a packed copy to flip a
    // bit in.)
    let unpacked: Option<Vec<SendPtr>> = shard
        .in_memory()
        .filter(|_| cfg.corrupt_tensor.is_none())
        .map(<[SendPtr]>::to_vec);
    let buffers = match unpacked {
        Some(_) => Vec::new(),
        None => take_buffers(pool, n_buf, largest)?,
    };
    let pump = Pump::start("publisher")?;
    pump.connect(&address)
        .map_err(|e| e.context(format!("reaching {}", conn.peer())))?;
    let threads = cfg.pack_threads();
    // Messages of each bucket still on the wire.
    let mut in_flight: HashMap<u64, usize> = HashMap::new();
    let mut acked = 0u64;
    let mut wait_free = |conn: &mut Conn,
                         in_flight: &mut HashMap<u64, usize>,
                         seq: u64,
                         stats: &mut SessionStats|
     -> Result<()> {
        let t = Instant::now();
        let deadline = step(cfg.bucket_timeout);
        match conn.recv(deadline)? {
            Frame::Ack { seq: s } if s == acked => acked += 1,
            Frame::Ack { seq: s } => {
                return Err(Error::peer(format!(
                    "acknowledged bucket {s}, expected {acked}"
                )))
            }
            other => return Err(Error::peer(format!("expected ACK, got {}", other.name()))),
        }
        while in_flight.get(&seq).copied().unwrap_or(0) > 0 {
            match pump.next(deadline)? {
                Some(c) => {
                    c.result
                        .map_err(|e| e.context(format!("sending to {}", conn.peer())))?;
                    if let Some(n) = in_flight.get_mut(&(c.tag >> 32)) {
                        *n -= 1;
                    }
                }
                None => {
                    return Err(Error::timeout(format!(
                        "bucket {seq} to {} was not sent within the bucket timeout",
                        conn.peer()
                    )))
                }
            }
        }
        stats.wait += t.elapsed();
        Ok(())
    };
    for (i, (entries, _)) in buckets.iter().enumerate() {
        let seq = i as u64;
        if i >= n_buf {
            wait_free(conn, &mut in_flight, seq - n_buf as u64, stats)?;
        }
        let from = |e: &BucketEntry| -> *const u8 {
            match &unpacked {
                Some(tensors) => tensors[e.tensor as usize]
                    .0
                    .wrapping_add(e.tensor_offset as usize),
                None => buffers[i % n_buf]
                    .ptr()
                    .wrapping_add(e.buffer_offset as usize),
            }
        };
        let mut sums = Vec::new();
        if unpacked.is_none() {
            let buf = buffers[i % n_buf].ptr();
            let t = Instant::now();
            fill(shard, entries, buf, threads)?;
            if keyed {
                // Before the test-only corruption, which stands for bytes
                // altered on the way.
                sums = digests(key, entries, from, threads);
            }
            if let Some(victim) = &cfg.corrupt_tensor {
                corrupt(&shard.manifest, entries, buf, victim);
            }
            stats.pack += t.elapsed();
        } else if keyed {
            sums = digests(key, entries, from, threads);
        }
        stats.bytes += entries.iter().map(|e| e.len).sum::<u64>();
        conn.send(&Frame::Bucket {
            seq,
            buffer: (i % n_buf) as u32,
            entries: entries.clone(),
        })?;
        if keyed {
            conn.send(&Frame::Digests { seq, digests: sums })?;
        }
        // SAFETY: the buffer is neither refilled nor freed before the send
        // completes (wait_free) or the pump is dropped (end of this function);
        // tensors in memory outlive the session (published copies are held
        // by the offer; added tensors by the trainer's promise).
        unsafe {
            for (k, e) in entries.iter().enumerate() {
                pump.send(tag(seq, k), from(e), e.len as usize)?;
            }
        }
        in_flight.insert(seq, entries.len());
    }
    // END before the last ACKs: an engine finishes its last buckets
    // only once it knows no more are coming.
    conn.send(&Frame::End {
        buckets: buckets.len() as u64,
    })?;
    for i in buckets.len().saturating_sub(n_buf)..buckets.len() {
        wait_free(conn, &mut in_flight, i as u64, stats)?;
    }
    stats.buckets = buckets.len() as u64;
    drop(pump);
    pool.give_back(buffers);
    Ok(())
}
