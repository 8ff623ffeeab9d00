//! A network session's buckets, sent over UCX to the engine's worker as one
//! message per entry (`wire::split_entries`: at most `wire::NET_MESSAGE`
//! bytes, one block of a request or several small ones packed): the engine
//! receives each into its staging slot at the entry's buffer offset
//! (staged), or straight into its params (`direct`: gdr, or host landing)
//! when it lands there in one piece, as it decides alone.
//!
//! Tensors in this process's memory (published copies, tensors the trainer
//! added) are not packed where a message is one block: it is sent from the
//! tensor itself. Messages of packed small blocks are copied into the
//! bucket buffer, back to back; tensors read from files are packed whole.
//!
//! The engine names the bucket size and how many buckets may be in flight
//! (READY). A bucket is packed, hashed and sent 8 MiB at a time
//! (`PACK_CHUNK`), each chunk on the wire while the next is packed, with
//! the SUMS of the parts a chunk completes right after it; its buffer is
//! refilled only after the engine acknowledged the bucket and UCX reported
//! the send complete.
//!
//! When READY asks for keyed digests, each BUCKET frame is followed by a
//! DIGESTS frame: the keyed BLAKE3 digest of each entry's bytes (the key is
//! the session's, `transport::auth`), computed from the bytes as packed or
//! as held, before anything could alter them on the way.

use super::buffers::take_buffers;
use super::deltas::Messages;
use super::engine_link::EngineLink;
use super::hooks;
use super::plan::{plan_buckets, request_sizes};
use super::shard::{fill, hash_entry, Shard};
use super::stats::SessionStats;
use super::streamer::{Bucket, BucketSink, SessionIo};
use super::sums::SliceSums;
use crate::checksum::Checksum;
use crate::checksum::KEYED;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::ucx::Pump;
use crate::wire::{
    check_cuts, delta_tag, message_source, message_tag as tag, split_entries, BucketEntry, Frame,
    Request,
};
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

/// Stream the `requests` of `shard` to the engine at `conn`, whose bucket
/// bytes' digests are keyed with `key`, through `engine`'s worker.
pub(super) fn stream(
    io: &mut SessionIo,
    (key, engine): (&[u8; KEYED], EngineLink),
    shard: &mut Shard,
    (requests, deltas): (&[Request], &Messages),
) -> Result<()> {
    let (cfg, pool) = (io.cfg, &io.pool.buffers);
    let EngineLink { pump, ready } = engine;
    check_cuts(requests, ready.bucket_size, true)
        .map_err(|e| e.context(format!("{}'s READY", io.conn.peer())))?;
    let buckets = plan_messages(requests, ready.bucket_size);
    let victim = hooks::corrupt_victim(cfg);
    // Tensors already in memory are sent from the tensors themselves where
    // a message is one block: only packed small blocks need a bucket
    // buffer. (The corruption test hook needs a packed copy to flip a bit
    // in.)
    let tensors: Option<Vec<SendPtr>> = shard
        .in_memory()
        .filter(|_| victim.is_none())
        .map(<[SendPtr]>::to_vec);
    let largest = buffer_bytes(&buckets, requests, tensors.is_some());
    let n_buf = buffers_in_flight(ready.depth, buckets.len(), largest);
    let buffers = match largest {
        0 => Vec::new(),
        n => take_buffers(pool, n_buf, n as usize)?,
    };
    send_deltas(&pump, deltas, (io.ack_deadline)())
        .map_err(|e| e.context(format!("sending deltas to {}", io.conn.peer())))?;
    // The sink borrows the buffers, so it (and its pump, whose sends read
    // them) is gone before they are freed or pooled.
    let mut sink = NetSink {
        pump,
        shard,
        requests,
        origin: Origin {
            tensors,
            buffers: &buffers,
            slots: n_buf,
        },
        key,
        keyed: ready.keyed,
        threads: cfg.pack_threads(),
        victim,
        digests: Vec::new(),
        bucket: Prepared::default(),
        sums: SliceSums::new(requests)?,
        in_flight: HashMap::new(),
    };
    io.stream(&buckets, n_buf, &mut sink)?;
    drop(sink);
    pool.give_back(buffers);
    Ok(())
}

/// The bucket buffers a session packs into: as many as the engine lets be
/// in flight (READY's depth, 1 to 8) and there are buckets, but no more
/// than [`SESSION_BUFFER_BYTES`] of them beyond one: the engine's bucket
/// size (up to 16 GiB) would otherwise set the publisher's memory (8
/// buffers of 16 GiB). Fewer in flight than the engine allows is within
/// the protocol.
fn buffers_in_flight(depth: usize, buckets: usize, largest: u64) -> usize {
    let by_bytes = SESSION_BUFFER_BYTES / largest.max(1);
    depth.min(buckets).min(by_bytes as usize).max(1)
}

/// The bucket buffers' bytes a session holds at most, beyond one buffer
/// (see [`buffers_in_flight`]): twice an engine's default (2 buffers of
/// 512 MiB), so that engines with buckets of up to 1 GiB keep two in
/// flight.
const SESSION_BUFFER_BYTES: u64 = 2 << 30;

/// Send each delta as one message (`wire::delta_tag`), before any bucket,
/// and wait until UCX has sent them all (the engine receives them a batch
/// at a time, so a delta's send completes once its batch is posted).
fn send_deltas(pump: &Pump, deltas: &Messages, deadline: Instant) -> Result<()> {
    for (k, d) in deltas {
        // SAFETY: `deltas` outlives the sends, which complete (or fail)
        // before this returns, or the pump is dropped first.
        unsafe { pump.send(delta_tag(*k), d.as_ptr(), d.len()) }?;
    }
    let mut left = deltas.len();
    while left > 0 {
        match pump.next(deadline)? {
            Some(c) if c.tag >> 32 == u32::MAX as u64 => {
                c.result?;
                left -= 1;
            }
            Some(c) => return Err(Error::peer(format!("UCX: a completion for tag {}", c.tag))),
            None => return Err(Error::timeout("the engine took no delta in time")),
        }
    }
    Ok(())
}

/// The buckets, each entry one message: no longer than `NET_MESSAGE`, and
/// one block of its request (sent from where it is) or several small ones
/// (packed). UCX tagged messages are contiguous buffers, and a message per
/// small block (a row of a column split) costs more than its bytes.
fn plan_messages(requests: &[Request], bucket_size: u64) -> Vec<Bucket> {
    let mut buckets = plan_buckets(&request_sizes(requests), bucket_size as usize);
    for (entries, _) in &mut buckets {
        *entries = split_entries(entries, requests);
    }
    buckets
}

/// The bucket buffer bytes a session needs: every bucket's when all is
/// packed; with tensors in memory, the most that one bucket's packed
/// messages hold (0: no buffer at all).
fn buffer_bytes(buckets: &[Bucket], requests: &[Request], in_memory: bool) -> u64 {
    let need = |(entries, used): &Bucket| match in_memory {
        false => (*used).max(1),
        true => entries
            .iter()
            .filter(|e| message_source(e, requests).is_none())
            .map(|e| e.len)
            .sum(),
    };
    buckets.iter().map(need).max().unwrap_or(0)
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
    /// The bucket prepared last: where each message is sent from, and what
    /// is still to pack.
    bucket: Prepared,
    /// Slice checksums asked for (SUMS after the messages completing them).
    sums: SliceSums,
    /// Messages of each bucket still on the wire.
    in_flight: HashMap<u64, usize>,
}

/// Where a bucket's bytes are sent from.
struct Origin<'a> {
    /// Where each tensor is in memory: messages of one block are sent from
    /// there (None: every message is packed).
    tensors: Option<Vec<SendPtr>>,
    /// Bucket buffers, when anything is packed.
    buffers: &'a [SharedBuffer],
    /// Buckets in flight: bucket `seq` is in slot `seq % slots` (the
    /// engine's staging slot, and the bucket buffer when packing).
    slots: usize,
}

impl Origin<'_> {
    fn slot(&self, seq: u64) -> usize {
        seq as usize % self.slots
    }

    /// Where each message of bucket `seq` is sent from, and the messages
    /// to pack into its bucket buffer first (at their buffer offsets there:
    /// the bucket's own when all is packed, else back to back): entry
    /// indices, and the entries as packed.
    fn layout(
        &self,
        seq: u64,
        entries: &[BucketEntry],
        requests: &[Request],
    ) -> (Vec<SendPtr>, Vec<usize>, Vec<BucketEntry>) {
        let buf = self.buffers.get(self.slot(seq)).map(SharedBuffer::ptr);
        let in_buf = |at: u64| {
            SendPtr(
                buf.expect("a buffer to pack into")
                    .wrapping_add(at as usize),
            )
        };
        let mut from = Vec::with_capacity(entries.len());
        let (mut ks, mut pack, mut packed) = (Vec::new(), Vec::new(), 0);
        for (k, e) in entries.iter().enumerate() {
            let at = match &self.tensors {
                None => e.buffer_offset,
                Some(tensors) => match message_source(e, requests) {
                    Some(at) => {
                        let t = tensors[requests[e.request as usize].tensor as usize];
                        from.push(SendPtr(t.0.wrapping_add(at as usize)));
                        continue;
                    }
                    None => {
                        packed += e.len;
                        packed - e.len
                    }
                },
            };
            from.push(in_buf(at));
            ks.push(k);
            pack.push(BucketEntry {
                buffer_offset: at,
                ..*e
            });
        }
        (from, ks, pack)
    }
}

/// A bucket's messages: where each is sent from (`from`, by entry), and
/// those packed into the bucket buffer at `buf` (entry indices `ks`, as
/// packed `pack`).
#[derive(Default)]
struct Prepared {
    from: Vec<SendPtr>,
    ks: Vec<usize>,
    pack: Vec<BucketEntry>,
    buf: Option<SendPtr>,
}

/// How many bytes of messages are packed and hashed before they are sent:
/// small enough that a packed message is still in cache when it is hashed
/// and that the wire is busy while the next ones are packed.
const PACK_CHUNK: u64 = 8 << 20;

impl NetSink<'_> {
    /// Pack the bucket's messages `range` (those not sent from where they
    /// are) and hash them (slice sums).
    ///
    /// A message of a tensor in memory whose request asks for a sum is
    /// packed on the thread hashing that request, right before its hash,
    /// while it is in cache; the others first, here.
    fn pack_and_hash(&mut self, entries: &[BucketEntry], range: Range<usize>) -> Result<()> {
        let b = &self.bucket;
        let in_memory = self.shard.in_memory().is_some();
        let mut now = Vec::new();
        let mut later = vec![false; range.len()];
        for (&k, e) in b.ks.iter().zip(&b.pack) {
            if range.contains(&k) {
                match in_memory && self.sums.asks(e.request) {
                    true => later[k - range.start] = true,
                    false => now.push(*e),
                }
            }
        }
        if let Some(buf) = b.buf.filter(|_| !now.is_empty()) {
            fill(self.shard, self.requests, &now, buf.0, self.threads)?;
        }
        let tensors = self.shard.in_memory();
        let (requests, first) = (self.requests, range.start);
        let from = &b.from[range.clone()];
        let feed = |k: usize, h: &mut Checksum| {
            let (e, at) = (&entries[first + k], from[k]);
            // SAFETY: message first + k has its own `len` bytes at its
            // `from` in the bucket buffer (`layout` packs messages back to
            // back, so no other thread writes them), and its request lies
            // inside its tensor (checked when WANT came); not packed here,
            // its bytes are held at `from` (packed above, or a tensor's own).
            unsafe { hash_entry(tensors.filter(|_| later[k]), requests, e, at, h) }
        };
        self.sums.hash_on(&entries[range], self.threads, &feed);
        Ok(())
    }

    /// The corruption test hook on the packed messages of `range`, once
    /// they are hashed (it stands for bytes altered on the way).
    fn corrupt(&self, range: Range<usize>) {
        let b = &self.bucket;
        if let (Some(buf), Some(_)) = (b.buf, self.victim) {
            let mine: Vec<BucketEntry> = (b.ks.iter().zip(&b.pack))
                .filter(|(k, _)| range.contains(k))
                .map(|(_, e)| *e)
                .collect();
            let manifest = &self.shard.manifest;
            hooks::corrupt(manifest, self.requests, &mine, buf.0, self.victim);
        }
    }
}

/// The bucket's entries cut into runs of about `PACK_CHUNK` bytes.
fn chunks(entries: &[BucketEntry]) -> Vec<Range<usize>> {
    let (mut out, mut start, mut bytes) = (Vec::new(), 0, 0);
    for (k, e) in entries.iter().enumerate() {
        bytes += e.len;
        if bytes >= PACK_CHUNK || k + 1 == entries.len() {
            out.push(start..k + 1);
            (start, bytes) = (k + 1, 0);
        }
    }
    out
}

impl BucketSink for NetSink<'_> {
    const END_BEFORE_LAST_ACKS: bool = true;

    /// Lay the bucket out. With keyed digests, which go out before its
    /// bytes, pack and hash all of it now; else `send` does, a chunk at a
    /// time.
    fn prepare(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<u32> {
        let slot = self.origin.slot(seq);
        let (from, ks, pack) = self.origin.layout(seq, entries, self.requests);
        let buf = self.origin.buffers.get(slot).map(|b| SendPtr(b.ptr()));
        self.bucket = Prepared {
            buf: buf.filter(|_| !pack.is_empty()),
            from,
            ks,
            pack,
        };
        if self.keyed {
            let t = Instant::now();
            self.pack_and_hash(entries, 0..entries.len())?;
            self.digests = digests(self.key, entries, &self.bucket.from, self.threads);
            self.corrupt(0..entries.len());
            stats.pack += t.elapsed();
        }
        stats.messages += entries.len() as u64;
        Ok(slot as u32)
    }

    /// DIGESTS (keyed), then the messages, a chunk at a time: each chunk
    /// packed and hashed, then sent while the next is packed, then SUMS of
    /// the parts it completes (the engine takes it before it finishes
    /// them).
    fn send(
        &mut self,
        conn: &mut Conn,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<()> {
        if self.keyed {
            let digests = std::mem::take(&mut self.digests);
            conn.send(&Frame::Digests { seq, digests })?;
        }
        for range in chunks(entries) {
            // Keyed, `prepare` packed and hashed all of it.
            if !self.keyed {
                let t = Instant::now();
                self.pack_and_hash(entries, range.clone())?;
                self.corrupt(range.clone());
                stats.pack += t.elapsed();
            }
            // SAFETY: the buffer is neither refilled nor freed before the
            // send completes (`release`) or the pump is dropped (with the
            // sink, before the buffers); tensors in memory outlive the
            // session (published copies are held by the offer; added
            // tensors by the trainer's promise).
            unsafe {
                for k in range {
                    let (e, at) = (&entries[k], self.bucket.from[k]);
                    self.pump.send(tag(seq, k), at.0, e.len as usize)?;
                }
            }
            // The sums of the parts this chunk completes, so the engine
            // finishes them while their last bytes are in its cache.
            if let Some(sums) = self.sums.frame(seq) {
                conn.send(&sums)?;
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

/// The keyed digest of each message's bytes (at `from`), on `threads`.
fn digests(
    key: &[u8; KEYED],
    entries: &[BucketEntry],
    from: &[SendPtr],
    threads: usize,
) -> Vec<[u8; KEYED]> {
    let one = |(e, at): (&BucketEntry, &SendPtr)| {
        // SAFETY: the message's bytes are packed (or held) and unchanged
        // until their send completes.
        let bytes = unsafe { std::slice::from_raw_parts(at.0, e.len as usize) };
        crate::checksum::keyed(key, bytes)
    };
    let per = entries.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = entries
            .chunks(per)
            .zip(from.chunks(per))
            .map(|(part, at)| s.spawn(move || part.iter().zip(at).map(one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("hashing does not panic"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's depth and the buckets bound the buffers in flight, and
    /// so do their bytes: 8 buffers of 16 GiB asked for are one; of 512
    /// MiB, 4; of 64 MiB, 8; none packed (sent from the tensors), the depth.
    #[test]
    fn the_publishers_buffer_bytes_bound_the_buffers_in_flight() {
        assert_eq!(buffers_in_flight(8, 400_000, 16 << 30), 1);
        assert_eq!(buffers_in_flight(8, 400_000, 1 << 30), 2);
        assert_eq!(buffers_in_flight(8, 400_000, 512 << 20), 4);
        assert_eq!(buffers_in_flight(8, 400_000, 64 << 20), 8);
        assert_eq!(buffers_in_flight(8, 3, 64 << 20), 3);
        assert_eq!(buffers_in_flight(4, 400_000, 0), 4);
        assert_eq!(buffers_in_flight(8, 0, 0), 1);
    }
}
