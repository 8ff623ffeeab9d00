//! The IPC source: a trainer's publisher on the same node serves buckets in
//! shared memory over a Unix socket (protocol in `docs/wire.md`).
//!
//! The engine connects, checks the publisher's uid (SO_PEERCRED), says which
//! rank it is, gets its manifest, tells which tensors it wants (after the
//! plan, so skipped tensors are never packed), receives the shared buffers
//! once, then applies bucket after bucket, acknowledging each so the
//! publisher can refill its buffer while the next one is applied.
//!
//! Trust: the socket's mode and the publisher's uid decide who may connect;
//! a publisher of the same uid is trusted with the bytes but not with the
//! engine's memory. Every bucket entry is range-checked against its buffer
//! and the plan; a buffer is mapped, never faulted in whole (only the
//! windows a bucket reads are), so a sparse buffer announced far larger
//! than the update costs address space, not memory; callback tensors are
//! bounded by the manager's `callback_staging_limit` (`memory::loose`).
//!
//! Copy mode copies from the buffers into params. Zero-copy mode is the
//! per-tensor callback in in-place mode: a tensor that lies whole in one
//! bucket is handed to the callback as a pointer into the shared buffer,
//! valid until the callback returns (tensors split across buckets, and
//! atomic mode, go through a library buffer first).
//!
//! **GPU buffers.** A trainer that published a version of GPU tensors
//! sends CUDA_BUFFERS (CUDA IPC handles) instead of BUFFERS. The engine
//! opens them once per session on its GPU (`IpcOptions::gpu`) and closes
//! them at its end. In place and unverified, bytes go device to device into
//! device params, and zero-copy hands the callback device pointers; host
//! params, atomic mode (its staging is host memory) and verification (the
//! hash runs on the CPU) copy the bytes to the host first. The engine waits
//! for its copies out of a bucket before acknowledging it.

use super::publisher_link::{unexpected, FromPublisher, Hello, PublisherLink};
use crate::apply::{Applier, Chunk};
use crate::memory::cuda_ipc::ImportedDeviceBuffer;
use crate::memory::shared::{check_announced, BucketMemory, MappedBuffers, SharedBuffer};
use crate::plan::Plan;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::unix::check_peer_uid;
use crate::wire::{check_bucket, BucketEntry, Frame};
use parking_lot::Mutex;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::defaults::BUCKET_TIMEOUT;

#[derive(Clone, Debug)]
pub struct IpcOptions {
    pub socket: PathBuf,
    pub rank: u32,
    pub world_size: u32,
    pub gpu_id: String,
    /// Version asked for; None: the publisher's latest.
    pub version: Option<String>,
    pub allow_other_uids: bool,
    pub bucket_timeout: Duration,
    /// The GPU (CUDA ordinal in this process) that opens a trainer's CUDA
    /// IPC buffers: the rank's device, or 0 when the config names none.
    pub gpu: i32,
}

pub struct IpcSource {
    link: PublisherLink,
    timeout: Duration,
    /// The manager's mappings of the last session's buffers.
    mapped: Arc<Mutex<MappedBuffers>>,
    gpu: i32,
}

impl IpcSource {
    /// Connect and take this rank's manifest. `mapped` holds the buffers
    /// the last session mapped; they are reused when the publisher hands
    /// the same ones over again, and replaced by this session's at its end.
    pub fn open(
        opts: &IpcOptions,
        deadline: Instant,
        mapped: Arc<Mutex<MappedBuffers>>,
    ) -> Result<IpcSource> {
        let who = format!("the publisher at {}", opts.socket.display());
        let stream = UnixStream::connect(&opts.socket).map_err(|e| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) {
                Error::not_found(format!(
                    "no publisher listens at {} ({e})",
                    opts.socket.display()
                ))
            } else {
                Error::io(format!("connecting to {who}"), e)
            }
        })?;
        check_peer_uid(&stream, opts.allow_other_uids, &who)?;
        let hello = Hello {
            rank: opts.rank,
            world_size: opts.world_size,
            gpu_id: &opts.gpu_id,
            version: opts.version.as_deref(),
        };
        let deadline = deadline.min(Instant::now() + opts.bucket_timeout);
        Ok(IpcSource {
            link: PublisherLink::handshake(
                Conn::new(stream, who),
                &hello,
                deadline,
                |_, _| Ok(()),
            )?,
            timeout: opts.bucket_timeout,
            mapped,
            gpu: opts.gpu,
        })
    }
}

impl FromPublisher for IpcSource {
    fn link(&self) -> &PublisherLink {
        &self.link
    }

    fn link_mut(&mut self) -> &mut PublisherLink {
        &mut self.link
    }

    fn receive(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        let r = self.receive_buckets(plan, applier);
        let mut mapped = self.mapped.lock();
        match r {
            Ok(buffers) => {
                mapped.keep(buffers);
                Ok(())
            }
            Err(e) => {
                // The publisher may be gone: hold none of its memory.
                mapped.forget();
                Err(e)
            }
        }
    }
}

impl IpcSource {
    /// Every bucket, applied and acknowledged; returns the buffers mapped.
    fn receive_buckets(
        &mut self,
        plan: &Plan,
        applier: &mut Applier,
    ) -> Result<Vec<Arc<SharedBuffer>>> {
        let buffers = self.take_buffers(applier)?;
        loop {
            applier.check_deadline()?;
            let deadline = self.next_deadline(applier);
            match self.link.conn.recv(deadline)? {
                Frame::Bucket {
                    seq,
                    buffer,
                    entries,
                } => {
                    apply_bucket(plan, applier, &buffers, seq, buffer, &entries)?;
                    self.link.conn.send(&Frame::Ack { seq })?;
                }
                Frame::End { .. } => {
                    applier.settle_uploads()?;
                    return Ok(host_buffers(buffers));
                }
                other => return Err(unexpected(&self.link.conn, "BUCKET or END", &other)),
            }
        }
    }

    /// When the next frame must have come.
    fn next_deadline(&self, applier: &Applier) -> Instant {
        (Instant::now() + self.timeout).min(applier.deadline())
    }

    /// The session's buffers: shared memory (BUFFERS, with their fds) or
    /// the trainer's GPU memory (CUDA_BUFFERS).
    fn take_buffers(&mut self, applier: &Applier) -> Result<Vec<BucketMemory>> {
        let deadline = self.next_deadline(applier);
        match self.link.conn.recv(deadline)? {
            Frame::Buffers { sizes } => self.map_host_buffers(&sizes),
            Frame::CudaBuffers { buffers } => buffers
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let size = usize::try_from(b.size)
                        .map_err(|_| Error::peer("GPU buffer size does not fit"))?;
                    let what = format!("the trainer's GPU buffer {i}");
                    ImportedDeviceBuffer::open(&what, self.gpu, &b.handle, size)
                        .map(BucketMemory::Device)
                })
                .collect(),
            other => Err(unexpected(&self.link.conn, "BUFFERS", &other)),
        }
    }

    /// Map the shared buffers whose fds follow BUFFERS (reusing the last
    /// session's mappings of the same ones).
    fn map_host_buffers(&mut self, sizes: &[u64]) -> Result<Vec<BucketMemory>> {
        check_announced(sizes)?;
        let fds = self.link.conn.take_fds(sizes.len())?;
        let mut mapped = self.mapped.lock();
        fds.into_iter()
            .zip(sizes)
            .enumerate()
            .map(|(i, (fd, &size))| {
                let size =
                    usize::try_from(size).map_err(|_| Error::peer("buffer size does not fit"))?;
                mapped
                    .receive(fd, size, &format!("shared buffer {i}"))
                    .map(BucketMemory::Host)
            })
            .collect()
    }
}

/// Check bucket `seq` (in `buffers[buffer]`) and apply its entries; device
/// copies out of it are done when this returns.
fn apply_bucket(
    plan: &Plan,
    applier: &mut Applier,
    buffers: &[BucketMemory],
    seq: u64,
    buffer: u32,
    entries: &[BucketEntry],
) -> Result<()> {
    let mem = buffers.get(buffer as usize).ok_or_else(|| {
        Error::peer(format!(
            "bucket {seq} names buffer {buffer} of {}",
            buffers.len()
        ))
    })?;
    check_bucket(seq, entries, mem.len() as u64, plan.entries.len())
        .map_err(|e| e.context(format!("shared buffer {buffer}")))?;
    if let BucketMemory::Host(b) = mem {
        // Only the windows this bucket reads (checked above to lie in the
        // buffer) are faulted in.
        b.populate(
            entries
                .iter()
                .map(|e| (e.buffer_offset, e.buffer_offset + e.len)),
        );
    }
    let chunks: Vec<Chunk> = entries
        .iter()
        .map(|e| Chunk {
            tensor: e.tensor as usize,
            offset: e.tensor_offset,
            len: e.len as usize,
            src: mem.source(e.buffer_offset),
        })
        .collect();
    applier.apply_batch(&format!("bucket {seq}"), &chunks)?;
    if let BucketMemory::Device(_) = mem {
        // Device copies out of the bucket run on a stream: done before the
        // trainer may reuse its memory.
        applier.settle_uploads()?;
    }
    Ok(())
}

/// The host buffers of a finished session, kept for the next one.
fn host_buffers(buffers: Vec<BucketMemory>) -> Vec<Arc<SharedBuffer>> {
    buffers
        .into_iter()
        .filter_map(|m| match m {
            BucketMemory::Host(b) => Some(b),
            BucketMemory::Device(_) => None,
        })
        .collect()
}
