//! Sharded updates never commit a mix: sources that serve different
//! versions (with the plan kept from the last update or not), a source that
//! names no version beside one that does, and replicas that disagree are
//! refused, naming the sources, with the old weights kept. And an
//! expert-parallel engine rank, whose trainers also hold other ranks'
//! experts, updates without `skip_unknown`.
//!
//! Publishers are in-process `Publisher`s serving on threads over real Unix
//! sockets and shared memory (IPC) or real TCP and UCX (`UCX_TLS=tcp`); the
//! engine is this process's `Manager`, pulling from both at once.

mod common;

use common::sharded::{serial, serving, Global};
use std::path::PathBuf;
use std::time::Duration;
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig, TensorDesc};

const SECRET: &str = "sharded-versions-secret-0123";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Via {
    Ipc,
    Net,
}

const BOTH: [Via; 2] = [Via::Ipc, Via::Net];

fn engine() -> Manager {
    common::sharded::net_engine(SECRET)
}

/// A publisher for trainer rank `r`, with nothing added yet.
fn publisher(dir: &std::path::Path, via: Via, r: usize) -> Publisher {
    publisher_with(dir, via, r, None)
}

/// [`publisher`], corrupting tensor `corrupt` after hashing it (a test hook).
fn publisher_with(dir: &std::path::Path, via: Via, r: usize, corrupt: Option<String>) -> Publisher {
    let cfg = PublisherConfig {
        bucket_size: 4096,
        bucket_timeout: Duration::from_secs(10),
        corrupt_tensor: corrupt,
        ..Default::default()
    };
    match via {
        Via::Ipc => Publisher::bind(&dir.join(format!("p{r}.sock")), cfg).unwrap(),
        Via::Net => Publisher::bind_net(
            "127.0.0.1:0",
            PublisherConfig {
                secret: Some(SECRET.as_bytes().to_vec()),
                ..cfg
            },
        )
        .unwrap(),
    }
}

/// Two publishers: rank `r` holds row half `r` of each of `globals[r]`
/// (so each rank may serve other bytes) and names `versions[r]`.
fn row_halves(
    dir: &std::path::Path,
    via: Via,
    globals: [&[Global]; 2],
    versions: [Option<&str>; 2],
) -> Vec<Publisher> {
    (0..2)
        .map(|r| {
            let p = publisher(dir, via, r);
            for g in globals[r] {
                // SAFETY: the globals outlive the serving.
                unsafe { g.add_half_to(&p, r as u64) };
            }
            p.set_version(versions[r].map(str::to_string));
            p
        })
        .collect()
}

fn request<'h>(via: Via, ps: &[Publisher]) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(PathBuf::new());
    r.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
    r.source = match via {
        Via::Ipc => SourceKind::Ipc,
        Via::Net => SourceKind::Rdma,
    };
    r.verify = true;
    r.mode = Mode::Atomic;
    r.timeout = Duration::from_secs(30);
    r
}

/// The model: "w" [8, 16] and "u" [4, 8], registered whole (each param
/// gets one row half from each publisher).
fn model(seed: u8) -> Vec<Global> {
    vec![
        Global::new("w", &[8, 16], seed),
        Global::new("u", &[4, 8], seed),
    ]
}

fn register_whole(m: &Manager, globals: &[Global]) -> Vec<(*mut u8, usize)> {
    globals
        .iter()
        .map(|g| {
            m.allocate(&ParamSpec::host(g.name, DType::F32, &g.shape))
                .unwrap()
        })
        .collect()
}

/// The params hold `globals`' bytes.
fn holds(ptrs: &[(*mut u8, usize)], globals: &[Global]) -> bool {
    ptrs.iter().zip(globals).all(|(&(p, n), g)| {
        // SAFETY: library-owned params; nothing writes them now.
        let held = unsafe { std::slice::from_raw_parts(p, n) };
        held == &g.bytes[..]
    })
}

/// An engine at "v1" from two publishers, its plan kept.
fn engine_at_v1(
    dir: &std::path::Path,
    via: Via,
    v1: &[Global],
) -> (Manager, Vec<(*mut u8, usize)>) {
    let m = engine();
    let ptrs = register_whole(&m, v1);
    let ps = row_halves(dir, via, [v1, v1], [Some("v1"), Some("v1")]);
    serving(&ps, || m.update(request(via, &ps))).0.unwrap();
    assert!(holds(&ptrs, v1));
    (m, ptrs)
}

/// Item: a kept plan skipped the same-version check. Both ranks served v1;
/// then rank 0 serves v2 while rank 1 still serves v1. The update reuses
/// the plan (same layouts) and used to commit "v2" with half of every
/// param from v1. Now refused, naming both, old weights and version kept.
#[test]
fn a_kept_plan_still_refuses_sources_of_different_versions() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let (v1, v2) = (model(1), model(2));
        let (m, ptrs) = engine_at_v1(dir.path(), via, &v1);
        let ps = row_halves(dir.path(), via, [&v2, &v1], [Some("v2"), Some("v1")]);
        let (r, served) = serving(&ps, || m.update(request(via, &ps)));
        let e = r.expect_err("mixed versions must not commit");
        assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{via:?}: {e}");
        assert!(
            e.message.contains("different versions")
                && e.message.contains("'v2'")
                && e.message.contains("'v1'")
                && e.message.contains(&ps[1].address()),
            "{via:?}: {e}"
        );
        // Each publisher hears the engine's reason, not "closed the
        // connection (did it exit or crash?)".
        for s in served {
            let pe = s.expect_err("the engine refused the plan");
            assert_eq!(pe.code, wm_result::WM_ERR_FORMAT, "{via:?}: {pe}");
            assert!(
                pe.message.contains("reports: ") && pe.message.contains("different versions"),
                "{via:?}: {pe}"
            );
        }
        assert!(holds(&ptrs, &v1), "{via:?}: old weights kept");
        assert_eq!(m.status().version.as_deref(), Some("v1"));
        drop(ps);
        // Both at v2: the kept plan serves again.
        let ps = row_halves(dir.path(), via, [&v2, &v2], [Some("v2"), Some("v2")]);
        serving(&ps, || m.update(request(via, &ps))).0.unwrap();
        assert!(holds(&ptrs, &v2), "{via:?}");
        assert!(m.status().last_update.unwrap().plan_reused, "{via:?}");
        drop(ps);
    }
}

/// Item: a source naming no version beside one naming v2 was mixed in.
/// Refused, naming the unnamed source, for a fresh engine and a kept plan.
#[test]
fn a_source_naming_no_version_beside_a_named_one_is_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let (v1, v2) = (model(1), model(2));
        let fresh = engine();
        let fresh_ptrs = register_whole(&fresh, &v1);
        let (kept, kept_ptrs) = engine_at_v1(dir.path(), via, &v1);
        for (m, ptrs) in [(&fresh, &fresh_ptrs), (&kept, &kept_ptrs)] {
            let ps = row_halves(dir.path(), via, [&v2, &v1], [Some("v2"), None]);
            let (r, _) = serving(&ps, || m.update(request(via, &ps)));
            let e = r.expect_err("an unnamed source must not be mixed in");
            assert!(
                e.message.contains("names no version")
                    && e.message.contains(&ps[1].address())
                    && e.message.contains("'v2'"),
                "{via:?}: {e}"
            );
            assert!(!holds(ptrs, &v2), "{via:?}: nothing of v2 committed");
            drop(ps);
        }
        assert!(holds(&kept_ptrs, &v1), "{via:?}: old weights kept");
        assert_eq!(kept.status().version.as_deref(), Some("v1"));
        // The request naming v2: the unnamed source serves its content
        // under that name, and is still refused beside the named one.
        let ps = row_halves(dir.path(), via, [&v2, &v1], [Some("v2"), None]);
        let mut req = request(via, &ps);
        req.version = Some("v2".into());
        let (r, _) = serving(&ps, || kept.update(req));
        let e = r.expect_err("an unnamed source must not be mixed in");
        assert!(e.message.contains("names no version"), "{via:?}: {e}");
        assert!(holds(&kept_ptrs, &v1), "{via:?}: old weights kept");
    }
}

/// Sources that all name no version (publishers that never set one): the
/// request names the version, as the README says, and the update takes it
/// (it used to be refused: the publishers answered that they serve '').
/// Without a version in the request: WM_ERR_NO_VERSION.
#[test]
fn publishers_naming_no_version_serve_the_version_the_request_names() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let v3 = model(3);
        let m = engine();
        let ptrs = register_whole(&m, &v3);
        let ps = row_halves(dir.path(), via, [&v3, &v3], [None, None]);
        let (r, _) = serving(&ps, || m.update(request(via, &ps)));
        let e = r.expect_err("nobody names a version");
        assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION, "{via:?}: {e}");
        drop(ps);
        let ps = row_halves(dir.path(), via, [&v3, &v3], [None, None]);
        let mut req = request(via, &ps);
        req.version = Some("v3".into());
        serving(&ps, || m.update(req)).0.unwrap();
        assert!(holds(&ptrs, &v3), "{via:?}");
        assert_eq!(m.status().version.as_deref(), Some("v3"), "{via:?}");
    }
}

/// Item: replicas that disagree. Both publishers hold all of "r" (the same
/// box: replicas), with different bytes and so different checksums in
/// their manifests. Engine ranks spread over replicas by rank, so two ranks
/// would hold different weights under one version; every rank refuses.
#[test]
fn replicas_with_different_checksums_are_refused_naming_both() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let a = Global::new("r", &[4, 8], 1);
        let b = Global::new("r", &[4, 8], 2);
        for rank in [0u32, 1] {
            std::env::set_var("UCX_TLS", "tcp");
            let m = Manager::new(ManagerConfig {
                rank,
                world_size: 2,
                fallback_dir: None,
                net: NetSettings {
                    secret: Some(SECRET.as_bytes().to_vec()),
                    ..Default::default()
                },
                ..Default::default()
            })
            .unwrap();
            let (ptr, n) = m
                .allocate(&ParamSpec::host("r", DType::F32, &a.shape))
                .unwrap();
            let ps: Vec<Publisher> = [&a, &b]
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    let p = publisher(dir.path(), via, i);
                    // SAFETY: the globals outlive the serving.
                    unsafe {
                        p.add(TensorDesc::host(
                            "r",
                            DType::F32,
                            &g.shape,
                            g.bytes.as_ptr(),
                            g.bytes.len(),
                        ))
                    }
                    .unwrap();
                    p.set_version(Some("v1".into()));
                    p
                })
                .collect();
            let (r, _) = serving(&ps, || m.update(request(via, &ps)));
            let e = r.expect_err("disagreeing replicas must be refused");
            assert!(
                e.message.contains("replicas disagree")
                    && e.message.contains(&ps[0].address())
                    && e.message.contains(&ps[1].address()),
                "{via:?} rank {rank}: {e}"
            );
            // SAFETY: library-owned, nothing writes it now.
            let held = unsafe { std::slice::from_raw_parts(ptr, n) };
            assert!(held.iter().all(|&x| x == 0), "{via:?}: nothing written");
            assert_eq!(m.status().version, None);
            drop(ps);
        }
    }
}

/// Item: an expert-parallel engine rank. Each trainer rank holds a row
/// half of every expert "e0".."e3"; this engine rank takes experts 1 and 2
/// stacked into one param. The experts it does not read are other ranks'
/// business: no error, not received, no `skip_unknown` needed.
#[test]
fn an_expert_parallel_rank_skips_other_ranks_experts_by_default() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let experts: Vec<Global> = ["e0", "e1", "e2", "e3"]
            .into_iter()
            .map(|n| Global::new(n, &[4, 8], 7))
            .collect();
        let m = engine();
        let pieces = vec![
            Piece {
                at: vec![0, 0, 0],
                ..Piece::whole("e1", &[4, 8])
            },
            Piece {
                at: vec![1, 0, 0],
                ..Piece::whole("e2", &[4, 8])
            },
        ];
        let spec = ParamSpec {
            pieces,
            ..ParamSpec::host("experts", DType::F32, &[2, 4, 8])
        };
        let (ptr, n) = m.allocate(&spec).unwrap();
        let ps = row_halves(
            dir.path(),
            via,
            [&experts, &experts],
            [Some("v1"), Some("v1")],
        );
        let (r, served) = serving(&ps, || m.update(request(via, &ps)));
        r.unwrap_or_else(|e| panic!("{via:?}: {e}"));
        // SAFETY: library-owned, nothing writes it now.
        let held = unsafe { std::slice::from_raw_parts(ptr, n) };
        let want: Vec<u8> = [&experts[1], &experts[2]]
            .iter()
            .flat_map(|g| g.bytes.clone())
            .collect();
        assert_eq!(held, &want[..], "{via:?}");
        // Only experts 1 and 2 moved: their row halves, 2 x 64 bytes per
        // publisher.
        for s in served {
            assert_eq!(s.unwrap().sessions[0].bytes, 128, "{via:?}");
        }
        drop(ps);
    }
}

/// Item: the plan of a failed update is not kept. An update that fails
/// after planning (a corrupted tensor, caught by its checksum) forgets its
/// plan: the next update plans again instead of reusing it.
#[test]
fn a_failed_update_keeps_no_plan() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let (v1, v2) = (model(1), model(2));
        let (m, ptrs) = engine_at_v1(dir.path(), via, &v1);
        let corrupt = |r: usize| {
            let p = publisher_with(dir.path(), via, r, (r == 1).then(|| "w".to_string()));
            for g in &v2 {
                // SAFETY: the globals outlive the serving.
                unsafe { g.add_half_to(&p, r as u64) };
            }
            p.set_version(Some("v2".into()));
            p
        };
        let ps = vec![corrupt(0), corrupt(1)];
        let (r, _) = serving(&ps, || m.update(request(via, &ps)));
        assert_eq!(r.unwrap_err().code, wm_result::WM_ERR_CHECKSUM, "{via:?}");
        assert!(holds(&ptrs, &v1), "{via:?}: old weights kept");
        drop(ps);
        let ps = row_halves(dir.path(), via, [&v2, &v2], [Some("v2"), Some("v2")]);
        serving(&ps, || m.update(request(via, &ps))).0.unwrap();
        assert!(holds(&ptrs, &v2), "{via:?}");
        assert!(
            !m.status().last_update.unwrap().plan_reused,
            "{via:?}: planned again"
        );
        drop(ps);
    }
}

/// Audit item: a publisher reached before another source failed to open
/// was dropped without a word ("closed the connection (did it exit or
/// crash?)"). It now hears the engine's reason; the engine keeps v1.
#[test]
fn a_publisher_hears_why_when_another_source_fails_to_open() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in BOTH {
        let v1 = model(1);
        let (m, ptrs) = engine_at_v1(dir.path(), via, &v1);
        let ps = row_halves(dir.path(), via, [&v1, &v1], [Some("v1"), Some("v1")]);
        let missing = match via {
            Via::Ipc => dir.path().join("nobody.sock").display().to_string(),
            Via::Net => "127.0.0.1:1".to_string(),
        };
        let mut req = request(via, &ps);
        req.locations[1] = PathBuf::from(&missing);
        let (r, served) = serving(&ps[..1], || m.update(req));
        let e = r.expect_err("a source that is not there fails the update");
        assert_eq!(e.code, wm_result::WM_ERR_NOT_FOUND, "{via:?}: {e}");
        let pe = served.into_iter().next().unwrap().expect_err("told why");
        assert_eq!(pe.code, wm_result::WM_ERR_NOT_FOUND, "{via:?}: {pe}");
        assert!(
            pe.message.contains("reports: ") && pe.message.contains(&missing),
            "{via:?}: {pe}"
        );
        assert!(holds(&ptrs, &v1), "{via:?}: old weights kept");
    }
}
