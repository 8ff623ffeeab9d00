//! The network sources: a publisher on another node streams buckets over UCX
//! (protocol in `docs/wire.md`; transport in `transport::ucx`).
//!
//! The engine connects over TCP, names its rank and the version it wants
//! ("latest" by default), proves it holds the shared secret (and checks
//! that the publisher does), says where its UCX worker is (READY: the
//! worker is made while it connects, and the publisher reaches it while it
//! hashes), gets its manifest, asks for exactly the bytes its plan needs
//! (WANT's requests), then
//! receives bucket after bucket (`receive`, a step at a time). Every bucket
//! entry (at most `wire::NET_MESSAGE` bytes: one block of its request, or
//! several small ones packed) is its own UCX message:
//!
//! - **direct** (rdma by default, gdr always): received straight where the
//!   applier wants the bytes (`Applier::receive_scatter`): the param itself
//!   in place, the atomic staging arena otherwise, and for device params
//!   without gdr a host buffer (pinned where it can) that goes up to the
//!   GPU. On RDMA hardware the NIC writes the params. A message that lies
//!   there in several pieces (packed small blocks of a column split) is
//!   scattered into them by UCX (an IOV receive) when they average at
//!   least `wire::MIN_SCATTER_PART` bytes; smaller ones (and several pieces of
//!   GPU memory) land in a bounce buffer and are scattered from it. gdr (straight into GPU
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
mod deltas;
mod landing;
mod receive;

use connect::{authenticate, connect};
use receive::{Peer, Receiver};

use super::from_publisher::FromPublisher;
use super::publisher_link::{PublisherLink, PullOptions};
use super::Step;
use crate::apply::Applier;
use crate::checksum::KEYED;
use crate::memory::host::HostRegion;
use crate::memory::pool::Pool;
use crate::plan::Plan;
use crate::result::{Error, Result};
use crate::transport::auth::Secret;
use crate::transport::conn::Conn;
use crate::transport::ucx::Pump;
use crate::wire::{Frame, MAX_BUFFERS};
use std::time::{Duration, Instant};

pub(crate) use crate::defaults::{
    BUCKET_SIZE as DEFAULT_BUCKET_SIZE, BUFFERS_IN_FLIGHT as DEFAULT_DEPTH,
};

#[derive(Clone, Debug)]
pub struct NetOptions {
    /// The publisher's "host:port".
    pub address: String,
    /// Who asks, for what, and how long it waits.
    pub pull: PullOptions,
    pub secret: Secret,
    pub bucket_size: usize,
    pub depth: usize,
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
    /// The session's UCX worker, whose address READY gave, until `begin`
    /// hands it to the receive.
    pump: Option<Pump>,
    /// The receive under way, from `begin` to the last ACK.
    rx: Option<Receiver>,
}

/// Staging slots kept between updates.
static SLOTS: Pool<HostRegion> = Pool::new();

impl NetSource {
    pub fn open(opts: NetOptions, deadline: Instant) -> Result<NetSource> {
        let align = crate::wire::ALIGN as usize;
        if opts.bucket_size < align {
            return Err(Error::invalid_argument(format!(
                "network bucket size {} is below the smallest bucket, {align} bytes",
                opts.bucket_size
            )));
        }
        if opts.depth == 0 || opts.depth > MAX_BUFFERS {
            return Err(Error::invalid_argument(format!(
                "network depth {} is out of range (1 to {MAX_BUFFERS})",
                opts.depth
            )));
        }
        // Fail before connecting when UCX is missing: nothing to receive with.
        // Its first use in a process loads and initializes it (about 0.4 s
        // on a 2-core machine): a deadline that passed meanwhile is said to
        // be UCX's, not blamed on the publisher's silence (audit).
        let loading = Instant::now();
        crate::transport::ucx::ucx()?;
        if Instant::now() >= deadline {
            return Err(Error::timeout(format!(
                "the update's deadline passed while UCX was made ready ({:?}: its first use in \
                 this process loads and initializes it), before connecting to {}",
                loading.elapsed(),
                opts.address
            )));
        }
        // UCX makes the worker while the connection and the challenge run.
        let mut pump = Pump::spawn("engine")?;
        let who = format!("the publisher at {}", opts.address);
        let stream = connect(&opts, deadline)?;
        let step = deadline.min(Instant::now() + opts.pull.bucket_timeout);
        let mut bytes_key = [0; KEYED];
        let conn = Conn::new(stream, who);
        let mut link = PublisherLink::handshake(conn, &opts.pull, step, |conn, hello| {
            bytes_key = authenticate(conn, &opts.secret, hello, step)?;
            pump.started(step)?;
            conn.send(&ready(&pump, &opts))
        })?;
        link.set_deltas_by_message();
        Ok(NetSource {
            link,
            opts,
            bytes_key,
            pump: Some(pump),
            rx: None,
        })
    }
}

/// READY: where the engine's worker is and how it receives. Sent right
/// after the challenge, before MANIFEST, so that the publisher connects to
/// the worker while it hashes its tensors for the manifest (protocol 10).
fn ready(pump: &Pump, opts: &NetOptions) -> Frame {
    Frame::Ready {
        address: pump.address().to_vec(),
        bucket_size: opts.bucket_size as u64,
        depth: opts.depth as u32,
        direct: opts.direct,
        keyed: opts.keyed,
    }
}

impl FromPublisher for NetSource {
    fn link(&self) -> &PublisherLink {
        &self.link
    }

    fn link_mut(&mut self) -> &mut PublisherLink {
        &mut self.link
    }

    fn begin(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()> {
        let pump =
            (self.pump.take()).ok_or_else(|| Error::state("a network session is received once"))?;
        let rx = self.rx.insert(Receiver::start(&self.opts, pump)?);
        rx.receive_deltas(&mut self.link, plan, applier)
    }

    fn advance(&mut self, plan: &Plan, applier: &mut Applier, wait: Duration) -> Result<Step> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(Step::Done);
        };
        let mut peer = Peer {
            link: &mut self.link,
            opts: &self.opts,
            key: &self.bytes_key,
        };
        let step = rx.advance(&mut peer, plan, applier, wait)?;
        if step == Step::Done {
            self.rx = None;
        }
        Ok(step)
    }

    /// Cancel the receives (before the applier's memory goes) and return
    /// the staging slots.
    fn give_up(&mut self) {
        self.rx = None;
    }
}
