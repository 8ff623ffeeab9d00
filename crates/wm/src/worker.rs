//! `wm worker`: the engine's worker loop (README "The worker loop") as a
//! real engine rank. Each step it
//! asks for the signal; UPDATING: update from the snapshot; CLEARING: clear;
//! otherwise serve (sleep `--step-us`). With `--two-phase`, UPDATING starts
//! staging on a side thread while the rank keeps serving, COMMIT commits it
//! (every rank at the same step), CLEARED after a stage means the ranks
//! dropped it; the log says `committed <version> at <step>` or
//! `no commit at <step>: <why>`. Used by the multi-process tests and as a
//! reference for engine authors.
//!
//! The rank holds one library-owned param `w` (f32 [16]); the snapshot in
//! `--model-dir` must hold it (any HuggingFace-style `*.safetensors`).
//! With `--device N`, `w` is GPU memory of device N and each successful
//! update logs `updated <version> w=<xxh3-128 of w's bytes, read back>`;
//! `--fanout G` (and `--nccl PATH`) puts the rank in NCCL fan-out group G.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use weight_manager_core::checksum;
use weight_manager_core::internals::memory::cuda_ipc::download;
use weight_manager_core::DType;
use weight_manager_core::FanoutSettings;
use weight_manager_core::Staged;
use weight_manager_core::State;
use weight_manager_core::{GroupSettings, Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

/// `wm worker` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The snapshot folder updates read: it must hold the tensor `w`, f32
    /// [16] (the rank's one param)
    #[arg(long, value_name = "DIR")]
    model_dir: PathBuf,
    #[arg(long, value_name = "R", default_value_t = 0)]
    rank: u32,
    #[arg(long, value_name = "W", default_value_t = 1)]
    world: u32,
    /// The ranks' group (default: none, a lone rank)
    #[arg(long, value_name = "NAME")]
    group: Option<String>,
    /// Group: this rank on its node
    #[arg(long, value_name = "L")]
    local_rank: Option<u32>,
    /// Group: ranks on this node
    #[arg(long, value_name = "N")]
    local_world: Option<u32>,
    /// Group: this node
    #[arg(long, value_name = "K", default_value_t = 0)]
    node: u32,
    /// Group: the address of the ranks' meeting point
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// The control cell
    #[arg(long, value_name = "NAME")]
    cell: Option<String>,
    /// Steps to run
    #[arg(long, value_name = "N", default_value_t = 1000)]
    steps: u64,
    /// Sleep of a serving step, in microseconds
    #[arg(long, value_name = "US", default_value_t = 100)]
    step_us: u64,
    /// Group timeout in milliseconds (at most 7 days)
    #[arg(long, value_name = "MS", default_value_t = 10_000, value_parser = crate::millis)]
    timeout_ms: u64,
    /// Log each step's signal (and updates' checksums) to this file
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// `w` in the memory of this GPU (default: host)
    #[arg(long, value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    device: i32,
    /// The rank's NCCL fan-out group
    #[arg(long, value_name = "G")]
    fanout: Option<u32>,
    /// The NCCL library (fan-out)
    #[arg(long, value_name = "PATH")]
    nccl: Option<PathBuf>,
    /// Two-phase updates: on UPDATING stage on a side thread and keep
    /// serving; commit when the signal says COMMIT
    #[arg(long)]
    two_phase: bool,
}

/// The manager of a worker rank.
fn manager(a: &Args) -> Result<Manager, String> {
    let group = a.group.as_ref().map(|name| GroupSettings {
        name: name.clone(),
        local_rank: a.local_rank,
        local_world_size: a.local_world,
        node_rank: a.node,
        addr: a.addr.clone(),
        timeout: Duration::from_millis(a.timeout_ms),
    });
    let fanout = a.fanout.map(|group| FanoutSettings {
        group,
        nccl_library: a.nccl.clone(),
    });
    Manager::new(ManagerConfig {
        rank: a.rank,
        world_size: a.world,
        device: a.device,
        fallback_dir: None,
        control_cell: a.cell.clone(),
        group,
        model_dir: Some(a.model_dir.clone()),
        fanout,
        ..Default::default()
    })
    .map_err(|e| format!("rank {}: init: {e}", a.rank))
}

/// A worker rank's param `w` and the log of its steps.
struct Rank<'a> {
    a: &'a Args,
    m: Arc<Manager>,
    w: (*mut u8, usize),
    log: Option<std::io::BufWriter<std::fs::File>>,
    /// Two-phase: the side thread staging the pending update.
    stager: Option<std::thread::JoinHandle<weight_manager_core::Result<Staged>>>,
}

impl Rank<'_> {
    /// Two-phase: act on this step's signal (UPDATING: start staging once,
    /// then serve; COMMIT: commit what was staged; CLEARED: the ranks
    /// dropped it). True when the step served.
    fn two_phase(&mut self, signal: State, step: u64) -> weight_manager_core::Result<bool> {
        match signal {
            State::Updating => {
                if self.stager.is_none() {
                    if let Some(l) = self.log.as_mut() {
                        let _ = writeln!(l, "staging at {step}");
                    }
                    let (m, dir) = (Arc::clone(&self.m), self.a.model_dir.clone());
                    let stage = move || m.stage(UpdateRequest::snapshot(dir));
                    self.stager = Some(std::thread::spawn(stage));
                }
                Ok(true)
            }
            State::Commit => {
                let staged = self.join_stager()?;
                let stats = staged.commit()?;
                if let Some(l) = self.log.as_mut() {
                    let _ = writeln!(l, "committed {} at {step}", stats.version);
                }
                self.log_device_w(&stats.version)?;
                Ok(false)
            }
            State::Cleared => {
                // Dropped by the ranks' vote (or a failed stage): say why.
                if self.stager.is_some() {
                    // What was staged is gone; the manager's last error says why.
                    drop(self.join_stager());
                    let why = self.m.status().last_error;
                    let why = why.map_or("dropped".into(), |e| e.to_string());
                    if let Some(l) = self.log.as_mut() {
                        let _ = writeln!(l, "no commit at {step}: {why}");
                    }
                }
                Ok(true)
            }
            _ => Ok(true),
        }
    }

    fn join_stager(&mut self) -> weight_manager_core::Result<Staged> {
        let t = self
            .stager
            .take()
            .ok_or_else(|| weight_manager_core::Error::state("COMMIT without a stage in flight"))?;
        t.join().unwrap_or_else(|_| {
            Err(weight_manager_core::Error::state(
                "the staging thread panicked",
            ))
        })
    }

    /// Update from the snapshot; on a device, log `w`'s checksum.
    fn update(&mut self) -> weight_manager_core::Result<()> {
        let stats = self.m.update(UpdateRequest::snapshot(&self.a.model_dir))?;
        self.log_device_w(&stats.version)
    }

    /// On a device, log `w`'s checksum as version `version` left it.
    fn log_device_w(&mut self, version: &str) -> weight_manager_core::Result<()> {
        let device = self.a.device;
        if let (Some(l), true) = (self.log.as_mut(), device >= 0) {
            let (w, w_len) = self.w;
            let mut bytes = vec![0u8; w_len];
            // SAFETY: `w` is this manager's device param of `w_len` bytes.
            unsafe { download(device, bytes.as_mut_ptr(), w as u64, w_len)? };
            let sum = checksum::of(&bytes);
            let _ = writeln!(l, "updated {version} w={sum:032x}");
        }
        Ok(())
    }
}

pub fn run(a: &Args) -> Result<(), String> {
    let rank = a.rank;
    let m = manager(a)?;
    let mut spec = ParamSpec::host("w", DType::F32, &[16]);
    if a.device >= 0 {
        spec.memory = MemoryKind::Device;
        spec.device_ordinal = a.device;
    }
    let w = m.allocate(&spec).map_err(|e| format!("rank {rank}: {e}"))?;
    let log = a.log.as_deref().map(open_log).transpose()?;
    let log_error = |e: std::io::Error| {
        let path = a.log.as_deref().unwrap_or(std::path::Path::new("the log"));
        format!("writing {}: {e}", path.display())
    };
    let mut r = Rank {
        a,
        m: Arc::new(m),
        w,
        log,
        stager: None,
    };
    let (mut updates, mut clears, mut failed) = (0, 0, 0);
    for step in 0..a.steps {
        let signal =
            r.m.broadcast_signal()
                .map_err(|e| format!("rank {rank}: step {step}: {e}"))?;
        if let Some(l) = r.log.as_mut() {
            writeln!(l, "{step} {}", signal.name()).map_err(log_error)?;
        }
        let outcome = match signal {
            State::Updating | State::Commit | State::Cleared if a.two_phase => {
                r.two_phase(signal, step).map(|serve| {
                    // Two-phase, an update counts once committed.
                    updates += u64::from(signal == State::Commit);
                    if serve {
                        std::thread::sleep(Duration::from_micros(a.step_us));
                    }
                })
            }
            State::Updating => {
                updates += 1;
                r.update()
            }
            State::Clearing => {
                clears += 1;
                r.m.clear().map(|_| ())
            }
            _ => {
                std::thread::sleep(Duration::from_micros(a.step_us));
                Ok(())
            }
        };
        if let Err(e) = outcome {
            // A failed local update is reported to the controller by rank 0;
            // the loop goes on serving. A dead peer ends it.
            if matches!(
                e.code,
                weight_manager_core::wm_result::WM_ERR_PEER
                    | weight_manager_core::wm_result::WM_ERR_TIMEOUT
            ) {
                return Err(format!("rank {rank}: step {step}: {e}"));
            }
            failed += 1;
            eprintln!("wm worker: rank {rank}: step {step}: {signal} failed: {e}");
        }
    }
    if let Some(mut l) = r.log.take() {
        l.flush().map_err(log_error)?;
    }
    let steps = a.steps;
    println!("rank {rank}: {steps} steps, {updates} updates, {clears} clears, {failed} failed");
    Ok(())
}

/// The worker's log at `path`, created (a regular file only: opening a
/// FIFO for writing waits for a reader).
fn open_log(path: &std::path::Path) -> Result<std::io::BufWriter<std::fs::File>, String> {
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return Err(format!("--log {}: not a regular file", path.display()));
    }
    let f = std::fs::File::create(path).map_err(|e| format!("creating {}: {e}", path.display()))?;
    Ok(std::io::BufWriter::new(f))
}
