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

use crate::apply::{Applier, Chunk};
use crate::manifest::Manifest;
use crate::memory::copy::CopySource;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::publisher::net_tag;
use crate::result::{Error, Result};
use crate::transport::auth::{self, Secret};
use crate::transport::conn::Conn;
use crate::transport::ucx::{Completion, Pump};
use crate::wire::{check_bucket, Frame, MAX_BUFFERS};
use parking_lot::Mutex;
use std::collections::HashMap;
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
    conn: Conn,
    manifest: Manifest,
    opts: NetOptions,
}

/// Staging slots kept between updates.
static SLOTS: Mutex<Vec<HostRegion>> = Mutex::new(Vec::new());

fn take_slots(n: usize, len: usize, threads: usize) -> Result<Vec<HostRegion>> {
    let mut out = Vec::with_capacity(n);
    {
        let mut free = SLOTS.lock();
        while out.len() < n {
            match free.iter().position(|r| r.len() >= len) {
                Some(i) => out.push(free.swap_remove(i)),
                None => break,
            }
        }
    }
    while out.len() < n {
        out.push(HostRegion::staging("network staging slot", len, threads)?);
    }
    Ok(out)
}

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
        let mut conn = Conn::new(stream, who);
        conn.send(&Frame::Hello {
            rank: opts.rank,
            world_size: opts.world_size,
            gpu_id: opts.gpu_id.clone(),
            version: opts.version.clone().unwrap_or_default(),
        })?;
        let step = deadline.min(Instant::now() + opts.bucket_timeout);
        authenticate(&mut conn, &opts.secret, step)?;
        let manifest = match conn.recv(step)? {
            Frame::Manifest { version, tensors } => Manifest {
                tensors,
                version: (!version.is_empty()).then_some(version),
            },
            other => {
                return Err(Error::peer(format!(
                    "{}: expected MANIFEST, got {}",
                    conn.peer(),
                    other.name()
                )))
            }
        };
        Ok(NetSource {
            conn,
            manifest,
            opts,
        })
    }

    fn stream_inner(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        let want: Vec<u32> = (0..plan.entries.len() as u32)
            .filter(|&i| plan.entries[i as usize].target != Target::Skip)
            .collect();
        self.conn.send(&Frame::Want { tensors: want })?;
        if self.opts.direct {
            return self.receive_direct(plan, applier);
        }
        let (size, depth) = (self.opts.bucket_size, self.opts.depth);
        let slots = take_slots(depth, size, crate::memory::copy::default_threads())?;
        let r = self.receive(plan, applier, &slots);
        SLOTS.lock().extend(slots);
        r
    }

    fn receive(&mut self, plan: &Plan, applier: &mut Applier, slots: &[HostRegion]) -> Result<()> {
        let (size, depth) = (self.opts.bucket_size, self.opts.depth);
        // Declared after the slots it writes into: dropped (and its receives
        // cancelled) before they are returned.
        let pump = Pump::start("engine")?;
        self.conn.send(&Frame::Ready {
            address: pump.address().to_vec(),
            bucket_size: size as u64,
            depth: depth as u32,
            direct: false,
        })?;
        for (s, slot) in slots.iter().enumerate() {
            // SAFETY: the slot outlives the pump (see above).
            unsafe { pump.recv(net_tag(s as u64, None), slot.ptr(), size)? };
        }
        let mut early: HashMap<u64, Result<usize>> = HashMap::new();
        let mut next = 0u64;
        loop {
            applier.check_deadline()?;
            let frame_deadline =
                (Instant::now() + self.opts.bucket_timeout).min(applier.deadline());
            match self.conn.recv(frame_deadline)? {
                Frame::Bucket {
                    seq,
                    buffer,
                    entries,
                } => {
                    if seq != next || buffer as u64 != seq % depth as u64 {
                        return Err(Error::peer(format!(
                            "{}: bucket {seq} in slot {buffer}, expected bucket {next} in slot {}",
                            self.conn.peer(),
                            next % depth as u64
                        )));
                    }
                    let slot = &slots[buffer as usize];
                    check_bucket(seq, &entries, size as u64, plan.entries.len())?;
                    let got =
                        self.wait_bytes(&pump, &mut early, net_tag(seq, None), seq, applier)?;
                    let need = entries
                        .iter()
                        .map(|e| e.buffer_offset + e.len)
                        .max()
                        .unwrap_or(0);
                    if (got as u64) < need {
                        return Err(Error::peer(format!(
                            "{}: bucket {seq} brought {got} bytes, its entries need {need}",
                            self.conn.peer()
                        )));
                    }
                    let chunks: Vec<Chunk> = entries
                        .iter()
                        .map(|e| Chunk {
                            tensor: e.tensor as usize,
                            offset: e.tensor_offset,
                            len: e.len as usize,
                            src: CopySource::Memory(SendPtr(
                                slot.ptr().wrapping_add(e.buffer_offset as usize),
                            )),
                        })
                        .collect();
                    applier.apply_batch(&format!("bucket {seq}"), &chunks)?;
                    // SAFETY: as above; the slot's bytes were consumed.
                    unsafe { pump.recv(net_tag(seq + depth as u64, None), slot.ptr(), size)? };
                    self.conn.send(&Frame::Ack { seq })?;
                    next += 1;
                }
                Frame::End { buckets } if buckets == next => return Ok(()),
                Frame::End { buckets } => {
                    return Err(Error::peer(format!(
                        "{}: END after {buckets} buckets, {next} received",
                        self.conn.peer()
                    )))
                }
                other => {
                    return Err(Error::peer(format!(
                        "{}: expected BUCKET or END, got {}",
                        self.conn.peer(),
                        other.name()
                    )))
                }
            }
        }
    }

    /// Direct receive: every entry of a bucket lands where the applier wants it.
    fn receive_direct(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        let pump = Pump::start("engine")?;
        self.conn.send(&Frame::Ready {
            address: pump.address().to_vec(),
            bucket_size: self.opts.bucket_size as u64,
            depth: self.opts.depth as u32,
            direct: true,
        })?;
        let mut early: HashMap<u64, Result<usize>> = HashMap::new();
        let mut next = 0u64;
        loop {
            applier.check_deadline()?;
            let frame_deadline =
                (Instant::now() + self.opts.bucket_timeout).min(applier.deadline());
            match self.conn.recv(frame_deadline)? {
                Frame::Bucket { seq, entries, .. } => {
                    if seq != next {
                        return Err(Error::peer(format!(
                            "{}: bucket {seq}, expected bucket {next}",
                            self.conn.peer()
                        )));
                    }
                    check_bucket(
                        seq,
                        &entries,
                        self.opts.bucket_size as u64,
                        plan.entries.len(),
                    )?;
                    for (k, e) in entries.iter().enumerate() {
                        let at = applier.landing_for(
                            e.tensor as usize,
                            e.tensor_offset,
                            e.len as usize,
                        )?;
                        // SAFETY: the landing range is inside the tensor's
                        // memory (checked); the pump is dropped, cancelling
                        // any receive, before this update ends.
                        unsafe { pump.recv(net_tag(seq, Some(k)), at.0, e.len as usize)? };
                    }
                    for (k, e) in entries.iter().enumerate() {
                        let got = self.wait_bytes(
                            &pump,
                            &mut early,
                            net_tag(seq, Some(k)),
                            seq,
                            applier,
                        )?;
                        if got as u64 != e.len {
                            return Err(Error::peer(format!(
                                "{}: bucket {seq} entry {k} brought {got} bytes, {} announced",
                                self.conn.peer(),
                                e.len
                            )));
                        }
                    }
                    let chunks: Vec<Chunk> = entries
                        .iter()
                        .map(|e| Chunk {
                            tensor: e.tensor as usize,
                            offset: e.tensor_offset,
                            len: e.len as usize,
                            src: CopySource::Memory(SendPtr(std::ptr::null_mut())),
                        })
                        .collect();
                    applier.landed_batch(&format!("bucket {seq}"), &chunks)?;
                    self.conn.send(&Frame::Ack { seq })?;
                    next += 1;
                }
                Frame::End { buckets } if buckets == next => return Ok(()),
                other => {
                    return Err(Error::peer(format!(
                        "{}: expected BUCKET or END, got {}",
                        self.conn.peer(),
                        other.name()
                    )))
                }
            }
        }
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
                    self.conn.peer()
                )));
            }
            match pump.next(deadline.min(now + Duration::from_millis(50)))? {
                Some(Completion { tag, result }) => {
                    early.insert(tag, result);
                }
                None if self.conn.peer_hung_up() => {
                    // Prefer the publisher's own reason, when it sent one.
                    let e = match self.conn.recv(Instant::now() + Duration::from_millis(100)) {
                        Err(e) => e,
                        Ok(f) => {
                            Error::peer(format!("{}: unexpected {}", self.conn.peer(), f.name()))
                        }
                    };
                    return Err(e.context(format!("waiting for bucket {seq}")));
                }
                None => {}
            }
        }
    }
}

/// The engine's side of the challenge (see `transport::auth`).
fn authenticate(conn: &mut Conn, secret: &Secret, deadline: Instant) -> Result<()> {
    let theirs = match conn.recv(deadline)? {
        Frame::Challenge { nonce } => nonce,
        other => {
            return Err(Error::peer(format!(
                "{}: expected CHALLENGE, got {}",
                conn.peer(),
                other.name()
            )))
        }
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
        Ok(other) => Err(Error::peer(format!(
            "{}: expected PROOF, got {}",
            conn.peer(),
            other.name()
        ))),
        Err(e) => Err(e),
    }
}

impl super::Source for NetSource {
    fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    fn no_version_reason(&self) -> String {
        format!("{} named no version", self.conn.peer())
    }

    fn describe(&self) -> String {
        self.conn.peer().to_string()
    }

    fn stream(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        let r = self.stream_inner(plan, applier);
        if let Err(e) = &r {
            self.conn.send_error(e);
        }
        r
    }
}
