use super::*;
use crate::logging::Logger;
use crate::manifest::Manifest;
use crate::registry::{ParamSpec, Registry};
use crate::result::Result;
use crate::tensor::byte_size;
use crate::tensor::DType;

pub(super) fn meta(name: &str, dtype: DType, shape: &[u64]) -> TensorMeta {
    TensorMeta {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        nbytes: byte_size(name, dtype, shape).unwrap(),
        checksum: None,
        placement: None,
    }
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
    assert_eq!(e.code, crate::wm_result::WM_ERR_MISMATCH);
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
    assert_eq!(e.code, crate::wm_result::WM_ERR_FORMAT);
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
