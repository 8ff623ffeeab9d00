//! What the ipc and network sources share: the control connection to a
//! trainer's publisher, the handshake that ends with this rank's manifest,
//! the WANT that follows the plan (a request per plan entry: exactly the
//! bytes it needs), bucket entries mapped back to plan entries, slice
//! checksums (SUMS). Each source adds only how bucket bytes reach it
//! (`from_publisher.rs` makes the `Source` of it).

use crate::apply::{Applier, Chunk, QuantRequest};
use crate::manifest::Manifest;
use crate::memory::copy::CopySource;
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use crate::stop::StopFlag;
use crate::transport::conn::Conn;
use crate::wire::{
    check_size, frames, values_per_frame, BucketEntry, DeltaBase, DeltaRun, Frame, Gathering,
    Request,
};
use std::time::{Duration, Instant};

/// What one pull from a publisher asks for and how long it waits: the
/// part of the ipc and network sources' options they share (HELLO's
/// fields, the engine's bounds).
#[derive(Clone, Debug)]
pub struct PullOptions {
    pub rank: u32,
    pub world_size: u32,
    pub gpu_id: String,
    /// Version asked for; None: the publisher's latest.
    pub version: Option<String>,
    /// The version this rank's params hold, to take deltas against (None:
    /// everything whole).
    pub base: Option<String>,
    /// The most tensors the MANIFEST may announce (the engine's bound,
    /// from the bytes it takes).
    pub manifest_tensors: usize,
    /// How long each frame may take after the one before (the handshake
    /// too), within the update's deadline.
    pub bucket_timeout: Duration,
    /// Ends the update's waits for this publisher once set (the engine's
    /// destroy, or a clear of the version it stages).
    pub stop: Option<StopFlag>,
}

pub struct PublisherLink {
    pub conn: Conn,
    pub manifest: Manifest,
    /// How long a DELTA frame may take after the one before, besides the
    /// update's deadline: the pull's bucket timeout, as between buckets.
    /// AMAX and DELTAS have the update's deadline alone: the publisher
    /// reads or diffs all it serves before sending them, which grows with
    /// the shard.
    frame_timeout: Duration,
    wanted: Wanted,
    /// The version HELLO named as the params' (`deltas.rs`), and whether
    /// the publisher keeps it; taken when WANT is sent.
    base: Base,
    /// The fingerprints WANT named.
    asked: Vec<(u32, u128)>,
    /// Deltas come as UCX messages (the network), not DELTA frames.
    by_message: bool,
    /// The deltas DELTAS announced, to be received as messages.
    pending: Vec<DeltaRun>,
    /// WANT named a base: DELTAS follows (after SCALES).
    deltas_asked: bool,
    /// The requests this publisher quantizes, with their blocks.
    quantized: Vec<(u32, QuantRequest)>,
}

impl PublisherLink {
    /// Send HELLO, run `before_manifest` (the network challenge, given the
    /// HELLO's encoding, which the session keys bind), then take the
    /// MANIFEST, all before `deadline`. `pull`'s stop flag ends the waits
    /// on `conn` from here on, and its bucket timeout bounds each later
    /// frame.
    pub fn handshake(
        mut conn: Conn,
        pull: &PullOptions,
        deadline: Instant,
        before_manifest: impl FnOnce(&mut Conn, &[u8]) -> Result<()>,
    ) -> Result<PublisherLink> {
        conn.stop_when(pull.stop.clone());
        let held = pull.base.clone().unwrap_or_default();
        let hello = Frame::Hello {
            rank: pull.rank,
            world_size: pull.world_size,
            gpu_id: pull.gpu_id.clone(),
            version: pull.version.clone().unwrap_or_default(),
            base: held.clone(),
        };
        conn.send(&hello)?;
        before_manifest(&mut conn, &hello.encode())?;
        conn.limit_manifest(pull.manifest_tensors);
        let (manifest, kept) = match conn.recv(deadline)? {
            Frame::Manifest {
                version,
                tensors,
                base_kept,
            } => {
                let version = (!version.is_empty()).then_some(version);
                let tensors = tensors.into();
                (Manifest { tensors, version }, base_kept)
            }
            other => return Err(unexpected(&conn, "MANIFEST", &other)),
        };
        // The version asked for is the one served, or the update would
        // commit other bytes under the name asked for (or another name).
        // A publisher serving no version serves its content under the name
        // asked for (the request names the version then).
        let asked = (pull.version.as_deref()).filter(|v| !v.is_empty() && *v != "latest");
        if let (Some(asked), Some(served)) = (asked, manifest.version.as_deref()) {
            if served != asked {
                return Err(Error::mismatch(format!(
                    "{}: asked for version '{asked}', it serves '{served}'",
                    conn.peer(),
                )));
            }
        }
        // Fingerprints cost a read of the params: only for a kept base.
        let base = match (held.is_empty(), kept) {
            (true, _) => Base::None,
            (false, true) => Base::Kept(held),
            (false, false) => Base::NotKept,
        };
        Ok(PublisherLink {
            conn,
            manifest,
            frame_timeout: pull.bucket_timeout,
            wanted: Wanted::default(),
            base,
            asked: Vec::new(),
            by_message: false,
            pending: Vec::new(),
            deltas_asked: false,
            quantized: Vec::new(),
        })
    }

    /// Ask for exactly the bytes of source `me` the plan's entries need:
    /// a request per entry that is not skipped, its segments as strided
    /// runs. Verifying, an entry moving part of its tensor gets its slice
    /// checksum from the publisher (SUMS); one taking all of its tensor
    /// (also in another place: a fused param) is checked against the
    /// manifest's.
    pub fn send_want(&mut self, plan: &Plan, me: usize, applier: &mut Applier) -> Result<()> {
        let mut requests = Vec::new();
        let mut wanted = Wanted::default();
        let mut quantized = Vec::new();
        for (i, e) in plan.entries.iter().enumerate() {
            if e.source != me || e.target == Target::Skip {
                continue;
            }
            let blocks = plan.segments(i).iter().filter(|s| s.len > 0);
            let mut q =
                Request::of_blocks(e.tensor as u32, blocks.map(|s| (s.source, s.len)), false);
            // A part of a tensor is checked against the sum the publisher
            // computes as it serves it; all of a tensor (also when it
            // lands in a fused param) against the manifest's.
            q.sums = applier.verifies() && !plan.takes_all(i);
            if let Some(r) = applier.quant_request(i)? {
                quantized.push((requests.len() as u32, r));
            }
            wanted.entries.push(i);
            wanted.bytes.push(q.bytes());
            wanted.sums.push(q.sums);
            wanted.got.push(false);
            requests.push(q);
        }
        check_size(&requests).map_err(|e| e.context(format!("asking {}", self.conn.peer())))?;
        let base = match std::mem::replace(&mut self.base, Base::None) {
            Base::Kept(v) => delta_base(v, &wanted.entries, applier),
            Base::NotKept => {
                applier.note_base(false, 0, 0);
                None
            }
            Base::None => None,
        };
        self.deltas_asked = base.is_some();
        let quant = quantized.iter().map(|(k, r)| (*k, r.scheme)).collect();
        let want = Frame::Want {
            requests,
            base,
            quant,
        };
        self.conn.send(&want)?;
        if let Frame::Want { requests, base, .. } = want {
            wanted.requests = requests;
            self.asked = base.map(|b| b.fingerprints).unwrap_or_default();
        }
        self.wanted = wanted;
        self.quantized = quantized;
        Ok(())
    }

    /// The bound on each DELTA frame after the one before.
    pub fn frame_timeout(&self) -> Duration {
        self.frame_timeout
    }

    /// The next frame `what` before `deadline` and, `bounded`, this
    /// link's frame timeout; a timeout says which frame was awaited.
    pub fn recv_awaiting(&mut self, deadline: Instant, what: &str, bounded: bool) -> Result<Frame> {
        let due = match bounded {
            true => deadline.min(Instant::now() + self.frame_timeout),
            false => deadline,
        };
        self.conn
            .recv(due)
            .map_err(|e| e.context(format!("waiting for {what}")))
    }

    /// AMAX: the publisher's amax of every block of each quantized
    /// request, over as many frames as it takes, offered to the applier's
    /// agreement (nothing without quantized requests).
    pub fn take_amax(&mut self, applier: &mut Applier) -> Result<()> {
        if self.quantized.is_empty() {
            return Ok(());
        }
        let expected = (self.quantized.iter())
            .map(|(k, r)| (*k, r.blocks.len()))
            .collect();
        let mut amax = Gathering::new(expected, "AMAX")?;
        while !amax.complete() {
            let values = match self.recv_awaiting(applier.deadline(), "AMAX", false)? {
                Frame::Amax { values } => values,
                other => return Err(unexpected(&self.conn, "AMAX", &other)),
            };
            (amax.take(values, "AMAX")).map_err(|e| e.context(self.conn.peer()))?;
        }
        for ((_, v), (_, r)) in amax.into_values().iter().zip(&self.quantized) {
            applier.offer_amax(r, v);
        }
        Ok(())
    }

    /// Once every source offered its amax: SCALES with the agreed amax
    /// (nothing without quantized requests).
    pub fn send_scales(&mut self, applier: &Applier) -> Result<()> {
        if self.quantized.is_empty() {
            return Ok(());
        }
        let values = (self.quantized.iter())
            .map(|(k, r)| (*k, applier.agreed_amax(r)))
            .collect();
        for values in frames(values, values_per_frame()) {
            self.conn.send(&Frame::Scales { values })?;
        }
        Ok(())
    }

    /// Whether WANT named a base (the deltas come next).
    pub(super) fn deltas_asked(&self) -> bool {
        self.deltas_asked
    }

    /// The plan entry of request `k` (checked: one of WANT's).
    pub(super) fn entry_of(&self, k: u32) -> Option<usize> {
        self.wanted.entries.get(k as usize).copied()
    }

    /// Deltas come as UCX messages after READY (a network session).
    pub(super) fn set_deltas_by_message(&mut self) {
        self.by_message = true;
    }

    pub(super) fn deltas_by_message(&self) -> bool {
        self.by_message
    }

    pub(super) fn set_pending_deltas(&mut self, due: Vec<DeltaRun>) {
        self.pending = due;
    }

    /// The deltas still to receive as messages (taken).
    pub(super) fn take_pending_deltas(&mut self) -> Vec<DeltaRun> {
        std::mem::take(&mut self.pending)
    }

    /// The requests WANT named a fingerprint for, with it.
    pub(super) fn asked_base(&self) -> &[(u32, u128)] {
        &self.asked
    }

    /// The bytes request `k` asked for.
    pub(super) fn request_bytes(&self, k: u32) -> u64 {
        self.wanted.bytes[k as usize]
    }

    /// The chunk of bucket entry `e` (checked against the bucket: a request
    /// of this WANT) with its bytes at `src`.
    pub fn chunk<'a>(&self, e: &BucketEntry, src: CopySource<'a>) -> Chunk<'a> {
        Chunk {
            tensor: self.wanted.entries[e.request as usize],
            offset: e.offset,
            len: e.len as usize,
            src,
        }
    }

    /// How many requests WANT made (bucket entries name one of them).
    pub fn requests(&self) -> usize {
        self.wanted.entries.len()
    }

    /// The requests WANT made, as sent (WINDOWS entries are expanded by
    /// them).
    pub fn sent_requests(&self) -> &[Request] {
        &self.wanted.requests
    }

    /// The plan entry of bucket entry `e`.
    pub fn entry(&self, e: &BucketEntry) -> usize {
        self.wanted.entries[e.request as usize]
    }

    /// Whether bucket entry `e` holds the last byte of a request that
    /// asked for a slice checksum (its sum must be in before it is
    /// applied).
    pub fn completes_sum(&self, e: &BucketEntry) -> bool {
        let (w, k) = (&self.wanted, e.request as usize);
        w.sums[k] && e.len > 0 && e.offset + e.len == w.bytes[k]
    }

    /// Whether bucket entry `e` completes a part whose sum has not come:
    /// it must not be applied before.
    pub fn awaits_sum(&self, e: &BucketEntry) -> bool {
        self.completes_sum(e) && !self.wanted.got[e.request as usize]
    }

    /// When bucket `seq` (its `entries` checked) holds the last byte of a
    /// request that asked for a slice checksum, its SUMS frame follows:
    /// take it before `deadline` and hand each sum to the applier, before
    /// any byte of the bucket is applied.
    pub fn recv_sums(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        deadline: Instant,
        applier: &mut Applier,
    ) -> Result<()> {
        if !entries.iter().any(|e| self.completes_sum(e)) {
            return Ok(());
        }
        match self.conn.recv(deadline)? {
            Frame::Sums { seq: s, sums } if s == seq => self.take_sums(seq, entries, sums, applier),
            other => Err(unexpected(
                &self.conn,
                &format!("SUMS of bucket {seq}"),
                &other,
            )),
        }
    }

    /// Hand the sums of a SUMS frame of bucket `seq` (its `entries`) to
    /// the applier: each for a request that asked for one, that the bucket
    /// completes, and whose sum has not come yet.
    pub fn take_sums(
        &mut self,
        seq: u64,
        entries: &[BucketEntry],
        sums: Vec<(u32, u128)>,
        applier: &mut Applier,
    ) -> Result<()> {
        for (k, sum) in sums {
            let completes = |e: &BucketEntry| e.request == k && self.completes_sum(e);
            let why = match self.wanted.sums.get(k as usize) {
                None | Some(false) => "which asked for none",
                Some(true) if self.wanted.got[k as usize] => "whose sum came already",
                Some(true) if !entries.iter().any(completes) => "which it does not complete",
                Some(true) => "",
            };
            if !why.is_empty() {
                return Err(Error::peer(format!(
                    "{}: bucket {seq}: a sum for request #{k}, {why}",
                    self.conn.peer()
                )));
            }
            self.wanted.got[k as usize] = true;
            applier.expect_checksum(self.wanted.entries[k as usize], sum)?;
        }
        Ok(())
    }
}

/// The version this rank's params hold, as the handshake left it.
enum Base {
    /// None is held (or deltas are not asked for).
    None,
    /// Held and kept by the publisher: WANT names it.
    Kept(String),
    /// Held, but the publisher does not keep it: everything comes whole.
    NotKept,
}

/// What WANT asked for: request `k` (`requests[k]`) is plan entry
/// `entries[k]`, of `bytes[k]` bytes, and asked for a slice checksum when
/// `sums[k]`.
#[derive(Default)]
struct Wanted {
    requests: Vec<Request>,
    entries: Vec<usize>,
    bytes: Vec<u64>,
    sums: Vec<bool>,
    /// Request k's sum came.
    got: Vec<bool>,
}

/// "<peer>: expected X, got Y".
pub fn unexpected(conn: &Conn, expected: &str, got: &Frame) -> Error {
    Error::peer(format!(
        "{}: expected {expected}, got {}",
        conn.peer(),
        got.name()
    ))
}

/// The base to name in WANT: `version` and the fingerprints of the requests
/// (request `k` is plan entry `entries[k]`) whose params hold a base here.
/// None when none does.
fn delta_base(version: String, entries: &[usize], applier: &Applier) -> Option<DeltaBase> {
    let sums = applier.base_fingerprints(entries);
    let fingerprints: Vec<(u32, u128)> = sums
        .into_iter()
        .enumerate()
        .filter_map(|(k, s)| Some((k as u32, s?)))
        .collect();
    (!fingerprints.is_empty()).then_some(DeltaBase {
        version,
        fingerprints,
    })
}
