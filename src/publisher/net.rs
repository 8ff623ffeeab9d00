//! A network session's buckets, sent over UCX to the engine's worker as one
//! message per entry (entries split to at most `wire::NET_MESSAGE` bytes):
//! the engine receives each into its staging slot at the entry's buffer
//! offset (staged), or straight into its params (`direct`: gdr, or host
//! landing), as it decides alone.
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

use super::buffers::take_buffers;
use super::hooks;
use super::plan::{plan_buckets, request_sizes};
use super::shard::{fill, Shard};
use super::stats::SessionStats;
use super::streamer::{Bucket, BucketSink, SessionIo};
use super::sums::SliceSums;
use crate::checksum::KEYED;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::ucx::Pump;
use crate::wire::{
    message_tag as tag, split_entries, BucketEntry, Frame, Request, ALIGN, MAX_BUFFERS,
};
use std::collections::HashMap;
use std::time::Instant;

/// Largest bucket an engine may ask for.
const MAX_BUCKET: u64 = 16 << 30;

/// What the engine asked for in its READY.
struct Ready {
    address: Vec<u8>,
    bucket_size: u64,
    depth: usize,
    keyed: bool,
}

/// Stream the `requests` of `shard` to the engine at `conn`, whose bucket
/// bytes' digests are keyed with `key`.
pub(super) fn stream(
    io: &mut SessionIo,
    key: &[u8; KEYED],
    shard: &mut Shard,
    requests: &[Request],
) -> Result<()> {
    let (cfg, pool) = (io.cfg, io.pool);
    let ready = recv_ready(io.conn, (io.ack_deadline)())?;
    let buckets = plan_messages(requests, ready.bucket_size);
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = ready.depth.min(buckets.len()).max(1);
    let victim = hooks::corrupt_victim(cfg);
    // Tensors already in memory are sent from the tensors themselves: each
    // message is one entry, so nothing needs packing, and no bucket buffers
    // are taken. (The corruption test hook needs a packed copy to flip a
    // bit in.)
    let unpacked: Option<Vec<SendPtr>> = shard
        .in_memory()
        .filter(|_| victim.is_none())
        .map(<[SendPtr]>::to_vec);
    let buffers = match unpacked {
        Some(_) => Vec::new(),
        None => take_buffers(pool, n_buf, largest)?,
    };
    let pump = Pump::start("publisher")?;
    pump.connect(&ready.address)
        .map_err(|e| e.context(format!("reaching {}", io.conn.peer())))?;
    // The sink borrows the buffers, so it (and its pump, whose sends read
    // them) is gone before they are freed or pooled.
    let mut sink = NetSink {
        pump,
        shard,
        requests,
        origin: Origin {
            unpacked,
            buffers: &buffers,
            slots: n_buf,
        },
        key,
        keyed: ready.keyed,
        threads: cfg.pack_threads(),
        victim,
        digests: Vec::new(),
        sums: SliceSums::new(requests),
        in_flight: HashMap::new(),
    };
    io.stream(&buckets, n_buf, &mut sink)?;
    drop(sink);
    pool.give_back(buffers);
    Ok(())
}

/// Read the engine's READY and check what it asks for. Staged or direct,
/// the messages are the same: the engine alone decides where each lands
/// (READY's direct flag is informational).
fn recv_ready(conn: &mut Conn, deadline: Instant) -> Result<Ready> {
    let ready = match conn.recv(deadline)? {
        Frame::Ready {
            address,
            bucket_size,
            depth,
            keyed,
            ..
        } => Ready {
            address,
            bucket_size,
            depth: depth as usize,
            keyed,
        },
        other => return Err(Error::peer(format!("expected READY, got {}", other.name()))),
    };
    let (bucket_size, depth) = (ready.bucket_size, ready.depth);
    if !(ALIGN..=MAX_BUCKET).contains(&bucket_size) || depth == 0 || depth > MAX_BUFFERS {
        return Err(Error::peer(format!(
            "{} asked for buckets of {bucket_size} bytes, {depth} in flight ({ALIGN} to {MAX_BUCKET} bytes, 1 to {MAX_BUFFERS} allowed)",
            conn.peer()
        )));
    }
    Ok(ready)
}

/// The buckets, each entry one message: no longer than `NET_MESSAGE`, and
/// within one block of its request. A strided request goes as a message
/// per block, sent from where the block is (nothing packed): the engine
/// lands each message in one contiguous place (its param or staging), and
/// UCX tagged messages are contiguous buffers.
fn plan_messages(requests: &[Request], bucket_size: u64) -> Vec<Bucket> {
    let mut buckets = plan_buckets(&request_sizes(requests), bucket_size as usize);
    for (entries, _) in &mut buckets {
        *entries = split_entries(entries, requests);
    }
    buckets
}

/// Network buckets: UCX messages to the engine's worker, one per entry,
/// after the BUCKET frame (and its DIGESTS when keyed).
struct NetSink<'a> {
    pump: Pump,
    shard: &'a mut Shard,
    requests: &'a [Request],
    origin: Origin<'a>,
    key: &'a [u8; KEYED],
    keyed: bool,
    threads: usize,
    victim: Option<&'a str>,
    /// The digests of the bucket prepared last, sent with it.
    digests: Vec<[u8; KEYED]>,
    /// Slice checksums asked for (SUMS after the BUCKET frame).
    sums: SliceSums,
    /// Messages of each bucket still on the wire.
    in_flight: HashMap<u64, usize>,
}

/// Where a bucket's bytes are sent from.
struct Origin<'a> {
    /// Where each tensor is in memory, when sent without packing.
    unpacked: Option<Vec<SendPtr>>,
    /// Bucket buffers, when packing.
    buffers: &'a [SharedBuffer],
    /// Buckets in flight: bucket `seq` is in slot `seq % slots` (the
    /// engine's staging slot, and the bucket buffer when packing).
    slots: usize,
}

impl Origin<'_> {
    fn slot(&self, seq: u64) -> usize {
        seq as usize % self.slots
    }

    /// Where entry `e` (of `requests`; one block's bytes at most) of
    /// bucket `seq` is sent from.
    fn at(&self, seq: u64, e: &BucketEntry, requests: &[Request]) -> *const u8 {
        match &self.unpacked {
            Some(tensors) => {
                let q = &requests[e.request as usize];
                let from = q.pieces(e.offset, e.len).first().map_or(0, |p| p.0);
                tensors[q.tensor as usize].0.wrapping_add(from as usize)
            }
            None => self.buffers[self.slot(seq)]
                .ptr()
                .wrapping_add(e.buffer_offset as usize),
        }
    }
}

impl BucketSink for NetSink<'_> {
    const END_BEFORE_LAST_ACKS: bool = true;

    fn prepare(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<u32> {
        let slot = self.origin.slot(seq);
        let (origin, requests) = (&self.origin, self.requests);
        let from = |e: &BucketEntry| origin.at(seq, e, requests);
        let t = Instant::now();
        if origin.unpacked.is_none() {
            let buf = origin.buffers[slot].ptr();
            fill(self.shard, requests, entries, buf, self.threads)?;
        }
        // Before the corruption test hook, which stands for bytes altered
        // on the way; right after packing, while the bytes are in cache.
        if self.keyed {
            self.digests = digests(self.key, entries, from, self.threads);
        }
        // SAFETY: each entry's bytes are packed, or held where `at` says.
        unsafe { self.sums.hash(entries, from) };
        if origin.unpacked.is_none() {
            let buf = origin.buffers[slot].ptr();
            hooks::corrupt(&self.shard.manifest, requests, entries, buf, self.victim);
            stats.pack += t.elapsed();
        }
        Ok(slot as u32)
    }

    fn send(&mut self, conn: &mut Conn, seq: u64, entries: &[BucketEntry]) -> Result<()> {
        if self.keyed {
            let digests = std::mem::take(&mut self.digests);
            conn.send(&Frame::Digests { seq, digests })?;
        }
        if let Some(sums) = self.sums.frame(seq) {
            conn.send(&sums)?;
        }
        // SAFETY: the buffer is neither refilled nor freed before the send
        // completes (`release`) or the pump is dropped (with the sink, before
        // the buffers); tensors in memory outlive the session (published
        // copies are held by the offer; added tensors by the trainer's
        // promise).
        unsafe {
            for (k, e) in entries.iter().enumerate() {
                self.pump.send(
                    tag(seq, k),
                    self.origin.at(seq, e, self.requests),
                    e.len as usize,
                )?;
            }
        }
        self.in_flight.insert(seq, entries.len());
        Ok(())
    }

    fn release(&mut self, conn: &mut Conn, seq: u64, deadline: Instant) -> Result<()> {
        while self.in_flight.get(&seq).copied().unwrap_or(0) > 0 {
            let Some(c) = self.pump.next(deadline)? else {
                return Err(Error::timeout(format!(
                    "bucket {seq} to {} was not sent within the bucket timeout",
                    conn.peer()
                )));
            };
            c.result
                .map_err(|e| e.context(format!("sending to {}", conn.peer())))?;
            if let Some(n) = self.in_flight.get_mut(&(c.tag >> 32)) {
                *n -= 1;
            }
        }
        Ok(())
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
