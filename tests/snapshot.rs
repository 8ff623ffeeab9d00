//! The snapshot path end to end through the Rust API: real files, real
//! host memory.

mod common;
#[path = "snapshot/hostile_files.rs"]
mod hostile_files;

use common::*;
use std::sync::Arc;
use weight_manager_core::checkpoint::checksums;
use weight_manager_core::wm_result;
use weight_manager_core::ParamSpec;
use weight_manager_core::State;
use weight_manager_core::{Hooks, Mode};
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

/// Registers every tensor of `ts`: even ones engine-owned (in `bufs`), odd ones library-owned.
fn register(m: &Manager, ts: &[T]) -> Vec<(*mut u8, usize)> {
    let mut ptrs = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        let spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
        if i % 2 == 0 {
            let buf = Box::leak(vec![0u8; t.data.len()].into_boxed_slice());
            unsafe { m.register(&spec, buf.as_mut_ptr(), buf.len()) }.unwrap();
            ptrs.push((buf.as_mut_ptr(), buf.len()));
        } else {
            ptrs.push(m.allocate(&spec).unwrap());
        }
    }
    ptrs
}

fn assert_params(ptrs: &[(*mut u8, usize)], ts: &[T]) {
    for ((p, n), t) in ptrs.iter().zip(ts) {
        let got = unsafe { std::slice::from_raw_parts(*p, *n) };
        assert!(got == &t.data[..], "param {} holds other bytes", t.name);
    }
}

#[test]
fn update_clear_update_per_rank_file() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = model(1);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v1);
    write_version(dir.path(), "100");
    let m = manager();
    let ptrs = register(&m, &v1);
    let stats = m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_eq!(stats.version, "100");
    assert_eq!(stats.tensors, 6);
    assert_eq!(
        stats.bytes,
        v1.iter().map(|t| t.data.len() as u64).sum::<u64>()
    );
    assert_params(&ptrs, &v1);
    let s = m.status();
    assert_eq!(
        (s.state, s.version.as_deref(), s.updates),
        (State::Normal, Some("100"), 1)
    );

    m.clear().unwrap();
    let s = m.status();
    assert_eq!(
        (s.state, s.version.as_deref(), s.resident_bytes),
        (State::Cleared, None, 0)
    );
    for (i, (p, n)) in ptrs.iter().enumerate() {
        if i % 2 == 1 {
            assert!(unsafe { std::slice::from_raw_parts(*p, *n) }
                .iter()
                .all(|b| *b == 0));
        }
    }
    assert!(m.clear().is_ok(), "clearing twice is a no-op");

    let v2 = model(2);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v2);
    let mut req = UpdateRequest::snapshot(dir.path());
    req.version = Some("explicit-2".into());
    let stats = m.update(req).unwrap();
    assert_eq!(stats.version, "explicit-2");
    assert_params(&ptrs, &v2);
    assert_eq!(m.status().resident_bytes, m.status().param_bytes);
}

/// Files found in the fallback directory take their version from the
/// model directory's `version.yaml`, and from the fallback's own when the
/// model directory has none; with neither, the error names both.
#[test]
fn a_fallback_snapshot_is_named_by_the_model_directory() {
    let (dir, fallback) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let v1 = model(1);
    write_safetensors(&fallback.path().join("model_state.tp0.0.safetensors"), &v1);
    let m = Manager::new(ManagerConfig {
        fallback_dir: Some(fallback.path().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let ptrs = register(&m, &v1);
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION, "{e}");
    for place in [dir.path(), fallback.path()] {
        let file = place.join("version.yaml");
        assert!(e.message.contains(&*file.to_string_lossy()), "{e}");
    }
    write_version(fallback.path(), "41");
    let stats = m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_eq!(stats.version, "41");
    write_version(dir.path(), "42");
    let stats = m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_eq!(stats.version, "42");
    assert_params(&ptrs, &v1);
    // A broken one in the model directory is the error, not a reason to
    // take the fallback's.
    std::fs::write(dir.path().join("version.yaml"), "step: [\n").unwrap();
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION, "{e}");
    assert!(
        !e.message.contains(&*fallback.path().to_string_lossy()),
        "{e}"
    );
}

/// The HuggingFace index of `v` written as two shards (its first three
/// tensors, then the rest).
fn hf_index(v: &[T]) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = v
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let f = if i < 3 {
                "model-00001-of-00002.safetensors"
            } else {
                "model-00002-of-00002.safetensors"
            };
            (t.name.clone(), f.into())
        })
        .collect();
    serde_json::json!({"metadata": {}, "weight_map": map})
}

/// `index` written as `dir`'s HuggingFace index: the error of `m`'s
/// update from `dir`.
fn refused_index(
    m: &Manager,
    dir: &std::path::Path,
    index: &serde_json::Value,
) -> weight_manager_core::Error {
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(path, index.to_string()).unwrap();
    let mut req = UpdateRequest::snapshot(dir);
    req.version = Some("x".into());
    m.update(req).unwrap_err()
}

/// A NUL in a shard's name is refused naming it, escaped (found by an
/// audit: the name was cut at the NUL and named a shard that exists).
#[test]
fn an_index_naming_a_shard_with_a_nul_is_refused() {
    let v = model(3);
    let d = tempfile::tempdir().unwrap();
    write_safetensors(&d.path().join("model-00001-of-00002.safetensors"), &v[..3]);
    write_safetensors(&d.path().join("model-00002-of-00002.safetensors"), &v[3..]);
    let m = manager();
    register(&m, &v);
    let mut bad = hf_index(&v);
    bad["weight_map"]["embed.weight"] = "model-00001-of-00002.safetensors\u{0}x".into();
    let e = refused_index(&m, d.path(), &bad);
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
    assert!(
        e.message.contains("weight_map['embed.weight']")
            && e.message.contains("safetensors\\0x")
            && e.message.contains("is not a file name"),
        "{e}"
    );
}

#[test]
fn part_files_hf_shards_and_index() {
    let v = model(3);
    // Part files: numeric order, a stray unparsable part skipped.
    let d = tempfile::tempdir().unwrap();
    write_safetensors(
        &d.path().join("model_state.tp0.0.part10.safetensors"),
        &v[4..],
    );
    write_safetensors(
        &d.path().join("model_state.tp0.0.part2.safetensors"),
        &v[2..4],
    );
    write_safetensors(&d.path().join("model_state.tp0.0.part1.pdparams"), &v[..2]);
    std::fs::write(
        d.path().join("model_state.tp0.0.partX.safetensors"),
        b"junk",
    )
    .unwrap();
    write_version(d.path(), "7");
    let m = manager();
    let ptrs = register(&m, &v);
    let mut req = UpdateRequest::snapshot(d.path());
    req.mode = Mode::InPlace;
    assert_eq!(m.update(req).unwrap().version, "7");
    assert_params(&ptrs, &v);

    // HF shards without an index, then with one.
    let d = tempfile::tempdir().unwrap();
    write_safetensors(&d.path().join("model-00001-of-00002.safetensors"), &v[..3]);
    write_safetensors(&d.path().join("model-00002-of-00002.safetensors"), &v[3..]);
    let m = manager();
    let ptrs = register(&m, &v);
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("hf".into());
    m.update(req).unwrap();
    assert_params(&ptrs, &v);
    let index = hf_index(&v);
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("hf-index".into());
    m.update(req).unwrap();
    // An index that points a tensor at the wrong shard is refused.
    let mut bad = index.clone();
    bad["weight_map"]["embed.weight"] = "model-00002-of-00002.safetensors".into();
    let e = refused_index(&m, d.path(), &bad);
    assert!(
        e.message.contains("embed.weight") && e.message.contains("maps it to"),
        "{e}"
    );
}

/// A `version.yaml` whose step is no version name (too long, a NUL) is the
/// file's fault: "no version", naming the file (found by an audit: it was
/// `WM_ERR_INVALID_ARGUMENT`, as if the caller had named it, without the
/// file). Beside a folder that names its version, the folder's reason is
/// part of the mixed-versions error.
#[test]
fn a_version_yaml_step_that_is_no_version_is_named() {
    let v = model(6);
    let m = manager();
    register(&m, &v);
    let d = tempfile::tempdir().unwrap();
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v);
    for step in ["9".repeat(300), "\"3\\0x\"".to_string()] {
        std::fs::write(d.path().join("version.yaml"), format!("step: {step}\n")).unwrap();
        let e = m.update(UpdateRequest::snapshot(d.path())).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION, "{e}");
        assert!(
            e.message
                .contains("version.yaml: its step is not a version"),
            "{e}"
        );
    }
    // Two folders: one names "2", the other's version.yaml uses an alias.
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_safetensors(&a.path().join("model_state.tp0.0.safetensors"), &v[..3]);
    write_safetensors(&b.path().join("model_state.tp0.0.safetensors"), &v[3..]);
    write_version(a.path(), "2");
    std::fs::write(b.path().join("version.yaml"), "x: &a 1\nstep: *a\n").unwrap();
    let mut req = UpdateRequest::snapshot(a.path());
    req.locations.push(b.path().into());
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
    assert!(
        e.message.contains("names no version (") && e.message.contains("uses a YAML alias"),
        "{e}"
    );
    // The request naming "2" does not make b's broken (or step-less)
    // version.yaml "2": it may be another step's folder. A folder with no
    // version.yaml at all is taken as the others'.
    for yaml in [
        Some("x: &a 1\nstep: *a\n"),
        Some("version: 3\n"),
        Some("step: ~\n"),
        None,
    ] {
        let file = b.path().join("version.yaml");
        match yaml {
            Some(text) => std::fs::write(&file, text).unwrap(),
            None => std::fs::remove_file(&file).unwrap(),
        }
        let mut req = UpdateRequest::snapshot(a.path());
        req.locations.push(b.path().into());
        req.version = Some("2".into());
        match (yaml, m.update(req)) {
            (None, Ok(stats)) => assert_eq!(stats.version, "2"),
            (Some(_), Err(e)) => {
                assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{yaml:?}: {e}");
                assert!(e.message.contains("names no version ("), "{e}");
            }
            (yaml, got) => panic!("{yaml:?}: {:?}", got.map(|s| s.version)),
        }
    }
}

#[test]
fn plan_failures_move_no_bytes() {
    let d = tempfile::tempdir().unwrap();
    let v = model(4);
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(d.path(), "1");
    let m = manager();
    let ptrs = register(&m, &v);
    m.update(UpdateRequest::snapshot(d.path())).unwrap();

    // Wrong shape for one tensor: refused before any byte moves, even in-place.
    let mut v2 = model(5);
    v2[2] = tensor(
        "layer0.mlp.up",
        weight_manager_core::DType::F32,
        &[48, 32],
        5,
    );
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v2);
    write_version(d.path(), "2");
    let mut req = UpdateRequest::snapshot(d.path());
    req.mode = Mode::InPlace;
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_MISMATCH);
    assert!(
        e.message.contains(
            "param 'layer0.mlp.up': shape mismatch: registered [32, 48], source [48, 32]"
        ),
        "{e}"
    );
    assert_params(&ptrs, &v);
    let s = m.status();
    assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("1")));
    assert_eq!(s.last_error.unwrap().code, wm_result::WM_ERR_MISMATCH);

    // Missing tensor.
    write_safetensors(
        &d.path().join("model_state.tp0.0.safetensors"),
        &model(5)[1..],
    );
    let e = m.update(UpdateRequest::snapshot(d.path())).unwrap_err();
    assert!(
        e.message
            .contains("param 'embed.weight' is registered but not in the source"),
        "{e}"
    );

    // Unknown tensor: error, or skipped on request.
    let mut extra = model(6);
    extra.push(tensor(
        "lm_head.bias",
        weight_manager_core::DType::F32,
        &[3],
        6,
    ));
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &extra);
    let e = m.update(UpdateRequest::snapshot(d.path())).unwrap_err();
    assert!(
        e.message
            .contains("'lm_head.bias' is not a registered param"),
        "{e}"
    );
    let mut req = UpdateRequest::snapshot(d.path());
    req.skip_unknown = true;
    let stats = m.update(req).unwrap();
    assert_eq!(stats.tensors, 6);
    assert_params(&ptrs, &extra[..6]);

    // No version anywhere.
    std::fs::remove_file(d.path().join("version.yaml")).unwrap();
    let mut req = UpdateRequest::snapshot(d.path());
    req.skip_unknown = true;
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION);
    assert!(
        e.message.contains("request names none") && e.message.contains("version.yaml"),
        "{e}"
    );

    // Not found names every place.
    let e = m
        .update(UpdateRequest::snapshot(d.path().join("nope")))
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NOT_FOUND);
}

/// A part file replaced (a rename) or rewritten in place by one of the
/// same size after the plan was made is refused naming it, also when the
/// update does not verify (its bytes would be another version's), and
/// atomic mode keeps the old weights.
#[test]
fn a_file_replaced_by_one_of_the_same_size_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let v1 = model(7);
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v1);
    write_version(d.path(), "1");
    let m = manager();
    let ptrs = register(&m, &v1);
    m.update(UpdateRequest::snapshot(d.path())).unwrap();
    let (v2, v3) = (model(8), model(9));
    for (rename, says) in [(true, "replaced by another file"), (false, "rewritten")] {
        let parts = tempfile::tempdir().unwrap();
        let p1 = parts.path().join("model_state.tp0.0.part1.safetensors");
        let p2 = parts.path().join("model_state.tp0.0.part2.safetensors");
        write_safetensors(&p1, &v2[..3]);
        write_safetensors(&p2, &v2[3..]);
        let other = parts.path().join("other.tmp");
        write_safetensors(&other, &v3[3..]);
        let (p2c, otherc) = (p2.clone(), other.clone());
        let mut swap = move |p: &weight_manager_core::Progress| {
            if p.tensors_done == 3 && otherc.exists() {
                if rename {
                    std::fs::rename(&otherc, &p2c).unwrap();
                } else {
                    // Same inode, same length, another version's bytes.
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    std::fs::write(&p2c, std::fs::read(&otherc).unwrap()).unwrap();
                    std::fs::remove_file(&otherc).unwrap();
                }
            }
            true
        };
        let mut req = UpdateRequest::snapshot(parts.path());
        req.version = Some("2".into());
        req.hooks = Hooks {
            progress: Some(&mut swap),
            tensor: None,
        };
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, weight_manager_core::wm_result::WM_ERR_FORMAT, "{e}");
        assert!(
            e.message.contains("part2") && e.message.contains(says),
            "{e}"
        );
        assert_eq!(m.status().version.as_deref(), Some("1"));
        assert_params(&ptrs, &v1);
    }
}

/// A file truncated after the plan was made: atomic mode keeps the old
/// weights; in-place mode reports FAILED until a later update succeeds.
#[test]
fn truncated_after_plan_atomic_and_in_place() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("model_state.tp0.0.safetensors");
    let v1 = model(7);
    write_safetensors(&path, &v1);
    write_version(d.path(), "1");
    let m = manager();
    let ptrs = register(&m, &v1);
    m.update(UpdateRequest::snapshot(d.path())).unwrap();

    let v2 = model(8);
    write_safetensors(&path, &v2);
    for mode in [Mode::Atomic, Mode::InPlace] {
        // Two part files, so there are two batches: cut the second file once
        // the first is applied, after the plan was made.
        let parts = tempfile::tempdir().unwrap();
        write_safetensors(
            &parts.path().join("model_state.tp0.0.part1.safetensors"),
            &v2[..3],
        );
        let p2 = parts.path().join("model_state.tp0.0.part2.safetensors");
        write_safetensors(&p2, &v2[3..]);
        let p2c = p2.clone();
        let mut cut = move |p: &weight_manager_core::Progress| {
            if p.tensors_done == 3 {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p2c)
                    .unwrap()
                    .set_len(100)
                    .unwrap();
            }
            true
        };
        let mut req = UpdateRequest::snapshot(parts.path());
        req.version = Some("2".into());
        req.mode = mode;
        req.hooks = Hooks {
            progress: Some(&mut cut),
            tensor: None,
        };
        let e = m.update(req).unwrap_err();
        assert!(
            e.message.contains("changed after the plan") || e.message.contains("truncated"),
            "{mode:?}: {e}"
        );
        let s = m.status();
        match mode {
            Mode::Atomic => {
                assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("1")));
                assert_params(&ptrs, &v1);
            }
            Mode::InPlace => {
                // Half-written params hold no version.
                assert_eq!((s.state, s.version.as_deref()), (State::Failed, None));
            }
        }
    }
    // A later good update recovers from FAILED.
    write_safetensors(&path, &v2);
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("3".into());
    m.update(req).unwrap();
    assert_eq!(m.status().state, State::Normal);
    assert_params(&ptrs, &v2);
}

#[test]
fn checksums_verified_and_bit_flip_caught() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("model_state.tp0.0.safetensors");
    let v = model(9);
    write_safetensors(&path, &v);
    write_version(d.path(), "9");
    let m = manager();
    let ptrs = register(&m, &v);
    let mut req = UpdateRequest::snapshot(d.path());
    req.verify = true;
    let e = m.update(req).unwrap_err();
    assert!(e.message.contains("wm manifest"), "{e}");
    let w = checksums::write(d.path(), 2).unwrap();
    assert_eq!((w.files, w.tensors), (1, 6));
    let mut req = UpdateRequest::snapshot(d.path());
    req.verify = true;
    m.update(req).unwrap();
    assert_params(&ptrs, &v);

    // Flip one bit inside a tensor: same size, so only the checksum can tell.
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let mut req = UpdateRequest::snapshot(d.path());
    req.verify = true;
    req.version = Some("10".into());
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM);
    assert!(e.message.contains("checksum mismatch"), "{e}");
    assert_params(&ptrs, &v);
    assert_eq!(m.status().version.as_deref(), Some("9"));
}

#[test]
fn tensor_callback_receives_every_tensor() {
    let d = tempfile::tempdir().unwrap();
    let v = model(11);
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(d.path(), "11");
    for mode in [Mode::Atomic, Mode::InPlace] {
        let m = manager();
        let mut seen: Vec<(String, Vec<u8>)> = Vec::new();
        let mut on_tensor = |t: &weight_manager_core::TensorView| {
            seen.push((t.name.to_string(), t.data.to_vec()));
            Ok(())
        };
        let mut req = UpdateRequest::snapshot(d.path());
        req.mode = mode;
        req.hooks.tensor = Some(&mut on_tensor);
        m.update(req).unwrap();
        seen.sort();
        let mut want: Vec<(String, Vec<u8>)> =
            v.iter().map(|t| (t.name.clone(), t.data.clone())).collect();
        want.sort();
        assert_eq!(seen, want, "{mode:?}");

        let mut failing = |t: &weight_manager_core::TensorView| {
            if t.name == "layer0.norm" {
                Err("no room".to_string())
            } else {
                Ok(())
            }
        };
        let mut req = UpdateRequest::snapshot(d.path());
        req.mode = mode;
        req.hooks.tensor = Some(&mut failing);
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_CALLBACK);
        assert!(e.message.contains("'layer0.norm': no room"), "{e}");
    }
}

/// In place, a deadline that passes while the per-tensor callback runs
/// fails the update when that callback returns, not at the end of the
/// snapshot batch (which holds every tensor of this model): the header's
/// "a deadline passed while one ran fails the update after it returns".
#[test]
fn a_deadline_passed_in_a_tensor_callback_fails_the_update_when_it_returns() {
    let d = tempfile::tempdir().unwrap();
    let v: Vec<T> = (0..16)
        .map(|i| {
            tensor(
                &format!("t{i}"),
                weight_manager_core::DType::F32,
                &[1024],
                i as u8,
            )
        })
        .collect();
    write_safetensors(&d.path().join("model.safetensors"), &v);
    write_version(d.path(), "1");
    let m = manager();
    let mut calls = 0;
    let mut slow = |_: &weight_manager_core::TensorView| {
        calls += 1;
        std::thread::sleep(std::time::Duration::from_millis(60));
        Ok(())
    };
    let mut req = UpdateRequest::snapshot(d.path());
    req.mode = Mode::InPlace;
    req.timeout = std::time::Duration::from_millis(100);
    req.hooks.tensor = Some(&mut slow);
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT, "{e}");
    assert!(
        calls <= 3,
        "{calls} callbacks ran after the deadline of 100 ms"
    );
    assert_eq!(m.status().state, State::Failed);
}

/// A tensor in two files of one snapshot (two part files, or two
/// HuggingFace shards without an index) is refused naming both files, as
/// the README promises ("naming file and tensor").
#[test]
fn a_tensor_in_two_files_is_refused_naming_both() {
    let d = tempfile::tempdir().unwrap();
    let a = tensor("a", weight_manager_core::DType::F32, &[4], 1);
    let b = tensor("b", weight_manager_core::DType::F32, &[4], 2);
    let part0 = d.path().join("model_state.tp0.0.part0.safetensors");
    let part1 = d.path().join("model_state.tp0.0.part1.safetensors");
    write_safetensors(&part0, &[a.clone(), b]);
    write_safetensors(&part1, std::slice::from_ref(&a));
    write_version(d.path(), "1");
    let m = manager();
    register(&m, std::slice::from_ref(&a));
    let mut req = UpdateRequest::snapshot(d.path());
    req.skip_unknown = true;
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
    assert!(
        e.message.contains("tensor 'a' is in both")
            && e.message.contains("part0.safetensors")
            && e.message.contains("part1.safetensors"),
        "{e}"
    );
}

#[test]
fn state_rules_busy_and_registration() {
    let d = tempfile::tempdir().unwrap();
    let v = model(12);
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(d.path(), "12");
    let m = Arc::new(manager());
    register(&m, &v);
    // An update that waits in its progress callback while another thread tries.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let m2 = m.clone();
    let dir = d.path().to_path_buf();
    let t = std::thread::spawn(move || {
        let mut hold = |_: &weight_manager_core::Progress| {
            tx.send(()).unwrap();
            go_rx.recv().unwrap();
            true
        };
        let mut req = UpdateRequest::snapshot(&dir);
        req.hooks.progress = Some(&mut hold);
        m2.update(req)
    });
    rx.recv().unwrap();
    assert_eq!(m.status().state, State::Updating);
    let e = m.update(UpdateRequest::snapshot(d.path())).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_BUSY);
    assert_eq!(m.clear().unwrap_err().code, wm_result::WM_ERR_BUSY);
    go_tx.send(()).unwrap();
    t.join().unwrap().unwrap();
    let e = m
        .allocate(&ParamSpec::host(
            "late",
            weight_manager_core::DType::F32,
            &[1],
        ))
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_STATE);
    // Cancel through progress: atomic, so nothing changes.
    let mut cancel = |_: &weight_manager_core::Progress| false;
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("cancelled".into());
    req.hooks.progress = Some(&mut cancel);
    assert_eq!(m.update(req).unwrap_err().code, wm_result::WM_ERR_CANCELLED);
    assert_eq!(m.status().version.as_deref(), Some("12"));
    // A too-long version.
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("v".repeat(300));
    assert_eq!(
        m.update(req).unwrap_err().code,
        wm_result::WM_ERR_INVALID_ARGUMENT
    );
}

#[test]
fn engine_owned_release_and_acquire_hooks() {
    let d = tempfile::tempdir().unwrap();
    let v = vec![tensor("w", weight_manager_core::DType::F32, &[16], 1)];
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(d.path(), "1");
    let released = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let r2 = released.clone();
    let fresh: &'static mut [u8] = Box::leak(vec![0u8; 64].into_boxed_slice());
    let fresh_ptr = fresh.as_mut_ptr() as usize;
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        release_hook: Some(Box::new(move |name, _, len| {
            r2.lock().push(format!("{name}:{len}"))
        })),
        acquire_hook: Some(Box::new(move |_, _, _| Some(fresh_ptr as *mut u8))),
        ..Default::default()
    })
    .unwrap();
    let old = Box::leak(vec![0u8; 64].into_boxed_slice());
    unsafe {
        m.register(
            &ParamSpec::host("w", weight_manager_core::DType::F32, &[16]),
            old.as_mut_ptr(),
            64,
        )
    }
    .unwrap();
    m.update(UpdateRequest::snapshot(d.path())).unwrap();
    assert_eq!(&old[..], &v[0].data[..]);
    m.clear().unwrap();
    assert_eq!(released.lock().as_slice(), ["w:64"]);
    m.update(UpdateRequest::snapshot(d.path())).unwrap();
    let fresh = unsafe { std::slice::from_raw_parts(fresh_ptr as *const u8, 64) };
    assert_eq!(fresh, &v[0].data[..]);
}
