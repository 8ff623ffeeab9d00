//! Snapshot files that carry shard placement: `wm shard` writes per-rank
//! files with each tensor's placement in `__metadata__`, the snapshot
//! source reads them back into the manifest (global names, placements, the
//! right bytes, checksums), a publisher serving such a directory sends the
//! placements on, and hostile placement metadata is refused naming the file
//! and the tensor.

mod common;

use common::*;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::layout::SnapshotLocation;
use weight_manager_core::checkpoint::Checkpoint;
use weight_manager_core::internals::source::ipc::{IpcOptions, IpcSource};
use weight_manager_core::internals::source::Source;
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Logger;
use weight_manager_core::{Manifest, TensorMeta};
use weight_manager_core::{Publisher, PublisherConfig};

use common::sharded::pull;
use common::WM;

fn open(dir: &Path, rank: u32) -> weight_manager_core::Result<Checkpoint> {
    let loc = SnapshotLocation {
        model_dir: dir.to_path_buf(),
        fallback_dir: None,
        rank,
        gpu_id: "0".into(),
    };
    Checkpoint::read(&loc, &Logger::default())
}

/// `wm shard INPUT --out OUT --ranks RANKS --dim DIM`, as run.
fn run_shard(input: &Path, out: &Path, ranks: u32, dim: u32) -> std::process::Output {
    Command::new(&*WM)
        .args([
            "shard",
            input.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .args(["--ranks", &ranks.to_string(), "--dim", &dim.to_string()])
        .output()
        .unwrap()
}

fn wm_shard(input: &Path, out: &Path, ranks: u32, dim: u32) {
    let o = run_shard(input, out, ranks, dim);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The bytes of the box at `offset` of lengths `shape` in `t` (row-major).
fn box_bytes(t: &T, offset: &[u64], shape: &[u64]) -> Vec<u8> {
    let e = t.dtype.size();
    if shape.is_empty() {
        return t.data.clone();
    }
    let strides: Vec<usize> = (0..t.shape.len())
        .map(|d| t.shape[d + 1..].iter().product::<u64>() as usize * e)
        .collect();
    let last = shape.len() - 1;
    let rows: u64 = shape[..last].iter().product();
    let mut out = Vec::new();
    for mut r in 0..rows {
        let mut at = offset[last] as usize * e;
        for d in (0..last).rev() {
            at += (offset[d] + r % shape[d]) as usize * strides[d];
            r /= shape[d];
        }
        out.extend_from_slice(&t.data[at..at + shape[last] as usize * e]);
    }
    out
}

/// Every rank's file holds, per tensor, its box's bytes under the global
/// name; split tensors follow the chunk rule and together cover their
/// tensor, the others are whole in every file.
fn check_ranks(out: &Path, model: &[T], ranks: u32, dim: usize) {
    let by_name: HashMap<&str, &T> = model.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut covered: HashMap<String, u64> = HashMap::new();
    for r in 0..ranks {
        let src = open(out, r).unwrap();
        let m = &src.manifest;
        assert_eq!(m.version.as_deref(), Some("5"), "version.yaml copied");
        assert_eq!(m.tensors.len(), model.len());
        for (i, meta) in m.tensors.iter().enumerate() {
            let t = by_name[meta.name.as_str()];
            assert!(meta.checksum.is_some(), "wm_checksums.json written");
            let (path, at) = src.tensor_location(i);
            let mut got = vec![0u8; meta.nbytes as usize];
            std::os::unix::fs::FileExt::read_exact_at(
                &std::fs::File::open(path).unwrap(),
                &mut got,
                at,
            )
            .unwrap();
            assert_eq!(
                got,
                box_bytes(t, &meta.offset(), &meta.shape),
                "{}",
                meta.name
            );
            let splits = t.shape.get(dim).is_some_and(|&n| n >= ranks as u64);
            assert_eq!(meta.placement.is_some(), splits, "{}", meta.name);
            if splits {
                let n = t.shape[dim];
                let chunk = n.div_ceil(ranks as u64);
                assert_eq!(meta.offset()[dim], chunk * r as u64, "{}", meta.name);
                assert_eq!(meta.global_shape(), t.shape.as_slice());
                *covered.entry(meta.name.clone()).or_default() += meta.shape[dim];
            }
        }
    }
    for (name, rows) in covered {
        assert_eq!(
            rows,
            by_name[name.as_str()].shape[dim],
            "{name} covered once"
        );
    }
}

/// A one-file snapshot of `model(3)` at version 5 in `dir`/model.
fn input_model(dir: &Path) -> (PathBuf, Vec<T>) {
    let input = dir.join("model");
    std::fs::create_dir(&input).unwrap();
    let model = model(3);
    write_safetensors(&input.join("model.safetensors"), &model);
    write_version(&input, "5");
    (input, model)
}

#[test]
fn wm_shard_writes_rank_files_the_snapshot_source_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let (input, model) = input_model(dir.path());
    for (ranks, dim) in [(3, 0), (4, 1)] {
        let out = dir.path().join(format!("tp{ranks}"));
        wm_shard(&input, &out, ranks, dim);
        check_ranks(&out, &model, ranks, dim as usize);
        // Other safetensors readers take the files (no gaps, aligned).
        let bytes = std::fs::read(out.join("model_state.tp0.0.safetensors")).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap();
    }
    // Splitting a shard again stays within its global tensor.
    let again = dir.path().join("again");
    wm_shard(
        &dir.path().join("tp3/model_state.tp1.0.safetensors"),
        &again,
        2,
        0,
    );
    let m = open(&again, 1).unwrap().manifest.clone();
    let embed = m.tensors.iter().find(|t| t.name == "embed.weight").unwrap();
    assert_eq!(
        (embed.offset(), embed.global_shape()),
        (vec![33, 0], &[64u64, 32][..])
    );
}

fn write_with_metadata(path: &Path, tensors: &[T], meta: &[(&str, &str)]) {
    let views: std::collections::BTreeMap<String, safetensors::tensor::TensorView> = tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|d| *d as usize).collect();
            let view = safetensors::tensor::TensorView::new(st_dtype(t.dtype), shape, &t.data);
            (t.name.clone(), view.unwrap())
        })
        .collect();
    let meta = meta
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    safetensors::serialize_to_file(views, &Some(meta), path).unwrap();
}

/// One file may hold several shards of one global tensor under different
/// stored names; other metadata is left alone.
/// `--out` naming the input's folder is refused before anything is
/// written (the rank files replaced the files later ranks were read from,
/// and the run reported success); rank files of an earlier run with more
/// ranks are removed, not left under the new checksums.
#[test]
fn wm_shard_refuses_its_input_folder_and_removes_stale_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (input, model) = input_model(dir.path());
    let file = input.join("model.safetensors");
    let before = std::fs::read(&file).unwrap();
    let o = run_shard(&input, &input, 2, 0);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("is the input's folder"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), before);
    assert_eq!(std::fs::read_dir(&input).unwrap().count(), 2);
    let out = dir.path().join("out");
    wm_shard(&input, &out, 4, 0);
    wm_shard(&input, &out, 2, 0);
    check_ranks(&out, &model, 2, 0);
    assert!(!out.join("model_state.tp2.0.safetensors").exists());
    assert!(!out.join("model_state.tp3.0.safetensors").exists());
}

/// Audit items: a run whose input names no version left an earlier run's
/// `version.yaml` in `--out` (new weights read as the old version); and a
/// folder of per-rank files was split from rank 0's file alone, printing
/// success. The version file goes; the per-rank folder is refused.
#[test]
fn wm_shard_leaves_no_stale_version_and_refuses_per_rank_folders() {
    let dir = tempfile::tempdir().unwrap();
    let (input, _) = input_model(dir.path());
    let out = dir.path().join("out");
    wm_shard(&input, &out, 2, 0);
    assert!(out.join("version.yaml").exists());
    let unnamed = dir.path().join("unnamed");
    std::fs::create_dir(&unnamed).unwrap();
    std::fs::copy(
        input.join("model.safetensors"),
        unnamed.join("model.safetensors"),
    )
    .unwrap();
    wm_shard(&unnamed, &out, 2, 0);
    assert!(
        !out.join("version.yaml").exists(),
        "an earlier run's version left"
    );
    let o = run_shard(&out, &dir.path().join("again"), 3, 0);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("per-rank files") && err.contains("model_state.tp1.0.safetensors"),
        "{err}"
    );
    // One rank's file alone is a model to split (its shards' placements kept).
    let single = dir.path().join("single");
    std::fs::create_dir(&single).unwrap();
    let rank0 = "model_state.tp0.0.safetensors";
    std::fs::copy(out.join(rank0), single.join(rank0)).unwrap();
    wm_shard(&single, &dir.path().join("single_out"), 2, 0);
}

#[test]
fn a_file_may_hold_several_shards_of_one_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let ts = [
        tensor("w.part0", DType::F32, &[2, 4], 1),
        tensor("w.part1", DType::F32, &[2, 4], 2),
        tensor("b", DType::F32, &[4], 3),
    ];
    let meta = [
        ("format", "pt"),
        (
            "wm.shard.w.part0",
            r#"{"tensor":"w","global_shape":[8,4],"offset":[0,0]}"#,
        ),
        (
            "wm.shard.w.part1",
            r#"{"tensor":"w","global_shape":[8,4],"offset":[6,0]}"#,
        ),
    ];
    let file = dir.path().join("shards.safetensors");
    write_with_metadata(&file, &ts, &meta);
    let m = open(&file, 0).unwrap().manifest.clone();
    let w: Vec<&TensorMeta> = m.tensors.iter().filter(|t| t.name == "w").collect();
    let offsets: Vec<Vec<u64>> = w.iter().map(|t| t.offset()).collect();
    assert_eq!(offsets.len(), 2);
    assert!(
        offsets.contains(&vec![0, 0]) && offsets.contains(&vec![6, 0]),
        "{offsets:?}"
    );
    let b = m.tensors.iter().find(|t| t.name == "b").unwrap();
    assert_eq!(b.placement, None, "a tensor without a key is whole");
}

/// Hostile placement metadata is a FORMAT error naming the file and the
/// stored tensor, before any byte is read.
#[test]
fn bad_placement_metadata_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let w = [tensor("w", DType::F32, &[2, 4], 1)];
    let nine = format!(
        r#"{{"tensor":"w","global_shape":[{}],"offset":[0]}}"#,
        ["1"; 9].join(",")
    );
    let cases: [(&str, &str, &str); 8] = [
        (
            "wm.shard.w",
            r#"{"tensor":"w","global_shape":[8,4],"offset":[7,0]}"#,
            "dimension 0",
        ),
        (
            "wm.shard.w",
            r#"{"tensor":"w","global_shape":[8],"offset":[0]}"#,
            "2 dimensions",
        ),
        (
            "wm.shard.x",
            r#"{"tensor":"w","global_shape":[8,4],"offset":[0,0]}"#,
            "names no tensor",
        ),
        ("wm.shard.w", r#"not json"#, "expected"),
        (
            "wm.shard.w",
            r#"{"tensor":"w","global_shape":[8,4]}"#,
            "offset",
        ),
        (
            "wm.shard.w",
            r#"{"tensor":"","global_shape":[8,4],"offset":[0,0]}"#,
            "empty",
        ),
        ("wm.shard.w", &nine, "more than 8 dimensions"),
        (
            "wm.shard.w",
            r#"{"tensor":"w","global_shape":[18446744073709551615,4],"offset":[0,0]}"#,
            "(global)",
        ),
    ];
    for (key, value, want) in cases {
        let file = dir.path().join("bad.safetensors");
        write_with_metadata(&file, &w, &[(key, value)]);
        let e = open(&file, 0).err().expect("refused");
        assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{want}: {e}");
        assert!(e.message.contains("bad.safetensors"), "{e}");
        assert!(e.message.contains(&format!("__metadata__ {key}")), "{e}");
        assert!(e.message.contains(want), "{want}: {e}");
    }
}

/// A publisher serving a directory of shard files sends the placements on
/// to the engine.
#[test]
fn a_publisher_serving_shard_files_sends_their_placement() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model");
    std::fs::create_dir(&input).unwrap();
    write_safetensors(&input.join("model.safetensors"), &model(4));
    write_version(&input, "5");
    let out = dir.path().join("tp2");
    wm_shard(&input, &out, 2, 0);
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
    p.set_dir(&out);
    let opts = IpcOptions {
        socket: sock.clone(),
        pull: pull(1, 2),
        allow_other_uids: false,
        gpu: 0,
    };
    let m: Manifest = std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        let deadline = Instant::now() + Duration::from_secs(20);
        let src = IpcSource::open(&opts, deadline, Arc::new(Mutex::new(Default::default())));
        let m = src.unwrap().manifest().clone();
        let _ = serving.join().unwrap(); // the engine stopped after the manifest
        m
    });
    let from_file = open(&out, 1).unwrap().manifest.clone();
    let placements = |m: &Manifest| -> Vec<_> {
        m.tensors
            .iter()
            .map(|t| (t.name.clone(), t.placement.clone()))
            .collect()
    };
    assert_eq!(placements(&m), placements(&from_file));
    assert!(
        m.tensors.iter().any(|t| t.offset() == vec![32, 0]),
        "rank 1's rows"
    );
}
