//! Where update bytes come from. A source knows two things: its manifest, and
//! how to hand its bytes to the applier as chunks. Everything else
//! (validation, checksums, staging, progress) is the applier's.

mod deltas;
mod from_publisher;
pub mod ipc;
pub mod locations;
pub mod net;
mod publisher_link;
pub mod snapshot;
mod streaming;

pub use publisher_link::PullOptions;
pub use streaming::stream_all;

use crate::apply::Applier;
use crate::manifest::Manifest;
use crate::plan::Plan;
use crate::result::{Error, Result};
use std::time::Duration;

/// The update paths. Numbers are part of the ABI (`wm_update_request.source`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// safetensors files on disk.
    Snapshot = 0,
    /// Same node: buffers a trainer shares over a Unix socket.
    Ipc = 1,
    /// Other node over UCX: received straight into param memory (or the
    /// atomic arena) by default; into staging slots first with `wm_net_config.staged`.
    Rdma = 2,
    /// Other node: straight into GPU memory.
    Gdr = 3,
}

impl SourceKind {
    pub fn from_raw(raw: u32) -> Option<SourceKind> {
        [
            SourceKind::Snapshot,
            SourceKind::Ipc,
            SourceKind::Rdma,
            SourceKind::Gdr,
        ]
        .get(raw as usize)
        .copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Snapshot => "snapshot",
            SourceKind::Ipc => "ipc",
            SourceKind::Rdma => "rdma",
            SourceKind::Gdr => "gdr",
        }
    }
}

/// What one [`Source::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Bytes moved (step again at once).
    Moved,
    /// Nothing came within the wait.
    Waiting,
    /// Every planned byte of this source was handed to the applier.
    Done,
}

/// One source of an update. An update may read from several at once
/// (trainer ranks each serving their shards): the plan numbers them, and
/// source `me` hands over exactly the plan entries whose `source` is `me`.
/// [`stream_all`] drives them together: `start` each, then `step` each in
/// turn until every one is done, so that no source waits on another.
pub trait Source {
    /// Every tensor the source will deliver, and the version it names.
    fn manifest(&self) -> &Manifest;
    /// Why the source names no version, for the no-version error.
    fn no_version_reason(&self) -> String;
    /// One line naming the source (for logs, errors and `wm inspect`).
    fn describe(&self) -> String;
    /// Whether the source checksums every part of a tensor it serves
    /// (`Applier::expect_checksum`), so that slices can be verified.
    fn checks_slices(&self) -> bool {
        false
    }
    /// Ask for this source's planned bytes (nothing is applied yet).
    fn start(&mut self, plan: &Plan, me: usize, applier: &mut Applier) -> Result<()>;
    /// Once every source started: what this source offers to an
    /// agreement across the sources (publishers quantizing to FP8: each
    /// block's amax, AMAX).
    fn collect(&mut self, _applier: &mut Applier) -> Result<()> {
        Ok(())
    }
    /// Once every source offered: the agreement's outcome (SCALES).
    fn answer(&mut self, _applier: &Applier) -> Result<()> {
        Ok(())
    }
    /// Once every source has the outcome: get ready to receive.
    fn start_streaming(&mut self, _plan: &Plan, _me: usize, _applier: &mut Applier) -> Result<()> {
        Ok(())
    }
    /// Hand what has come to `applier`, waiting at most about `wait` for
    /// something to come.
    fn step(
        &mut self,
        plan: &Plan,
        me: usize,
        applier: &mut Applier,
        wait: Duration,
    ) -> Result<Step>;
    /// The update failed, here or at another source: tell the peer why.
    fn abort(&mut self, _why: &Error) {}
}
