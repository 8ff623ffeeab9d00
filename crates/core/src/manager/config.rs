//! What a manager is configured with, what an update asks for, and what
//! updates and clears report back.

use super::deltas::DeltaMode;
use crate::apply::{Hooks, Mode};
use crate::fanout::FanoutSettings;
use crate::logging::Logger;
use crate::result::{Error, Result};
use crate::signal::GroupConfig;
use crate::source::net;
use crate::source::snapshot;
use crate::source::SourceKind;
use crate::state::State;
use std::path::PathBuf;
use std::time::Duration;

/// Default bound on a whole update (`UpdateRequest::timeout`).
pub const DEFAULT_TIMEOUT: Duration = crate::defaults::UPDATE_TIMEOUT;

/// Called with (name, pointer, length) for each engine-owned param on clear.
pub type ReleaseHook = Box<dyn Fn(&str, *mut u8, usize) + Send + Sync>;
/// Called with (name, old pointer, length) for each engine-owned param before
/// the first update after a clear; returns the memory to write (the old
/// pointer or a new one), or None to fail the update.
pub type AcquireHook = Box<dyn Fn(&str, *mut u8, usize) -> Option<*mut u8> + Send + Sync>;

pub struct ManagerConfig {
    pub rank: u32,
    pub world_size: u32,
    /// CUDA device index of the rank, or -1 for a host-only engine. Picks
    /// `G` in snapshot file names through `CUDA_VISIBLE_DEVICES`.
    pub device: i32,
    /// Default snapshot location when a request names none.
    pub model_dir: Option<PathBuf>,
    /// Directory searched last for snapshot files (`checkpoint::layout`);
    /// `None` disables it.
    pub fallback_dir: Option<PathBuf>,
    /// Name of the shared-memory control cell (`/dev/shm/<name>`), if any;
    /// read and written by rank 0 only.
    pub control_cell: Option<String>,
    /// How the ranks meet; required when `world_size` > 1.
    pub group: Option<GroupSettings>,
    pub logger: Logger,
    /// Copy threads; 0 means one per core.
    pub threads: usize,
    /// IPC: accept a publisher running as another uid (default: same uid only).
    pub allow_other_uids: bool,
    pub release_hook: Option<ReleaseHook>,
    pub acquire_hook: Option<AcquireHook>,
    /// The network paths (rdma, gdr).
    pub net: NetSettings,
    /// NCCL fan-out among this node's ranks (see [`crate::fanout`]); needs
    /// a group and a device.
    pub fanout: Option<FanoutSettings>,
    /// The most bytes of tensors for the per-tensor callback an update may
    /// make the library hold: their sizes come from the source (a peer's
    /// manifest), with no registered param to bound them. Atomic mode
    /// stages all of them at once; in place, any one of them (and those
    /// received at once) must fit. Over it, the update fails with
    /// `WM_ERR_OUT_OF_MEMORY` before anything is allocated.
    pub callback_staging_limit: u64,
    /// Atomic mode: keep staging memory from one update to the next, so
    /// only the first update faults it in: the packed staging of
    /// engine-owned host params, device params and callback tensors, and
    /// the next update's shadows of library-owned host params (faulted in
    /// between updates, `shadows.rs`); in place too, the buffers a
    /// snapshot's bytes of quantized params land in before they are
    /// quantized (their source dtype's bytes: faulting them in cost more
    /// than quantizing). Memory: one more copy of those params while the
    /// engine runs, freed by `clear` and the manager's end. Default true
    /// (`free_atomic_staging` = 0 in C).
    pub keep_atomic_staging: bool,
    /// Atomic mode: commit library-owned device params that an update
    /// writes whole by a device page swap (`apply/device_swap.rs`): the
    /// update is uploaded into fresh device memory while the engine still
    /// reads the old weights, and the commit maps it at the param's
    /// addresses and frees the old memory. Costs one more copy of those
    /// params in device memory during each update. Default false: the
    /// commit uploads into the params themselves.
    pub swap_device_pages: bool,
}

/// Settings of the network paths.
#[derive(Clone, Debug)]
pub struct NetSettings {
    /// Shared secret; None: `WM_NET_SECRET`.
    pub secret: Option<Vec<u8>>,
    /// Staging slot size, the largest bucket (default 512 MiB).
    pub bucket_size: usize,
    /// Buckets in flight (default 2).
    pub depth: usize,
    /// gdr may run as rdma (with a warning) when it cannot land in GPU memory.
    pub gdr_fallback: bool,
    /// rdma: receive each bucket into a staging slot and copy it to the
    /// params from there, instead of straight into param memory (or the
    /// atomic arena); off by default (`source::net`, README "Decisions").
    pub staged: bool,
    /// rdma: authenticate every bucket entry's bytes with a keyed BLAKE3
    /// digest the publisher sends (for untrusted networks; the manifest's
    /// XXH3 catches corruption, not forgery). Off by default; not for gdr.
    pub keyed_digests: bool,
}

impl Default for NetSettings {
    fn default() -> NetSettings {
        NetSettings {
            secret: None,
            bucket_size: net::DEFAULT_BUCKET_SIZE,
            depth: net::DEFAULT_DEPTH,
            gdr_fallback: false,
            staged: false,
            keyed_digests: false,
        }
    }
}

impl Default for ManagerConfig {
    fn default() -> ManagerConfig {
        ManagerConfig {
            rank: 0,
            world_size: 1,
            device: -1,
            model_dir: None,
            fallback_dir: Some(PathBuf::from(snapshot::DEFAULT_FALLBACK_DIR)),
            control_cell: None,
            group: None,
            logger: Logger::default(),
            threads: 0,
            allow_other_uids: false,
            release_hook: None,
            acquire_hook: None,
            net: NetSettings::default(),
            fanout: None,
            callback_staging_limit: crate::defaults::CALLBACK_STAGING_LIMIT,
            keep_atomic_staging: true,
            swap_device_pages: false,
        }
    }
}

impl ManagerConfig {
    /// The checks `Manager::new` makes before anything is opened.
    pub(super) fn check(&self) -> Result<()> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid_argument(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            )));
        }
        if self.device < -1 {
            return Err(Error::invalid_argument(format!(
                "device {} is not a CUDA device index (0 or more) or -1 (a host-only engine)",
                self.device
            )));
        }
        let max = crate::wire::MAX_BUFFERS;
        if !(1..=max).contains(&self.net.depth) {
            return Err(Error::invalid_argument(format!(
                "net depth {} is out of range (1 to {max})",
                self.net.depth
            )));
        }
        if self.net.bucket_size < crate::wire::ALIGN as usize {
            return Err(Error::invalid_argument(format!(
                "net bucket size {} is below the smallest bucket, {} bytes",
                self.net.bucket_size,
                crate::wire::ALIGN
            )));
        }
        if self.net.bucket_size as u64 > crate::wire::MAX_NET_BUCKET {
            return Err(Error::invalid_argument(format!(
                "net bucket size {} is above the largest bucket, 16 GiB",
                self.net.bucket_size
            )));
        }
        // A short secret would fail every network update later: said
        // here, at init (one from WM_NET_SECRET at the first network
        // update, with the same code).
        let min = crate::transport::auth::MIN_SECRET;
        if let Some(secret) = self.net.secret.as_ref().filter(|s| s.len() < min) {
            return Err(Error::invalid_argument(format!(
                "net secret has {} bytes; at least {min} are required",
                secret.len()
            )));
        }
        if self.fanout.is_some() {
            if self.group.is_none() || self.world_size < 2 {
                return Err(Error::invalid_argument(
                    "wm_fanout_config.group (Python: fanout_group) needs the ranks in a group \
                     (world_size > 1 and wm_group_config.name)",
                ));
            }
            if self.device < 0 {
                return Err(Error::invalid_argument(
                    "wm_fanout_config.group (Python: fanout_group) needs this rank's GPU (device >= 0): \
                     fan-out moves device params",
                ));
            }
        }
        Ok(())
    }

    /// How the signal plane meets the other ranks, if they are a group.
    pub(super) fn group_config(&self) -> Option<GroupConfig> {
        self.group.as_ref().map(|g| GroupConfig {
            name: g.name.clone(),
            rank: self.rank,
            world_size: self.world_size,
            local_rank: g.local_rank.unwrap_or(self.rank),
            local_world_size: g.local_world_size.unwrap_or(self.world_size),
            node_rank: g.node_rank,
            addr: g.addr.clone(),
            timeout: g.timeout,
            fanout: self.fanout.as_ref().map(|f| f.group),
        })
    }
}

/// Where this rank sits among the engine's ranks (see [`crate::signal::group`]).
#[derive(Clone, Debug)]
pub struct GroupSettings {
    pub name: String,
    /// None: all ranks on one node (local rank = rank).
    pub local_rank: Option<u32>,
    pub local_world_size: Option<u32>,
    pub node_rank: u32,
    /// `host:port` of rank 0, when ranks span nodes.
    pub addr: Option<String>,
    /// Bound on rendezvous and on every per-step wait.
    pub timeout: Duration,
}

/// What to update from and how.
pub struct UpdateRequest<'h> {
    pub source: SourceKind,
    /// Where the bytes come from: snapshot: a model directory or file
    /// (empty: the config's model_dir); ipc: publisher socket paths;
    /// rdma, gdr: publishers' `host:port`. Several publishers (one per
    /// trainer rank) serve one version together; `@FILE` names a file
    /// listing locations, one per line (`source::locations`).
    pub locations: Vec<PathBuf>,
    /// None: the version the source names (snapshot: `version.yaml`).
    pub version: Option<String>,
    pub verify: bool,
    /// The network sources (rdma, gdr) verify checksums unless this is set.
    pub skip_network_checksums: bool,
    pub mode: Mode,
    pub skip_unknown: bool,
    /// Whether runs may come as deltas (`manager::deltas`).
    pub deltas: DeltaMode,
    pub timeout: Duration,
    pub hooks: Hooks<'h>,
}

impl<'h> UpdateRequest<'h> {
    pub fn snapshot(location: impl Into<PathBuf>) -> UpdateRequest<'h> {
        UpdateRequest {
            source: SourceKind::Snapshot,
            locations: vec![location.into()],
            version: None,
            verify: false,
            skip_network_checksums: false,
            mode: Mode::Atomic,
            skip_unknown: false,
            deltas: DeltaMode::Auto,
            timeout: DEFAULT_TIMEOUT,
            hooks: Hooks::default(),
        }
    }
}

/// Statistics of one update: receiving (`sync`), applying (`update`) and the whole call (`total`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpdateStats {
    pub version: String,
    pub rank: u32,
    pub tensors: u64,
    pub bytes: u64,
    /// Receiving: source bytes into library-visible memory, checksums included.
    pub sync: Duration,
    /// Applying: staged bytes into params, callbacks.
    pub update: Duration,
    /// Whole call, planning included.
    pub total: Duration,
    /// Planning (or finding the last plan still valid).
    pub plan_time: Duration,
    /// The last update's plan was reused: the layouts had not changed.
    pub plan_reused: bool,
    /// Bytes moved from each source, in the order the request names them.
    pub source_bytes: Vec<u64>,
    /// What deltas did.
    pub deltas: super::DeltaStats,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClearStats {
    pub params: u64,
    pub bytes_released: u64,
    /// GPU memory the driver reports freed by releasing library-owned
    /// device params (its free-memory query before and after; other users
    /// of the GPU can shift it). 0 without such params.
    pub device_bytes_freed: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub state: State,
    /// Version of the weights in the params (None before the first update,
    /// after a clear, and after an update that left them half-written:
    /// FAILED).
    pub version: Option<String>,
    pub updates: u64,
    pub last_update: Option<UpdateStats>,
    pub last_error: Option<Error>,
    pub params: u64,
    pub param_bytes: u64,
    pub resident_bytes: u64,
    /// GPU memory freed by the last clear, as the driver reports it.
    pub device_bytes_freed: u64,
    /// GPU memory taken back by the last update after a clear, as the
    /// driver reports it.
    pub device_bytes_restored: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The network settings an engine names in its READY are refused at
    /// init when the wire cannot carry them, naming the setting (a 4 TiB
    /// bucket reached the publisher, which refused the session: the engine
    /// heard WM_ERR_PEER).
    #[test]
    fn net_settings_outside_the_wire_are_refused_at_init() {
        let with_bucket = |bucket_size| ManagerConfig {
            net: NetSettings {
                bucket_size,
                ..NetSettings::default()
            },
            ..ManagerConfig::default()
        };
        for (size, says) in [(100, "below"), (4 << 40, "above")] {
            let e = with_bucket(size).check().unwrap_err();
            assert!(
                e.message.contains("net bucket size") && e.message.contains(says),
                "{e}"
            );
        }
        for size in [256, 16 << 30] {
            with_bucket(size).check().unwrap();
        }
    }
}
