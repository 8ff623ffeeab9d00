//! Sharded plans: pieces against shards from several sources, checked
//! byte by byte against the global tensors.

use super::tests::meta;
use super::*;
use crate::logging::Logger;
use crate::manifest::Manifest;
use crate::manifest::Placement;
use crate::pieces::Piece;
use crate::plan::ParamLayout;
use crate::registry::{ParamSpec, Registry};
use crate::tensor::{byte_size, DType};
use crate::tensor_box::TensorBox;

/// Element `flat` of global tensor `name`, as two bytes.
fn value(name: &str, flat: u64) -> [u8; 2] {
    let h = name.bytes().fold(flat.wrapping_mul(2654435761), |h, b| {
        h.rotate_left(5) ^ u64::from(b)
    });
    (h as u16).to_le_bytes()
}

fn flat_index(idx: &[u64], shape: &[u64]) -> u64 {
    idx.iter().zip(shape).fold(0, |f, (&i, &n)| f * n + i)
}

/// Every index of a box, row-major.
fn indices(b: &TensorBox) -> Vec<Vec<u64>> {
    let mut out = vec![vec![]];
    for d in 0..b.ndim() {
        out = out
            .into_iter()
            .flat_map(|p| {
                (b.offset[d]..b.offset[d] + b.len[d]).map(move |i| {
                    let mut q = p.clone();
                    q.push(i);
                    q
                })
            })
            .collect();
    }
    out
}

/// A shard of global tensor `name` (`shape`): its manifest entry and bytes.
fn shard(name: &str, shape: &[u64], region: TensorBox) -> (TensorMeta, Vec<u8>) {
    let bytes: Vec<u8> = indices(&region)
        .iter()
        .flat_map(|i| value(name, flat_index(i, shape)))
        .collect();
    let mut m = meta(name, DType::Bf16, &region.len);
    m.placement = Some(Placement {
        global_shape: shape.to_vec(),
        offset: region.offset.clone(),
    });
    (m, bytes)
}

/// `n` row shards of `shape` (FSDP-like; the last may be shorter).
fn row_shards(name: &str, shape: &[u64], n: u64) -> Vec<(TensorMeta, Vec<u8>)> {
    let rows = shape[0].div_ceil(n);
    (0..n)
        .filter(|r| r * rows < shape[0])
        .map(|r| {
            let mut b = TensorBox::whole(shape);
            b.offset[0] = r * rows;
            b.len[0] = rows.min(shape[0] - r * rows);
            shard(name, shape, b)
        })
        .collect()
}

/// What the param must hold: every piece's elements at their place.
fn expected(spec: &ParamSpec, global_shapes: &[(&str, Vec<u64>)]) -> Vec<u8> {
    let n = byte_size("p", spec.dtype, &spec.shape).unwrap() as usize;
    let mut out = vec![0u8; n];
    for piece in &spec.pieces {
        let a = piece.aligned(&spec.shape);
        let gshape = &global_shapes
            .iter()
            .find(|(g, _)| *g == piece.tensor)
            .unwrap()
            .1;
        let extra = a.global.ndim() - gshape.len();
        for idx in indices(&a.global) {
            let at: Vec<u64> = (0..idx.len())
                .map(|d| a.in_param.offset[d] + idx[d] - a.global.offset[d])
                .collect();
            let p = flat_index(&at, &a.param_shape) as usize * 2;
            out[p..p + 2].copy_from_slice(&value(&piece.tensor, flat_index(&idx[extra..], gshape)));
        }
    }
    out
}

fn piece_at(mut p: Piece, at: &[u64]) -> Piece {
    p.at = at.to_vec();
    p
}

/// An engine rank of a TP=2 engine: a column-split weight, a fused QKV
/// (q, k, v of unequal sizes, each row-split by TP), and a stacked expert
/// param (experts 2..4 of a [4, 3, 5] tensor) plus two per-expert tensors
/// stacked into one param.
pub(super) fn engine_rank(rank: u64) -> Vec<ParamSpec> {
    let spec = |name: &str, shape: &[u64], pieces: Vec<Piece>| ParamSpec {
        pieces,
        ..ParamSpec::host(name, DType::Bf16, shape)
    };
    vec![
        spec(
            "o.tp",
            &[6, 4],
            vec![Piece::narrow("o", &[6, 8], 1, 4 * rank, 4)],
        ),
        spec(
            "qkv.tp",
            &[8, 5],
            vec![
                Piece::narrow("q", &[8, 5], 0, 4 * rank, 4),
                piece_at(Piece::narrow("k", &[4, 5], 0, 2 * rank, 2), &[4, 0]),
                piece_at(Piece::narrow("v", &[4, 5], 0, 2 * rank, 2), &[6, 0]),
            ],
        ),
        spec(
            "experts",
            &[2, 3, 5],
            vec![Piece::narrow("w", &[4, 3, 5], 0, 2, 2)],
        ),
        spec(
            "pair",
            &[2, 3, 5],
            vec![
                piece_at(Piece::whole("e0", &[3, 5]), &[0, 0, 0]),
                piece_at(Piece::whole("e1", &[3, 5]), &[1, 0, 0]),
            ],
        ),
    ]
}

fn globals() -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("o", vec![6, 8]),
        ("q", vec![8, 5]),
        ("k", vec![4, 5]),
        ("v", vec![4, 5]),
        ("w", vec![4, 3, 5]),
        ("e0", vec![3, 5]),
        ("e1", vec![3, 5]),
    ]
}

/// Four trainer ranks, each holding a row shard of every global tensor.
pub(super) fn trainer(ranks: u64) -> Vec<(Manifest, Vec<Vec<u8>>)> {
    let mut out: Vec<(Manifest, Vec<Vec<u8>>)> = (0..ranks)
        .map(|_| {
            (
                Manifest {
                    tensors: vec![].into(),
                    version: Some("7".into()),
                },
                vec![],
            )
        })
        .collect();
    for (name, shape) in globals() {
        for (r, (m, bytes)) in row_shards(name, &shape, ranks).into_iter().enumerate() {
            out[r].0.tensors.push(m);
            out[r].1.push(bytes);
        }
    }
    out
}

#[test]
fn a_tp_engine_rank_gets_exactly_its_bytes_from_four_row_sharded_sources() {
    let sources = trainer(4);
    let manifests: Vec<&Manifest> = sources.iter().map(|(m, _)| m).collect();
    for rank in 0..2 {
        let specs = engine_rank(rank);
        let mut registry = Registry::default();
        for s in &specs {
            registry.allocate(s).unwrap();
        }
        let p = make_sharded_plan(
            &manifests,
            &registry,
            PlanOptions::default(),
            &Logger::default(),
        )
        .unwrap();
        let mut params: Vec<Vec<u8>> = specs
            .iter()
            .map(|s| vec![0; byte_size("p", s.dtype, &s.shape).unwrap() as usize])
            .collect();
        let mut moved = 0;
        for (i, e) in p.entries.iter().enumerate() {
            let Target::Param(k) = e.target else { continue };
            let data = &sources[e.source].1[e.tensor];
            for s in p.segments(i) {
                let (src, dst, n) = (s.source as usize, s.param as usize, s.len as usize);
                params[k][dst..dst + n].copy_from_slice(&data[src..src + n]);
                moved += n as u64;
            }
        }
        let need: u64 = specs
            .iter()
            .map(|s| byte_size("p", s.dtype, &s.shape).unwrap())
            .sum();
        assert_eq!((moved, p.bytes), (need, need), "each byte moved once");
        for (s, got) in specs.iter().zip(&params) {
            assert_eq!(
                got,
                &expected(s, &globals()),
                "rank {rank} param '{}'",
                s.name
            );
        }
    }
}

pub(super) fn registry_of(specs: &[ParamSpec]) -> Registry {
    let mut r = Registry::default();
    for s in specs {
        r.allocate(s).unwrap();
    }
    r
}

fn sharded_err(manifests: &[&Manifest], specs: &[ParamSpec]) -> String {
    make_sharded_plan(
        manifests,
        &registry_of(specs),
        PlanOptions::default(),
        &Logger::default(),
    )
    .unwrap_err()
    .message
}

#[test]
fn uncovered_overlapping_outside_and_mismatched_versions_are_named() {
    let mut sources = trainer(4);
    // The third row shard of 'q' goes missing.
    let (m, _) = &mut sources[2];
    m.tensors.retain(|t| t.name != "q");
    let ms: Vec<&Manifest> = sources.iter().map(|(m, _)| m).collect();
    let e = sharded_err(&ms, &engine_rank(1));
    assert!(
        e.contains(
            "param 'qkv.tp': piece 0 ('q' [4:8, 0:5]): [4:6, 0:5] of 'q' is held by no source"
        ),
        "{e}"
    );
    // Overlap: rank 3 also claims rows 0..2 of 'o'.
    let mut sources = trainer(4);
    let (m, _) = shard(
        "o",
        &[6, 8],
        TensorBox {
            offset: vec![1, 0],
            len: vec![1, 8],
        },
    );
    let mut renamed = m;
    renamed.placement.as_mut().unwrap().offset = vec![1, 0];
    sources[3].0.tensors.push(renamed);
    let ms: Vec<&Manifest> = sources.iter().map(|(m, _)| m).collect();
    let e = sharded_err(&ms, &engine_rank(0));
    assert!(
        e.contains("tensor 'o': shards") && e.contains("overlap at [1:2, 0:8]"),
        "{e}"
    );
    // A piece outside its tensor.
    let sources = trainer(4);
    let ms: Vec<&Manifest> = sources.iter().map(|(m, _)| m).collect();
    let mut bad = engine_rank(0);
    bad[0].pieces = vec![Piece::narrow("o", &[6, 12], 1, 8, 4)];
    let e = sharded_err(&ms, &bad);
    assert!(
        e.contains(
            "param 'o.tp': piece 0 ('o' [0:6, 8:12]): outside the global tensor's shape [6, 8]"
        ),
        "{e}"
    );
    // Versions.
    let mut sources = trainer(2);
    sources[1].0.version = Some("8".into());
    let ms: Vec<&Manifest> = sources.iter().map(|(m, _)| m).collect();
    let e = sharded_err(&ms, &engine_rank(0));
    assert!(
        e.contains("different versions: source 0 '7', source 1 '8'"),
        "{e}"
    );
}

#[test]
fn replicas_are_spread_and_unneeded_shards_are_skipped() {
    // Two sources each hold all of 'o' (replicas); rank r reads from source r.
    let whole = |v: &str| Manifest {
        tensors: vec![shard("o", &[6, 8], TensorBox::whole(&[6, 8])).0].into(),
        version: Some(v.into()),
    };
    let (a, b) = (whole("1"), whole("1"));
    let spec = ParamSpec {
        pieces: vec![Piece::narrow("o", &[6, 8], 0, 0, 3)],
        ..ParamSpec::host("o.top", DType::Bf16, &[3, 8])
    };
    for spread in 0..2 {
        let opts = PlanOptions {
            spread,
            ..Default::default()
        };
        let p = make_sharded_plan(
            &[&a, &b],
            &registry_of(std::slice::from_ref(&spec)),
            opts,
            &Logger::default(),
        )
        .unwrap();
        let moving: Vec<usize> = p
            .entries
            .iter()
            .filter(|e| e.target != Target::Skip)
            .map(|e| e.source)
            .collect();
        assert_eq!(moving, [spread]);
        assert_eq!(p.bytes, 48);
        // With several sources, the replica not read has no entry at all.
        assert_eq!(p.entries.len(), 1);
    }
    // With one source, a tensor no piece needs keeps a `Skip` entry, so
    // that entry `i` is still tensor `i` of the manifest.
    let two = Manifest {
        tensors: vec![
            shard("n", &[2], TensorBox::whole(&[2])).0,
            shard("o", &[6, 8], TensorBox::whole(&[6, 8])).0,
        ]
        .into(),
        version: None,
    };
    let opts = PlanOptions {
        skip_unknown: true,
        ..Default::default()
    };
    let registry = registry_of(std::slice::from_ref(&spec));
    let p = make_sharded_plan(&[&two], &registry, opts, &Logger::default()).unwrap();
    let targets: Vec<(usize, Target)> = p.entries.iter().map(|e| (e.tensor, e.target)).collect();
    assert_eq!(targets, [(0, Target::Skip), (1, Target::Param(0))]);
}

pub(super) fn layouts_of(specs: &[ParamSpec]) -> Vec<ParamLayout> {
    specs
        .iter()
        .map(|s| ParamLayout {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            pieces: s.pieces.clone(),
            whole: false,
            quant: Default::default(),
        })
        .collect()
}

#[test]
fn a_first_slice_named_like_its_param_is_not_the_whole_tensor() {
    // TP rank 0 of 'o' [6, 8] split along dim 0, registered as 'o': its one
    // piece looks like "all of 'o' of the param's shape" but holds rows 0..3.
    let whole = Manifest {
        tensors: vec![shard("o", &[6, 8], TensorBox::whole(&[6, 8])).0].into(),
        version: None,
    };
    let spec = ParamSpec {
        pieces: vec![Piece::narrow("o", &[6, 8], 0, 0, 3)],
        ..ParamSpec::host("o", DType::Bf16, &[3, 8])
    };
    let p = make_sharded_plan(
        &[&whole],
        &registry_of(std::slice::from_ref(&spec)),
        PlanOptions::default(),
        &Logger::default(),
    )
    .unwrap();
    assert_eq!(p.bytes, 48);
    // Registered without pieces, a shorter param is still a mismatch.
    let e = sharded_err(&[&whole], &[ParamSpec::host("o", DType::Bf16, &[3, 8])]);
    assert!(
        e.contains("param 'o': shape mismatch: registered [3, 8], source [6, 8]"),
        "{e}"
    );
}

#[test]
fn many_replicas_of_one_box_are_joined_and_a_box_twice_in_one_source_is_named() {
    // 64 sources each hold all of 'o': one box, 64 replicas, spread by rank.
    let one = Manifest {
        tensors: vec![shard("o", &[6, 8], TensorBox::whole(&[6, 8])).0].into(),
        version: None,
    };
    let ms: Vec<&Manifest> = (0..64).map(|_| &one).collect();
    let spec = ParamSpec {
        pieces: vec![Piece::narrow("o", &[6, 8], 0, 0, 3)],
        ..ParamSpec::host("o.top", DType::Bf16, &[3, 8])
    };
    let layouts = layouts_of(std::slice::from_ref(&spec));
    let indexed = Sources::new(&ms).unwrap();
    for spread in [0, 17, 63, 64] {
        let opts = PlanOptions {
            spread,
            ..Default::default()
        };
        let p = indexed.plan(&layouts, opts, &Logger::default()).unwrap();
        let from: Vec<usize> = p
            .entries
            .iter()
            .filter(|e| e.target != Target::Skip)
            .map(|e| e.source)
            .collect();
        assert_eq!(from, [spread % 64]);
    }
    let mut twice = one.clone();
    let again = twice.tensors[0].clone();
    twice.tensors.push(again);
    let e = sharded_err(&[&twice], std::slice::from_ref(&spec));
    assert!(
        e.contains("tensor 'o' [0:6, 0:8] appears more than once in the source"),
        "{e}"
    );
}

/// One-row shards against one-column pieces meet in a box per (row,
/// column) before runs are joined: planning refuses them with
/// OUT_OF_MEMORY naming the param once they pass the params' block bound,
/// instead of listing 16.7 M runs (1.4 GB) first.
#[test]
fn shards_and_pieces_cutting_a_param_too_finely_are_refused_before_listing() {
    let (rows, cols) = (512u64, 32_768u64);
    let shape = [rows, cols];
    let tensors: Vec<TensorMeta> = (0..rows)
        .map(|r| {
            let mut m = meta("g", DType::F32, &[1, cols]);
            m.placement = Some(Placement {
                global_shape: shape.to_vec(),
                offset: vec![r, 0],
            });
            m
        })
        .collect();
    let m = Manifest {
        tensors: tensors.into(),
        version: None,
    };
    let piece = |c: u64| Piece {
        tensor: "g".into(),
        global: TensorBox {
            offset: vec![0, c],
            len: vec![rows, 1],
        },
        at: vec![0, c],
    };
    let param = ParamLayout {
        pieces: (0..cols).map(piece).collect(),
        whole: false,
        ..ParamLayout::whole("g", DType::F32, &shape)
    };
    let params = [param];
    let e = make_sharded_plan(
        &[&m],
        &params[..],
        PlanOptions::default(),
        &Logger::default(),
    )
    .unwrap_err();
    assert_eq!(
        e.code,
        crate::result::wm_result::WM_ERR_OUT_OF_MEMORY,
        "{e}"
    );
    assert!(e.message.contains("param 'g' (32768 pieces)"), "{e}");
    assert!(
        e.message
            .contains(&format!("more than {} runs", max_blocks(rows * cols * 4))),
        "{e}"
    );
}
