//! An IPC session's buckets: windows into shared memory the engine maps.
//!
//! A published version's buffer (host shared memory, or a GPU buffer shared
//! by CUDA IPC) is handed over whole and every bucket is a set of windows
//! into it: nothing is packed. Live tensors and files are packed into
//! pooled bucket buffers, which alternate: while the engine applies bucket
//! i, bucket i+1 is packed into the other one.

use super::buffers::take_buffers;
use super::hooks;
use super::offer::Published;
use super::plan::{plan_buckets, windows};
use super::shard::{fill, Shard};
use super::stats::SessionStats;
use super::streamer::{BucketSink, SessionIo};
use crate::memory::cuda_ipc::ExportedDeviceBuffer;
use crate::memory::shared::SharedBuffer;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::wire::{BucketEntry, CudaBuffer, Frame};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Stream the `want`ed tensors of `shard` to the engine at `conn`.
pub(super) fn stream(io: &mut SessionIo, shard: &mut Shard, want: &[u32]) -> Result<()> {
    // The corruption test hook needs a packed copy to flip a bit in.
    match (shard.published.clone(), hooks::corrupt_victim(io.cfg)) {
        (Some(Published::Device(_)), Some(_)) => Err(Error::invalid_argument(
            "the corrupt-tensor test option does not apply to a GPU version",
        )),
        (Some(published), None) => stream_published(io, shard, &published, want),
        _ => stream_packed(io, shard, want),
    }
}

/// A published version: its buffer handed over, buckets as windows into it.
fn stream_published(
    io: &mut SessionIo,
    shard: &Shard,
    published: &Published,
    want: &[u32],
) -> Result<()> {
    let (base, handover) = match published {
        Published::Host(b) => (b.ptr() as u64, Handover::Shared(vec![&**b])),
        Published::Device(d) => (d.ptr(), Handover::Cuda(d)),
    };
    let buckets = windows(shard, base, want, io.cfg.bucket_size);
    handover.send(io.conn)?;
    let mut sink = IpcSink(|_: u64, _: &[BucketEntry]| Ok(0));
    io.stream(&buckets, io.cfg.buffers, &mut sink)
}

/// Live tensors or files: packed into pooled bucket buffers.
fn stream_packed(io: &mut SessionIo, shard: &mut Shard, want: &[u32]) -> Result<()> {
    let (cfg, pool) = (io.cfg, io.pool);
    let buckets = plan_buckets(&shard.manifest, want, cfg.bucket_size);
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = cfg.buffers.min(buckets.len()).max(1);
    let buffers = take_buffers(pool, n_buf, largest)?;
    let threads = cfg.pack_threads();
    let victim = hooks::corrupt_victim(cfg);
    let mut sink = IpcSink(|seq: u64, entries: &[BucketEntry]| {
        let slot = seq as usize % n_buf;
        let buf = &buffers[slot];
        fill(shard, entries, buf.ptr(), threads)?;
        hooks::corrupt(&shard.manifest, entries, buf.ptr(), victim);
        Ok(slot as u32)
    });
    let r = Handover::Shared(buffers.iter().collect())
        .send(io.conn)
        .and_then(|()| io.stream(&buckets, n_buf, &mut sink));
    // A clean session's buffers serve the next one; a failed session's are
    // freed at once (the engine may be gone, or still mapping them).
    if r.is_ok() {
        pool.give_back(buffers);
    }
    r
}

/// IPC buckets: the engine reads them from the buffers it mapped, so
/// nothing goes out but the BUCKET frame. `0` packs bucket `seq` and
/// returns the buffer it is in.
struct IpcSink<F>(F);

impl<F: FnMut(u64, &[BucketEntry]) -> Result<u32>> BucketSink for IpcSink<F> {
    const END_BEFORE_LAST_ACKS: bool = false;

    fn prepare(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<u32> {
        let t = Instant::now();
        let buffer = (self.0)(seq, entries)?;
        stats.pack += t.elapsed();
        Ok(buffer)
    }

    fn send(&mut self, _: &mut Conn, _: u64, _: &[BucketEntry]) -> Result<()> {
        Ok(())
    }

    fn release(&mut self, _: &mut Conn, _: u64, _: Instant) -> Result<()> {
        Ok(())
    }
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
