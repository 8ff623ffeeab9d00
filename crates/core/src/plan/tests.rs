use super::*;
use crate::logging::Logger;
use crate::manifest::Manifest;
use crate::registry::{ParamSpec, Registry};
use crate::result::Result;
use crate::tensor::DType;

pub(super) fn meta(name: &str, dtype: DType, shape: &[u64]) -> TensorMeta {
    TensorMeta::whole(name, dtype, shape)
}

fn registry() -> Registry {
    let mut r = Registry::default();
    r.allocate(&ParamSpec::host("a", DType::Bf16, &[2, 3]))
        .unwrap();
    r.allocate(&ParamSpec::host("b", DType::F32, &[4])).unwrap();
    r
}

fn plan(m: Vec<TensorMeta>, opts: PlanOptions) -> Result<Plan> {
    make_plan(
        &Manifest {
            tensors: m.into(),
            version: None,
        },
        &registry(),
        opts,
        &Logger::default(),
    )
}

#[test]
fn matching_manifest_plans() {
    let p = plan(
        vec![meta("b", DType::F32, &[4]), meta("a", DType::Bf16, &[2, 3])],
        PlanOptions::default(),
    )
    .unwrap();
    assert_eq!(p.tensors, 2);
    assert_eq!(p.bytes, 28);
    assert_eq!(p.entries[0].target, Target::Param(1));
}

#[test]
fn dtype_is_compared_before_shape() {
    let e = plan(
        vec![meta("a", DType::F16, &[9]), meta("b", DType::F32, &[4])],
        PlanOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.code, crate::result::wm_result::WM_ERR_MISMATCH);
    assert!(
        e.message
            .contains("param 'a': dtype mismatch: registered bf16, source f16"),
        "{e}"
    );
    let e = plan(
        vec![meta("a", DType::Bf16, &[3, 2]), meta("b", DType::F32, &[4])],
        PlanOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("shape mismatch: registered [2, 3], source [3, 2]"),
        "{e}"
    );
}

#[test]
fn unknown_missing_duplicate_and_empty() {
    let e = plan(
        vec![meta("a", DType::Bf16, &[2, 3]), meta("zz", DType::U8, &[1])],
        PlanOptions::default(),
    )
    .unwrap_err();
    assert!(e.message.contains("tensor 'zz' is not a registered param"));
    assert!(e
        .message
        .contains("param 'b' is registered but not in the source"));
    let opts = PlanOptions {
        skip_unknown: true,
        ..Default::default()
    };
    let e = plan(
        vec![meta("a", DType::Bf16, &[2, 3]), meta("zz", DType::U8, &[1])],
        opts,
    )
    .unwrap_err();
    assert!(
        !e.message.contains("zz") && e.message.contains("'b'"),
        "{e}"
    );
    let e = plan(
        vec![
            meta("a", DType::Bf16, &[2, 3]),
            meta("a", DType::Bf16, &[2, 3]),
        ],
        PlanOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.code, crate::result::wm_result::WM_ERR_FORMAT);
    assert!(plan(vec![], PlanOptions::default())
        .unwrap_err()
        .message
        .contains("empty"));
}

#[test]
fn callback_mode_needs_no_registration_and_verify_needs_checksums() {
    let opts = PlanOptions {
        callback: true,
        ..Default::default()
    };
    let p = plan(vec![meta("q", DType::F16, &[8])], opts).unwrap();
    assert_eq!(p.entries[0].target, Target::Callback);
    let opts = PlanOptions {
        callback: true,
        verify: true,
        ..Default::default()
    };
    let e = plan(vec![meta("q", DType::F16, &[8])], opts).unwrap_err();
    assert!(e.message.contains("'q' has no checksum"));
}

#[test]
fn every_moving_tensor_is_one_whole_run() {
    let opts = PlanOptions {
        skip_unknown: true,
        ..Default::default()
    };
    let p = plan(
        vec![
            meta("zz", DType::U8, &[3]),
            meta("b", DType::F32, &[4]),
            meta("a", DType::Bf16, &[2, 3]),
        ],
        opts,
    )
    .unwrap();
    assert!(p.runs_of(0).is_empty(), "a skipped tensor has no run");
    assert_eq!(
        p.runs_of(1),
        [Run {
            entry: 1,
            target: Target::Param(1),
            source: 0..16,
            param: 0..16,
            rows: 1,
            source_stride: 16,
            param_stride: 16,
        }]
    );
    assert!((0..p.entries.len()).all(|i| p.entries[i].target == Target::Skip || p.moves_whole(i)));
    assert_eq!(p.entries[2].target, Target::Param(0));
    assert_eq!(p.bytes, 28);
}

/// A param registered without pieces is all of its tensor: a source
/// tensor that is longer (the param would be its start) is a mismatch.
#[test]
fn a_whole_param_is_not_the_start_of_a_longer_tensor() {
    let e = plan(
        vec![meta("a", DType::Bf16, &[2, 3]), meta("b", DType::F32, &[8])],
        PlanOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("param 'b': shape mismatch: registered [4], source [8]"),
        "{e}"
    );
}

fn manifest(tensors: Vec<TensorMeta>) -> Manifest {
    Manifest {
        tensors: tensors.into(),
        version: None,
    }
}

#[test]
fn entries_share_the_manifest_and_take_the_next_versions() {
    let sums = |a, b| {
        let mut m = vec![meta("b", DType::F32, &[4]), meta("a", DType::Bf16, &[2, 3])];
        (m[0].checksum, m[1].checksum) = (Some(a), Some(b));
        manifest(m)
    };
    let (first, next) = (sums(1, 2), sums(3, 4));
    let logger = Logger::default();
    let mut p = make_plan(&first, &registry(), PlanOptions::default(), &logger).unwrap();
    assert!(p.has_sources(&[&first]) && !p.has_sources(&[&next]));
    assert!(p.entries.iter().all(|e| e.meta.is_in(&first.tensors)));
    // Same layout (the same fingerprint), new checksums: taken in place.
    assert_eq!(
        fingerprint(&[&first], &registry()),
        fingerprint(&[&next], &registry())
    );
    p.take_sources(&[&next]);
    assert!(p.has_sources(&[&next]));
    let got: Vec<_> = p.entries.iter().map(|e| e.meta.checksum).collect();
    assert_eq!(got, [Some(3), Some(4)]);
    assert_eq!((p.tensors, p.bytes), (2, 28));
}

#[test]
fn sources_listing_tensors_in_other_orders_plan_alike() {
    // The second source's shards are looked up by guessing the first
    // source's tensor at the same position; a wrong guess must not matter.
    let rows = |name: &str, row: u64| {
        let mut t = meta(name, DType::F32, &[2]);
        t.placement = Some(crate::manifest::Placement {
            global_shape: vec![4],
            offset: vec![row],
        });
        t
    };
    let mut r = Registry::default();
    for name in ["x", "y"] {
        r.allocate(&ParamSpec::host(name, DType::F32, &[4]))
            .unwrap();
    }
    let first = manifest(vec![rows("x", 0), rows("y", 0)]);
    let logger = Logger::default();
    let mut plans = Vec::new();
    for second in [
        vec![rows("x", 2), rows("y", 2)],
        vec![rows("y", 2), rows("x", 2)],
        vec![rows("y", 2), meta("z", DType::F32, &[1]), rows("x", 2)],
    ] {
        let second = manifest(second);
        let opts = PlanOptions {
            skip_unknown: true,
            ..Default::default()
        };
        let p = make_sharded_plan(&[&first, &second], &r, opts, &logger).unwrap();
        let mut moved: Vec<_> = p
            .entries
            .iter()
            .zip(0..)
            .filter(|(e, _)| e.target != Target::Skip)
            .map(|(e, i)| (e.meta.name.clone(), e.source, p.segments(i).to_vec()))
            .collect();
        moved.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        plans.push(moved);
    }
    assert_eq!(plans[0].len(), 4, "{:?}", plans[0]);
    assert!(plans.iter().all(|p| *p == plans[0]), "{plans:?}");
    // And a wrong guess that names a tensor of another shape is still
    // refused by name, not mixed up with the guess.
    let bad = manifest(vec![rows("y", 2), meta("x", DType::F32, &[3])]);
    let e = make_sharded_plan(&[&first, &bad], &r, PlanOptions::default(), &logger).unwrap_err();
    assert!(
        e.message
            .contains("tensor 'x': sources disagree on it: source 0 has f32 [")
            && e.message.contains("], source 1 f32 [3]"),
        "{e}"
    );
}

/// One-column shards of a [4096, n] f32 param cut it into 4096 * n rows
/// of 4 bytes: 4 shards are under the floor, 32 over it (73,728 blocks
/// for its 512 KiB); the error names the param and the shard bringing the
/// most. Segments are then worked out fallibly, a row each.
#[test]
fn blocks_are_bounded_by_the_params_bytes() {
    let columns = |n: u64| {
        let mut r = Registry::default();
        r.allocate(&ParamSpec::host("w", DType::F32, &[4096, n]))
            .unwrap();
        let shard = |j: u64| TensorMeta {
            placement: Some(crate::manifest::Placement {
                global_shape: vec![4096, n],
                offset: vec![0, j],
            }),
            ..meta("w", DType::F32, &[4096, 1])
        };
        let m = Manifest {
            tensors: (0..n).map(shard).collect::<Vec<_>>().into(),
            version: None,
        };
        make_plan(&m, &r, PlanOptions::default(), &Logger::default()).unwrap()
    };
    let few = columns(4);
    assert_eq!(few.check_blocks(|_| 4096 * 4 * 4), Ok(()));
    assert_eq!(few.try_segments(0).unwrap().len(), 4096);
    let many = columns(32);
    let e = many.check_blocks(|_| 4096 * 32 * 4).unwrap_err();
    assert_eq!(
        (e.param, e.blocks, e.param_blocks, e.limit, e.entry_blocks),
        (0, 131_072, 131_072, BLOCKS_FLOOR + 8192, 4096)
    );
    assert_eq!(max_blocks(64 << 20), BLOCKS_FLOOR + (1 << 20));
}

/// A moving entry's quantized blocks are worked out once per plan (a
/// reused plan asks every update); a failure is not kept, so it is found
/// again; a skipped entry has none.
#[test]
fn quantized_blocks_are_found_once_per_plan_and_failures_again() {
    let p = plan(
        vec![meta("b", DType::F32, &[4]), meta("a", DType::Bf16, &[2, 3])],
        PlanOptions::default(),
    )
    .unwrap();
    let calls = std::cell::Cell::new(0);
    let failing = || -> Result<BlockRuns> {
        calls.set(calls.get() + 1);
        Err(crate::result::Error::mismatch("cut"))
    };
    assert!(p.quant_blocks(1, failing).is_err());
    assert!(p.quant_blocks(1, failing).is_err());
    assert_eq!(calls.get(), 2, "a failure is looked for again");
    let found = || {
        calls.set(calls.get() + 1);
        Ok([0, 2].into_iter().collect())
    };
    let listed = |b: Arc<BlockRuns>| b.iter().collect::<Vec<_>>();
    assert_eq!(listed(p.quant_blocks(1, found).unwrap()), [0, 2]);
    assert_eq!(listed(p.quant_blocks(1, found).unwrap()), [0, 2]);
    assert_eq!(calls.get(), 3, "found once");
    assert!(p.quant_blocks(7, found).unwrap().is_empty());
}
