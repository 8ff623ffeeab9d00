//! The control plane when things break: a full or shrinking /dev/shm, a torn
//! report, ranks that die during a request or the rendezvous. Real
//! processes, real shared-memory objects, a real tmpfs.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use weight_manager_core::wm_result;
use weight_manager_core::Controller;
use weight_manager_core::State;
use weight_manager_core::{Manager, ManagerConfig};

mod common;

use common::ShmNames as Names;

use common::WM;

fn unique(tag: &str) -> String {
    format!("wm_ft_{tag}_{}", std::process::id())
}

fn truncate(name: &str) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap();
    f.set_len(0).unwrap();
}

#[test]
fn a_cell_truncated_under_a_controller_is_an_error_not_sigbus() {
    let cell = unique("trc");
    let _names = Names(vec![cell.clone()]);
    let c = Controller::open(&cell).unwrap();
    assert_eq!(c.get().unwrap(), State::Normal);
    truncate(&cell);
    let e = c.get().unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT);
    assert!(
        e.message.contains(&cell) && e.message.contains("truncated"),
        "{e}"
    );
    assert!(c.set(State::Cleared).is_err());
    assert!(c
        .request(State::Updating, Duration::from_millis(50))
        .is_err());
}

#[test]
fn a_cell_truncated_under_rank_0_fails_the_step_not_the_engine() {
    let cell = unique("trm");
    let _names = Names(vec![cell.clone()]);
    let m = Manager::new(ManagerConfig {
        control_cell: Some(cell.clone()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(m.broadcast_signal().unwrap(), State::Normal);
    truncate(&cell);
    let e = m.broadcast_signal().unwrap_err();
    assert!(e.message.contains("truncated"), "{e}");
}

/// Fills this namespace's /dev/shm, then checks every way in. Run only by
/// `a_full_dev_shm_is_out_of_memory_not_sigbus`, inside its own mount
/// namespace with a small tmpfs on /dev/shm.
#[test]
#[ignore = "run by a_full_dev_shm_is_out_of_memory_not_sigbus inside a private tmpfs"]
fn full_dev_shm_inner() {
    assert_eq!(std::env::var("WM_FULL_SHM_INNER").as_deref(), Ok("1"));
    let mut fill = std::fs::File::create("/dev/shm/filler").unwrap();
    let chunk = vec![1u8; 4096];
    while fill.write_all(&chunk).is_ok() {}
    drop(fill);
    let e = Controller::open("c")
        .err()
        .expect("open on a full /dev/shm");
    assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
    assert!(e.message.contains("/dev/shm"), "{e}");
    let e = Manager::new(ManagerConfig {
        control_cell: Some("m".into()),
        ..Default::default()
    })
    .err()
    .expect("init on a full /dev/shm");
    assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let args = worker_args(2, "g", Some("w"), 100, 3000, dir.path());
    let ranks: Vec<Child> = (0..2)
        .map(|r| worker(r, &args).stderr(Stdio::piped()).spawn().unwrap())
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(1),
            "rank {r}: {:?} {err}",
            out.status
        );
        if r == 0 {
            assert!(err.contains("/dev/shm is full"), "rank 0: {err}");
        }
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["filler".to_string()], "left behind");
    println!("full /dev/shm checks passed");
}

#[test]
fn a_full_dev_shm_is_out_of_memory_not_sigbus() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: mounting a private tmpfs on /dev/shm needs root");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let script = "mount -t tmpfs -o size=256k tmpfs /dev/shm && exec \"$0\" --exact full_dev_shm_inner --ignored --nocapture --test-threads=1";
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script])
        .arg(&exe)
        .env("WM_FULL_SHM_INNER", "1")
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: cannot run unshare: {e}");
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{:?}: {text}", out.status);
    assert!(text.contains("full /dev/shm checks passed"), "{text}");
}

/// Writes a report object by hand: `seq` odd means "being written".
fn write_report(cell: &str, seq: u64, pid: u32) {
    use std::os::unix::fs::MetadataExt;
    let mut bytes = vec![0u8; 4096];
    bytes[..8].copy_from_slice(&seq.to_le_bytes());
    bytes[20..24].copy_from_slice(&pid.to_le_bytes());
    let ns = std::fs::metadata("/proc/self/ns/pid").unwrap().ino();
    bytes[24..32].copy_from_slice(&ns.to_le_bytes());
    std::fs::write(format!("/dev/shm/{cell}.wm_report"), bytes).unwrap();
}

/// Runs a request on another thread; fails the test (rather than hanging
/// it) if it has not returned within `limit`.
fn request_within(
    cell: &str,
    action: State,
    timeout: Duration,
    limit: Duration,
) -> weight_manager_core::Result<weight_manager_core::RequestOutcome> {
    let (tx, rx) = mpsc::channel();
    let name = cell.to_string();
    std::thread::spawn(move || {
        let c = Controller::open(&name).unwrap();
        let _ = tx.send(c.request(action, timeout));
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("the request did not return within {limit:?}"))
}

#[test]
fn a_torn_report_does_not_hang_the_controller() {
    let cell = unique("torn");
    let _names = Names(vec![cell.clone()]);
    Controller::open(&cell)
        .unwrap()
        .set(State::Cleared)
        .unwrap();
    write_report(&cell, 7, 0);
    let start = Instant::now();
    let e = request_within(
        &cell,
        State::Updating,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT);
    assert!(e.message.contains("never settled"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_torn_report_of_a_dead_rank_0_leaves_the_word_cleared() {
    let cell = unique("tdead");
    let _names = Names(vec![cell.clone()]);
    let c = Controller::open(&cell).unwrap();
    c.set(State::Cleared).unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    write_report(&cell, 3, pid);
    let e = request_within(
        &cell,
        State::Updating,
        Duration::from_millis(500),
        Duration::from_secs(30),
    )
    .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_PEER);
    assert!(e.message.contains(&format!("rank 0 (pid {pid})")), "{e}");
    assert_eq!(c.get().unwrap(), State::Cleared);
    // The controller's report repaired the torn one and says the same.
    let e2 = c
        .request(State::Updating, Duration::from_millis(200))
        .unwrap_err();
    assert!(e2.message.contains("is gone"), "{e2}");
}

fn snapshot(dir: &Path) {
    common::write_safetensors(
        &dir.join("model.safetensors"),
        &[common::tensor(
            "w",
            weight_manager_core::DType::F32,
            &[16],
            1,
        )],
    );
    common::write_version(dir, "1");
}

fn worker_args(
    world: u32,
    group: &str,
    cell: Option<&str>,
    step_us: u64,
    timeout_ms: u64,
    dir: &Path,
) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--world".into(),
        world.to_string(),
        "--group".into(),
        group.into(),
        "--steps".into(),
        "100000000".into(),
        "--step-us".into(),
        step_us.to_string(),
        "--timeout-ms".into(),
        timeout_ms.to_string(),
        "--model-dir".into(),
        dir.to_string_lossy().into_owned(),
    ];
    if let Some(c) = cell {
        a.extend(["--cell".into(), c.into()]);
    }
    a
}

fn worker(rank: u32, args: &[String]) -> Command {
    let mut c = Command::new(&*WM);
    c.arg("worker")
        .args(["--rank", &rank.to_string()])
        .args(args)
        .stdout(Stdio::null());
    c
}

/// Kills the ranks still running when a test ends.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_ranks(ranks: &[u32], args: &[String], dir: &Path) -> Ranks {
    Ranks(
        ranks
            .iter()
            .map(|&r| {
                let err = std::fs::File::create(dir.join(format!("stderr{r}.log"))).unwrap();
                worker(r, args).stderr(err).spawn().unwrap()
            })
            .collect(),
    )
}

/// Waits until `pid` has the group's segment mapped, and a little more: it
/// marks itself arrived a few instructions after mapping it.
fn wait_arrived(pid: u32, segment: &str) {
    let start = Instant::now();
    loop {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        if maps.contains(segment) {
            std::thread::sleep(Duration::from_millis(500));
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "pid {pid} never arrived"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_exit(c: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return s;
        }
        assert!(start.elapsed() < limit, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_rank_killed_after_arriving_fails_the_rendezvous_at_once() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("rdv");
    // Rank 3 never comes: the rendezvous would wait the whole 60 s for it.
    let args = worker_args(4, &group, None, 100, 60_000, dir.path());
    let mut ranks = spawn_ranks(&[0, 1, 2], &args, dir.path());
    let segment = format!("/dev/shm/wm.{group}.n0");
    wait_arrived(ranks.0[1].id(), &segment);
    ranks.0[1].kill().unwrap();
    ranks.0[1].wait().unwrap();
    for i in [0, 2] {
        let status = wait_exit(&mut ranks.0[i], Duration::from_secs(20));
        assert!(!status.success());
        let err = std::fs::read_to_string(dir.path().join(format!("stderr{i}.log"))).unwrap();
        assert!(
            err.contains("rank 1 (pid") && err.contains("died"),
            "rank {i}: {err}"
        );
    }
}

/// Starts `world` ranks serving `cell` and waits until each stepped.
fn running_group(world: u32, cell: &str, dir: &Path) -> Ranks {
    let group = unique(&format!("g{cell}"));
    let args = worker_args(world, &group, Some(cell), 100_000, 60_000, dir);
    let ranks: Vec<u32> = (0..world).collect();
    let r = spawn_ranks(&ranks, &args, dir);
    let c = Controller::open(cell).unwrap();
    // A round trip through the engine: every rank has met and steps.
    let outcome = c.request(State::Clearing, Duration::from_secs(60)).unwrap();
    assert_eq!(outcome, weight_manager_core::RequestOutcome::Done);
    r
}

#[test]
fn a_dead_rank_is_named_to_the_controller_and_the_word_left_cleared() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let cell = unique("dr");
    let _names = Names(vec![cell.clone()]);
    let mut ranks = running_group(4, &cell, dir.path());
    ranks.0[2].kill().unwrap();
    ranks.0[2].wait().unwrap();
    let start = Instant::now();
    let c = Controller::open(&cell).unwrap();
    let e = c
        .request(State::Updating, Duration::from_secs(30))
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    assert!(e.message.contains("rank 2 (pid"), "{e}");
    // Named by liveness, not after waiting the 30 s out.
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(c.get().unwrap(), State::Cleared);
}

#[test]
fn a_dead_rank_0_is_named_when_the_request_times_out() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let cell = unique("d0");
    let _names = Names(vec![cell.clone()]);
    let mut ranks = running_group(2, &cell, dir.path());
    let pid = ranks.0[0].id();
    ranks.0[0].kill().unwrap();
    ranks.0[0].wait().unwrap();
    let c = Controller::open(&cell).unwrap();
    let e = c
        .request(State::Updating, Duration::from_secs(2))
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    assert!(e.message.contains(&format!("rank 0 (pid {pid})")), "{e}");
    assert_eq!(c.get().unwrap(), State::Cleared);
}

#[test]
fn init_fails_when_a_member_on_another_node_died_during_the_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let group = unique("rdv2");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let node_args = |node: u32, local: u32| -> Vec<String> {
        let mut a = worker_args(4, &group, None, 100, 60_000, dir.path());
        a.extend(
            [
                "--node",
                &node.to_string(),
                "--local-rank",
                &local.to_string(),
                "--local-world",
                "2",
                "--addr",
                &format!("127.0.0.1:{port}"),
            ]
            .map(String::from),
        );
        a
    };
    // Node 1 (ranks 2 and 3) and rank 0 first; rank 1 only after rank 3 died,
    // so every rank has arrived when rank 0 welcomes node 1.
    let mut ranks = spawn_ranks(&[2], &node_args(1, 0), dir.path());
    ranks
        .0
        .append(&mut spawn_ranks(&[3], &node_args(1, 1), dir.path()).0);
    ranks
        .0
        .append(&mut spawn_ranks(&[0], &node_args(0, 0), dir.path()).0);
    wait_arrived(ranks.0[1].id(), &format!("/dev/shm/wm.{group}.n1"));
    ranks.0[1].kill().unwrap();
    ranks.0[1].wait().unwrap();
    ranks
        .0
        .append(&mut spawn_ranks(&[1], &node_args(0, 1), dir.path()).0);
    let status = wait_exit(&mut ranks.0[2], Duration::from_secs(30));
    assert!(!status.success());
    let err = std::fs::read_to_string(dir.path().join("stderr0.log")).unwrap();
    assert!(
        err.contains("init") && err.contains("rank 3 (pid"),
        "rank 0: {err}"
    );
}

/// A call refused with BUSY while the update (or clear) the signal asked
/// for runs is not that action: the controller hears the running call's
/// result, not the refusal (before, the refusal ended the action as failed
/// and the word went to CLEARED while the update went on and committed).
#[test]
fn a_call_refused_as_busy_does_not_end_the_signals_action() {
    let dir = tempfile::tempdir().unwrap();
    snapshot(dir.path());
    let cell = unique("busy");
    let _names = Names(vec![cell.clone()]);
    let m = std::sync::Arc::new(
        Manager::new(ManagerConfig {
            control_cell: Some(cell.clone()),
            fallback_dir: None,
            ..Default::default()
        })
        .unwrap(),
    );
    let spec = weight_manager_core::ParamSpec::host("w", weight_manager_core::DType::F32, &[16]);
    m.allocate(&spec).unwrap();
    let c = Controller::open(&cell).unwrap();
    assert!(c.set(State::Updating).is_ok());
    assert_eq!(m.broadcast_signal().unwrap(), State::Updating);
    let (running, refused) = (mpsc::channel(), mpsc::channel::<()>());
    let worker = {
        let (m, dir) = (m.clone(), dir.path().to_path_buf());
        std::thread::spawn(move || {
            // Holds the update until the other thread was refused.
            let mut hold = |_: &weight_manager_core::Progress| {
                let _ = running.0.send(());
                let _ = refused.1.recv_timeout(Duration::from_secs(10));
                true
            };
            let mut req = weight_manager_core::UpdateRequest::snapshot(&dir);
            req.hooks.progress = Some(&mut hold);
            m.update(req).map(|s| s.version)
        })
    };
    running.1.recv_timeout(Duration::from_secs(10)).unwrap();
    let req = weight_manager_core::UpdateRequest::snapshot(dir.path());
    assert_eq!(m.update(req).unwrap_err().code, wm_result::WM_ERR_BUSY);
    assert_eq!(m.clear().unwrap_err().code, wm_result::WM_ERR_BUSY);
    refused.0.send(()).unwrap();
    assert_eq!(worker.join().unwrap().unwrap(), "1");
    assert_eq!(c.get().unwrap(), State::Normal);
}

/// Ranks out of step: rank 1 (`wm worker`) clears at the first CLEARING,
/// or updates at the first UPDATING, while rank 0 (here) takes the signal
/// once more first. Rank 1's finishing barrier then met rank 0's step:
/// before, every barrier after paired unlike things, and a two-phase
/// update of one version on both ranks ended in a false "rank 1 took
/// another version". Now rank 0's step fails naming the step and rank 1,
/// and the group stops (rank 1 exits with an error, the word goes to
/// CLEARED).
#[test]
fn ranks_out_of_step_stop_the_group_naming_them() {
    for (tag, asked) in [("oosc", State::Clearing), ("oosu", State::Updating)] {
        let dir = tempfile::tempdir().unwrap();
        snapshot(dir.path());
        let (group, cell) = (unique(tag), unique(&format!("{tag}c")));
        let _names = Names(vec![cell.clone(), format!("{cell}.wm_report")]);
        let args = worker_args(2, &group, Some(&cell), 100, 5000, dir.path());
        let mut ranks = spawn_ranks(&[1], &args, dir.path());
        let m = rank_0_of_two(&group, &cell);
        let c = Controller::open(&cell).unwrap();
        c.set(asked).unwrap();
        assert_eq!(m.broadcast_signal().unwrap(), asked);
        let e = m.broadcast_signal().unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_STATE, "{asked:?}: {e}");
        assert!(
            e.message.contains("ranks out of step at step") && e.message.contains("rank(s) 1 "),
            "{e}"
        );
        let status = wait_exit(&mut ranks.0[0], Duration::from_secs(20));
        assert!(!status.success(), "rank 1: {status:?}");
        assert_eq!(c.get().unwrap(), State::Cleared);
    }
}

/// Rank 0 of a group of two in this process, at `cell`.
fn rank_0_of_two(group: &str, cell: &str) -> Manager {
    Manager::new(ManagerConfig {
        rank: 0,
        world_size: 2,
        control_cell: Some(cell.to_string()),
        group: Some(weight_manager_core::GroupSettings {
            name: group.to_string(),
            local_rank: None,
            local_world_size: None,
            node_rank: 0,
            addr: None,
            timeout: Duration::from_secs(5),
        }),
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}
