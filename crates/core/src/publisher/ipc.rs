//! An IPC session's buckets: windows into shared memory the engine maps.
//!
//! A published version's buffer (host shared memory, or a GPU buffer shared
//! by CUDA IPC) is handed over whole and every bucket is a set of windows
//! into it (WINDOWS frames), whatever the requests' shapes: nothing is
//! packed, and the engine copies each block of a strided request straight
//! out of the buffer (a GPU buffer's equally spaced blocks with one 2D copy
//! per run). Slice sums are hashed where the engine reads the bytes: in
//! the host buffer, or read back from the GPU buffer (`device_sums.rs`). Live tensors and files are packed into pooled bucket
//! buffers, which alternate: while the engine applies bucket i, bucket i+1
//! is packed into the other one.

use super::buffers::take_buffers;
use super::device_sums::DeviceSums;
use super::hooks;
use super::offer::Published;
use super::plan::{plan_buckets, request_sizes, windows};
use super::shard::{fill, hash_entry, Shard, BLOCK_BATCH};
use super::stats::SessionStats;
use super::streamer::{BucketSink, SessionIo};
use super::sums::SliceSums;
use crate::checksum::Checksum;
use crate::memory::cuda_ipc::ExportedDeviceBuffer;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{try_vec, Error, Result};
use crate::transport::conn::Conn;
use crate::wire::{check_cuts, BucketEntry, CudaBuffer, Frame, Request};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Stream the `requests` of `shard` to the engine at `conn`.
pub(super) fn stream(io: &mut SessionIo, shard: &mut Shard, requests: &[Request]) -> Result<()> {
    check_cuts(requests, io.cfg.bucket_size as u64, false)?;
    // The corruption test hook needs a packed copy to flip a bit in.
    match (shard.published.clone(), hooks::corrupt_victim(io.cfg)) {
        (Some(Published::Device(_)), Some(_)) => Err(Error::invalid_argument(
            "the corrupt-tensor test option does not apply to a GPU version",
        )),
        // Quantized requests are images of this session's: packed.
        (Some(published), None) if !shard.has_images() => {
            stream_published(io, shard, &published, requests)
        }
        _ => stream_packed(io, shard, requests),
    }
}

/// A published version: its buffer handed over, buckets as WINDOWS into
/// it (the engine copies each block of its requests straight out of it).
/// Slice sums are hashed block by block where the engine reads them: in
/// the host buffer, or read back from the GPU buffer (`device_sums.rs`).
fn stream_published(
    io: &mut SessionIo,
    shard: &mut Shard,
    published: &Published,
    requests: &[Request],
) -> Result<()> {
    let (base, len, handover) = match published {
        Published::Host(b) => (b.ptr() as u64, b.len(), Handover::Shared(vec![&**b])),
        Published::Device(d) => (d.ptr(), d.len(), Handover::Cuda(d)),
    };
    let mut device_sums = match published {
        Published::Device(d) => Some(DeviceSums::new(d.ordinal())),
        Published::Host(_) => None,
    };
    let buckets = windows(shard, base, requests, io.cfg.bucket_size);
    // The engine waits for a bucket's sums before it copies: hashed on
    // every packing thread (a request each).
    let threads = io.cfg.pack_threads();
    handover.send(io.conn)?;
    let mut sink = IpcSink {
        pack: |seq: u64, entries: &[BucketEntry], sums: &mut SliceSums| {
            if sums.any() {
                window_blocks(seq, entries, len as u64, requests, |blocks| {
                    match &mut device_sums {
                        Some(d) => d.hash(sums, base, blocks, requests)?,
                        // SAFETY: the blocks were just checked to lie in the buffer.
                        None => unsafe {
                            sums.hash(blocks, threads, |b| (base + b.buffer_offset) as *const u8)
                        },
                    }
                    Ok(())
                })?;
            }
            Ok(0)
        },
        sums: SliceSums::new(requests)?,
        windows: true,
    };
    io.stream(&buckets, io.cfg.buffers, &mut sink)
}

/// The blocks of WINDOWS bucket `seq` (this publisher's own windows into
/// its buffer of `buffer_len` bytes), each checked to lie in the buffer,
/// handed to `f` a batch at a time in order: walked, not listed whole (a
/// request of one-byte rows would be 32 bytes of list per byte).
fn window_blocks(
    seq: u64,
    entries: &[BucketEntry],
    buffer_len: u64,
    requests: &[Request],
    mut f: impl FnMut(&[BucketEntry]) -> Result<()>,
) -> Result<()> {
    let mut batch: Vec<BucketEntry> = try_vec(BLOCK_BATCH, "hashing a bucket's blocks")?;
    for e in entries {
        let q = &requests[e.request as usize];
        let zero = (e.len == 0).then_some((0, e.offset, 0));
        for (at, offset, len) in zero.into_iter().chain(q.extents(e.offset, e.len)) {
            let start = e.buffer_offset.saturating_add(at);
            if start.saturating_add(len) > buffer_len {
                return Err(Error::invalid_argument(format!(
                    "bucket {seq}: a block of {len} bytes at {start} runs past the \
                     {buffer_len}-byte version buffer"
                )));
            }
            if batch.len() == BLOCK_BATCH {
                f(&batch)?;
                batch.clear();
            }
            batch.push(BucketEntry {
                request: e.request,
                offset,
                len,
                buffer_offset: start,
            });
        }
    }
    match batch.is_empty() {
        true => Ok(()),
        false => f(&batch),
    }
}

/// Live tensors and files: packed into pooled bucket buffers.
fn stream_packed(io: &mut SessionIo, shard: &mut Shard, requests: &[Request]) -> Result<()> {
    let (cfg, pool) = (io.cfg, &io.pool.buffers);
    let buckets = plan_buckets(&request_sizes(requests), cfg.bucket_size);
    let largest = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as usize;
    let n_buf = cfg.buffers.min(buckets.len()).max(1);
    let buffers = take_buffers(pool, n_buf, largest)?;
    let threads = cfg.pack_threads();
    let victim = hooks::corrupt_victim(cfg);
    let mut sink = IpcSink {
        pack: |seq: u64, entries: &[BucketEntry], sums: &mut SliceSums| {
            let slot = seq as usize % n_buf;
            let buf = buffers[slot].ptr();
            pack_and_hash(shard, requests, entries, (buf, threads), sums)?;
            hooks::corrupt(&shard.manifest, requests, entries, buf, victim);
            Ok(slot as u32)
        },
        sums: SliceSums::new(requests)?,
        windows: false,
    };
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

/// Pack `entries` (of `requests`) into the bucket buffer at `buf` on
/// `threads`, and feed those whose requests ask for sums to `sums`. Those
/// of tensors in host memory are packed on the thread hashing their
/// request and hashed as they are copied (each byte read once: a bucket is
/// far larger than the cache, so packing it all and then hashing read
/// every byte twice from memory); the others are packed first, then
/// hashed in the buffer.
fn pack_and_hash(
    shard: &mut Shard,
    requests: &[Request],
    entries: &[BucketEntry],
    (buf, threads): (*mut u8, usize),
    sums: &mut SliceSums,
) -> Result<()> {
    let in_host = shard.in_host_memory().is_some();
    let later = |e: &BucketEntry| in_host && sums.asks(e.request);
    match entries.iter().any(later) {
        true => {
            let now: Vec<BucketEntry> = entries.iter().filter(|e| !later(e)).copied().collect();
            fill(shard, requests, &now, buf, threads)?;
        }
        false => fill(shard, requests, entries, buf, threads)?,
    }
    if !sums.any() {
        return Ok(());
    }
    let tensors = shard.in_host_memory();
    let buf = SendPtr(buf);
    let at = |e: &BucketEntry| buf.wrapping_add(e.buffer_offset as usize);
    let feed = |k: usize, h: &mut Checksum| {
        let e = &entries[k];
        // SAFETY: entry k's range of the buffer is its own (planned from
        // the buffer's size), its request inside its tensor (checked when
        // WANT came); without tensors it was just packed there.
        unsafe { hash_entry(tensors, requests, e, at(e), h) }
    };
    sums.hash_on(entries, threads, &feed);
    Ok(())
}

/// IPC buckets: the engine reads them from the buffers it mapped, so
/// nothing goes out but the BUCKET (or WINDOWS) frame and SUMS. `pack`
/// gets bucket `seq` ready (and hashed into the sums) and returns the
/// buffer it is in.
struct IpcSink<F> {
    pack: F,
    sums: SliceSums,
    /// The entries are windows into a published version (WINDOWS frames).
    windows: bool,
}

impl<F> BucketSink for IpcSink<F>
where
    F: FnMut(u64, &[BucketEntry], &mut SliceSums) -> Result<u32>,
{
    const END_BEFORE_LAST_ACKS: bool = false;

    fn prepare(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        stats: &mut SessionStats,
    ) -> Result<u32> {
        let t = Instant::now();
        let buffer = (self.pack)(seq, entries, &mut self.sums)?;
        stats.pack += t.elapsed();
        Ok(buffer)
    }

    fn announce(&self, seq: u64, buffer: u32, entries: &[BucketEntry]) -> Frame {
        let entries = entries.to_vec();
        match self.windows {
            true => Frame::Windows {
                seq,
                buffer,
                entries,
            },
            false => Frame::Bucket {
                seq,
                buffer,
                entries,
            },
        }
    }

    fn send(
        &mut self,
        conn: &mut Conn,
        seq: u64,
        _: &[BucketEntry],
        _: &mut SessionStats,
    ) -> Result<()> {
        match self.sums.frame(seq) {
            Some(f) => conn.send(&f),
            None => Ok(()),
        }
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
