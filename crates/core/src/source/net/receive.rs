//! Receiving one network session, a step at a time: BUCKET frames get
//! their UCX receives posted as soon as they come, landed entries are
//! applied (verified) one by one while their bytes are in cache, and each
//! bucket is acknowledged once its last entry is. The pump and the receive
//! state live here between steps, so several network sources are read at
//! once (one UCX worker each).
//! Where each message lands is `landing`'s.

use super::landing::{apply_landed, post, Bounce, Landings, Posted};
use super::NetOptions;
use crate::apply::Applier;
use crate::checksum::KEYED;
use crate::plan::Plan;
use crate::result::{Error, Result};
use crate::source::publisher_link::{unexpected, PublisherLink};
use crate::source::Step;
use crate::transport::ucx::{Completion, Pump};
use crate::wire::message_tag as net_tag;
use crate::wire::{check_bucket, Frame, NET_MESSAGE};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The session's side that a step reads: the control connection, the
/// options, and the key of the bucket bytes' digests.
pub(super) struct Peer<'a> {
    pub link: &'a mut PublisherLink,
    pub opts: &'a NetOptions,
    pub key: &'a [u8; KEYED],
}

/// One session's receive, from the first bucket to the last ACK. Dropping it cancels
/// the posted receives (the pump goes first) and only then returns the
/// staging slots and bounce buffers; the applier's memory (direct
/// receives) outlives it.
pub(super) struct Receiver {
    pump: Option<Pump>,
    /// Staged: the staging slots, grown as buckets need (None: direct).
    slots: Option<Bounce>,
    /// Direct: where messages that do not land in one piece go.
    bounce: Bounce,
    /// The delta messages' buffers (`deltas.rs`): dropped after the pump,
    /// which cancels any receive still posted into them.
    pub(super) deltas: Vec<Vec<u8>>,
    st: Receiving,
}

impl Drop for Receiver {
    /// The pump first: it cancels the receives posted into the slots and
    /// bounce buffers, which go back to the pool after (field order).
    fn drop(&mut self) {
        self.pump = None;
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
    /// When something last moved (a frame, a landed entry, an ACK).
    waiting_since: Instant,
}

impl Receiver {
    /// Take the staging slots (staged) and this session's UCX worker,
    /// whose address the publisher already has (READY, sent at `open`).
    pub(super) fn start(opts: &NetOptions, pump: Pump) -> Result<Receiver> {
        let (depth, size) = (opts.depth, opts.bucket_size as u64);
        let slots = (!opts.direct).then(|| Bounce::new("network staging slot", depth, size));
        let mut rx = Receiver {
            pump: None,
            slots,
            bounce: Bounce::new("network bounce buffer", depth, size),
            deltas: Vec::new(),
            st: Receiving {
                early: HashMap::new(),
                pending: VecDeque::new(),
                applied: 0,
                next: 0,
                ended: false,
                waiting_since: Instant::now(),
            },
        };
        rx.pump = Some(pump);
        Ok(rx)
    }

    /// The session's UCX worker.
    pub(super) fn pump(&self) -> &Pump {
        self.pump.as_ref().expect("started")
    }

    /// One pass: a BUCKET frame waiting gets its receives posted (so its
    /// bytes flow while earlier buckets are applied); else the oldest
    /// bucket's next entry is applied once it lands, or the bucket is
    /// acknowledged once all have. Waits at most about `wait`.
    pub(super) fn advance(
        &mut self,
        p: &mut Peer,
        plan: &Plan,
        applier: &mut Applier,
        wait: Duration,
    ) -> Result<Step> {
        // Out of time while this publisher still owes bytes: name it.
        let owed =
            |e: crate::result::Error| e.context(format!("waiting for {}", p.link.conn.peer()));
        applier.check_deadline().map_err(owed)?;
        if !self.st.ended {
            let idle = self.st.pending.is_empty();
            let conn = &p.link.conn;
            let frame = match idle {
                true => conn.readable_within(wait),
                false => conn.readable(),
            };
            if frame {
                self.take_frame(p, applier)?;
                return Ok(Step::Moved);
            }
            if idle {
                check_stall(self.st.waiting_since, p, applier, ("bytes", self.st.next))?;
                return Ok(Step::Waiting);
            }
        }
        let Some(oldest) = self.st.pending.front() else {
            return Ok(Step::Done); // ended, and every bucket acknowledged
        };
        if self.st.applied < oldest.entries.len() {
            return self.apply_next_entry(p, plan, applier, wait);
        }
        p.link.conn.send(&Frame::Ack { seq: oldest.seq })?;
        self.st.pending.pop_front();
        self.st.applied = 0;
        self.st.waiting_since = Instant::now();
        Ok(Step::Moved)
    }

    /// The next control frame: a BUCKET (with its DIGESTS) gets its
    /// receives posted, a SUMS hands a posted bucket's sums to the applier,
    /// END marks the stream ended.
    fn take_frame(&mut self, p: &mut Peer, applier: &mut Applier) -> Result<()> {
        let frame_deadline = (Instant::now() + p.opts.pull.bucket_timeout).min(applier.deadline());
        let (seq, buffer, entries) = match p.link.conn.recv(frame_deadline)? {
            Frame::Bucket {
                seq,
                buffer,
                entries,
            } => (seq, buffer, entries),
            Frame::Sums { seq, sums } => return self.take_sums(p, applier, seq, sums),
            Frame::End { buckets } if buckets == self.st.next => {
                let owes = |b: &&Posted| b.entries.iter().any(|e| p.link.awaits_sum(e));
                if let Some(b) = self.st.pending.iter().find(owes) {
                    return Err(Error::peer(format!(
                        "{}: END before the SUMS of bucket {}",
                        p.link.conn.peer(),
                        b.seq
                    )));
                }
                self.st.ended = true;
                return Ok(());
            }
            Frame::End { buckets } => {
                return Err(Error::peer(format!(
                    "{}: END after {buckets} buckets, {} received",
                    p.link.conn.peer(),
                    self.st.next
                )))
            }
            other => return Err(unexpected(&p.link.conn, "BUCKET or END", &other)),
        };
        self.check_bucket_order(p, seq, buffer)?;
        // Messages are blocks of requests: where they sit in a slot needs
        // no alignment (nothing maps it).
        let slot_size = p.opts.bucket_size as u64;
        check_bucket(seq, &entries, slot_size, p.link.requests(), 1)?;
        check_messages(seq, &entries)?;
        let digests = match p.opts.keyed {
            true => recv_digests(p.link, seq, entries.len(), frame_deadline)?,
            false => Vec::new(),
        };
        // The slot holds the bucket's messages at their offsets: as far as
        // the last one ends (checked within the bucket size above).
        let extent = entries.iter().map(|e| e.buffer_offset + e.len).max();
        let slot = match &mut self.slots {
            Some(slots) => Some(slots.take(seq, extent.unwrap_or(0))?),
            None => None,
        };
        if self.st.pending.is_empty() {
            self.st.waiting_since = Instant::now();
        }
        let pump = self.pump.as_ref().expect("started");
        let at = Landings {
            slot,
            bounce: &mut self.bounce,
        };
        let mut posted = post(pump, p.link, seq, entries, at, applier)?;
        posted.digests = digests;
        self.st.pending.push_back(posted);
        self.st.next += 1;
        Ok(())
    }

    /// A SUMS frame of bucket `seq` (one of several, each after the chunk
    /// of messages completing its parts): the bucket must be in flight.
    fn take_sums(
        &mut self,
        p: &mut Peer,
        applier: &mut Applier,
        seq: u64,
        sums: Vec<(u32, u128)>,
    ) -> Result<()> {
        let Some(bucket) = self.st.pending.iter().find(|b| b.seq == seq) else {
            return Err(Error::peer(format!(
                "{}: SUMS of bucket {seq}, which is not in flight",
                p.link.conn.peer()
            )));
        };
        p.link.take_sums(seq, &bucket.entries, sums, applier)
    }

    /// The bucket is the next one, in its slot (`seq % depth`, direct or
    /// staged: direct has no slots, but a publisher naming another is not
    /// the one the protocol describes), with room for it in flight.
    fn check_bucket_order(&self, p: &Peer, seq: u64, buffer: u32) -> Result<()> {
        let (depth, st) = (p.opts.depth, &self.st);
        if seq != st.next || buffer as u64 != seq % depth as u64 || st.pending.len() >= depth {
            return Err(Error::peer(format!(
                "{}: bucket {seq} in slot {buffer} with {} unacknowledged, expected bucket {} in slot {} with fewer than {depth}",
                p.link.conn.peer(),
                st.pending.len(),
                st.next,
                st.next % depth as u64
            )));
        }
        Ok(())
    }

    /// Wait (at most `wait`) for the oldest bucket's next entry to land,
    /// then check its length and digest and hand it to the applier
    /// (copied, verified) at once, while its bytes are still in cache.
    fn apply_next_entry(
        &mut self,
        p: &mut Peer,
        plan: &Plan,
        applier: &mut Applier,
        wait: Duration,
    ) -> Result<Step> {
        // Wait briefly when another frame may come, so it is posted soon.
        let slice = match self.st.pending.len() < p.opts.depth && !self.st.ended {
            true => Duration::from_millis(1),
            false => Duration::from_millis(50),
        }
        .min(wait);
        let oldest = self.st.pending.front().expect("a posted bucket");
        if p.link.awaits_sum(&oldest.entries[self.st.applied]) {
            return self.await_sums(p, applier, slice);
        }
        let st = &mut self.st;
        let oldest = st.pending.front().expect("a posted bucket");
        let k = st.applied;
        let tag = net_tag(oldest.seq, k);
        let pump = self.pump.as_ref().expect("started");
        let Some(got) = poll_bytes(pump, p.link, &mut st.early, tag, oldest.seq, slice)? else {
            check_stall(st.waiting_since, p, applier, ("bytes", oldest.seq))?;
            return Ok(Step::Waiting);
        };
        let e = &oldest.entries[k];
        if got as u64 != e.len {
            return Err(Error::peer(format!(
                "{}: bucket {} entry {k} brought {got} bytes, {} announced",
                p.link.conn.peer(),
                oldest.seq,
                e.len
            )));
        }
        if let Some(want) = oldest.digests.get(k) {
            check_digest(p, oldest, k, want, plan)?;
        }
        apply_landed(applier, p.link, oldest, k)?;
        st.applied += 1;
        st.waiting_since = Instant::now();
        Ok(Step::Moved)
    }

    /// The oldest bucket's next entry completes a part whose sum is still
    /// to come (SUMS follows the bucket's messages): take the next frame
    /// when one comes within `slice`.
    fn await_sums(&mut self, p: &mut Peer, applier: &mut Applier, slice: Duration) -> Result<Step> {
        if p.link.conn.readable_within(slice) {
            self.take_frame(p, applier)?;
            return Ok(Step::Moved);
        }
        let seq = self.st.pending.front().map_or(0, |b| b.seq);
        check_stall(self.st.waiting_since, p, applier, ("SUMS", seq))?;
        Ok(Step::Waiting)
    }
}

/// Nothing moved since `since`, for the bucket timeout: `what` ("bytes",
/// "SUMS") of bucket `seq` is late. Not when the update's own deadline
/// comes first or with it: the update's timeout is then the one reported
/// (both timers used to race at the same instant).
fn check_stall(
    since: Instant,
    p: &Peer,
    applier: &Applier,
    (what, seq): (&str, u64),
) -> Result<()> {
    let bound = since + p.opts.pull.bucket_timeout;
    if Instant::now() <= bound || bound >= applier.deadline() {
        return Ok(());
    }
    Err(Error::timeout(format!(
        "{}: the {what} of bucket {seq} did not arrive within {:?}",
        p.link.conn.peer(),
        p.opts.pull.bucket_timeout
    )))
}

/// The DIGESTS frame that follows BUCKET `seq` (of `n` entries).
fn recv_digests(
    link: &mut PublisherLink,
    seq: u64,
    n: usize,
    deadline: Instant,
) -> Result<Vec<[u8; KEYED]>> {
    let conn = &mut link.conn;
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
    p: &Peer,
    bucket: &Posted,
    k: usize,
    want: &[u8; KEYED],
    plan: &Plan,
) -> Result<()> {
    let e = &bucket.entries[k];
    let mut hash = blake3::Hasher::new_keyed(p.key);
    for (at, len) in bucket.landing[k].scatter_list(e.len as usize) {
        // SAFETY: the entry's receive completed into these pieces (a slot,
        // or the applier's landing, both host memory: keyed excludes gdr).
        hash.update(unsafe { std::slice::from_raw_parts(at.0, len) });
    }
    // blake3::Hash compares in constant time.
    if hash.finalize() == blake3::Hash::from(*want) {
        return Ok(());
    }
    Err(Error::checksum(format!(
        "tensor '{}' from bucket {} of {}: its bytes do not match their keyed BLAKE3 digest \
         (altered or corrupted on the way)",
        plan.entries[p.link.entry(e)].meta.name,
        bucket.seq,
        p.link.conn.peer()
    )))
}

/// The length that message `tag` (of bucket `seq`) brought, once it
/// landed; None when it has not within `slice`. A publisher that closed
/// the control connection (it died, or gave up) is an error at once; so is
/// a message UCX could not receive (longer than its entry), naming it.
fn poll_bytes(
    pump: &Pump,
    link: &mut PublisherLink,
    early: &mut HashMap<u64, Result<usize>>,
    tag: u64,
    seq: u64,
    slice: Duration,
) -> Result<Option<usize>> {
    let named = |e: Error| {
        let k = (tag & 0xffff_ffff).saturating_sub(1);
        e.context(format!("{}: bucket {seq} entry {k}", link.conn.peer()))
    };
    if let Some(r) = early.remove(&tag) {
        return r.map(Some).map_err(named);
    }
    match pump.next(Instant::now() + slice)? {
        Some(Completion { tag: t, result }) if t == tag => result.map(Some).map_err(named),
        Some(Completion { tag, result }) => {
            early.insert(tag, result);
            Ok(None)
        }
        None if link.conn.peer_hung_up() => {
            // Prefer the publisher's own reason, when it sent one.
            let e = match link.conn.recv(Instant::now() + Duration::from_millis(100)) {
                Err(e) => e,
                Ok(f) => Error::peer(format!("{}: unexpected {}", link.conn.peer(), f.name())),
            };
            Err(e.context(format!("waiting for bucket {seq}")))
        }
        None => Ok(None),
    }
}

/// Every entry of a network bucket is one UCX message of at most
/// `NET_MESSAGE` bytes: a longer one is refused before any receive is
/// posted (a direct receive of it would wait for a message the protocol
/// never sends, until the bucket timeout).
fn check_messages(seq: u64, entries: &[crate::wire::BucketEntry]) -> Result<()> {
    match entries.iter().position(|e| e.len > NET_MESSAGE) {
        Some(k) => Err(Error::peer(format!(
            "bucket {seq}: entry {k} is {} bytes; a network message is at most {NET_MESSAGE}",
            entries[k].len
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use crate::wire::{BucketEntry, NET_MESSAGE};

    #[test]
    fn a_network_entry_over_one_message_is_refused_naming_it() {
        let entry = |len| BucketEntry {
            request: 0,
            offset: 0,
            len,
            buffer_offset: 0,
        };
        assert!(super::check_messages(3, &[entry(NET_MESSAGE), entry(1)]).is_ok());
        let e = super::check_messages(3, &[entry(1), entry(NET_MESSAGE + 1)]).unwrap_err();
        assert!(
            e.message.contains("bucket 3: entry 1 is 1048577 bytes"),
            "{e}"
        );
    }
}
