//! Where update bytes come from. A source knows two things: its manifest, and
//! how to hand its bytes to the applier as chunks. Everything else
//! (validation, checksums, staging, progress) is the applier's.

pub mod ipc;
pub mod net;
mod publisher_link;
pub mod snapshot;

use crate::apply::Applier;
use crate::manifest::Manifest;
use crate::plan::Plan;
use crate::result::Result;

/// The update paths. Numbers are part of the ABI (`wm_update_request.source`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// safetensors files on disk.
    Snapshot = 0,
    /// Same node: buffers a trainer shares over a Unix socket.
    Ipc = 1,
    /// Other node over UCX: received straight into param memory (or the
    /// atomic arena) by default; into staging slots first with `net_staged`.
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

pub trait Source {
    /// Every tensor the source will deliver, and the version it names.
    fn manifest(&self) -> &Manifest;
    /// Why the source names no version, for the no-version error.
    fn no_version_reason(&self) -> String;
    /// Hand every planned tensor's bytes to `applier`, in batches.
    fn stream(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()>;
    /// One line naming the source (for logs and `wm inspect`).
    fn describe(&self) -> String;
}
