//! The manager: one per engine rank. It owns the registry and runs the state
//! machine around updates and clears.
//!
//! Rules (each enforced here, tested from Rust and from C):
//! - One update or clear at a time: a second concurrent one gets
//!   `WM_ERR_BUSY` immediately (it does not wait).
//! - Params may be registered only before the first update or clear
//!   (`WM_ERR_STATE` after; an update that failed without writing a param
//!   does not count), so a plan never races a registration.
//! - An update validates its whole plan before any byte moves; a failure
//!   before bytes move leaves the state, version and weights as they were.
//! - Atomic updates that fail keep the old weights and version. In-place
//!   updates that fail after bytes moved leave the manager FAILED until a
//!   later update succeeds.
//! - A clear releases library-owned memory at stable addresses (checked with
//!   `mincore`), hands engine-owned params to the release hook, and leaves the
//!   manager CLEARED; clearing twice is a no-op.
//!
//! Where each job lives:
//! - `config.rs`: the config, request and stats types (re-exported here);
//! - `register.rs`: registering params (before the first update or clear);
//! - `sources.rs`: opening the source a request names, and the gdr check;
//! - `update.rs`: an update, from the source to the commit;
//! - `fanout_root.rs`, `fanout_member.rs`: the update's NCCL fan-out
//!   steps (see [`crate::fanout`]);
//! - `kept.rs`: what is kept between updates (plan cache, staging, the
//!   IPC mapping, the fan-out link); `plan_cache.rs`, `shadows.rs`: two of
//!   them;
//! - `quantized.rs`: an update's quantized params (targets, buffers);
//! - `memory.rs`: releasing and restoring param memory, with GPU accounting;
//! - `clear.rs`: a clear; `cancel.rs`: stopping for good.

use crate::fanout::FanoutLink;
use crate::logging::Logger;
use crate::memory::copy::default_threads;
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::signal::SignalPlane;
use crate::source::snapshot;
use crate::state::State;
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::AtomicBool;

mod atomic_staging;
mod cancel;
mod clear;
mod config;
mod deltas;
mod fanout_member;
mod fanout_root;
mod geometry;
mod kept;
mod memory;
mod plan_cache;
mod prepare;
mod quantized;
mod register;
mod shadows;
mod sources;
mod staged;
mod staged_vote;
mod update;

pub use config::{
    AcquireHook, ClearStats, GroupSettings, ManagerConfig, NetSettings, ReleaseHook, Status,
    UpdateRequest, UpdateStats,
};
pub use deltas::{DeltaFallback, DeltaMode, DeltaStats};
pub use staged::Staged;

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
    /// Held by a registration while it waits for `op`: registrations on
    /// several threads take turns (each is short) instead of one finding
    /// the other's `op` taken and failing as busy.
    registrations: Mutex<()>,
    registry: RwLock<Registry>,
    record: Mutex<Record>,
    signal: SignalPlane,
    /// Caches and buffers kept from one update to the next.
    kept: kept::Kept,
    /// Set by [`Manager::cancel`] (the handle is being destroyed): updates
    /// stop at their next batch boundary and new ones are refused.
    cancelled: AtomicBool,
    /// A staged update's decision channel, while one is staged
    /// (`staged.rs`): a clear or cancel aborts it through this.
    staged: Mutex<Option<std::sync::mpsc::Sender<staged::Decision>>>,
    /// Why the staged version was dropped (a clear, a cancel), set while
    /// it still stages too: that update stops at its next batch.
    stage_dropped: Mutex<Option<String>>,
    /// Where this rank's staging is, for the ranks' vote while an update
    /// is pending (`staged_vote.rs`).
    stage_status: Mutex<staged_vote::StageStatus>,
    /// The running update's flag that ends its waits for a publisher
    /// (`crate::stop`): set by a destroy, and by a clear or
    /// abort of the version it stages (`cancel.rs`).
    stop_waits: Mutex<Option<(std::thread::ThreadId, crate::stop::StopFlag)>>,
    /// The staging thread while it runs its update (`staged.rs`): calls
    /// from its callbacks must not wait for the staging to end.
    stage_thread: Mutex<Option<std::thread::ThreadId>>,
    /// The staging reached its commit gate (staged, and `stage` returns in
    /// a moment): set by the gate, cleared when the staging ends.
    at_gate: AtomicBool,
    /// The action (UPDATING or CLEARING) of the call holding `op`, while
    /// it holds it: a call refused as busy finishes the signal's action
    /// only when the running call will not (`refused`).
    running: Mutex<Option<State>>,
    /// The version of this rank's last ready vote (`staged_vote.rs`).
    last_ready_vote: Mutex<Option<String>>,
    /// Flips every voting step: a staged rank's vote carries the second
    /// hash of its version at every other step (`staged_vote.rs`).
    vote_second: AtomicBool,
}

impl Manager {
    pub fn new(config: ManagerConfig) -> Result<Manager> {
        config.check()?;
        let cvd = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let gpu_id = snapshot::gpu_id(cvd.as_deref(), config.device)?;
        let group = config.group_config();
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
            kept: kept::Kept::new(
                (config.fanout.clone()).map(|f| FanoutLink::new(f, config.device)),
            ),
            op: Mutex::new(()),
            registrations: Mutex::new(()),
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
            staged: Mutex::new(None),
            stage_dropped: Mutex::new(None),
            stage_status: Mutex::default(),
            stop_waits: Mutex::default(),
            running: Mutex::default(),
            at_gate: AtomicBool::new(false),
            last_ready_vote: Mutex::default(),
            stage_thread: Mutex::default(),
            vote_second: AtomicBool::new(false),
        })
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
        // Shut down: that is why, whatever still runs or is staged (a
        // staging ends on its own thread, a moment after `wm_shutdown`).
        if let Err(e) = self.check_cancelled() {
            return e;
        }
        match self.staged.lock().is_some() {
            true => Error::busy(format!(
                "rank {}: a version is staged or staging (commit or abort it first)",
                self.config.rank
            )),
            false => self.busy_running(),
        }
    }

    fn busy_running(&self) -> Error {
        Error::busy(format!(
            "rank {}: another update, clear or registration is running on this manager",
            self.config.rank
        ))
    }

    fn recorded<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.record_error(e))
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
    /// While an update is pending, the step's signal carries this rank's
    /// vote on a staged version (`staged_vote.rs`): UPDATING, COMMIT, or
    /// CLEARED when no rank may commit.
    pub fn broadcast_signal(&self) -> Result<State> {
        let r = match self.signal.update_pending() {
            true => self.broadcast_voting(),
            false => {
                // This step carries no vote, so the next one pairs no
                // earlier ready vote of this rank with it: a version staged
                // next is voted ready at once (it waited one step more).
                self.last_ready_vote.lock().take();
                self.signal.broadcast()
            }
        };
        self.recorded(r)
    }

    /// A call refused because another holds `op`: it finishes the action
    /// the signal asked for (as failed) only when the running call is not
    /// that action, which then finishes it itself.
    fn refused<T>(&self, action: State, busy: Error) -> Result<T> {
        let r = match *self.running.lock() == Some(action) {
            true => Err(busy),
            false => self.finish_action(action, Err(busy), |_: &T| String::new()),
        };
        self.recorded(r)
    }

    /// Mark the call holding `op` as running `action` until the returned
    /// guard drops (before `op` is let go: declared after it).
    fn running_as(&self, action: State) -> RunningAction<'_> {
        *self.running.lock() = Some(action);
        RunningAction(&self.running)
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
}

/// Clears the running action when the call that holds `op` ends.
struct RunningAction<'a>(&'a Mutex<Option<State>>);

impl Drop for RunningAction<'_> {
    fn drop(&mut self) {
        *self.0.lock() = None;
    }
}
