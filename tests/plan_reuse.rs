//! The plan is kept while the layouts do not change: the second update of
//! the same layout reuses it (the stats say so) and still takes the new
//! version's checksums; a changed layout is planned anew.

mod common;

use common::*;
use weight_manager_core::checkpoint::checksums;
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

/// A snapshot of `ts` in a fresh directory, with checksums.
fn snapshot(ts: &[T], step: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), ts);
    write_version(dir.path(), step);
    checksums::write(dir.path(), 1).unwrap();
    dir
}

fn verified(dir: &std::path::Path) -> UpdateRequest<'static> {
    let mut req = UpdateRequest::snapshot(dir);
    req.verify = true;
    req
}

#[test]
fn the_second_update_of_a_layout_reuses_its_plan_with_the_new_checksums() {
    let m = manager();
    let first = model(1);
    let params = register(&m, &first);
    let a = snapshot(&first, "1");
    let s1 = m.update(verified(a.path())).unwrap();
    assert!(!s1.plan_reused);
    assert_eq!(s1.source_bytes, vec![s1.bytes]);
    // New bytes, same layout: the plan is reused, and verification checks
    // the new version's sums (a stale sum would fail it).
    let second = model(2);
    let b = snapshot(&second, "2");
    let s2 = m.update(verified(b.path())).unwrap();
    assert!(s2.plan_reused, "{s2:?}");
    assert_params(&params, &second);
    // And a flipped byte is still caught with the reused plan.
    let third = model(3);
    let c = snapshot(&third, "3");
    let file = c.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let e = m.update(verified(c.path())).unwrap_err();
    assert!(e.message.contains("checksum mismatch"), "{e}");
    assert_params(&params, &second);
}

#[test]
fn a_changed_source_layout_is_planned_anew() {
    let m = manager();
    let ts = vec![tensor("w", DType::F32, &[8, 4], 1)];
    m.allocate(&ParamSpec {
        pieces: vec![Piece::whole("w", &[8, 4])],
        ..ParamSpec::host("w", DType::F32, &[8, 4])
    })
    .unwrap();
    let a = snapshot(&ts, "1");
    assert!(
        !m.update(UpdateRequest::snapshot(a.path()))
            .unwrap()
            .plan_reused
    );
    assert!(
        m.update(UpdateRequest::snapshot(a.path()))
            .unwrap()
            .plan_reused
    );
    // The same tensor with one more (skipped) tensor beside it: planned anew.
    let more = vec![
        tensor("w", DType::F32, &[8, 4], 2),
        tensor("extra", DType::F32, &[2], 2),
    ];
    let b = snapshot(&more, "2");
    let mut req = UpdateRequest::snapshot(b.path());
    req.skip_unknown = true;
    let s = m.update(req).unwrap();
    assert!(!s.plan_reused, "{s:?}");
    assert_eq!(s.bytes, 8 * 4 * 4);
}
