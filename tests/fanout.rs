//! NCCL fan-out without a GPU: how NCCL is found and refused, the meetings
//! through which a fan-out group agrees on its communicator, the manager's
//! checks, and the whole fan-out between two `wm worker` processes on the
//! fake CUDA driver (`tests/fake_cuda.c`) and a fake NCCL
//! (`tests/fake_nccl.c`: the ranks meet in shared memory), one-call and
//! two-phase. The same run on two GPUs and NCCL is tests/gpu.rs
//! (`fanout_between_two_gpus`); where a member's bytes land (its applier)
//! is tested alone in `fanout::member_tests`.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weight_manager_core::internals::fanout::nccl::nccl;
use weight_manager_core::internals::signal::{
    ControlCell, FanoutMeeting, Group, GroupConfig, SignalPlane,
};
use weight_manager_core::wm_result;
use weight_manager_core::FanoutSettings;
use weight_manager_core::{GroupSettings, Manager, ManagerConfig, UpdateRequest};

/// Build a stub `libnccl` from `source` in `dir`; returns its path.
fn stub(dir: &Path, name: &str, source: &str) -> std::path::PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let lib = dir.join(format!("{name}.so"));
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("running cc");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

#[test]
fn nccl_that_is_missing_old_or_partial_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere/libnccl.so.2");
    let e = nccl(Some(&missing)).err().expect("no NCCL there");
    assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED);
    assert!(
        e.message.contains("nowhere/libnccl.so.2")
            && e.message.contains("nccl_library")
            && e.message.contains("WM_NCCL_LIB"),
        "{e}"
    );

    // NCCL 2.12: too old for non-blocking communicators.
    let old = stub(
        dir.path(),
        "old",
        "int ncclGetVersion(int *v) { *v = 21203; return 0; }\n\
         int ncclGetUniqueId(void *id) { (void)id; return 0; }\n\
         const char *ncclGetErrorString(int r) { (void)r; return \"x\"; }\n\
         int ncclCommInitRankConfig() { return 0; }\n\
         int ncclCommGetAsyncError() { return 0; }\n\
         int ncclCommFinalize() { return 0; }\n\
         int ncclCommDestroy() { return 0; }\n\
         int ncclCommAbort() { return 0; }\n\
         int ncclBroadcast() { return 0; }\n\
         int ncclAllReduce() { return 0; }\n",
    );
    let e = nccl(Some(&old)).err().expect("too old");
    assert!(
        e.message.contains("NCCL 2.12.3") && e.message.contains("2.14 or later"),
        "{e}"
    );

    // A library without the entry points fan-out calls.
    let partial = stub(
        dir.path(),
        "partial",
        "int ncclGetVersion(int *v) { *v = 22105; return 0; }\n",
    );
    let e = nccl(Some(&partial)).err().expect("partial");
    assert!(
        e.message.contains("not a usable NCCL") && e.message.contains("ncclGetUniqueId"),
        "{e}"
    );
}

/// The fan-out end to end between two `wm worker` processes, each with
/// its own fake GPU 0, over the fake NCCL: rank 1 gets its weights only
/// from rank 0's broadcast, twice (the communicator reused); one-call,
/// then two-phase (the root broadcasts its staging, both ranks commit on
/// the signal's COMMIT).
#[test]
fn two_ranks_fan_out_on_the_fake_driver_and_nccl() {
    if !common::fake_cuda::under_fake_driver("two_ranks_fan_out_on_the_fake_driver_and_nccl", false)
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let nccl = stub(dir.path(), "fake_nccl", include_str!("fake_nccl.c"));
    for two_phase in [false, true] {
        common::fanout_ranks::fan_out_twice(common::fanout_ranks::Ranks {
            devices: [0, 0],
            nccl: Some(&nccl),
            two_phase,
        });
    }
    common::fanout_ranks::mixed_modes_are_refused(common::fanout_ranks::Ranks {
        devices: [0, 0],
        nccl: Some(&nccl),
        two_phase: true,
    });
}

fn unique(tag: &str) -> String {
    format!("wm_fo_{tag}_{}", std::process::id())
}

/// `n` ranks of one node joining group `name`, rank `i` in fan-out group
/// `colors[i]`, each on its own thread (joining waits for all).
fn join_all(name: &str, colors: &[Option<u32>], timeout: Duration) -> Vec<Group> {
    let n = colors.len() as u32;
    let threads: Vec<_> = colors
        .iter()
        .enumerate()
        .map(|(i, &fanout)| {
            let cfg = GroupConfig {
                name: name.to_string(),
                rank: i as u32,
                world_size: n,
                local_rank: i as u32,
                local_world_size: n,
                node_rank: 0,
                addr: None,
                timeout,
                fanout,
            };
            std::thread::spawn(move || Group::join(cfg).unwrap())
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn a_fanout_group_agrees_on_its_communicator_and_rebuilds_a_lost_one() {
    let groups = join_all(
        &unique("meet"),
        &[Some(0), Some(1), Some(0), None],
        Duration::from_secs(10),
    );
    // Ranks 0 and 2 are one fan-out group, rank 1 is alone, rank 3 in none.
    assert_eq!(groups[0].fanout_members(), vec![0, 2]);
    assert_eq!(groups[2].fanout_members(), vec![0, 2]);
    assert_eq!(groups[1].fanout_members(), vec![1]);
    assert!(groups[3].fanout_members().is_empty());
    let e = groups[3]
        .fanout_meet(0, || Ok([0; 128]), Instant::now() + Duration::from_secs(1))
        .unwrap_err();
    assert!(e.message.contains("needs a fan-out group"), "{e}");

    let groups = Arc::new(groups);
    let meet = |haves: [u64; 2], id: u8| {
        let barrier = Arc::new(Barrier::new(2));
        let runs: Vec<_> = [0usize, 2]
            .into_iter()
            .zip(haves)
            .map(|(i, have)| {
                let (groups, barrier) = (groups.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    groups[i]
                        .fanout_meet(
                            have,
                            || Ok([id; 128]),
                            Instant::now() + Duration::from_secs(10),
                        )
                        .unwrap()
                })
            })
            .collect();
        runs.into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Vec<_>>()
    };
    // First meeting: nobody holds a communicator; the root's id reaches the member.
    let m = meet([0, 0], 7);
    assert_eq!((m[0].index, m[1].index), (0, 1));
    assert_eq!(m[0].ranks, vec![0, 2]);
    assert_eq!(m[0].gen, 1);
    assert_eq!(m[0].id, Some([7; 128]));
    assert_eq!((m[1].gen, m[1].id), (1, Some([7; 128])));
    // Both hold generation 1: reused, no new id.
    let m = meet([1, 1], 8);
    assert_eq!((m[0].gen, m[0].id, m[1].gen, m[1].id), (1, None, 1, None));
    // The member lost its communicator: a new generation for both.
    let m = meet([1, 0], 9);
    assert_eq!((m[0].gen, m[0].id), (2, Some([9; 128])));
    assert_eq!((m[1].gen, m[1].id), (2, Some([9; 128])));
}

/// Two ranks' signal planes in fan-out group 0, their cell holding UPDATING
/// (so each step ends in a barrier), the group's timeout 3 s. Returns the
/// planes and the cell's name.
fn two_planes_updating(tag: &str) -> (Vec<Arc<SignalPlane>>, String) {
    let name = unique(tag);
    let cell_name = unique(&format!("{tag}_cell"));
    let cell = ControlCell::open_or_create(&cell_name).unwrap();
    cell.store(1).unwrap(); // UPDATING: the step ends in a barrier
    let planes = (0..2u32)
        .map(|rank| {
            let cfg = GroupConfig {
                name: name.clone(),
                rank,
                world_size: 2,
                local_rank: rank,
                local_world_size: 2,
                node_rank: 0,
                addr: None,
                timeout: Duration::from_secs(3),
                fanout: Some(0),
            };
            let cell = cell_name.clone();
            std::thread::spawn(move || {
                SignalPlane::new(rank, 2, Some(&cell), Some(cfg), Default::default()).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| Arc::new(t.join().unwrap()))
        .collect();
    (planes, cell_name)
}

fn unlink_cell(cell_name: &str) {
    let _ = weight_manager_core::internals::signal::shm::unlink(cell_name);
    let _ = weight_manager_core::internals::signal::shm::unlink(&format!("{cell_name}.wm_report"));
}

/// A member's fan-out meeting (a staging thread's) waits for the root while
/// the ranks' steps go on: the member's step is not held back by it. (The
/// meeting held the member's signal plane, so its step waited for the
/// meeting, the root's step waited in the barrier for the member, and the
/// root never came to the meeting: all until the group's timeout.)
/// A member (holding no communicator) meeting its fan-out group on a
/// thread of its own, as its staging thread does.
fn member_meets(
    plane: &Arc<SignalPlane>,
) -> std::thread::JoinHandle<weight_manager_core::Result<FanoutMeeting>> {
    let p = plane.clone();
    std::thread::spawn(move || {
        p.fanout_meet(
            0,
            || unreachable!(),
            Instant::now() + Duration::from_secs(10),
        )
    })
}

#[test]
fn a_fanout_meeting_does_not_hold_back_the_steps() {
    let (planes, cell_name) = two_planes_updating("steps");
    let member_meets = member_meets(&planes[1]);
    std::thread::sleep(Duration::from_millis(200)); // the member waits in it
    let started = Instant::now();
    let root_steps = {
        let p = planes[0].clone();
        std::thread::spawn(move || p.broadcast())
    };
    let member_step = planes[1].broadcast();
    let root_step = root_steps.join().unwrap();
    assert!(
        member_step.is_ok() && root_step.is_ok(),
        "{member_step:?} {root_step:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let root = planes[0]
        .fanout_meet(0, || Ok([5; 128]), Instant::now() + Duration::from_secs(10))
        .unwrap();
    let member = member_meets.join().unwrap().unwrap();
    assert_eq!((root.gen, member.gen, member.id), (1, 1, Some([5; 128])));
    unlink_cell(&cell_name);
}

/// The other way round: the root's stepping thread waits in a barrier for
/// the member, whose one-call update waits for the root's staging thread
/// to meet it and announce. The staging thread must get through the
/// meeting while the root's step waits. (It took the signal plane's lock to
/// ask the fan-out group's size and to meet, which the waiting step held:
/// a two-phase root with a one-call member under CPU load reached the
/// refusal only after the group's timeout.)
#[test]
fn a_staging_thread_meets_while_its_own_step_waits_in_a_barrier() {
    let (planes, cell_name) = two_planes_updating("held");
    let root_steps = {
        let p = planes[0].clone();
        std::thread::spawn(move || p.broadcast())
    };
    std::thread::sleep(Duration::from_millis(200)); // the root waits in the barrier
    let started = Instant::now();
    let member_meets = member_meets(&planes[1]);
    // The root's staging thread.
    assert_eq!(planes[0].fanout_size(), 2);
    let root = planes[0]
        .fanout_meet(0, || Ok([6; 128]), Instant::now() + Duration::from_secs(10))
        .unwrap();
    let member = member_meets.join().unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the meeting waited for the root's step: {:?}",
        started.elapsed()
    );
    assert_eq!((root.gen, member.gen, member.id), (1, 1, Some([6; 128])));
    // The member steps: both steps pass the barrier.
    let member_step = planes[1].broadcast();
    let root_step = root_steps.join().unwrap();
    assert!(
        member_step.is_ok() && root_step.is_ok(),
        "{member_step:?} {root_step:?}"
    );
    unlink_cell(&cell_name);
}

#[test]
fn a_root_whose_member_never_comes_names_it_within_the_deadline() {
    let groups = join_all(
        &unique("late"),
        &[Some(3), Some(3)],
        Duration::from_secs(10),
    );
    let started = Instant::now();
    let e = groups[0]
        .fanout_meet(
            0,
            || Ok([1; 128]),
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT);
    assert!(
        e.message.contains("rank(s) 1") && e.message.contains("call wm_update"),
        "{e}"
    );
    // A member that missed a meeting asks for the next one: the two meet.
    let g = Arc::new(groups);
    let member = {
        let g = g.clone();
        std::thread::spawn(move || {
            g[1].fanout_meet(
                0,
                || unreachable!(),
                Instant::now() + Duration::from_secs(10),
            )
        })
    };
    let root = g[0]
        .fanout_meet(0, || Ok([2; 128]), Instant::now() + Duration::from_secs(10))
        .unwrap();
    let member = member.join().unwrap().unwrap();
    assert_eq!((root.gen, member.gen, member.id), (1, 1, Some([2; 128])));
}

#[test]
fn the_manager_checks_fanout_settings_and_names_a_missing_nccl() {
    let settings = FanoutSettings {
        group: 0,
        nccl_library: Some("/nonexistent/libnccl.so.2".into()),
    };
    // Fan-out without a group, or without a GPU, is refused at init.
    let e = Manager::new(ManagerConfig {
        fanout: Some(settings.clone()),
        device: 0,
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(e.message.contains("needs the ranks in a group"), "{e}");
    let name = unique("mgr");
    let group = || GroupSettings {
        name: name.clone(),
        local_rank: None,
        local_world_size: None,
        node_rank: 0,
        addr: None,
        timeout: Duration::from_secs(10),
    };
    let e = Manager::new(ManagerConfig {
        rank: 0,
        world_size: 2,
        group: Some(group()),
        fanout: Some(settings.clone()),
        device: -1,
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(e.message.contains("needs this rank's GPU"), "{e}");

    // Two ranks in one fan-out group; NCCL is not where the config says:
    // each rank's update fails at once, naming the path, before any wait.
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            let (settings, g) = (settings.clone(), group());
            std::thread::spawn(move || {
                let m = Manager::new(ManagerConfig {
                    rank,
                    world_size: 2,
                    group: Some(g),
                    fanout: Some(settings),
                    device: 0,
                    fallback_dir: None,
                    ..Default::default()
                })
                .unwrap();
                let started = Instant::now();
                let e = m
                    .update(UpdateRequest::snapshot("/nonexistent"))
                    .unwrap_err();
                (e, started.elapsed(), m.status())
            })
        })
        .collect();
    for t in ranks {
        let (e, took, status) = t.join().unwrap();
        assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED, "{e}");
        assert!(e.message.contains("/nonexistent/libnccl.so.2"), "{e}");
        assert!(took < Duration::from_secs(5));
        assert_eq!(status.version, None);
    }
}

/// What a rank of [`a_member_cancelling_on_the_last_batch_fails_the_root_too`]
/// saw: its first update's version (or error), its state and version
/// after it, and its next update's version.
type RankSaw = (
    weight_manager_core::Result<String>,
    (weight_manager_core::State, Option<String>),
    weight_manager_core::Result<String>,
);

/// Rank `rank` of fan-out group 0 in signal group `group` (NCCL at
/// `nccl`) with device params for `v1`, updating from `snap` twice; the
/// member (rank 1) cancels its first update from its progress callback,
/// in `member_mode`.
fn cancelling_rank(
    rank: u32,
    (group, nccl): (String, std::path::PathBuf),
    (snap, v1): (std::path::PathBuf, Vec<common::T>),
    member_mode: weight_manager_core::Mode,
) -> RankSaw {
    use weight_manager_core::{Hooks, MemoryKind, ParamSpec, Progress};
    let m = Manager::new(ManagerConfig {
        rank,
        world_size: 2,
        group: Some(GroupSettings {
            name: group,
            local_rank: None,
            local_world_size: None,
            node_rank: 0,
            addr: None,
            timeout: Duration::from_secs(10),
        }),
        fanout: Some(FanoutSettings {
            group: 0,
            nccl_library: Some(nccl),
        }),
        device: 0,
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap();
    for t in &v1 {
        let mut spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
        spec.memory = MemoryKind::Device;
        spec.device_ordinal = 0;
        m.allocate(&spec).unwrap();
    }
    let mut cancel = |_: &Progress| false;
    let mut req = UpdateRequest::snapshot(&snap);
    req.timeout = Duration::from_secs(20);
    if rank == 1 {
        req.mode = member_mode;
        req.hooks = Hooks {
            progress: Some(&mut cancel),
            tensor: None,
        };
    }
    let first = m.update(req).map(|s| s.version);
    let status = m.status();
    let status = (status.state, status.version);
    let again = m.update(UpdateRequest::snapshot(&snap)).map(|s| s.version);
    (first, status, again)
}

/// A member whose progress callback cancels on the last batch (here the
/// only one: the model is under the bucket size) keeps its weights
/// (atomic) or ends FAILED (in place), and the root hears it in the final
/// vote: its update fails naming the member, its own weights new (found by
/// an audit: the root returned WM_OK, the group out of step with no error).
/// Both ranks' next update brings the group back in step.
#[test]
fn a_member_cancelling_on_the_last_batch_fails_the_root_too() {
    use weight_manager_core::{Mode, State};
    let name = "a_member_cancelling_on_the_last_batch_fails_the_root_too";
    if !common::fake_cuda::under_fake_driver(name, false) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let nccl = stub(dir.path(), "fake_nccl", include_str!("fake_nccl.c"));
    let snap = dir.path().join("v1");
    std::fs::create_dir(&snap).unwrap();
    let v1 = common::model(1);
    common::write_safetensors(&snap.join("model.safetensors"), &v1);
    common::write_version(&snap, "1");
    for member_mode in [Mode::Atomic, Mode::InPlace] {
        let group = unique("cancel");
        let ranks: Vec<_> = (0..2u32)
            .map(|rank| {
                let names = (group.clone(), nccl.clone());
                let model = (snap.clone(), v1.clone());
                std::thread::spawn(move || cancelling_rank(rank, names, model, member_mode))
            })
            .collect();
        let mut out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        let (member, root) = (out.pop().unwrap(), out.pop().unwrap());
        let e = root.0.unwrap_err();
        assert!(
            e.message.contains("fan-out to rank(s) 1 failed")
                && e.message.contains("rank 1 did not take"),
            "{member_mode:?}: {e}"
        );
        assert_eq!(root.1 .0, State::Failed, "{member_mode:?}");
        let e = member.0.unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_CANCELLED, "{member_mode:?}: {e}");
        let left = match member_mode {
            Mode::Atomic => State::Normal,
            _ => State::Failed,
        };
        assert_eq!(member.1, (left, None), "{member_mode:?}");
        assert_eq!(root.2.unwrap(), "1", "{member_mode:?}: the next update");
        assert_eq!(member.2.unwrap(), "1", "{member_mode:?}: the next update");
    }
}
