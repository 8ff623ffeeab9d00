//! The control plane with real processes: `wm worker` ranks in a group, a
//! controller in this process driving the control cell.

mod common;

use common::ShmNames as Names;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::DType;
use weight_manager_core::State;
use weight_manager_core::{Controller, RequestOutcome};

use common::WM;

fn unique(tag: &str) -> String {
    format!("wm_it_{tag}_{}", std::process::id())
}

fn snapshot(dir: &Path) {
    common::write_safetensors(
        &dir.join("model.safetensors"),
        &[common::tensor("w", DType::F32, &[16], 1)],
    );
    common::write_version(dir, "1");
}

struct Rank {
    child: Child,
    log: PathBuf,
    err: PathBuf,
}

fn spawn(dir: &Path, rank: u32, args: &[String]) -> Rank {
    let log = dir.join(format!("steps{rank}.log"));
    let err = dir.join(format!("stderr{rank}.log"));
    let child = Command::new(&*WM)
        .arg("worker")
        .args(["--rank", &rank.to_string(), "--log"])
        .arg(&log)
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Rank { child, log, err }
}

fn all_exited(ranks: &mut [Rank]) -> bool {
    ranks
        .iter_mut()
        .all(|r| r.child.try_wait().unwrap().is_some())
}

/// Cycles NORMAL, UPDATING, NORMAL, CLEARING, CLEARED, UPDATING, NORMAL
/// until the ranks finish their steps; returns the cycles completed.
fn drive(cell: &str, ranks: &mut [Rank]) -> usize {
    let c = Controller::open(cell).unwrap();
    let t = Duration::from_secs(10);
    let mut cycles = 0;
    while !all_exited(ranks) {
        if c.wait_for(State::Normal, t).is_err()
            || c.cell().compare_exchange(0, 1).unwrap().is_err()
        {
            break;
        }
        if c.wait_for(State::Normal, t).is_err() {
            break;
        }
        if c.request(State::Clearing, t) != Ok(RequestOutcome::Done) {
            break;
        }
        if c.request(State::Updating, t) != Ok(RequestOutcome::Done) {
            break;
        }
        cycles += 1;
    }
    cycles
}

fn finish(ranks: &mut [Rank]) -> Vec<String> {
    ranks
        .iter_mut()
        .map(|r| {
            let status = r.child.wait().unwrap();
            let err = std::fs::read_to_string(&r.err).unwrap_or_default();
            assert!(status.success(), "rank failed: {err}");
            std::fs::read_to_string(&r.log).unwrap()
        })
        .collect()
}

fn check_same_steps(logs: &[String], cycles: usize) {
    assert!(cycles >= 5, "only {cycles} controller cycles completed");
    for (i, l) in logs.iter().enumerate() {
        assert_eq!(l, &logs[0], "rank {i} saw other values than rank 0");
    }
    for want in ["UPDATING", "CLEARING", "CLEARED", "NORMAL"] {
        assert!(logs[0].contains(want), "no {want} step");
    }
}

#[test]
fn eight_ranks_on_one_node_follow_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let (group, cell) = (unique("g8"), unique("c8"));
    let _names = Names(vec![cell.clone()]);
    let common: Vec<String> = [
        "--world",
        "8",
        "--group",
        &group,
        "--cell",
        &cell,
        "--steps",
        "3000",
        "--step-us",
        "100",
        "--timeout-ms",
        "10000",
        "--model-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.path().to_string_lossy().into_owned()])
    .collect();
    let mut ranks: Vec<Rank> = (0..8).map(|r| spawn(dir.path(), r, &common)).collect();
    let cycles = drive(&cell, &mut ranks);
    let logs = finish(&mut ranks);
    check_same_steps(&logs, cycles);
    // The group segment is gone from /dev/shm once the ranks met.
    assert!(!Path::new(&format!("/dev/shm/wm.{group}.n0")).exists());
}

#[test]
fn two_nodes_of_two_ranks_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let (group, cell) = (unique("g22"), unique("c22"));
    let _names = Names(vec![cell.clone()]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut ranks = Vec::new();
    for rank in 0..4u32 {
        let (node, local) = (rank / 2, rank % 2);
        let args: Vec<String> = [
            "--world",
            "4",
            "--group",
            &group,
            "--cell",
            &cell,
            "--node",
            &node.to_string(),
            "--local-rank",
            &local.to_string(),
            "--local-world",
            "2",
            "--addr",
            &addr,
            "--steps",
            "2500",
            "--step-us",
            "100",
            "--timeout-ms",
            "10000",
            "--model-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([dir.path().to_string_lossy().into_owned()])
        .collect();
        ranks.push(spawn(dir.path(), rank, &args));
    }
    let cycles = drive(&cell, &mut ranks);
    let logs = finish(&mut ranks);
    check_same_steps(&logs, cycles);
}

#[test]
fn a_killed_rank_is_named_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("gk");
    let args: Vec<String> = [
        "--world",
        "4",
        "--group",
        &group,
        "--steps",
        "10000000",
        "--step-us",
        "200",
        "--timeout-ms",
        "3000",
        "--model-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.path().to_string_lossy().into_owned()])
    .collect();
    let mut ranks: Vec<Rank> = (0..4).map(|r| spawn(dir.path(), r, &args)).collect();
    // Let them loop a while, then kill rank 2.
    let start = Instant::now();
    while std::fs::metadata(&ranks[3].log)
        .map(|m| m.len())
        .unwrap_or(0)
        < 2000
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks[2].child.kill().unwrap();
    ranks[2].child.wait().unwrap();
    let killed = Instant::now();
    for (i, r) in ranks.iter_mut().enumerate().filter(|(i, _)| *i != 2) {
        let status = loop {
            if let Some(s) = r.child.try_wait().unwrap() {
                break s;
            }
            if killed.elapsed() > Duration::from_secs(15) {
                let _ = r.child.kill();
                panic!("rank {i} still running 15 s after rank 2 died");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let err = std::fs::read_to_string(&r.err).unwrap();
        assert!(!status.success(), "rank {i} did not notice");
        assert!(
            err.contains("rank 2"),
            "rank {i} does not name rank 2: {err}"
        );
    }
    // Within the 3 s timeout (plus process exit): detection is by liveness, not by waiting it out.
    assert!(
        killed.elapsed() < Duration::from_secs(6),
        "took {:?}",
        killed.elapsed()
    );
}

#[test]
fn a_failed_update_reaches_the_controller() {
    let good = tempfile::tempdir().unwrap();
    snapshot(good.path());
    let empty = tempfile::tempdir().unwrap();
    let (group, cell) = (unique("gf"), unique("cf"));
    let _names = Names(vec![cell.clone()]);
    let mut ranks = Vec::new();
    for rank in 0..2u32 {
        let model = if rank == 1 { empty.path() } else { good.path() };
        let args: Vec<String> = [
            "--world",
            "2",
            "--group",
            &group,
            "--cell",
            &cell,
            "--steps",
            "4000",
            "--step-us",
            "200",
            "--timeout-ms",
            "10000",
            "--model-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([model.to_string_lossy().into_owned()])
        .collect();
        ranks.push(spawn(good.path(), rank, &args));
    }
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    let e = c.request(State::Updating, t).unwrap_err();
    assert_eq!(e.code, weight_manager_core::wm_result::WM_ERR_NOT_FOUND);
    assert!(e.message.contains("update failed on rank 1"), "{e}");
    // The word does not claim NORMAL, and a new request is accepted from CLEARED.
    assert_eq!(c.get().unwrap(), State::Cleared);
    assert!(c.request(State::Updating, t).is_err());
    for r in &mut ranks {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}

#[test]
fn rendezvous_names_the_ranks_that_never_arrived() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("gm");
    let args: Vec<String> = [
        "--world",
        "4",
        "--group",
        &group,
        "--steps",
        "10",
        "--timeout-ms",
        "1000",
        "--model-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.path().to_string_lossy().into_owned()])
    .collect();
    let mut ranks: Vec<Rank> = [0, 1, 2]
        .iter()
        .map(|&r| spawn(dir.path(), r, &args))
        .collect();
    let status = ranks[0].child.wait().unwrap();
    assert!(!status.success());
    let err = std::fs::read_to_string(&ranks[0].err).unwrap();
    assert!(err.contains("ranks never arrived: 3"), "{err}");
    for r in &mut ranks[1..] {
        assert!(!r.child.wait().unwrap().success());
    }
}
