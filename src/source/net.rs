//! The network sources: a publisher on another node streams buckets over UCX
//! (protocol in `docs/wire.md`; transport in `transport::ucx`).
//!
//! The engine connects over TCP, proves it holds the shared secret (and
//! checks that the publisher does), names its rank and the version it wants
//! ("latest" by default), gets its manifest, says which tensors it wants and
//! where its UCX worker is, then receives bucket after bucket into `depth`
//! staging slots: while bucket i is applied, buckets i+1.. are already
//! landing in the other slots. Each bucket is acknowledged once applied, so
//! the publisher can send the next one into its slot.
//!
//! Staging slots are kept for the process and reused by the next update
//! (fresh memory costs a page fault per page; a 512 MiB slot is ~130k).
//!
//! **Direct receive** (gdr, and rdma when asked): there are no staging slots;
//! the publisher sends every bucket entry as its own message and the engine
//! receives it where the applier wants the bytes (`Applier::landing_for`):
//! the param itself in place, the atomic staging arena otherwise. One copy
//! fewer; on RDMA hardware the NIC writes the params. gdr (straight into GPU
//! memory) also needs device params and a UCX built with CUDA; without
//! either it is refused with a clear error (or, when allowed, runs as rdma
//! with a warning).

use super::publisher_link::{unexpected, FromPublisher, Hello, PublisherLink};
use crate::apply::{Applier, Chunk};
use crate::memory::copy::CopySource;
use crate::memory::host::HostRegion;
use crate::memory::pool::Pool;
use crate::memory::SendPtr;
use crate::plan::Plan;
use crate::publisher::net_tag;
use crate::result::{Error, Result};
use crate::transport::auth::{self, Secret};
use crate::transport::conn::Conn;
use crate::transport::ucx::{Completion, Pump};
use crate::wire::{check_bucket, BucketEntry, Frame, MAX_BUFFERS};
use std::collections::{HashMap, VecDeque};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// SPEC.md's network knobs.
pub(crate) const DEFAULT_BUCKET_SIZE: usize = 512 << 20;
pub(crate) const DEFAULT_DEPTH: usize = 2;

#[derive(Clone, Debug)]
pub struct NetOptions {
    /// The publisher's "host:port".
    pub address: String,
    pub rank: u32,
    pub world_size: u32,
    pub gpu_id: String,
    /// Version asked for; None: "latest".
    pub version: Option<String>,
    pub secret: Secret,
    pub bucket_size: usize,
    pub depth: usize,
    pub bucket_timeout: Duration,
    /// Receive each bucket entry straight where the applier wants it (param
    /// memory in place, the staging arena when atomic) instead of into a
    /// staging slot first: gdr always, rdma when asked.
    pub direct: bool,
}

pub struct NetSource {
    link: PublisherLink,
    opts: NetOptions,
}

/// Staging slots kept between updates.
static SLOTS: Pool<HostRegion> = Pool::new();

impl NetSource {
    pub fn open(opts: NetOptions, deadline: Instant) -> Result<NetSource> {
        if opts.bucket_size < crate::wire::ALIGN as usize
            || opts.depth == 0
            || opts.depth > MAX_BUFFERS
        {
            return Err(Error::invalid_argument(format!(
                "network bucket size {} (at least 256) and depth {} (1 to {MAX_BUFFERS}) are out of range",
                opts.bucket_size, opts.depth
            )));
        }
        // Fail before connecting when UCX is missing: nothing to receive with.
        crate::transport::ucx::ucx()?;
        let who = format!("the publisher at {}", opts.address);
        let addrs: Vec<_> = opts
            .address
            .to_socket_addrs()
            .map_err(|e| {
                Error::invalid_argument(format!(
                    "publisher address '{}' is not host:port ({e})",
                    opts.address
                ))
            })?
            .collect();
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(opts.bucket_timeout)
            .max(Duration::from_millis(1));
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, wait) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = stream.ok_or_else(|| {
            let e = last.map_or("no address".to_string(), |e| e.to_string());
            Error::not_found(format!("no publisher answers at {} ({e})", opts.address))
        })?;
        let _ = stream.set_nodelay(true);
        let hello = Hello {
            rank: opts.rank,
            world_size: opts.world_size,
            gpu_id: &opts.gpu_id,
            version: opts.version.as_deref(),
        };
        let step = deadline.min(Instant::now() + opts.bucket_timeout);
        let link = PublisherLink::handshake(Conn::new(stream, who), &hello, step, |conn| {
            authenticate(conn, &opts.secret, step)
        })?;
        Ok(NetSource { link, opts })
    }

    /// Receive every bucket: into `slots` (staged) and applied from there,
    /// or, with no slots (direct), each entry where the applier wants it.
    fn receive_into(
        &mut self,
        plan: &Plan,
        applier: &mut Applier,
        slots: &[HostRegion],
    ) -> Result<()> {
        let (size, depth) = (self.opts.bucket_size, self.opts.depth);
        let direct = slots.is_empty();
        // Declared after the memory it writes into: dropped (and its
        // receives cancelled) before that memory is returned or released.
        let pump = Pump::start("engine")?;
        self.link.conn.send(&Frame::Ready {
            address: pump.address().to_vec(),
            bucket_size: size as u64,
            depth: depth as u32,
            direct,
        })?;
        for (s, slot) in slots.iter().enumerate() {
            // SAFETY: the slot outlives the pump (see above).
            unsafe { pump.recv(net_tag(s as u64, None), slot.ptr(), size)? };
        }
        let mut early: HashMap<u64, Result<usize>> = HashMap::new();
        // Direct: buckets whose receives are posted, not yet acknowledged.
        let mut pending: VecDeque<(u64, Vec<BucketEntry>)> = VecDeque::new();
        let mut next = 0u64;
        loop {
            applier.check_deadline()?;
            let frame_deadline =
                (Instant::now() + self.opts.bucket_timeout).min(applier.deadline());
            match self.link.conn.recv(frame_deadline)? {
                Frame::Bucket {
                    seq,
                    buffer,
                    entries,
                } => {
                    if seq != next || (!direct && buffer as u64 != seq % depth as u64) {
                        return Err(Error::peer(format!(
                            "{}: bucket {seq} in slot {buffer}, expected bucket {next} in slot {}",
                            self.link.conn.peer(),
                            next % depth as u64
                        )));
                    }
                    check_bucket(seq, &entries, size as u64, plan.entries.len())?;
                    if direct {
                        // Post this bucket's receives before finishing the
                        // oldest one, so the bytes keep flowing while that
                        // one is verified and acknowledged.
                        post_direct(&pump, seq, &entries, applier)?;
                        pending.push_back((seq, entries));
                        if pending.len() >= depth {
                            let (seq, entries) = pending.pop_front().expect("pending bucket");
                            self.finish_direct(&pump, &mut early, seq, &entries, applier)?;
                        }
                    } else {
                        let origin = format!("bucket {seq}");
                        let slot = &slots[buffer as usize];
                        let tag = net_tag(seq, None);
                        let got = self.wait_bytes(&pump, &mut early, tag, seq, applier)?;
                        let need = entries
                            .iter()
                            .map(|e| e.buffer_offset + e.len)
                            .max()
                            .unwrap_or(0);
                        if (got as u64) < need {
                            return Err(Error::peer(format!(
                                "{}: bucket {seq} brought {got} bytes, its entries need {need}",
                                self.link.conn.peer()
                            )));
                        }
                        let chunks = chunks(&entries, |e| {
                            slot.ptr().wrapping_add(e.buffer_offset as usize)
                        });
                        applier.apply_batch(&origin, &chunks)?;
                        let again = net_tag(seq + depth as u64, None);
                        // SAFETY: as above; the slot's bytes were consumed.
                        unsafe { pump.recv(again, slot.ptr(), size)? };
                        self.link.conn.send(&Frame::Ack { seq })?;
                    }
                    next += 1;
                }
                Frame::End { buckets } if buckets == next => {
                    while let Some((seq, entries)) = pending.pop_front() {
                        self.finish_direct(&pump, &mut early, seq, &entries, applier)?;
                    }
                    return Ok(());
                }
                Frame::End { buckets } => {
                    return Err(Error::peer(format!(
                        "{}: END after {buckets} buckets, {next} received",
                        self.link.conn.peer()
                    )))
                }
                other => return Err(unexpected(&self.link.conn, "BUCKET or END", &other)),
            }
        }
    }

    /// Direct receive, second half: wait until every entry of bucket `seq`
    /// (posted by [`post_direct`]) brought exactly its length, account for
    /// the bytes with the applier, and acknowledge the bucket.
    fn finish_direct(
        &mut self,
        pump: &Pump,
        early: &mut HashMap<u64, Result<usize>>,
        seq: u64,
        entries: &[BucketEntry],
        applier: &mut Applier,
    ) -> Result<()> {
        for (k, e) in entries.iter().enumerate() {
            let got = self.wait_bytes(pump, early, net_tag(seq, Some(k)), seq, applier)?;
            if got as u64 != e.len {
                return Err(Error::peer(format!(
                    "{}: bucket {seq} entry {k} brought {got} bytes, {} announced",
                    self.link.conn.peer(),
                    e.len
                )));
            }
        }
        let chunks = chunks(entries, |_| std::ptr::null_mut());
        applier.landed_batch(&format!("bucket {seq}"), &chunks)?;
        self.link.conn.send(&Frame::Ack { seq })
    }

    /// Wait for bucket `seq`'s bytes. Bounded by the bucket timeout; a
    /// publisher that closes the control connection meanwhile (it died, or
    /// gave up) ends the wait at once.
    fn wait_bytes(
        &mut self,
        pump: &Pump,
        early: &mut HashMap<u64, Result<usize>>,
        tag: u64,
        seq: u64,
        applier: &Applier,
    ) -> Result<usize> {
        let deadline = (Instant::now() + self.opts.bucket_timeout).min(applier.deadline());
        loop {
            if let Some(r) = early.remove(&tag) {
                return r.map_err(|e| e.context(format!("bucket {seq}")));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!(
                    "{}: the bytes of bucket {seq} did not arrive before the deadline",
                    self.link.conn.peer()
                )));
            }
            match pump.next(deadline.min(now + Duration::from_millis(50)))? {
                Some(Completion { tag, result }) => {
                    early.insert(tag, result);
                }
                None if self.link.conn.peer_hung_up() => {
                    // Prefer the publisher's own reason, when it sent one.
                    let e = match self
                        .link
                        .conn
                        .recv(Instant::now() + Duration::from_millis(100))
                    {
                        Err(e) => e,
                        Ok(f) => Error::peer(format!(
                            "{}: unexpected {}",
                            self.link.conn.peer(),
                            f.name()
                        )),
                    };
                    return Err(e.context(format!("waiting for bucket {seq}")));
                }
                None => {}
            }
        }
    }
}

/// Direct receive, first half: post one receive per entry of bucket `seq`,
/// each where the applier wants its bytes.
fn post_direct(
    pump: &Pump,
    seq: u64,
    entries: &[BucketEntry],
    applier: &mut Applier,
) -> Result<()> {
    for (k, e) in entries.iter().enumerate() {
        let at = applier.landing_for(e.tensor as usize, e.tensor_offset, e.len as usize)?;
        // SAFETY: the landing range is inside the tensor's memory (checked);
        // the pump is dropped, cancelling any receive, before this update ends.
        unsafe { pump.recv(net_tag(seq, Some(k)), at.0, e.len as usize)? };
    }
    Ok(())
}

/// The engine's side of the challenge (see `transport::auth`).
fn authenticate(conn: &mut Conn, secret: &Secret, deadline: Instant) -> Result<()> {
    let theirs = match conn.recv(deadline)? {
        Frame::Challenge { nonce } => nonce,
        other => return Err(unexpected(conn, "CHALLENGE", &other)),
    };
    let mine = auth::nonce()?;
    conn.send(&Frame::Proof {
        mac: secret.engine_proof(&theirs, &mine),
        nonce: mine,
    })?;
    match conn.recv(deadline) {
        Ok(Frame::Proof { mac, .. }) if secret.check_publisher_proof(&mine, &theirs, &mac) => {
            Ok(())
        }
        Ok(Frame::Proof { .. }) => Err(Error::auth(format!(
            "authentication failed: {} does not hold this engine's shared secret",
            conn.peer()
        ))),
        Ok(other) => Err(unexpected(conn, "PROOF", &other)),
        Err(e) => Err(e),
    }
}

impl FromPublisher for NetSource {
    fn link(&self) -> &PublisherLink {
        &self.link
    }

    fn link_mut(&mut self) -> &mut PublisherLink {
        &mut self.link
    }

    fn receive(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        if self.opts.direct {
            return self.receive_into(plan, applier, &[]);
        }
        let (size, depth) = (self.opts.bucket_size, self.opts.depth);
        let threads = crate::memory::copy::default_threads();
        let slots = SLOTS.take(depth, size, |_| {
            HostRegion::staging("network staging slot", size, threads)
        })?;
        let r = self.receive_into(plan, applier, &slots);
        SLOTS.give_back(slots);
        r
    }
}

/// Chunks for a bucket's entries, each found at `at(entry)`.
fn chunks(entries: &[BucketEntry], at: impl Fn(&BucketEntry) -> *mut u8) -> Vec<Chunk<'static>> {
    entries
        .iter()
        .map(|e| Chunk {
            tensor: e.tensor as usize,
            offset: e.tensor_offset,
            len: e.len as usize,
            src: CopySource::Memory(SendPtr(at(e))),
        })
        .collect()
}
