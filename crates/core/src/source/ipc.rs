//! The IPC source: a trainer's publisher on the same node serves buckets in
//! shared memory over a Unix socket (protocol in `docs/wire.md`).
//!
//! The engine connects, checks the publisher's uid (SO_PEERCRED), says which
//! rank it is, gets its manifest, asks for exactly the bytes its plan needs
//! (WANT: a request per plan entry, after the plan, so skipped tensors and
//! unneeded parts are never packed), receives the shared buffers
//! once, then applies bucket after bucket, acknowledging each so the
//! publisher can refill its buffer while the next one is applied. Each
//! step takes one frame, waiting only as long as it is told, so several
//! publishers (one socket each) are read at once.
//!
//! A published version comes as WINDOWS: each entry says where its
//! request's tensor starts in the version's buffer, and the engine expands
//! it by its own request into blocks (a strided request's rows), each
//! copied straight out of the buffer (`wire::check_windows`).
//!
//! Trust: the socket's mode and the publisher's uid decide who may connect;
//! a publisher of the same uid is trusted with the bytes but not with the
//! engine's memory. Every bucket entry (every block of a window) is
//! range-checked against its buffer and the plan; a buffer is mapped, never
//! faulted in whole (only the 64 KiB chunks a bucket reads are, once), so
//! a sparse buffer announced far larger than the update costs address
//! space, not memory; callback tensors are bounded by the manager's
//! `callback_staging_limit` (`memory::loose`).
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
//! hash runs on the CPU, slice sums included) copy the bytes to the host
//! first. A strided part's blocks, equally spaced in the trainer's buffer,
//! go as one 2D copy per run either way (`memory::strided`). The engine
//! waits for its copies out of a bucket before acknowledging it.

use super::from_publisher::FromPublisher;
use super::publisher_link::{unexpected, PublisherLink, PullOptions};
use super::Step;
use crate::apply::{Applier, Chunk};
use crate::memory::cuda_ipc::ImportedDeviceBuffer;
use crate::memory::kept_mappings::{BucketMemory, MappedBuffers};
use crate::memory::shared::{check_announced, SharedBuffer};
use crate::plan::Plan;
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::unix::check_peer_uid;
use crate::wire::{check_bucket, check_windows, BucketEntry, Frame, ALIGN};
use parking_lot::Mutex;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::defaults::BUCKET_TIMEOUT;

#[derive(Clone, Debug)]
pub struct IpcOptions {
    pub socket: PathBuf,
    /// Who asks, for what, and how long it waits.
    pub pull: PullOptions,
    pub allow_other_uids: bool,
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
    /// This session's buffers, once BUFFERS (or CUDA_BUFFERS) came.
    buffers: Option<Vec<BucketMemory>>,
    /// When the next frame must have come.
    due: Instant,
    /// Buckets received: the next one's sequence number, END's count.
    buckets: u64,
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
        if opts.socket.as_os_str().is_empty() {
            return Err(Error::invalid_argument(
                "the location is empty: an IPC update needs the publisher's socket path",
            ));
        }
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
        let deadline = deadline.min(Instant::now() + opts.pull.bucket_timeout);
        let conn = Conn::new(stream, who);
        let link = PublisherLink::handshake(conn, &opts.pull, deadline, |_, _| Ok(()))?;
        Ok(IpcSource {
            link,
            timeout: opts.pull.bucket_timeout,
            mapped,
            gpu: opts.gpu,
            buffers: None,
            due: Instant::now(),
            buckets: 0,
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

    fn begin(&mut self, _: &Plan, _: &mut Applier) -> Result<()> {
        self.due = Instant::now() + self.timeout;
        Ok(())
    }

    /// The next frame, when one comes within `wait`: the buffers, a bucket
    /// (applied and acknowledged), or END.
    fn advance(&mut self, _: &Plan, applier: &mut Applier, wait: Duration) -> Result<Step> {
        let owed = |e: Error| e.context(format!("waiting for {}", self.link.conn.peer()));
        applier.check_deadline().map_err(owed)?;
        if !self.link.conn.readable_within(wait) {
            if Instant::now() < self.due {
                return Ok(Step::Waiting);
            }
            return Err(Error::timeout(format!(
                "{}: no frame came within {:?} (the bucket timeout, or the update's timeout when shorter)",
                self.link.conn.peer(),
                self.timeout
            )));
        }
        let deadline = self.next_deadline(applier);
        let Some(buffers) = &self.buffers else {
            self.buffers = Some(self.take_buffers(applier)?);
            self.due = self.next_deadline(applier);
            return Ok(Step::Moved);
        };
        let frame = self.link.conn.recv(deadline)?;
        check_numbering(&mut self.buckets, self.link.conn.peer(), &frame)?;
        match frame {
            Frame::Bucket {
                seq,
                buffer,
                entries,
            } => {
                let mem = checked_bucket(&self.link, buffers, seq, buffer, &entries)?;
                self.link.recv_sums(seq, &entries, deadline, applier)?;
                let windows = entries
                    .iter()
                    .map(|e| (e.buffer_offset, e.buffer_offset + e.len));
                apply_bucket(&self.link, applier, mem, seq, windows, &entries)?;
                self.acknowledge(seq, applier)
            }
            Frame::Windows {
                seq,
                buffer,
                entries,
            } => {
                let mem = bucket_buffer(buffers, seq, buffer)?;
                let expanded =
                    check_windows(seq, &entries, mem.len() as u64, self.link.sent_requests())
                        .map_err(|e| e.context(buffer_name(mem, buffer)))?;
                self.link.recv_sums(seq, &entries, deadline, applier)?;
                let extents = expanded.extents.iter().copied();
                apply_bucket(&self.link, applier, mem, seq, extents, &expanded.blocks)?;
                self.acknowledge(seq, applier)
            }
            Frame::End { .. } => {
                applier.settle_uploads()?;
                let buffers = self.buffers.take().unwrap_or_default();
                let peer = self.link.conn.peer().to_string();
                self.mapped.lock().keep(&peer, host_buffers(buffers));
                Ok(Step::Done)
            }
            other => Err(unexpected(&self.link.conn, "BUCKET or END", &other)),
        }
    }

    /// The publisher may be gone: hold none of its memory.
    fn give_up(&mut self) {
        self.buffers = None;
        self.mapped.lock().forget();
    }
}

impl IpcSource {
    /// Bucket `seq` is applied: tell the publisher, and wait for the next.
    fn acknowledge(&mut self, seq: u64, applier: &Applier) -> Result<Step> {
        self.link.conn.send(&Frame::Ack { seq })?;
        self.due = self.next_deadline(applier);
        Ok(Step::Moved)
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

/// Buckets come numbered 0, 1, 2, ... (`received` so far) and END counts
/// them; from publisher `peer`.
fn check_numbering(received: &mut u64, peer: &str, frame: &Frame) -> Result<()> {
    match *frame {
        Frame::Bucket { seq, .. } | Frame::Windows { seq, .. } if seq != *received => {
            Err(Error::peer(format!(
                "{peer}: bucket {seq} came where bucket {received} was next"
            )))
        }
        Frame::Bucket { .. } | Frame::Windows { .. } => {
            *received += 1;
            Ok(())
        }
        Frame::End { buckets } if buckets != *received => Err(Error::peer(format!(
            "{peer}: END after {buckets} buckets, {received} received"
        ))),
        _ => Ok(()),
    }
}

/// The buffer bucket `seq` names.
fn bucket_buffer(buffers: &[BucketMemory], seq: u64, buffer: u32) -> Result<&BucketMemory> {
    buffers.get(buffer as usize).ok_or_else(|| {
        Error::peer(format!(
            "bucket {seq} names buffer {buffer} of {}",
            buffers.len()
        ))
    })
}

/// Buffer number `buffer` (`mem`), as errors name it.
fn buffer_name(mem: &BucketMemory, buffer: u32) -> String {
    match mem {
        BucketMemory::Host(_) => format!("shared buffer {buffer}"),
        BucketMemory::Device(_) => format!("the trainer's GPU buffer {buffer}"),
    }
}

/// Bucket `seq`'s buffer, `buffers[buffer]`, once its entries are checked
/// to lie in it and to name requests of this session.
fn checked_bucket<'b>(
    link: &PublisherLink,
    buffers: &'b [BucketMemory],
    seq: u64,
    buffer: u32,
    entries: &[BucketEntry],
) -> Result<&'b BucketMemory> {
    let mem = bucket_buffer(buffers, seq, buffer)?;
    check_bucket(seq, entries, mem.len() as u64, link.requests(), ALIGN)
        .map_err(|e| e.context(buffer_name(mem, buffer)))?;
    Ok(mem)
}

/// Apply bucket `seq`'s entries (checked: contiguous ranges in `mem`),
/// faulting in the byte ranges `windows` of `mem` first; device copies out
/// of it are done when this returns.
fn apply_bucket(
    link: &PublisherLink,
    applier: &mut Applier,
    mem: &BucketMemory,
    seq: u64,
    windows: impl IntoIterator<Item = (u64, u64)>,
    entries: &[BucketEntry],
) -> Result<()> {
    if let BucketMemory::Host(b) = mem {
        // Only the windows this bucket reads (checked to lie in the
        // buffer) are faulted in.
        b.populate(windows);
    }
    let chunks: Vec<Chunk> = entries
        .iter()
        .map(|e| link.chunk(e, mem.source(e.buffer_offset)))
        .collect();
    applier.apply_batch(&format!("{}: bucket {seq}", link.conn.peer()), &chunks)?;
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
