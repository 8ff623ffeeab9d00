//! The one bucket streamer of IPC and network sessions: announce bucket
//! after bucket (a BUCKET frame each), at most `in_flight` unacknowledged,
//! and END. How a bucket's bytes get ready and go out is the sink's
//! ([`BucketSink`]: `ipc::IpcSink`, `net::NetSink`); the window of
//! acknowledgements and the order of the frames are the streamer's.

use super::buffers::Pools;
use super::config::PublisherConfig;
use super::stats::SessionStats;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::wire::{BucketEntry, Frame};
use std::time::Instant;

/// A bucket as planned: its entries, and the bytes of its buffer they span.
pub(super) type Bucket = (Vec<BucketEntry>, u64);

/// How one session's buckets go out.
pub(super) trait BucketSink {
    /// Whether END goes out before the acknowledgements of the last
    /// buckets (else after every one).
    ///
    /// An IPC engine applies and acknowledges each bucket as it reads its
    /// BUCKET frame, so END can wait for every ACK and then tells the
    /// engine that the publisher is done with every buffer. A network
    /// engine keeps several buckets on the wire and finishes its last ones
    /// only once it knows no more are coming: END must come first, or both
    /// sides wait for each other until the bucket timeout.
    const END_BEFORE_LAST_ACKS: bool;

    /// Get bucket `seq`'s bytes ready (pack them, or nothing when they are
    /// sent from where they are, or `send` packs them) and return the
    /// buffer it is in. Adds the time spent packing to `stats.pack`.
    fn prepare(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<u32>;

    /// The frame announcing bucket `seq` in `buffer`: BUCKET, or WINDOWS
    /// for windows into a published version.
    fn announce(&self, seq: u64, buffer: u32, entries: &[BucketEntry]) -> Frame {
        Frame::Bucket {
            seq,
            buffer,
            entries: entries.to_vec(),
        }
    }

    /// Send bucket `seq`'s bytes, right after its BUCKET frame (IPC:
    /// nothing, the engine reads the shared buffer). Adds the time spent
    /// packing to `stats.pack`.
    fn send(
        &mut self,
        conn: &mut Conn,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<()>;

    /// Wait, until `deadline`, for bucket `seq`'s buffer to be free again,
    /// once the engine acknowledged it (network: UCX reports its sends
    /// complete).
    fn release(&mut self, conn: &mut Conn, seq: u64, deadline: Instant) -> Result<()>;
}

/// What a session's buckets go out with: its connection, the publisher's
/// config and bucket buffers, the deadline of the next acknowledgement, and
/// the session's figures. IPC and network sessions take the same parts.
pub(super) struct SessionIo<'a> {
    pub conn: &'a mut Conn,
    pub cfg: &'a PublisherConfig,
    pub pool: &'a Pools,
    pub ack_deadline: &'a dyn Fn() -> Instant,
    /// Wait until the FP8 images a bucket's entries hold are made
    /// (`quantize_behind.rs`).
    pub images_ready: &'a dyn Fn(&[BucketEntry]) -> Result<()>,
    pub stats: &'a mut SessionStats,
}

impl SessionIo<'_> {
    /// Stream `buckets` through `sink` on this session, at most
    /// `in_flight` unacknowledged; each acknowledgement within
    /// `ack_deadline()`.
    pub fn stream<S: BucketSink>(
        &mut self,
        buckets: &[Bucket],
        in_flight: usize,
        sink: &mut S,
    ) -> Result<()> {
        let (conn, stats) = (&mut *self.conn, &mut *self.stats);
        let in_flight = in_flight.max(1);
        let mut window = AckWindow {
            acked: 0,
            ack_deadline: self.ack_deadline,
        };
        for (i, (entries, _)) in buckets.iter().enumerate() {
            let seq = i as u64;
            if i >= in_flight {
                window.wait_free(conn, sink, stats)?;
            }
            (self.images_ready)(entries)?;
            let buffer = sink.prepare(seq, entries, stats)?;
            stats.bytes += entries.iter().map(|e| e.len).sum::<u64>();
            conn.send(&sink.announce(seq, buffer, entries))?;
            sink.send(conn, seq, entries, stats)?;
        }
        let end = Frame::End {
            buckets: buckets.len() as u64,
        };
        if S::END_BEFORE_LAST_ACKS {
            conn.send(&end)?;
        }
        for _ in buckets.len().saturating_sub(in_flight)..buckets.len() {
            window.wait_free(conn, sink, stats)?;
        }
        if !S::END_BEFORE_LAST_ACKS {
            conn.send(&end)?;
        }
        stats.buckets = buckets.len() as u64;
        Ok(())
    }
}

/// The acknowledgements: they come in order, one per bucket.
struct AckWindow<'a> {
    /// Buckets acknowledged so far: the next ACK must name this one.
    acked: u64,
    ack_deadline: &'a dyn Fn() -> Instant,
}

impl AckWindow<'_> {
    /// Wait for the oldest unacknowledged bucket's ACK, then for its buffer
    /// to be free; the time counts as `stats.wait`.
    fn wait_free<S: BucketSink>(
        &mut self,
        conn: &mut Conn,
        sink: &mut S,
        stats: &mut SessionStats,
    ) -> Result<()> {
        let t = Instant::now();
        let deadline = (self.ack_deadline)();
        let seq = self.acked;
        match conn.recv(deadline)? {
            Frame::Ack { seq: s } if s == seq => self.acked += 1,
            Frame::Ack { seq: s } => {
                return Err(Error::peer(format!(
                    "acknowledged bucket {s}, expected {seq}"
                )))
            }
            other => return Err(Error::peer(format!("expected ACK, got {}", other.name()))),
        }
        sink.release(conn, seq, deadline)?;
        stats.wait += t.elapsed();
        Ok(())
    }
}
