//! The layout rules, expanded and checked without planning.

use super::*;
use crate::manifest::Manifest;
use crate::tensor::DType;
use serde_json::json;

fn trainer(v: serde_json::Value) -> TrainerLayout {
    TrainerLayout::from_json(&v).unwrap()
}

fn trainer_err(v: serde_json::Value) -> String {
    TrainerLayout::from_json(&v).unwrap_err().message
}

/// (offset, shape) of every shard of `name` on `m`.
fn boxes(m: &Manifest, name: &str) -> Vec<(Vec<u64>, Vec<u64>)> {
    m.tensors
        .iter()
        .filter(|t| t.name == name)
        .map(|t| (t.offset(), t.shape.clone()))
        .collect()
}

#[test]
fn a_split_follows_pytorch_chunks_and_skips_empty_ones() {
    let t = trainer(json!({"ranks": 4, "dtype": "bf16", "tensors": [
        {"name": "w", "shape": [6, 8], "split": 0},
        {"name": "n", "shape": [8], "replicate": true, "ranks": [1, 3]}
    ]}));
    let rows: Vec<_> = t.manifests.iter().map(|m| boxes(m, "w")).collect();
    assert_eq!(rows[0], [(vec![0, 0], vec![2, 8])]);
    assert_eq!(rows[2], [(vec![4, 0], vec![2, 8])]);
    assert!(
        rows[3].is_empty(),
        "ceil(6 / 4) = 2 rows each: rank 3 has none"
    );
    let norm: Vec<usize> = t.manifests.iter().map(|m| boxes(m, "n").len()).collect();
    assert_eq!(norm, [0, 1, 1, 0]);
    let m = &t.manifests[1].tensors[0];
    assert_eq!((m.nbytes, m.dtype), (32, DType::Bf16));
    assert_eq!(m.placement.as_ref().unwrap().global_shape, [6, 8]);
    assert_eq!(t.elements(), 56);
}

#[test]
fn layers_and_expert_groups_expand() {
    let t = trainer(json!({"ranks": 4, "dtype": "bf16", "tensors": [
        {"name": "l{L}.e{E}", "layers": [1, 3], "experts": 4, "expert_groups": 2,
         "shape": [2, 3], "split": 0, "dtype": "f32"}
    ]}));
    assert_eq!(t.tensors.len(), 8);
    assert_eq!(t.find("l2.e3").unwrap().dtype, DType::F32);
    assert!(t.find("l0.e0").is_none());
    // Experts 0, 1 on ranks 0, 1 (a row each); experts 2, 3 on ranks 2, 3.
    assert_eq!(boxes(&t.manifests[1], "l1.e0"), [(vec![1, 0], vec![1, 3])]);
    assert!(boxes(&t.manifests[2], "l1.e0").is_empty());
    assert_eq!(boxes(&t.manifests[2], "l1.e3"), [(vec![0, 0], vec![1, 3])]);
}

#[test]
fn trainer_mistakes_name_the_field() {
    let cases = [
        (json!({"ranks": 0, "tensors": []}), "trainer.ranks: must be 1 or more"),
        (json!({"ranks": 2, "tensors": [{"name": "w", "shape": [2]}]}), "trainer.tensors[0].dtype: is missing"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [2], "split": 0, "replicate": true}]}),
         "'split' and 'replicate' exclude each other"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "layers": 2, "shape": [2]}]}),
         "trainer.tensors[0].name: 'w' needs {L}: layers are given"),
        (json!({"ranks": 4, "dtype": "bf16", "tensors": [{"name": "e{E}", "experts": 3, "expert_groups": 2, "shape": [2], "split": 0}]}),
         "trainer.tensors[0].expert_groups: 2 groups must divide both the 3 experts and the 4 ranks"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [2]}, {"name": "w", "shape": [2]}]}),
         "trainer.tensors[1].name: tensor 'w' is described twice"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [4]}],
                "shards": [{"rank": 1, "tensor": "w", "offsets": [3], "shape": [2]}]}),
         "trainer.shards[0]: tensor 'w': shard placement: dimension 0: offset 3 + length 2 runs past the global 4"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [4]}],
                "shards": [{"rank": 2, "tensor": "w", "offsets": [0], "shape": [2]}]}),
         "trainer.shards[0].rank: 2 is more than 1"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [4], "layers": [3, 3]}]}),
         "trainer.tensors[0].layers: [first, end] needs whole numbers, first < end"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "shape": [1, 1, 1, 1, 1, 1, 1, 1, 1]}]}),
         "trainer.tensors[0].shape: 9 dimensions, at most 8"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "w", "experts": 200000, "shape": [4]}]}),
         "trainer.tensors[0].experts: ends at 200000, past 100000"),
        (json!({"ranks": 2, "dtype": "bf16", "tensors": [{"name": "s", "shape": [], "split": 0}]}),
         "trainer.tensors[0].split: a scalar has no dimension to split"),
    ];
    for (v, want) in cases {
        let e = trainer_err(v);
        assert!(e.contains(want), "want '{want}' in: {e}");
    }
}

fn small_trainer() -> TrainerLayout {
    trainer(json!({"ranks": 2, "dtype": "bf16", "tensors": [
        {"name": "q", "shape": [8, 4], "split": 0},
        {"name": "k", "shape": [4, 4], "split": 0},
        {"name": "o", "shape": [4, 8], "split": 0},
        {"name": "e{E}.gate", "experts": 4, "shape": [3, 4], "split": 0},
        {"name": "e{E}.up", "experts": 4, "shape": [3, 4], "split": 0},
        {"name": "n", "shape": [4], "replicate": true}
    ]}))
}

fn engine(v: serde_json::Value) -> EngineLayout {
    EngineLayout::from_json(&v).unwrap()
}

#[test]
fn engine_rules_stack_split_and_spread_experts() {
    let t = small_trainer();
    let e = engine(json!({"ranks": 4, "dtype": "bf16", "params": [
        {"name": "qk", "pieces": [{"tensor": "q", "split": 0, "tp": 2}, {"tensor": "k", "split": 0, "tp": 2}]},
        {"name": "o", "pieces": [{"tensor": "o", "split": 1, "tp": 2}]},
        {"name": "w13", "experts": 4, "ep": 2, "stack": 0,
         "pieces": [{"tensor": "e{E}.gate"}, {"tensor": "e{E}.up"}]},
        {"name": "n"}
    ]}));
    let p = e.rank_params(3, &t).unwrap();
    let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["qk", "o", "w13", "n"]);
    // TP index 3 % 2 = 1: rows 4..8 of q then rows 2..4 of k.
    assert_eq!(p[0].shape, [6, 4]);
    assert_eq!(p[0].pieces[1].global.offset, [2, 0]);
    assert_eq!(p[0].pieces[1].at, [4, 0]);
    assert_eq!(p[1].shape, [4, 4]);
    assert_eq!(p[1].pieces[0].global.offset, [0, 4]);
    // EP index 3 % 2 = 1: experts 2 and 3, gate then up, each [6, 4].
    assert_eq!(p[2].shape, [2, 6, 4]);
    let w13: Vec<(&str, &[u64])> = p[2]
        .pieces
        .iter()
        .map(|x| (x.tensor.as_str(), x.at.as_slice()))
        .collect();
    assert_eq!(
        w13,
        [
            ("e2.gate", &[0, 0, 0][..]),
            ("e2.up", &[0, 3, 0]),
            ("e3.gate", &[1, 0, 0]),
            ("e3.up", &[1, 3, 0])
        ]
    );
    assert!(p[3].whole && !p[0].whole);
    assert_eq!(p[3].shape, [4]);
}

#[test]
fn engine_mistakes_name_the_rank_and_field() {
    let t = small_trainer();
    let err = |v: serde_json::Value| match EngineLayout::from_json(&v) {
        Err(e) => e.message,
        Ok(e) => e.rank_params(1, &t).unwrap_err().message,
    };
    let cases = [
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "pieces": [{"tensor": "nope"}]}]}),
            "engine rank 1: engine.params[0].pieces[0].tensor: 'nope' is not a trainer tensor",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "k", "pieces": [{"tensor": "k", "split": 0, "tp": 3}]}]}),
            "engine.params[0].pieces[0].split: dimension 0 of 'k' (4) does not divide by tp 3",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "pieces": [{"tensor": "q"}, {"tensor": "o"}]}]}),
            "engine.params[0].pieces[1]: box [0:4, 0:8] does not stack along dimension 0",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "n"}, {"name": "n"}]}),
            "engine rank 1: engine.params[1]: param 'n' is described twice",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "w", "experts": 4, "ep": 3, "pieces": [{"tensor": "e{E}.up"}]}]}),
            "engine.params[0].ep: 3 must divide the 4 experts",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "pieces": [{"tensor": "q", "at": [0, 0]}]}]}),
            "engine.params[0].shape: is needed when every piece gives 'at'",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "pieces": [{"tensor": "q", "split": 0}]}]}),
            "engine.params[0].pieces[0].tp: a split needs tp",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "rank": 2}]}),
            "engine.params[0].rank: 2 is more than 1",
        ),
        (
            json!({"ranks": 2, "dtype": "bf16", "params": [{"name": "x", "shape": [4, 4], "pieces": [
            {"tensor": "k", "offsets": [0, 0], "shape": [2, 4], "at": [0, 0]}]}]}),
            "engine rank 1: engine.params[0]: param 'x': its pieces hold 8 of its 16 elements",
        ),
    ];
    for (v, want) in cases {
        let e = err(v);
        assert!(e.contains(want), "want '{want}' in: {e}");
    }
}

#[test]
fn a_file_is_read_only_up_to_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.json");
    std::fs::write(
        &path,
        format!("{{\"ranks\": 1, \"pad\": \"{}\"}}", "x".repeat(100)),
    )
    .unwrap();
    let e = json::read_file(&path, 64).unwrap_err();
    assert!(e.message.contains("larger than 64 bytes"), "{e}");
    let e = read_trainer(&dir.path().join("missing.json")).unwrap_err();
    assert_eq!(e.code, crate::result::wm_result::WM_ERR_NOT_FOUND);
}

#[test]
fn the_repository_small_layout_gives_each_engine_rank_its_bytes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../layouts/tp-small");
    let t = read_trainer(&root.join("trainer.json")).unwrap();
    let e = read_engine(&root.join("engine.json")).unwrap();
    for rank in 0..e.ranks {
        let params = e.rank_params(rank, &t).unwrap();
        let bytes: u64 = params
            .iter()
            .map(|p| p.shape.iter().product::<u64>() * 2)
            .sum();
        assert_eq!(bytes, 1680, "rank {rank}");
    }
}

#[test]
fn pieces_stacked_past_two_to_the_64_are_refused_as_such() {
    // Four [2^62, 1] boxes stacked along dimension 0 end at 2^64: the
    // cursor wrapped to 0 and the refusal described a [0, 1] param.
    let t = trainer(json!({"ranks": 1, "dtype": "u8", "tensors": [
        {"name": "big", "shape": [4611686018427387904u64, 1], "split": 0}
    ]}));
    let e = engine(
        json!({"ranks": 1, "dtype": "u8", "params": [{"name": "x", "pieces": [
        {"tensor": "big"}, {"tensor": "big"}, {"tensor": "big"}, {"tensor": "big"}]}]}),
    );
    let msg = e.rank_params(0, &t).unwrap_err().message;
    assert!(
        msg.contains("engine.params[0].pieces[3]: box [0:4611686018427387904, 0:1] stacked after the pieces before it ends past 2^64 along dimension 0"),
        "{msg}"
    );
}
