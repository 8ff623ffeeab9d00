//! A signal group: every rank of one engine, in step.
//!
//! **Layout.** Ranks on one node share a segment `/dev/shm/wm.<group>.n<node>`
//! created by the node's leader (local rank 0); once every local rank joined,
//! the leader unlinks its name, so nothing is left in /dev/shm even if the
//! engine crashes. Rank 0 is the leader of node 0. With ranks on several
//! nodes, rank 0 listens on `addr` and every other node's leader connects to
//! it over TCP.
//!
//! **Per step (`broadcast`).** Rank 0 reads the value, writes `(step, value)`
//! into a 64-entry ring in the segment and sends it to the other leaders,
//! which write it into their own node's ring. Everybody else reads the ring
//! entry of its step: in the steady state that is one shared-memory load, no
//! syscall, because the value is there before the reader looks (a bounded
//! spin covers small skews, then a futex sleep). The futex wake is paid only
//! when somebody sleeps. A publisher never laps a reader: before step `k` it
//! checks that every local rank consumed step `k - 62`.
//!
//! **Barrier.** For any value other than NORMAL, every rank passes a barrier
//! before returning, so all enter the update or clear together: local ranks
//! count in on a shared word, the leader waits for them, leaders report to
//! rank 0, rank 0 releases them, they release their ranks. Barriers carry a
//! result code per rank, which the manager uses to learn, at rank 0, whether
//! every rank's update succeeded.
//!
//! **Failure.** Every wait has the group's timeout. Between futex sleeps a
//! waiter checks that the process it waits for is alive, so a dead local rank
//! is reported within milliseconds; a dead remote node shows as a closed TCP
//! connection. Errors name the ranks. The first rank to fail writes its
//! reason into the segment (and sends it over TCP): every other rank's next
//! wait fails with that reason, so all survivors name the rank that died.
//! A group that failed stays failed; the engine restarts its ranks.
//!
//! **Files.** `segment`: the shared layout (header, ring, slots), which the
//! fan-out meetings read too; `config`: where a rank sits; `rendezvous`:
//! joining; `step`: `broadcast`; `barrier`; `liveness`: stopping the group
//! and naming dead ranks.

use crate::signal::link::Msg;
use std::net::TcpStream;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

mod barrier;
mod config;
mod liveness;
mod rendezvous;
pub(crate) mod segment;
mod step;

pub use config::GroupConfig;
use segment::{Header, Segment, Slot};

const NO_RANK: u32 = u32::MAX;

enum Link {
    /// All ranks on one node.
    Local,
    /// Rank 0 with leaders of other nodes.
    Root(Vec<Peer>),
    /// Leader of another node, connected to rank 0.
    Leader(TcpStream),
    /// Not a leader.
    Member,
}

struct Peer {
    stream: TcpStream,
    node: u32,
    ranks: Vec<u32>,
}

impl Peer {
    fn who(&self) -> String {
        format!("node {} (ranks {})", self.node, list(&self.ranks))
    }
}

/// "0, 2, 5": ranks in messages.
pub(crate) fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A rank's group: what all its threads may read at once
/// ([`GroupShared`]), and the steps' own state, which the rank's stepping
/// thread holds under the signal plane's lock.
pub struct Group {
    shared: Arc<GroupShared>,
    link: Link,
    step: u64,
    gen: u64,
}

/// Where the rank sits, the shared segment and the rank found dead: read by
/// the steps and by the fan-out meetings, which run on a staging thread
/// without the signal plane's lock. (Under it, a meeting waiting for another
/// rank's staging thread held this rank's steps back, while that rank's
/// steps waited in a barrier for this one: both stalled until the group's
/// timeout.)
pub struct GroupShared {
    pub(super) cfg: GroupConfig,
    /// Spin budget of waits: short when ranks outnumber cores.
    spin: u32,
    seg: Segment,
    /// The rank this process found dead (`NO_RANK`: none yet).
    failed_rank: AtomicU32,
}

impl std::ops::Deref for Group {
    type Target = GroupShared;
    fn deref(&self) -> &GroupShared {
        &self.shared
    }
}

impl Group {
    /// The part of the group other threads may hold while the steps go on.
    pub fn shared(&self) -> Arc<GroupShared> {
        self.shared.clone()
    }

    /// The step the next `broadcast` serves.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Send `msg` to every other node's leader (rank 0 only).
    fn send_to_peers(peers: &mut [Peer], msg: &Msg) -> crate::result::Result<()> {
        for p in peers.iter_mut() {
            let who = p.who();
            crate::signal::link::send(&mut p.stream, msg, &who)?;
        }
        Ok(())
    }
}

impl GroupShared {
    fn header(&self) -> &Header {
        self.seg.header()
    }

    pub(super) fn slot(&self, i: u32) -> &Slot {
        self.seg.slot(i)
    }

    pub(super) fn me(&self) -> &Slot {
        self.slot(self.cfg.local_rank)
    }
}
