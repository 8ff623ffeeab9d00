//! Where a rank sits in its engine, and the checks of it.

use crate::result::{Error, Result};
use std::time::Duration;

/// Where a rank sits in its engine.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Names the group (segment and TCP handshake); unique per engine and node.
    pub name: String,
    pub rank: u32,
    pub world_size: u32,
    /// This rank's index among the ranks of its node.
    pub local_rank: u32,
    /// Ranks on this node.
    pub local_world_size: u32,
    /// This node's index (node 0 holds rank 0).
    pub node_rank: u32,
    /// `host:port` rank 0 listens on when ranks span nodes.
    pub addr: Option<String>,
    /// Bound on every wait: rendezvous, a step's value, a barrier.
    pub timeout: Duration,
    /// This rank's fan-out group, if any (see `signal::fanout`).
    pub fanout: Option<u32>,
}

impl GroupConfig {
    pub(super) fn check(&self) -> Result<()> {
        crate::signal::shm::check_name(&format!("wm.{}.n{}", self.name, self.node_rank))?;
        let bad = |m: String| Err(Error::invalid_argument(m));
        if self.world_size == 0 || self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return bad(format!(
                "local_rank {} is not below local_world_size {}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.local_world_size > self.world_size {
            return bad(format!(
                "local_world_size {} is more than world_size {}",
                self.local_world_size, self.world_size
            ));
        }
        if self.rank == 0 && (self.local_rank != 0 || self.node_rank != 0) {
            return bad("rank 0 must be local rank 0 of node 0".into());
        }
        if self.world_size == self.local_world_size && self.local_rank != self.rank {
            return bad(format!(
                "all ranks are on one node, so local_rank ({}) must equal rank ({})",
                self.local_rank, self.rank
            ));
        }
        if self.world_size > self.local_world_size && self.addr.is_none() {
            return bad("ranks span several nodes: set the rendezvous address of rank 0".into());
        }
        Ok(())
    }

    pub(super) fn segment_name(&self) -> String {
        format!("wm.{}.n{}", self.name, self.node_rank)
    }
}
