//! The network sources: a publisher on another node streams buckets over UCX
//! (protocol in `docs/wire.md`; transport in `transport::ucx`).
//!
//! The engine connects over TCP, proves it holds the shared secret (and
//! checks that the publisher does), names its rank and the version it wants
//! ("latest" by default), gets its manifest, says which tensors it wants and
//! where its UCX worker is, then receives bucket after bucket. Every bucket
//! entry (at most `wire::NET_MESSAGE` bytes) is its own UCX message:
//!
//! - **direct** (rdma by default, gdr always): received straight where the
//!   applier wants the bytes (`Applier::receive_buffer_for`): the param itself in
//!   place, the atomic staging arena otherwise, and for device params
//!   without gdr a host buffer (pinned where it can) that goes up to the
//!   GPU. On RDMA hardware the NIC writes the params. gdr (straight into GPU
//!   memory) also needs device params and a UCX built with CUDA; without
//!   either it is refused with a clear error (or, when allowed, runs as
//!   rdma with a warning).
//! - **staged** (rdma with `NetSettings::staged`): received into one of
//!   `depth` staging slots at the entry's buffer offset, then copied to its
//!   param; one copy more (README "Decisions").
//!
//! A bucket's receives are posted when its BUCKET frame arrives; up to
//! `depth` buckets are posted (the next one first, when its frame is already
//! waiting), so bytes keep flowing while the oldest one is finished. Each
//! entry is handed to the applier (copied, verified) the moment it lands,
//! while its bytes are still in cache: verifying a whole bucket afterwards
//! would read it back from memory, which on a machine whose cores are busy
//! moving the bytes costs as much as the transfer.
//!
//! Staging slots are kept for the process and reused by the next update
//! (fresh memory costs a page fault per page; a 512 MiB slot is ~130k).

mod connect;

use connect::{authenticate, connect};

use super::publisher_link::{unexpected, FromPublisher, Hello, PublisherLink};
use crate::apply::{Applier, Chunk};
use crate::checksum::KEYED;
use crate::memory::copy::CopySource;
use crate::memory::host::HostRegion;
use crate::memory::pool::Pool;
use crate::memory::SendPtr;
use crate::plan::Plan;
use crate::result::{Error, Result};
use crate::transport::auth::Secret;
use crate::transport::conn::Conn;
use crate::transport::ucx::{Completion, Pump};
use crate::wire::message_tag as net_tag;
use crate::wire::{check_bucket, BucketEntry, Frame, MAX_BUFFERS};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

pub(crate) use crate::defaults::{
    BUCKET_SIZE as DEFAULT_BUCKET_SIZE, BUFFERS_IN_FLIGHT as DEFAULT_DEPTH,
};

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
    /// Check every entry's bytes against a keyed BLAKE3 digest the
    /// publisher sends (DIGESTS): authenticates the bytes themselves, where
    /// the manifest's XXH3 only catches corruption. Host landing only.
    pub keyed: bool,
}

pub struct NetSource {
    link: PublisherLink,
    opts: NetOptions,
    /// This session's key of the bucket bytes' digests.
    bytes_key: [u8; KEYED],
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
        let stream = connect(&opts, deadline)?;
        let hello = Hello {
            rank: opts.rank,
            world_size: opts.world_size,
            gpu_id: &opts.gpu_id,
            version: opts.version.as_deref(),
        };
        let step = deadline.min(Instant::now() + opts.bucket_timeout);
        let mut bytes_key = [0; KEYED];
        let link =
            PublisherLink::handshake(Conn::new(stream, who), &hello, step, |conn, hello| {
                bytes_key = authenticate(conn, &opts.secret, hello, step)?;
                Ok(())
            })?;
        Ok(NetSource {
            link,
            opts,
            bytes_key,
        })
    }

    /// Receive every bucket: into `slots` (staged) and applied from there,
    /// or, with no slots (direct), each entry where the applier wants it.
    ///
    /// One loop does two things, whichever can move: a BUCKET frame that is
    /// waiting gets its receives posted at once (so its bytes flow while
    /// earlier buckets are applied), and the oldest bucket's entries are
    /// applied one by one as they land, its ACK sent when the last is.
    fn receive_into(
        &mut self,
        plan: &Plan,
        applier: &mut Applier,
        slots: &[HostRegion],
    ) -> Result<()> {
        // Declared after the memory it writes into: dropped (and its
        // receives cancelled) before that memory is returned or released.
        let pump = Pump::start("engine")?;
        self.link.conn.send(&Frame::Ready {
            address: pump.address().to_vec(),
            bucket_size: self.opts.bucket_size as u64,
            depth: self.opts.depth as u32,
            direct: slots.is_empty(),
            keyed: self.opts.keyed,
        })?;
        let mut st = Receiving {
            early: HashMap::new(),
            pending: VecDeque::new(),
            applied: 0,
            next: 0,
            ended: false,
            waiting_since: Instant::now(),
        };
        loop {
            applier.check_deadline()?;
            // A frame: block for one only when nothing else can move.
            if !st.ended && (st.pending.is_empty() || self.link.conn.readable()) {
                self.take_frame(&pump, plan, applier, slots, &mut st)?;
                continue;
            }
            let Some(oldest) = st.pending.front() else {
                return Ok(()); // ended, and every bucket acknowledged
            };
            if st.applied < oldest.entries.len() {
                self.apply_next_entry(&pump, plan, applier, &mut st)?;
            } else {
                self.link.conn.send(&Frame::Ack { seq: oldest.seq })?;
                st.pending.pop_front();
                st.applied = 0;
                st.waiting_since = Instant::now();
            }
        }
    }

    /// The next control frame: a BUCKET gets its receives posted, END
    /// marks the stream ended.
    fn take_frame(
        &mut self,
        pump: &Pump,
        plan: &Plan,
        applier: &mut Applier,
        slots: &[HostRegion],
        st: &mut Receiving,
    ) -> Result<()> {
        let frame_deadline = (Instant::now() + self.opts.bucket_timeout).min(applier.deadline());
        match self.link.conn.recv(frame_deadline)? {
            Frame::Bucket {
                seq,
                buffer,
                entries,
            } => {
                self.check_bucket_order(seq, buffer, slots.is_empty(), st)?;
                check_bucket(
                    seq,
                    &entries,
                    self.opts.bucket_size as u64,
                    plan.entries.len(),
                )?;
                let digests = if self.opts.keyed {
                    self.recv_digests(seq, entries.len(), frame_deadline)?
                } else {
                    Vec::new()
                };
                let slot = slots.get(buffer as usize);
                if st.pending.is_empty() {
                    st.waiting_since = Instant::now();
                }
                let mut posted = post(pump, seq, entries, slot, applier)?;
                posted.digests = digests;
                st.pending.push_back(posted);
                st.next += 1;
                Ok(())
            }
            Frame::End { buckets } if buckets == st.next => {
                st.ended = true;
                Ok(())
            }
            Frame::End { buckets } => Err(Error::peer(format!(
                "{}: END after {buckets} buckets, {} received",
                self.link.conn.peer(),
                st.next
            ))),
            other => Err(unexpected(&self.link.conn, "BUCKET or END", &other)),
        }
    }

    /// BUCKET `seq` in slot `buffer` must be the next one, in its slot (when
    /// staged), within the window of `depth` unacknowledged buckets.
    fn check_bucket_order(
        &self,
        seq: u64,
        buffer: u32,
        direct: bool,
        st: &Receiving,
    ) -> Result<()> {
        let depth = self.opts.depth;
        if seq != st.next
            || (!direct && buffer as u64 != seq % depth as u64)
            || st.pending.len() >= depth
        {
            return Err(Error::peer(format!(
                "{}: bucket {seq} in slot {buffer} with {} unacknowledged, expected bucket {} in slot {} with fewer than {depth}",
                self.link.conn.peer(),
                st.pending.len(),
                st.next,
                st.next % depth as u64
            )));
        }
        Ok(())
    }

    /// Wait (a slice) for the oldest bucket's next entry to land, then check
    /// its length and digest and hand it to the applier (copied, verified)
    /// at once, while its bytes are still in cache.
    fn apply_next_entry(
        &mut self,
        pump: &Pump,
        plan: &Plan,
        applier: &mut Applier,
        st: &mut Receiving,
    ) -> Result<()> {
        let oldest = st.pending.front().expect("a posted bucket");
        let applied = st.applied;
        let e = &oldest.entries[applied];
        // Wait briefly when another frame may come, so it is posted soon;
        // otherwise up to the usual slice.
        let slice = if st.pending.len() < self.opts.depth && !st.ended {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(50)
        };
        let tag = net_tag(oldest.seq, applied);
        let Some(got) = self.poll_bytes(pump, &mut st.early, tag, oldest.seq, slice)? else {
            if st.waiting_since.elapsed() > self.opts.bucket_timeout {
                return Err(Error::timeout(format!(
                    "{}: the bytes of bucket {} did not arrive within {:?}",
                    self.link.conn.peer(),
                    oldest.seq,
                    self.opts.bucket_timeout
                )));
            }
            return Ok(());
        };
        if got as u64 != e.len {
            return Err(Error::peer(format!(
                "{}: bucket {} entry {applied} brought {got} bytes, {} announced",
                self.link.conn.peer(),
                oldest.seq,
                e.len
            )));
        }
        if let Some(want) = oldest.digests.get(applied) {
            self.check_digest(oldest, applied, want, plan)?;
        }
        apply_landed(applier, oldest, applied)?;
        st.applied += 1;
        st.waiting_since = Instant::now();
        Ok(())
    }

    /// The DIGESTS frame that follows BUCKET `seq` (of `n` entries).
    fn recv_digests(&mut self, seq: u64, n: usize, deadline: Instant) -> Result<Vec<[u8; KEYED]>> {
        let conn = &mut self.link.conn;
        match conn.recv(deadline)? {
            Frame::Digests { seq: s, digests } if s == seq && digests.len() == n => Ok(digests),
            Frame::Digests { seq: s, digests } => Err(Error::peer(format!(
                "{}: digests of bucket {s} ({} entries) after bucket {seq} ({n} entries)",
                conn.peer(),
                digests.len()
            ))),
            other => Err(unexpected(conn, "DIGESTS", &other)),
        }
    }

    /// Entry `k` of `bucket` landed: its bytes must match their keyed digest.
    fn check_digest(
        &self,
        bucket: &Posted,
        k: usize,
        want: &[u8; KEYED],
        plan: &Plan,
    ) -> Result<()> {
        let e = &bucket.entries[k];
        // SAFETY: the entry's receive completed into this range (a slot or
        // the applier's landing, both host memory: keyed excludes gdr).
        let bytes = unsafe { std::slice::from_raw_parts(bucket.landing[k].0, e.len as usize) };
        if crate::checksum::keyed_matches(&self.bytes_key, bytes, want) {
            return Ok(());
        }
        Err(Error::checksum(format!(
            "tensor '{}' from bucket {} of {}: its bytes do not match their keyed BLAKE3 digest \
             (altered or corrupted on the way)",
            plan.entries[e.tensor as usize].meta.name,
            bucket.seq,
            self.link.conn.peer()
        )))
    }

    /// The length that message `tag` (of bucket `seq`) brought, once it
    /// landed; None when it has not within `slice`. A publisher that closed
    /// the control connection (it died, or gave up) is an error at once.
    fn poll_bytes(
        &mut self,
        pump: &Pump,
        early: &mut HashMap<u64, Result<usize>>,
        tag: u64,
        seq: u64,
        slice: Duration,
    ) -> Result<Option<usize>> {
        if let Some(r) = early.remove(&tag) {
            return r.map(Some).map_err(|e| e.context(format!("bucket {seq}")));
        }
        match pump.next(Instant::now() + slice)? {
            Some(Completion { tag: t, result }) if t == tag => result
                .map(Some)
                .map_err(|e| e.context(format!("bucket {seq}"))),
            Some(Completion { tag, result }) => {
                early.insert(tag, result);
                Ok(None)
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
                Err(e.context(format!("waiting for bucket {seq}")))
            }
            None => Ok(None),
        }
    }
}

/// Where one receive stands: posted buckets, oldest first, and how far the
/// oldest is applied.
struct Receiving {
    /// Completions that came before their turn, by tag.
    early: HashMap<u64, Result<usize>>,
    pending: VecDeque<Posted>,
    /// Entries of the oldest pending bucket applied so far.
    applied: usize,
    /// The sequence number the next BUCKET must carry.
    next: u64,
    /// END came: no more buckets.
    ended: bool,
    /// When the oldest bucket's next entry was first waited for.
    waiting_since: Instant,
}

/// Entry `k` of `bucket` landed: hand it to the applier, from its staging
/// slot or (direct) from where it already is.
fn apply_landed(applier: &mut Applier, bucket: &Posted, k: usize) -> Result<()> {
    let e = &bucket.entries[k];
    let at = bucket.slot.map_or(std::ptr::null_mut(), |slot| {
        slot.0.wrapping_add(e.buffer_offset as usize)
    });
    let chunk = Chunk {
        tensor: e.tensor as usize,
        offset: e.tensor_offset,
        len: e.len as usize,
        src: CopySource::Memory(SendPtr(at)),
    };
    let origin = format!("bucket {}", bucket.seq);
    match bucket.slot {
        Some(_) => applier.apply_batch(&origin, &[chunk]),
        None => applier.account_landed(&origin, &[chunk]),
    }
}

/// A bucket whose receives are posted, and its staging slot (None: direct).
struct Posted {
    seq: u64,
    entries: Vec<BucketEntry>,
    slot: Option<SendPtr>,
    /// Where each entry lands.
    landing: Vec<SendPtr>,
    /// Each entry's keyed digest (empty: not asked for).
    digests: Vec<[u8; KEYED]>,
}

/// Post one receive per entry of bucket `seq`: at the entry's offset in its
/// staging slot, or (direct) where the applier wants the bytes.
fn post(
    pump: &Pump,
    seq: u64,
    entries: Vec<BucketEntry>,
    slot: Option<&HostRegion>,
    applier: &mut Applier,
) -> Result<Posted> {
    let mut landing = Vec::with_capacity(entries.len());
    for (k, e) in entries.iter().enumerate() {
        let at = match slot {
            Some(slot) => SendPtr(slot.ptr().wrapping_add(e.buffer_offset as usize)),
            None => {
                applier.receive_buffer_for(e.tensor as usize, e.tensor_offset, e.len as usize)?
            }
        };
        // SAFETY: the range is inside the slot (entries checked against the
        // bucket size) or the tensor's memory (checked by the applier). The
        // pump is dropped, cancelling any receive, before that memory goes;
        // a slot is reposted only after its bucket was applied (the
        // publisher waits for the ACK).
        unsafe { pump.recv(net_tag(seq, k), at.0, e.len as usize)? };
        landing.push(at);
    }
    Ok(Posted {
        seq,
        entries,
        slot: slot.map(|s| SendPtr(s.ptr())),
        landing,
        digests: Vec::new(),
    })
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
