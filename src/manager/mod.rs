//! The manager: one per engine rank. It owns the registry and runs the state
//! machine around updates and clears.
//!
//! Rules (each enforced here, tested from Rust and from C):
//! - One update or clear at a time: a second concurrent one gets
//!   `WM_ERR_BUSY` immediately (it does not wait).
//! - Params may be registered only before the first update or clear
//!   (`WM_ERR_STATE` after), so a plan never races a registration.
//! - An update validates its whole plan before any byte moves; a failure
//!   before bytes move leaves the state, version and weights as they were.
//! - Atomic updates that fail keep the old weights and version. In-place
//!   updates that fail after bytes moved leave the manager FAILED until a
//!   later update succeeds.
//! - A clear releases library-owned memory at stable addresses (checked with
//!   `mincore`), hands engine-owned params to the release hook, and leaves the
//!   manager CLEARED; clearing twice is a no-op.

use crate::apply::{Applier, ApplyOptions, Hooks, Mode};
use crate::fanout::{Announcement, FanoutLink, FanoutSession, FanoutSettings, Word};
use crate::logging::Logger;
use crate::memory::copy::default_threads;
use crate::memory::shared::MappedBuffers;
use crate::memory::staging::DeviceStaging;
use crate::memory::SendPtr;
use crate::plan::{make_plan, Plan, PlanOptions, Target};
use crate::registry::{ParamMemory, ParamSpec, Registry};
use crate::result::{Error, Result};
use crate::signal::{GroupConfig, SignalPlane};
use crate::source::ipc::{self, IpcOptions, IpcSource};
use crate::source::net::{self, NetOptions, NetSource};
use crate::source::snapshot::{self, SnapshotLocation, SnapshotSource};
use crate::source::{Source, SourceKind};
use crate::state::State;
use crate::transport::auth::Secret;
use parking_lot::{Mutex, RwLock};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod fanout;

/// SPEC.md: whole-session timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest version string accepted (bytes).
pub(crate) const MAX_VERSION_LEN: usize = 255;

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
    /// SPEC.md's fallback directory; `None` disables it.
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
}

/// Settings of the network paths.
#[derive(Clone, Debug)]
pub struct NetSettings {
    /// Shared secret; None: `WM_NET_SECRET`.
    pub secret: Option<Vec<u8>>,
    /// Staging slot size, the largest bucket (SPEC.md: 512 MiB).
    pub bucket_size: usize,
    /// Buckets in flight (SPEC.md: 2).
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
            callback_staging_limit: crate::memory::loose::DEFAULT_CALLBACK_STAGING_LIMIT,
        }
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

/// SPEC.md's per-bucket receive timeout, used for per-step waits too.
pub const DEFAULT_SIGNAL_TIMEOUT: Duration = Duration::from_secs(60);

/// What to update from and how.
pub struct UpdateRequest<'h> {
    pub source: SourceKind,
    /// Snapshot: model directory or file (None: the config's model_dir).
    pub location: Option<PathBuf>,
    /// None: the version the source names (snapshot: `version.yaml`).
    pub version: Option<String>,
    pub verify: bool,
    /// The network sources (rdma, gdr) verify checksums unless this is set.
    pub skip_network_checksums: bool,
    pub mode: Mode,
    pub skip_unknown: bool,
    pub timeout: Duration,
    pub hooks: Hooks<'h>,
}

impl<'h> UpdateRequest<'h> {
    pub fn snapshot(location: impl Into<PathBuf>) -> UpdateRequest<'h> {
        UpdateRequest {
            source: SourceKind::Snapshot,
            location: Some(location.into()),
            version: None,
            verify: false,
            skip_network_checksums: false,
            mode: Mode::Atomic,
            skip_unknown: false,
            timeout: DEFAULT_TIMEOUT,
            hooks: Hooks::default(),
        }
    }
}

/// Statistics of one update (SPEC.md: sync_cost, update_cost, total_cost).
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
    /// Version of the weights in the params (None before the first update and after a clear).
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

struct Record {
    state: State,
    version: Option<String>,
    updates: u64,
    last_update: Option<UpdateStats>,
    last_error: Option<Error>,
    registration_open: bool,
    params: u64,
    param_bytes: u64,
    resident_bytes: u64,
    device_bytes_freed: u64,
    device_bytes_restored: u64,
}

pub struct Manager {
    config: ManagerConfig,
    gpu_id: String,
    threads: usize,
    op: Mutex<()>,
    registry: RwLock<Registry>,
    record: Mutex<Record>,
    signal: SignalPlane,
    /// The last IPC session's shared buffers, mapped (see `MappedBuffers`).
    ipc_buffers: Arc<Mutex<MappedBuffers>>,
    /// Pinned host buffers and upload streams for device params, kept from
    /// one update to the next (freed by a clear).
    staging: Mutex<DeviceStaging>,
    /// NCCL fan-out: the communicator, kept from one update to the next.
    fanout: Option<Mutex<FanoutLink>>,
    /// Set by [`Manager::cancel`] (the handle is being destroyed): updates
    /// stop at their next batch boundary and new ones are refused.
    cancelled: AtomicBool,
}

/// A version name engines accept: 1 to [`MAX_VERSION_LEN`] bytes (the
/// publisher checks its versions with this too, so it never announces one
/// every engine refuses).
pub(crate) fn check_version(v: &str) -> Result<()> {
    if v.is_empty() || v.len() > MAX_VERSION_LEN {
        let shown: String = v.chars().take(40).collect();
        let more = if shown.len() < v.len() { "..." } else { "" };
        return Err(Error::invalid_argument(format!(
            "version '{shown}{more}' is {} bytes; a version must be 1 to {MAX_VERSION_LEN} bytes",
            v.len()
        )));
    }
    Ok(())
}

impl Manager {
    pub fn new(config: ManagerConfig) -> Result<Manager> {
        if config.world_size == 0 || config.rank >= config.world_size {
            return Err(Error::invalid_argument(format!(
                "rank {} is not below world_size {}",
                config.rank, config.world_size
            )));
        }
        if config.fanout.is_some() {
            if config.group.is_none() || config.world_size < 2 {
                return Err(Error::invalid_argument(
                    "fanout_group needs the ranks in a group (world_size > 1 and group_name)",
                ));
            }
            if config.device < 0 {
                return Err(Error::invalid_argument(
                    "fanout_group needs this rank's GPU (device >= 0): fan-out moves device params",
                ));
            }
        }
        let cvd = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let gpu_id = snapshot::gpu_id(cvd.as_deref(), config.device)?;
        let group = config.group.as_ref().map(|g| GroupConfig {
            name: g.name.clone(),
            rank: config.rank,
            world_size: config.world_size,
            local_rank: g.local_rank.unwrap_or(config.rank),
            local_world_size: g.local_world_size.unwrap_or(config.world_size),
            node_rank: g.node_rank,
            addr: g.addr.clone(),
            timeout: g.timeout,
            fanout: config.fanout.as_ref().map(|f| f.group),
        });
        let signal = SignalPlane::new(
            config.rank,
            config.world_size,
            config.control_cell.as_deref(),
            group,
            config.logger.clone(),
        )?;
        let threads = if config.threads == 0 {
            default_threads()
        } else {
            config.threads
        };
        Ok(Manager {
            gpu_id,
            threads,
            ipc_buffers: Arc::default(),
            staging: Mutex::default(),
            fanout: config
                .fanout
                .clone()
                .map(|f| Mutex::new(FanoutLink::new(f, config.device))),
            op: Mutex::new(()),
            registry: RwLock::new(Registry::default()),
            record: Mutex::new(Record {
                state: State::Normal,
                version: None,
                updates: 0,
                last_update: None,
                last_error: None,
                registration_open: true,
                params: 0,
                param_bytes: 0,
                resident_bytes: 0,
                device_bytes_freed: 0,
                device_bytes_restored: 0,
            }),
            signal,
            config,
            cancelled: AtomicBool::new(false),
        })
    }

    /// Stop for good: an update in flight fails with `WM_ERR_CANCELLED` at
    /// its next batch boundary (before anything more is committed), and
    /// later updates are refused. For destroying the manager while another
    /// thread's update runs (see `wm_destroy`).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    /// A cancellation seen through the progress hook while the handle is
    /// being destroyed is the destroy's doing, not the engine callback's.
    fn cancel_cause(&self, e: Error) -> Error {
        if e.code == crate::wm_result::WM_ERR_CANCELLED && self.cancelled.load(Ordering::Acquire) {
            return Error::cancelled(format!(
                "rank {}: the manager is being destroyed ({})",
                self.config.rank, e.message
            ));
        }
        e
    }

    fn check_cancelled(&self) -> Result<()> {
        if self.cancelled.load(Ordering::Acquire) {
            return Err(Error::cancelled(format!(
                "rank {}: the manager is being destroyed",
                self.config.rank
            )));
        }
        Ok(())
    }

    pub fn rank(&self) -> u32 {
        self.config.rank
    }

    pub fn logger(&self) -> &Logger {
        &self.config.logger
    }

    /// Remember `e` as this handle's last error and return it.
    pub fn record_error(&self, e: Error) -> Error {
        self.record.lock().last_error = Some(e.clone());
        e
    }

    fn busy(&self) -> Error {
        Error::busy(format!(
            "rank {}: another update or clear is running on this manager",
            self.config.rank
        ))
    }

    fn recorded<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.record_error(e))
    }

    fn registering<T>(&self, f: impl FnOnce(&mut Registry) -> Result<T>) -> Result<T> {
        let r = (|| {
            let _op = self.op.try_lock().ok_or_else(|| self.busy())?;
            if !self.record.lock().registration_open {
                return Err(Error::state(
                    "params can only be registered before the first update or clear",
                ));
            }
            let mut reg = self.registry.write();
            let out = f(&mut reg)?;
            let mut rec = self.record.lock();
            rec.params = reg.len() as u64;
            rec.param_bytes = reg.total_bytes();
            rec.resident_bytes = reg.resident_bytes();
            Ok(out)
        })();
        self.recorded(r)
    }

    /// Register engine-owned memory (`len` bytes at `ptr`) as param `spec`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid and writable for the manager's life
    /// (or until the release hook hands it back).
    pub unsafe fn register(&self, spec: &ParamSpec, ptr: *mut u8, len: usize) -> Result<()> {
        self.registering(|r| r.register_engine(spec, ptr, len))
    }

    /// Allocate a library-owned param; returns its stable address and length.
    pub fn allocate(&self, spec: &ParamSpec) -> Result<(*mut u8, usize)> {
        self.registering(|r| r.allocate(spec))
    }

    pub fn status(&self) -> Status {
        let r = self.record.lock();
        Status {
            state: r.state,
            version: r.version.clone(),
            updates: r.updates,
            last_update: r.last_update.clone(),
            last_error: r.last_error.clone(),
            params: r.params,
            param_bytes: r.param_bytes,
            resident_bytes: r.resident_bytes,
            device_bytes_freed: r.device_bytes_freed,
            device_bytes_restored: r.device_bytes_restored,
        }
    }

    /// The signal every rank should act on this step (see [`crate::signal`]).
    pub fn broadcast_signal(&self) -> Result<State> {
        self.recorded(self.signal.broadcast())
    }

    /// After an update or clear that the signal asked for: pass the group's
    /// finishing barrier and let rank 0 report. A failure there (a dead peer)
    /// turns a local success into an error saying so.
    fn finish_action<T>(
        &self,
        action: State,
        result: Result<T>,
        version: impl Fn(&T) -> String,
    ) -> Result<T> {
        let outcome = result.as_ref().map(&version).map_err(Clone::clone);
        match (self.signal.finish(action, &outcome), result) {
            (Ok(()), r) => r,
            (Err(e), Ok(_)) => Err(e.context(format!(
                "the {} was applied on rank {}, but the group did not finish it",
                if action == State::Updating {
                    "update"
                } else {
                    "clear"
                },
                self.config.rank
            ))),
            (Err(fe), Err(e)) => {
                self.config
                    .logger
                    .warn(&format!("finishing the failed action: {fe}"));
                Err(e)
            }
        }
    }

    /// `gdr`: a gdr request that may land in GPU memory (`check_gdr`).
    fn open_source(&self, req: &UpdateRequest, gdr: bool) -> Result<Box<dyn Source>> {
        match req.source {
            SourceKind::Snapshot => {
                let dir = req
                    .location
                    .clone()
                    .or_else(|| self.config.model_dir.clone())
                    .ok_or_else(|| {
                        Error::invalid_argument(
                            "snapshot update names no location and the config has no model_dir",
                        )
                    })?;
                let loc = SnapshotLocation {
                    model_dir: dir,
                    fallback_dir: self.config.fallback_dir.clone(),
                    rank: self.config.rank,
                    gpu_id: self.gpu_id.clone(),
                };
                let (deadline, read_version) =
                    (Instant::now() + req.timeout, req.version.is_none());
                let source =
                    SnapshotSource::open_until(&loc, &self.config.logger, deadline, read_version)?;
                Ok(Box::new(source))
            }
            SourceKind::Ipc => {
                let socket = req.location.clone().ok_or_else(|| {
                    Error::invalid_argument(
                        "an ipc update needs the publisher's socket path as its location",
                    )
                })?;
                let opts = IpcOptions {
                    socket,
                    rank: self.config.rank,
                    world_size: self.config.world_size,
                    gpu_id: self.gpu_id.clone(),
                    version: req.version.clone(),
                    allow_other_uids: self.config.allow_other_uids,
                    bucket_timeout: ipc::BUCKET_TIMEOUT.min(req.timeout),
                    // CUDA IPC buffers open on the rank's GPU (device
                    // copies to params on other GPUs go peer to peer).
                    gpu: self.config.device.max(0),
                };
                Ok(Box::new(IpcSource::open(
                    &opts,
                    Instant::now() + req.timeout,
                    self.ipc_buffers.clone(),
                )?))
            }
            SourceKind::Rdma | SourceKind::Gdr => {
                let address = req.location.clone().ok_or_else(|| {
                    Error::invalid_argument(format!(
                        "a {} update needs the publisher's host:port as its location",
                        req.source.name()
                    ))
                })?;
                let opts = NetOptions {
                    address: address.display().to_string(),
                    rank: self.config.rank,
                    world_size: self.config.world_size,
                    gpu_id: self.gpu_id.clone(),
                    version: req.version.clone(),
                    secret: Secret::resolve(self.config.net.secret.as_deref())?,
                    bucket_size: self.config.net.bucket_size,
                    depth: self.config.net.depth,
                    bucket_timeout: ipc::BUCKET_TIMEOUT.min(req.timeout),
                    direct: gdr || !self.config.net.staged,
                    keyed: self.config.net.keyed_digests,
                };
                if gdr && opts.keyed {
                    return Err(Error::unsupported(
                        "keyed digests are checked on the CPU: they apply to rdma updates, not gdr \
                         (bytes land in GPU memory)",
                    ));
                }
                let source =
                    NetSource::open(opts, Instant::now() + req.timeout).inspect_err(|e| {
                        if e.code == crate::wm_result::WM_ERR_AUTH {
                            self.config
                                .logger
                                .warn(&format!("{} update: {e}", req.source.name()));
                        }
                    })?;
                Ok(Box::new(source))
            }
        }
    }

    /// gdr lands bytes straight in GPU memory: it needs a UCX built with CUDA
    /// and device params. Ok(true): device params receive straight from the
    /// wire (direct receive, `source::net`; host params too); Ok(false): run
    /// as rdma, when the config allows the fallback.
    fn check_gdr(&self, registry: &Registry) -> Result<bool> {
        let ucx = crate::transport::ucx::ucx()?;
        let on_gpu = registry.params().iter().any(|p| p.device.is_some());
        let why = if !on_gpu {
            "this manager's params are host memory (gdr needs device params)".to_string()
        } else if !ucx.supports_cuda() {
            format!(
                "{} cannot reach CUDA memory (install a CUDA-enabled UCX, e.g. the libucx-cu12 wheel, and set WM_UCX_LIB)",
                ucx.describe()
            )
        } else {
            return Ok(true);
        };
        if self.config.net.gdr_fallback {
            self.config.logger.warn(&format!(
                "gdr: {why}; falling back to rdma as the config allows"
            ));
            return Ok(false);
        }
        Err(Error::unsupported(format!(
            "gdr: {why}; use source rdma, or allow the fallback to rdma in the config"
        )))
    }

    /// Bring released memory back before writing: library regions are faulted
    /// in; engine-owned params go through the acquire hook.
    /// Returns the GPU memory taken back, as the driver reports it.
    fn restore(&self, registry: &mut Registry) -> Result<u64> {
        let before = device_free(registry)?;
        for p in registry.params_mut() {
            if p.resident {
                continue;
            }
            match &mut p.memory {
                ParamMemory::Library(r) => r
                    .restore()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::LibraryDevice(r) => r
                    .restore()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::Engine { ptr } => {
                    if let Some(acquire) = &self.config.acquire_hook {
                        let new = acquire(&p.name, ptr.0, p.nbytes)
                            .filter(|n| !n.is_null() || p.nbytes == 0);
                        *ptr = SendPtr(new.ok_or_else(|| {
                            Error::callback(format!(
                                "acquire callback gave no memory for param '{}'",
                                p.name
                            ))
                        })?);
                        if let Some(ordinal) = p.device {
                            // New device memory gets the registration's checks.
                            crate::registry::check_device_memory(
                                ordinal,
                                ptr.0,
                                p.nbytes,
                                &format!("param '{}' (from the acquire callback)", p.name),
                            )?;
                        }
                    }
                }
            }
            p.resident = true;
        }
        let after = device_free(registry)?;
        Ok(free_change(&after, &before))
    }

    fn release(&self, registry: &mut Registry) -> Result<ClearStats> {
        let mut stats = ClearStats::default();
        let before = device_free(registry)?;
        for p in registry.params_mut() {
            if !p.resident {
                continue;
            }
            match &p.memory {
                ParamMemory::Library(r) => {
                    r.release()
                        .map_err(|e| e.context(format!("param '{}'", p.name)))?;
                    let left = r.resident_bytes()?;
                    if left != 0 {
                        return Err(Error::out_of_memory(format!(
                            "param '{}' still holds {left} bytes after release (locked memory?)",
                            p.name
                        )));
                    }
                }
                ParamMemory::LibraryDevice(r) => r
                    .release()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::Engine { ptr } => {
                    if let Some(release) = &self.config.release_hook {
                        release(&p.name, ptr.0, p.nbytes);
                    }
                }
            }
            p.resident = false;
            stats.params += 1;
            stats.bytes_released += p.nbytes as u64;
        }
        stats.device_bytes_freed = free_change(&before, &device_free(registry)?);
        Ok(stats)
    }

    /// Run one update. See the module docs for what failure leaves behind.
    pub fn update(&self, req: UpdateRequest) -> Result<UpdateStats> {
        let r = self.try_update(req).map_err(|e| self.cancel_cause(e));
        let r = self.finish_action(State::Updating, r, |s| s.version.clone());
        self.recorded(r)
    }

    fn try_update(&self, mut req: UpdateRequest) -> Result<UpdateStats> {
        let start = Instant::now();
        let _op = self.op.try_lock().ok_or_else(|| self.busy())?;
        self.check_cancelled()?;
        if let Some(v) = &req.version {
            check_version(v)?;
        }
        let prev = {
            let mut rec = self.record.lock();
            rec.registration_open = false;
            std::mem::replace(&mut rec.state, State::Updating)
        };
        let mut registry = self.registry.write();
        let mut restored = false;
        let outcome = self.run_update(&mut registry, &mut req, prev, &mut restored, start);
        let mut state = prev;
        let result = match outcome {
            Ok(stats) => {
                state = State::Normal;
                Ok(stats)
            }
            Err((e, wrote)) => {
                if wrote {
                    state = State::Failed;
                } else if restored {
                    if let Err(re) = self.release(&mut registry) {
                        self.config
                            .logger
                            .warn(&format!("re-releasing after a failed update: {re}"));
                        state = State::Failed;
                    }
                }
                Err(e)
            }
        };
        let mut rec = self.record.lock();
        rec.state = state;
        rec.resident_bytes = registry.resident_bytes();
        if let Ok(stats) = &result {
            rec.version = Some(stats.version.clone());
            rec.updates += 1;
            rec.last_update = Some(stats.clone());
            rec.last_error = None;
        }
        result
    }

    fn run_update(
        &self,
        registry: &mut Registry,
        req: &mut UpdateRequest,
        prev: State,
        restored: &mut bool,
        start: Instant,
    ) -> std::result::Result<UpdateStats, (Error, bool)> {
        let early = |e: Error| (e, false);
        let mut link = self
            .fanout
            .as_ref()
            .filter(|_| self.signal.fanout_size() > 1)
            .map(|l| l.lock());
        let mut fan = match link.as_mut() {
            Some(l) => {
                let meet_by = Instant::now() + ipc::BUCKET_TIMEOUT.min(req.timeout);
                Some(
                    l.start(&self.signal, self.config.rank, meet_by)
                        .map_err(early)?,
                )
            }
            None => None,
        };
        if let Some(s) = fan.as_mut() {
            if !s.is_root() {
                return self.receive_fanout(registry, req, prev, restored, start, s);
            }
        }
        let said_by = start + req.timeout;
        // The fan-out root tells its members why it stops (they stop too).
        let stop = |fan: &mut Option<FanoutSession>, e: Error| -> (Error, bool) {
            if let Some(s) = fan.as_mut() {
                let word: Word<Announcement> = Word::Stop(e.to_string());
                if let Err(se) = s.word(Some(&word), said_by) {
                    self.config
                        .logger
                        .warn(&format!("telling the fan-out members: {se}"));
                }
            }
            (e, false)
        };
        let (mut source, version, plan, gdr) = match self.prepare(registry, req) {
            Ok(p) => p,
            Err(e) => return Err(stop(&mut fan, e)),
        };
        let mut fan_params = Vec::new();
        if let Some(s) = fan.as_mut() {
            let announced =
                crate::fanout::refuse_tensor_hook(req.hooks.tensor.is_some()).and_then(|()| {
                    crate::fanout::announce(&version, &plan, registry, self.config.device)
                });
            let (announcement, params) = match announced {
                Ok(a) => a,
                Err(e) => return Err(stop(&mut fan, e)),
            };
            fan_params = params;
            s.word(Some(&Word::Go(announcement)), said_by)
                .map_err(early)?;
            s.vote(Ok(()), said_by).map_err(early)?;
        }
        let streamed =
            self.stream_and_commit(registry, req, prev, restored, &plan, gdr, &mut *source);
        let applied = match streamed {
            Ok(a) => a,
            Err((e, wrote)) => {
                let (e, _) = stop(&mut fan, e);
                return Err((e, wrote));
            }
        };
        let mut stats = UpdateStats {
            version,
            rank: self.config.rank,
            tensors: applied.tensors as u64,
            bytes: applied.bytes,
            sync: applied.receive,
            update: applied.commit,
            total: Duration::ZERO,
        };
        if let Some(s) = fan.as_mut() {
            let sent = Instant::now();
            self.send_fanout(registry, s, &fan_params, said_by)
                .map_err(|e| {
                    (
                        e.context(format!(
                            "the update to {} was applied on rank {}, but its fan-out to rank(s) {} failed",
                            stats.version,
                            self.config.rank,
                            crate::signal::group::list(s.members())
                        )),
                        true,
                    )
                })?;
            stats.update += sent.elapsed();
        }
        self.config.logger.info(&format!(
            "rank {}: updated to version {} from {} ({} tensors, {} bytes)",
            self.config.rank,
            stats.version,
            source.describe(),
            applied.tensors,
            applied.bytes
        ));
        stats.total = start.elapsed();
        Ok(stats)
    }

    /// Open the source, name the version and plan (nothing moves yet).
    /// Returns the source, version, plan and whether gdr lands on the GPU.
    fn prepare(
        &self,
        registry: &Registry,
        req: &mut UpdateRequest,
    ) -> Result<(Box<dyn Source>, String, Plan, bool)> {
        // gdr lands in device params; when it may not, it runs as rdma.
        let gdr = req.source == SourceKind::Gdr && self.check_gdr(registry)?;
        let source = self.open_source(req, gdr)?;
        // A publisher (ipc, rdma, gdr) serves the version asked for and names
        // it ("latest" becomes its real name); a snapshot request's version
        // overrides the snapshot's version.yaml.
        let from_source = source.manifest().version.clone();
        let named = match req.source {
            SourceKind::Snapshot => req.version.clone().or(from_source),
            _ => from_source.or_else(|| req.version.clone().filter(|v| v != "latest")),
        };
        let version = named.ok_or_else(|| {
            Error::no_version(format!(
                "no version: the request names none and {}",
                source.no_version_reason()
            ))
        })?;
        check_version(&version)?;
        if matches!(req.source, SourceKind::Rdma | SourceKind::Gdr) && !req.skip_network_checksums {
            req.verify = true;
        }
        let opts = PlanOptions {
            skip_unknown: req.skip_unknown,
            callback: req.hooks.tensor.is_some(),
            verify: req.verify,
        };
        let plan = make_plan(source.manifest(), registry, opts, &self.config.logger)?;
        Ok((source, version, plan, gdr))
    }

    /// Bring released memory back, then stream the source through the
    /// applier and commit. Err's flag: whether params were written.
    #[allow(clippy::too_many_arguments)]
    fn stream_and_commit(
        &self,
        registry: &mut Registry,
        req: &mut UpdateRequest,
        prev: State,
        restored: &mut bool,
        plan: &Plan,
        gdr: bool,
        source: &mut dyn Source,
    ) -> std::result::Result<crate::apply::Applied, (Error, bool)> {
        let early = |e: Error| (e, false);
        self.restore_if_released(registry, prev, restored)
            .map_err(early)?;
        let dests = plan
            .entries
            .iter()
            .map(|e| match e.target {
                Target::Param(i) => Some(registry.params()[i].dest()),
                _ => None,
            })
            .collect();
        let apply_opts = ApplyOptions {
            mode: req.mode,
            verify: req.verify,
            threads: self.threads,
            timeout: req.timeout,
            callback_staging_limit: self.config.callback_staging_limit,
        };
        let Hooks {
            progress: mut user_progress,
            tensor: mut user_tensor,
        } = std::mem::take(&mut req.hooks);
        // Cancellation rides on the progress hook, which the applier calls
        // after every batch, before anything more moves.
        let mut progress = |p: &crate::apply::Progress| {
            let go_on = user_progress.as_mut().is_none_or(|f| f(p));
            go_on && !self.cancelled.load(Ordering::Acquire)
        };
        let hooks = Hooks {
            progress: Some(&mut progress),
            tensor: match user_tensor.as_mut() {
                Some(t) => Some(&mut **t),
                None => None,
            },
        };
        let mut staging = self.staging.lock();
        let mut applier = Applier::new(plan, dests, apply_opts, hooks)
            .map_err(early)?
            .with_staging(&mut staging)
            .land_on_device(gdr);
        if let Err(e) = source.stream(plan, &mut applier) {
            return Err((e, applier.wrote_params()));
        }
        applier
            .finish()
            .map_err(|f| (f.error, f.weights == crate::apply::Weights::Written))
    }

    /// After a clear (or a failed update), bring the params' memory back.
    fn restore_if_released(
        &self,
        registry: &mut Registry,
        prev: State,
        restored: &mut bool,
    ) -> Result<()> {
        if prev == State::Cleared || prev == State::Failed {
            *restored = registry.params().iter().any(|p| !p.resident);
            let taken = self.restore(registry)?;
            self.record.lock().device_bytes_restored = taken;
        }
        Ok(())
    }

    /// Release weight memory; the next update brings it back.
    pub fn clear(&self) -> Result<ClearStats> {
        let r = self.try_clear();
        let r = self.finish_action(State::Clearing, r, |_| String::new());
        self.recorded(r)
    }

    fn try_clear(&self) -> Result<ClearStats> {
        let _op = self.op.try_lock().ok_or_else(|| self.busy())?;
        {
            let mut rec = self.record.lock();
            rec.registration_open = false;
            if rec.state == State::Cleared {
                return Ok(ClearStats::default());
            }
            rec.state = State::Clearing;
        }
        // A cleared engine holds no trainer memory, nor pinned staging.
        self.ipc_buffers.lock().forget();
        self.staging.lock().release();
        let mut registry = self.registry.write();
        let result = self.release(&mut registry);
        let mut rec = self.record.lock();
        rec.state = if result.is_ok() {
            State::Cleared
        } else {
            State::Failed
        };
        rec.version = None;
        rec.resident_bytes = registry.resident_bytes();
        if let Ok(stats) = &result {
            rec.device_bytes_freed = stats.device_bytes_freed;
        }
        result
    }
}

/// Free memory of each GPU that holds library-owned device params (none:
/// empty, and no driver call).
fn device_free(registry: &Registry) -> Result<Vec<(i32, u64)>> {
    let mut ordinals: Vec<i32> = registry
        .params()
        .iter()
        .filter_map(|p| match &p.memory {
            ParamMemory::LibraryDevice(r) => Some(r.ordinal()),
            _ => None,
        })
        .collect();
    ordinals.sort_unstable();
    ordinals.dedup();
    ordinals
        .into_iter()
        .map(|o| Ok((o, crate::memory::device::memory_info(o)?.0 as u64)))
        .collect()
}

/// How much more free memory `more` reports than `less`, over all GPUs.
fn free_change(more: &[(i32, u64)], less: &[(i32, u64)]) -> u64 {
    more.iter()
        .zip(less)
        .map(|(a, b)| a.1.saturating_sub(b.1))
        .sum()
}
