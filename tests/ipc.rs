//! The IPC path: a publisher serving buckets in shared memory, engines
//! applying them. Publisher processes are `wm serve`; engines are this test
//! process (a Manager) and `wm pull` processes.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager::apply::Mode;
use weight_manager::manager::{Manager, ManagerConfig, UpdateRequest};
use weight_manager::publisher::{Publisher, PublisherConfig};
use weight_manager::registry::ParamSpec;
use weight_manager::source::SourceKind;
use weight_manager::tensor::DType;
use weight_manager::wm_result;

const WM: &str = env!("CARGO_BIN_EXE_wm");

fn manager(rank: u32, world: u32) -> Manager {
    Manager::new(ManagerConfig {
        rank,
        world_size: world,
        fallback_dir: None,
        group: None,
        ..Default::default()
    })
    .unwrap()
}

fn ipc_request<'h>(socket: &Path) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(socket);
    r.source = SourceKind::Ipc;
    r.timeout = Duration::from_secs(30);
    r
}

fn register(m: &Manager, ts: &[T]) -> Vec<(*mut u8, usize)> {
    ts.iter()
        .map(|t| m.allocate(&ParamSpec::host(&t.name, t.dtype, &t.shape)).unwrap())
        .collect()
}

fn assert_params(ptrs: &[(*mut u8, usize)], ts: &[T]) {
    for ((p, n), t) in ptrs.iter().zip(ts) {
        assert!(unsafe { std::slice::from_raw_parts(*p, *n) } == &t.data[..], "param {}", t.name);
    }
}

fn small_buckets() -> PublisherConfig {
    PublisherConfig {
        bucket_size: 4096,
        bucket_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

#[test]
fn tensors_from_memory_copy_and_zero_copy() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let mut ts = model(21);
    ts.push(tensor("big", DType::F32, &[3000], 21)); // 12000 bytes: split across buckets
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    for t in &ts {
        unsafe { publisher.add_tensor(&t.name, t.dtype, &t.shape, t.data.as_ptr(), t.data.len(), None) }.unwrap();
    }
    publisher.set_version(Some("v21".into()));
    let mode = std::fs::metadata(&sock).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(2, Duration::from_secs(20)));
        // Copy mode into params, checksums verified.
        let m = manager(0, 1);
        let ptrs = register(&m, &ts);
        let mut req = ipc_request(&sock);
        req.verify = true;
        let stats = m.update(req).unwrap();
        assert_eq!(stats.version, "v21");
        assert_params(&ptrs, &ts);
        // Zero-copy: the callback sees the bytes in the shared buffer.
        let m2 = manager(0, 1);
        let mut got = Vec::new();
        let mut cb = |t: &weight_manager::apply::TensorView| {
            got.push((t.name.to_string(), t.data.to_vec()));
            Ok(())
        };
        let mut req = ipc_request(&sock);
        req.mode = Mode::InPlace;
        req.hooks.tensor = Some(&mut cb);
        m2.update(req).unwrap();
        got.sort();
        let mut want: Vec<_> = ts.iter().map(|t| (t.name.clone(), t.data.clone())).collect();
        want.sort();
        assert_eq!(got, want);
        let st = serving.join().unwrap().unwrap();
        assert_eq!(st.sessions.len(), 2);
        assert!(st.sessions.iter().all(|s| s.buckets > 3));
    });
}

#[test]
fn corrupted_bucket_is_caught_and_old_weights_kept() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let v1 = model(1);
    let v2 = model(2);
    let m = manager(0, 1);
    let ptrs = register(&m, &v1);
    for (v, corrupt, version) in [(&v1, None, "1"), (&v2, Some("layer0.norm".to_string()), "2")] {
        let publisher = Publisher::bind(
            &sock,
            PublisherConfig {
                corrupt_tensor: corrupt.clone(),
                ..small_buckets()
            },
        )
        .unwrap();
        for t in v.iter() {
            unsafe { publisher.add_tensor(&t.name, t.dtype, &t.shape, t.data.as_ptr(), t.data.len(), None) }.unwrap();
        }
        publisher.set_version(Some(version.into()));
        std::thread::scope(|s| {
            let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
            let mut req = ipc_request(&sock);
            req.verify = true;
            let r = m.update(req);
            let served = serving.join().unwrap();
            if corrupt.is_some() {
                let e = r.unwrap_err();
                assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM);
                assert!(e.message.contains("'layer0.norm'"), "{e}");
                assert!(served.is_err(), "the publisher hears why");
            } else {
                r.unwrap();
                served.unwrap();
            }
        });
    }
    assert_params(&ptrs, &v1);
    assert_eq!(m.status().version.as_deref(), Some("1"));
}

#[test]
fn another_version_or_no_publisher_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let m = manager(0, 1);
    let ts = model(3);
    register(&m, &ts);
    let e = m.update(ipc_request(&sock)).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NOT_FOUND);
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    for t in &ts {
        unsafe { publisher.add_tensor(&t.name, t.dtype, &t.shape, t.data.as_ptr(), t.data.len(), None) }.unwrap();
    }
    publisher.set_version(Some("7".into()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let mut req = ipc_request(&sock);
        req.version = Some("8".into());
        let e = m.update(req).unwrap_err();
        assert!(e.message.contains("asked for version '8'") && e.message.contains("serves '7'"), "{e}");
        assert!(serving.join().unwrap().is_err());
    });
}
