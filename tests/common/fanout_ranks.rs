//! NCCL fan-out between two `wm worker` ranks, driven through the control
//! cell: rank 0 reads the snapshot, rank 1's model directory is empty, so
//! its weights can only arrive by fan-out. Two updates (the second reuses
//! the communicator); both ranks read `w` back from their GPU and log its
//! checksum. Shared by `tests/gpu.rs` (two real GPUs and NCCL) and
//! `tests/fanout.rs` (the fake driver and the fake NCCL, one "GPU" per
//! process).

use super::{tensor, write_safetensors, write_version, T, WM};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;
use weight_manager_core::{Controller, DType, State};

/// How the two ranks run.
pub struct Ranks<'a> {
    /// Each rank's GPU.
    pub devices: [i32; 2],
    /// `--nccl` (None: the worker's default lookup).
    pub nccl: Option<&'a Path>,
    /// `--two-phase`: stage on UPDATING, commit on COMMIT.
    pub two_phase: bool,
}

/// Start rank `rank` of two in fan-out group 0 (`two_phase` its mode),
/// logging to `log`; its model folder is `model`.
fn spawn_rank(
    r: &Ranks,
    rank: u32,
    (group, cell): (&str, &str),
    (model, log, err): (&Path, &Path, &Path),
    two_phase: bool,
) -> std::process::Child {
    let mut cmd = Command::new(&*WM);
    cmd.arg("worker")
        .args(["--rank", &rank.to_string(), "--world", "2"])
        .args(["--group", group, "--cell", cell])
        .args(["--device", &r.devices[rank as usize].to_string()])
        .args(["--fanout", "0"])
        .args(["--steps", "3000", "--step-us", "1000"])
        .args(["--timeout-ms", "30000"])
        .arg("--model-dir")
        .arg(model)
        .arg("--log")
        .arg(log);
    if let Some(n) = r.nccl {
        cmd.arg("--nccl").arg(n);
    }
    if two_phase {
        cmd.arg("--two-phase");
    }
    cmd.stdout(Stdio::null())
        .stderr(std::fs::File::create(err).unwrap())
        .spawn()
        .unwrap()
}

/// Two ranks of fan-out group 0 reading version 1 of `w`: rank 0 from a
/// snapshot, rank 1 from an empty folder (its weights can only come from
/// the fan-out); `two_phase(rank)` is each one's mode. Returns the folder
/// (kept alive), the control cell, `w`, and each rank's process, log and
/// stderr.
fn start_two(
    r: &Ranks,
    tag: &str,
    two_phase: impl Fn(u32) -> bool,
) -> (TempDir, String, T, Vec<(Child, PathBuf, PathBuf)>) {
    let dir = tempfile::tempdir().unwrap();
    let (full, empty) = (dir.path().join("full"), dir.path().join("empty"));
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::create_dir_all(&full).unwrap();
    let w = tensor("w", DType::F32, &[16], 21);
    write_safetensors(&full.join("model.safetensors"), std::slice::from_ref(&w));
    write_version(&full, "1");
    let pid = std::process::id();
    let (group, cell) = (format!("wm_{tag}_{pid}"), format!("wm_{tag}_cell_{pid}"));
    let ranks = (0..2u32)
        .map(|rank| {
            let log = dir.path().join(format!("rank{rank}.log"));
            let err = dir.path().join(format!("rank{rank}.err"));
            let model = if rank == 0 { &full } else { &empty };
            let io = (model.as_path(), log.as_path(), err.as_path());
            let child = spawn_rank(r, rank, (&group, &cell), io, two_phase(rank));
            (child, log, err)
        })
        .collect();
    (dir, cell, w, ranks)
}

/// The root stages while the member updates in one call: the member
/// refuses before any byte moves (it would commit a version the ranks may
/// drop), no rank commits, and the controller is told.
pub fn mixed_modes_are_refused(r: Ranks) {
    let (_dir, cell, _w, mut children) = start_two(&r, "fom", |rank| rank == 0);
    let ctl = Controller::open(&cell).unwrap();
    ctl.wait_for(State::Normal, Duration::from_secs(60))
        .unwrap();
    ctl.cell().compare_exchange(0, 1).unwrap().unwrap();
    // Refused: the word goes to CLEARED, never NORMAL.
    ctl.wait_for(State::Cleared, Duration::from_secs(120))
        .unwrap();
    for (child, log, _) in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
        let log = std::fs::read_to_string(&*log).unwrap_or_default();
        assert!(!log.contains("updated 1"), "a rank committed: {log}");
    }
    let _ = weight_manager_core::internals::signal::shm::unlink(&cell);
    let _ = weight_manager_core::internals::signal::shm::unlink(&format!("{cell}.wm_report"));
}

/// Run two updates of version 1 through the cell; both ranks must log
/// `w`'s checksum after each.
pub fn fan_out_twice(r: Ranks) {
    let (_dir, cell, w, mut ranks) = start_two(&r, "fo", |_| r.two_phase);
    let ctl = Controller::open(&cell).unwrap();
    for _ in 0..2 {
        ctl.wait_for(State::Normal, Duration::from_secs(60))
            .unwrap();
        ctl.cell().compare_exchange(0, 1).unwrap().unwrap();
        let done = ctl.wait_for(State::Normal, Duration::from_secs(120));
        if done.is_err() {
            for (child, log, err) in ranks.iter_mut() {
                let _ = child.kill();
                println!("{}", std::fs::read_to_string(&*err).unwrap_or_default());
                let l = std::fs::read_to_string(&*log).unwrap_or_default();
                let lines: Vec<&str> = l.lines().collect();
                println!(
                    "LOG {}: {}",
                    log.display(),
                    lines[lines.len().saturating_sub(12)..].join(" | ")
                );
            }
            panic!("the fan-out update did not finish: {done:?}");
        }
    }
    let want = format!(
        "updated 1 w={:032x}",
        weight_manager_core::checksum::of(&w.data)
    );
    for (mut child, log, err) in ranks {
        let status = child.wait().unwrap();
        let err = std::fs::read_to_string(&err).unwrap_or_default();
        assert!(status.success(), "{err}");
        let log = std::fs::read_to_string(&log).unwrap();
        assert_eq!(log.matches(&want).count(), 2, "{log}\n{err}");
    }
    let _ = weight_manager_core::internals::signal::shm::unlink(&cell);
    let _ = weight_manager_core::internals::signal::shm::unlink(&format!("{cell}.wm_report"));
}
