//! The control plane with real processes: `wm worker` ranks in a group, a
//! controller in this process driving the control cell.

mod common;

use common::ShmNames as Names;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
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

/// `wm worker` options `opts`, then `--model-dir model` last.
fn worker_args(opts: &[&str], model: &Path) -> Vec<String> {
    (opts.iter().map(|s| s.to_string()))
        .chain([model.to_string_lossy().into_owned()])
        .collect()
}

/// A loopback `host:port` nothing listens on now (for a rendezvous).
fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

struct Rank {
    child: Child,
    log: PathBuf,
    err: PathBuf,
    /// Its stdout: the closing summary.
    out: PathBuf,
}

fn spawn(dir: &Path, rank: u32, args: &[String]) -> Rank {
    let log = dir.join(format!("steps{rank}.log"));
    let err = dir.join(format!("stderr{rank}.log"));
    let out = dir.join(format!("stdout{rank}.log"));
    let child = Command::new(&*WM)
        .arg("worker")
        .args(["--rank", &rank.to_string(), "--log"])
        .arg(&log)
        .args(args)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Rank {
        child,
        log,
        err,
        out,
    }
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
    let common: Vec<String> = worker_args(
        &[
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
        ],
        dir.path(),
    );
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
    let addr = free_addr();
    let mut ranks = Vec::new();
    for rank in 0..4u32 {
        let (node, local) = (rank / 2, rank % 2);
        let args: Vec<String> = worker_args(
            &[
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
            ],
            dir.path(),
        );
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
    let args: Vec<String> = worker_args(
        &[
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
        ],
        dir.path(),
    );
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

/// Audit item: three ranks on one node, the word CLEARED (every step a
/// barrier), rank 1 stopped (SIGSTOP: alive, silent). Rank 2 enters each
/// barrier well before rank 0 (whose steps are slower), so its deadline
/// passes first: it named rank 0 ("waited for rank 0 (or the ranks it
/// waits for)"), and that became every rank's reason. Now every rank
/// names rank 1, from the node's slots.
#[test]
fn a_stopped_rank_is_named_by_the_rank_that_times_out_first() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let (group, cell) = (unique("gst"), unique("cst"));
    let _names = Names(vec![cell.clone()]);
    let mut ranks: Vec<Rank> = (0..3u32)
        .map(|rank| {
            let step_us = if rank == 0 { "300000" } else { "200" };
            let opts = [
                "--world",
                "3",
                "--group",
                &group,
                "--cell",
                &cell,
                "--steps",
                "100000",
                "--step-us",
                step_us,
                "--timeout-ms",
                "2000",
                "--model-dir",
            ];
            spawn(dir.path(), rank, &worker_args(&opts, dir.path()))
        })
        .collect();
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    unsafe { libc::kill(ranks[1].child.id() as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    for r in [0, 2] {
        while ranks[r].child.try_wait().unwrap().is_none() {
            if stopped.elapsed() > Duration::from_secs(20) {
                for r in ranks.iter_mut() {
                    let _ = r.child.kill();
                }
                panic!("rank {r} still stepping 20 s after rank 1 stopped");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    unsafe { libc::kill(ranks[1].child.id() as i32, libc::SIGCONT) };
    let _ = ranks[1].child.kill();
    let _ = ranks[1].child.wait();
    for r in [0, 2] {
        let err = std::fs::read_to_string(&ranks[r].err).unwrap();
        assert!(
            err.contains("rank(s) 1 did not reach barrier") && !err.contains("for rank 0"),
            "rank {r}: {err}"
        );
    }
}

/// Two nodes of one rank each over TCP, stepping as fast as they can with
/// the word NORMAL; node 1 is stopped (SIGSTOP: alive, its socket open,
/// nothing read). Once rank 0's sends to it fill the TCP buffers, rank 0's
/// step fails within the group's timeout naming node 1 (its send waited
/// without end before).
#[test]
fn a_stopped_node_fails_rank_0s_steps_once_its_socket_is_full() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("gs");
    let addr = free_addr();
    let mut ranks: Vec<Rank> = (0..2u32)
        .map(|rank| {
            let args: Vec<String> = worker_args(
                &[
                    "--world",
                    "2",
                    "--group",
                    &group,
                    "--node",
                    &rank.to_string(),
                    "--local-rank",
                    "0",
                    "--local-world",
                    "1",
                    "--addr",
                    &addr,
                    "--steps",
                    "100000000",
                    "--step-us",
                    "0",
                    "--timeout-ms",
                    "2000",
                    "--model-dir",
                ],
                dir.path(),
            );
            spawn(dir.path(), rank, &args)
        })
        .collect();
    let start = Instant::now();
    while std::fs::metadata(&ranks[1].log).map_or(0, |m| m.len()) < 2000 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(ranks[1].child.id() as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    let status = loop {
        if let Some(s) = ranks[0].child.try_wait().unwrap() {
            break Some(s);
        }
        if stopped.elapsed() > Duration::from_secs(90) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for r in ranks.iter_mut() {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
    let err = std::fs::read_to_string(&ranks[0].err).unwrap();
    let status =
        status.unwrap_or_else(|| panic!("rank 0 still stepping 90 s after node 1 stopped: {err}"));
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("node 1") && err.contains("took no message"),
        "{err}"
    );
}

/// `wm worker` options of one of two ranks in `group` with `cell`, each
/// reading `model`.
fn two_rank_args((group, cell): (&str, &str), model: &Path) -> Vec<String> {
    let model = model.to_string_lossy().into_owned();
    [
        "--world", "2", "--group", group, "--cell", cell, "--steps", "4000",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(["--step-us", "200", "--timeout-ms", "10000", "--model-dir"].map(String::from))
    .chain([model])
    .collect()
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
        let args = two_rank_args((&group, &cell), model);
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

/// Two ranks whose snapshots hold different versions both update, but
/// the word does not go to NORMAL over a mix: CLEARED, the controller told
/// which rank took another version (`WM_ERR_MISMATCH`).
/// Also names whose 32-bit FNV-1a hashes agree in the 28 bits one round of
/// the barrier carries ('step-19324' and 'step-58640'): they passed as one
/// version before the second round.
#[test]
fn ranks_that_took_different_versions_are_not_reported_done() {
    for (v1, v2) in [("1", "2"), ("step-19324", "step-58640")] {
        different_versions_are_refused(v1, v2);
    }
}

fn different_versions_are_refused(v1: &str, v2: &str) {
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    snapshot(one.path());
    snapshot(two.path());
    common::write_version(one.path(), v1);
    common::write_version(two.path(), v2);
    let (group, cell) = (unique("gv"), unique("cv"));
    let _names = Names(vec![cell.clone()]);
    let mut ranks = Vec::new();
    for (rank, model) in [one.path(), two.path()].into_iter().enumerate() {
        let args = two_rank_args((&group, &cell), model);
        ranks.push(spawn(one.path(), rank as u32, &args));
    }
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    let e = c.request(State::Updating, t).unwrap_err();
    assert_eq!(
        e.code,
        weight_manager_core::wm_result::WM_ERR_MISMATCH,
        "{e}"
    );
    assert!(
        e.message
            .contains(&format!("rank 1 took another version than rank 0's '{v1}'")),
        "{e}"
    );
    assert_eq!(c.get().unwrap(), State::Cleared);
    for r in &mut ranks {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}

/// Ranks misconfigured against each other are told so, naming the
/// setting: a rank number given twice (at once), and a rank given another
/// world size than its node's rank 0 (at its group timeout).
#[test]
fn a_rank_number_given_twice_or_another_world_size_is_named() {
    let d = tempfile::tempdir().unwrap();
    snapshot(d.path());
    let args = |group: &str, world: &str| -> Vec<String> {
        let model = d.path().to_string_lossy().into_owned();
        [
            "--world",
            world,
            "--group",
            group,
            "--steps",
            "300",
            "--step-us",
            "10000",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            "--timeout-ms".into(),
            "3000".into(),
            "--model-dir".into(),
            model,
        ])
        .collect()
    };
    let stderr = |r: &mut Rank| {
        let status = r.child.wait().unwrap();
        (status, std::fs::read_to_string(&r.err).unwrap_or_default())
    };
    // Ranks started first (rank, world size), then one more that must be
    // refused, naming why.
    let late_rank_is_refused = |tag: &str, first: &[(u32, &str)], late: (u32, &str), want: &str| {
        let group = unique(tag);
        let first: Vec<Rank> = (first.iter())
            .map(|&(r, world)| spawn(d.path(), r, &args(&group, world)))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let late_dir = tempfile::tempdir().unwrap();
        let mut late = spawn(late_dir.path(), late.0, &args(&group, late.1));
        let (status, err) = stderr(&mut late);
        assert!(!status.success());
        assert!(err.contains(want), "{tag}: {err}");
        for mut r in first {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    };
    // Rank 1 twice in a group of three: the second is refused at once.
    let taken = "local rank 1 of node 0 is taken by process";
    late_rank_is_refused("dup", &[(0, "3"), (1, "3")], (1, "3"), taken);
    // Rank 0 twice while the first still meets its ranks: the second
    // would replace the group's segment; it is refused at once.
    let taken = "local rank 0 of node 0 is taken by process";
    late_rank_is_refused("dup0", &[(0, "3")], (0, "3"), taken);
    // Rank 1 told a world of three where rank 0 was told two.
    let other = "made the group for 2 local rank(s), but rank 1 was told 3";
    late_rank_is_refused("size", &[(0, "2")], (1, "3"), other);
}

#[test]
fn rendezvous_names_the_ranks_that_never_arrived() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("gm");
    let args: Vec<String> = worker_args(
        &[
            "--world",
            "4",
            "--group",
            &group,
            "--steps",
            "10",
            "--timeout-ms",
            "1000",
            "--model-dir",
        ],
        dir.path(),
    );
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

/// `wm worker --two-phase` ranks, rank `r` reading `model(r)` and serving
/// 3000 steps of `step_us(r)` microseconds.
fn two_phase_ranks(
    dir: &Path,
    world: u32,
    (group, cell): (&str, &str),
    model: impl Fn(u32) -> PathBuf,
    step_us: impl Fn(u32) -> u64,
) -> Vec<Rank> {
    two_phase_ranks_stepping(dir, world, (group, cell), model, (step_us, 3000))
}

/// [`two_phase_ranks`] serving `steps` steps.
fn two_phase_ranks_stepping(
    dir: &Path,
    world: u32,
    (group, cell): (&str, &str),
    model: impl Fn(u32) -> PathBuf,
    (step_us, steps): (impl Fn(u32) -> u64, u32),
) -> Vec<Rank> {
    (0..world)
        .map(|rank| {
            let args: Vec<String> = [
                "--two-phase",
                "--world",
                &world.to_string(),
                "--group",
                group,
                "--cell",
                cell,
                "--steps",
                &steps.to_string(),
                "--timeout-ms",
                "10000",
                "--step-us",
                &step_us(rank).to_string(),
                "--model-dir",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([model(rank).to_string_lossy().into_owned()])
            .collect();
            spawn(dir, rank, &args)
        })
        .collect()
}

/// The step each rank's log says it committed `version` at.
fn commit_steps(logs: &[String], version: &str) -> Vec<Option<u64>> {
    let prefix = format!("committed {version} at ");
    logs.iter()
        .map(|l| {
            l.lines()
                .find_map(|line| line.strip_prefix(&prefix))
                .map(|s| s.parse().unwrap())
        })
        .collect()
}

/// Two-phase updates under the controller: every rank stages while it
/// keeps serving, and all commit at the same step (each logs the step it
/// committed at), for 2 and 4 ranks, three versions each.
#[test]
fn two_phase_ranks_commit_at_the_same_step() {
    for world in [2u32, 4] {
        let dir = tempfile::tempdir().unwrap();
        snapshot(dir.path());
        let (group, cell) = (
            unique(&format!("g2p{world}")),
            unique(&format!("c2p{world}")),
        );
        let _names = Names(vec![cell.clone()]);
        let mut ranks = two_phase_ranks(
            dir.path(),
            world,
            (&group, &cell),
            |_| dir.path().into(),
            |_| 200,
        );
        let c = Controller::open(&cell).unwrap();
        let t = Duration::from_secs(10);
        assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
        for v in ["v1", "v2", "v3"] {
            common::write_version(dir.path(), v);
            assert_eq!(
                c.request(State::Updating, t).unwrap(),
                RequestOutcome::Done,
                "{v}"
            );
            assert_eq!(c.get().unwrap(), State::Normal);
            if v != "v3" {
                assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
            }
        }
        let logs = finish(&mut ranks);
        for r in &ranks {
            // The closing summary counts the commits as updates.
            let out = std::fs::read_to_string(&r.out).unwrap();
            assert!(out.contains(" 3 updates, "), "{world} ranks: {out}");
        }
        for v in ["v1", "v2", "v3"] {
            let steps = commit_steps(&logs, v);
            assert!(
                steps[0].is_some(),
                "{world} ranks: rank 0 never committed {v}"
            );
            assert!(
                steps.iter().all(|s| *s == steps[0]),
                "{world} ranks: {v} committed at steps {steps:?}"
            );
        }
    }
}

/// Audit item: from the second two-phase update on, COMMIT came one step
/// later than the first's (each rank's last ready vote, kept from the
/// update before, made its first vote for the next version "not ready").
/// Steps of 20 ms, so staging ends within the step it starts in: every
/// version commits the same number of steps after its staging started.
#[test]
fn every_two_phase_update_commits_as_soon_as_the_first() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let (group, cell) = (unique("g2ps"), unique("c2ps"));
    let _names = Names(vec![cell.clone()]);
    let steps = (|_| 20_000, 200);
    let mut ranks =
        two_phase_ranks_stepping(dir.path(), 2, (&group, &cell), |_| dir.path().into(), steps);
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    let versions = ["s1", "s2", "s3"];
    for v in versions {
        common::write_version(dir.path(), v);
        assert_eq!(
            c.request(State::Updating, t).unwrap(),
            RequestOutcome::Done,
            "{v}"
        );
        assert_eq!(
            c.request(State::Clearing, t).unwrap(),
            RequestOutcome::Done,
            "{v}"
        );
    }
    let logs = finish(&mut ranks);
    for (r, log) in logs.iter().enumerate() {
        let started: Vec<u64> = (log.lines())
            .filter_map(|l| l.strip_prefix("staging at "))
            .map(|s| s.parse().unwrap())
            .collect();
        let committed: Vec<u64> = (versions.iter())
            .map(|v| commit_steps(std::slice::from_ref(log), v)[0].unwrap())
            .collect();
        assert_eq!(started.len(), versions.len(), "rank {r}: {log}");
        let took: Vec<u64> = committed.iter().zip(&started).map(|(c, s)| c - s).collect();
        assert!(
            took.iter().all(|&n| n == took[0] && n <= 4),
            "rank {r}: steps to commit {took:?}: {log}"
        );
    }
}

/// One rank fails to stage (its model folder is empty): no rank commits,
/// every rank learns why at the same step, and the controller hears which
/// rank failed; the word goes to CLEARED.
#[test]
fn a_rank_that_fails_to_stage_stops_every_commit() {
    let good = tempfile::tempdir().unwrap();
    snapshot(good.path());
    let empty = tempfile::tempdir().unwrap();
    let model = |rank: u32| match rank {
        1 => empty.path().to_path_buf(),
        _ => good.path().to_path_buf(),
    };
    let (e, logs) = no_rank_commits(("2pf", good.path()), 3, model, "rank 1 failed to stage");
    assert!(e.message.contains("failed on rank 1"), "{e}");
    // The failing rank says why (its error names the empty folder); the
    // others, which got its code in the vote, say where to look.
    let heard = |r: usize| {
        logs[r]
            .lines()
            .find(|l| l.starts_with("no commit at"))
            .unwrap()
    };
    let folder = empty.path().display().to_string();
    assert!(heard(1).contains(&folder), "{}", heard(1));
    for r in [0, 2] {
        assert!(
            heard(r).contains("that rank's last error says why"),
            "{}",
            heard(r)
        );
    }
}

/// Two ranks staging versions whose names' first 28-bit hashes collide
/// ('step-19324' and 'step-58640'): the vote's other hash tells them
/// apart, so no rank commits (before, both committed and the finishing
/// barrier caught it after the fact), and the controller hears
/// `WM_ERR_MISMATCH`.
#[test]
fn ranks_staging_colliding_names_do_not_commit() {
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    snapshot(one.path());
    snapshot(two.path());
    common::write_version(one.path(), "step-19324");
    common::write_version(two.path(), "step-58640");
    let model = |rank: u32| match rank {
        0 => one.path().to_path_buf(),
        _ => two.path().to_path_buf(),
    };
    let (e, _) = no_rank_commits(
        ("2pc", one.path()),
        2,
        model,
        "rank 1 staged another version",
    );
    let mismatch = weight_manager_core::wm_result::WM_ERR_MISMATCH;
    assert_eq!(e.code, mismatch, "{e}");
}

/// `world` two-phase ranks reading `model(rank)` (group and cell named
/// after `tag`) are asked for an update
/// that no rank may commit: the controller's error (the word goes to
/// CLEARED), after checking that no rank committed and every rank heard
/// `why` at the same step.
fn no_rank_commits(
    (tag, dir): (&str, &Path),
    world: u32,
    model: impl Fn(u32) -> PathBuf,
    why: &str,
) -> (weight_manager_core::Error, Vec<String>) {
    let (group, cell) = (unique(&format!("g{tag}")), unique(&format!("c{tag}")));
    let _names = Names(vec![cell.clone()]);
    let mut ranks = two_phase_ranks(dir, world, (&group, &cell), model, |_| 200);
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    let e = c.request(State::Updating, t).unwrap_err();
    assert_eq!(c.get().unwrap(), State::Cleared);
    let logs = finish(&mut ranks);
    let mut at = None;
    for (r, log) in logs.iter().enumerate() {
        assert!(!log.contains("committed"), "rank {r} committed: {log}");
        let line = log.lines().find(|l| l.starts_with("no commit at"));
        let line = line.unwrap_or_else(|| panic!("rank {r} never heard: {log}"));
        assert!(line.contains(why), "rank {r}: {line}");
        let step = line
            .split_whitespace()
            .nth(3)
            .unwrap()
            .trim_end_matches(':')
            .to_string();
        assert_eq!(
            *at.get_or_insert(step.clone()),
            step,
            "rank {r} heard at another step"
        );
    }
    (e, logs)
}

/// A rank killed between stage and commit: the others name it and stop,
/// and nobody commits. Rank 1 serves steps of 1.5 s, so the group steps
/// that slowly: UPDATING is seen within 1.5 s of the request, the ranks
/// stage at once, and COMMIT comes three steps later; rank 1 is killed in
/// between.
#[test]
fn a_rank_killed_while_staging_is_named() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let (group, cell) = (unique("g2pk"), unique("c2pk"));
    let _names = Names(vec![cell.clone()]);
    let slow = |rank: u32| if rank == 1 { 1_500_000 } else { 200 };
    let mut ranks = two_phase_ranks(dir.path(), 2, (&group, &cell), |_| dir.path().into(), slow);
    let c = Controller::open(&cell).unwrap();
    let t = Duration::from_secs(10);
    assert_eq!(c.request(State::Clearing, t).unwrap(), RequestOutcome::Done);
    assert!(c
        .cell()
        .compare_exchange(State::Cleared as i32, 1)
        .unwrap()
        .is_ok());
    std::thread::sleep(Duration::from_millis(2000));
    ranks[1].child.kill().unwrap();
    ranks[1].child.wait().unwrap();
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = ranks[0].child.try_wait().unwrap() {
            break s;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "rank 0 still running"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!status.success());
    let err = std::fs::read_to_string(&ranks[0].err).unwrap();
    assert!(err.contains("rank 1"), "rank 0 does not name rank 1: {err}");
    let log = std::fs::read_to_string(&ranks[0].log).unwrap();
    assert!(!log.contains("committed"), "{log}");
}
