//! Quantized params through the Rust API: bf16/f16/f32 global tensors from
//! real snapshot files and real publishers land in F8_E4M3 params with
//! their scales, byte for byte what `quant::quantize` (checked bit for bit
//! against PyTorch in the crate's own tests) makes of the global tensors.

mod common;

use common::quant::{f32s, publish_rows, reference, row_publishers, scale_bytes, write_snapshot};
use common::sharded::{piece, serial, serving};
use common::T;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use weight_manager_core::quant::Scheme;
use weight_manager_core::{
    wm_result, DType, DeltaFallback, DeltaMode, DeltaStats, Manager, ManagerConfig, Mode,
    ParamSpec, Placement, Publisher, PublisherConfig, SourceKind, State, TensorDesc, UpdateRequest,
};

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

/// Finite values of many magnitudes (a few tiny ones, some large), as
/// `dtype` bytes; `seed` makes versions differ.
fn values(dtype: DType, shape: &[u64], seed: u32) -> Vec<u8> {
    let n = shape.iter().product::<u64>() as u32;
    (0..n)
        .flat_map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9e37_79b9))
                .wrapping_mul(0x85eb_ca6b)
                .rotate_left(13);
            let unit = (h >> 8) as f32 / (1 << 24) as f32 - 0.5;
            let x = unit * [1e-6f32, 0.03, 1.0, 7.0, 300.0][(h % 5) as usize];
            match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::Bf16 => ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                _ => half_bits(x).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

/// f32 to IEEE half, truncating (any finite half will do as test data).
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    match exp {
        e if e <= 0 => sign,
        e if e >= 31 => sign | 0x7bff,
        e => sign | ((e as u16) << 10) | ((b >> 13) & 0x3ff) as u16,
    }
}

fn t(name: &str, dtype: DType, shape: &[u64], seed: u32) -> T {
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data: values(dtype, shape, seed),
    }
}

fn read(p: (*mut u8, usize)) -> Vec<u8> {
    // SAFETY: a registered param, not written while the test reads it.
    unsafe { std::slice::from_raw_parts(p.0, p.1) }.to_vec()
}

/// Register FP8 param `name` of `shape` and its scales `name.scale_inv`,
/// engine-owned when `engine`, and declare it quantized.
fn quantized(m: &Manager, spec: ParamSpec, scheme: Scheme, engine: bool) -> [(*mut u8, usize); 2] {
    let scales_shape = weight_manager_core::quant::params::scales_shape(scheme, &spec.shape);
    let s = ParamSpec::host(
        &format!("{}.scale_inv", spec.name),
        scheme.scale_dtype(),
        &scales_shape,
    );
    let out = [&spec, &s].map(|spec| match engine {
        true => {
            let n = spec.shape.iter().product::<u64>() as usize * spec.dtype.size();
            let buf = Box::leak(vec![0u8; n].into_boxed_slice());
            unsafe { m.register(spec, buf.as_mut_ptr(), n) }.unwrap();
            (buf.as_mut_ptr(), n)
        }
        false => m.allocate(spec).unwrap(),
    });
    m.quantize(&spec.name, &s.name, scheme).unwrap();
    out
}

/// The snapshot model: three tensors quantized three ways, one plain.
fn snapshot_model(seed: u32) -> Vec<T> {
    vec![
        t("w", DType::Bf16, &[300, 200], seed),
        t("experts", DType::F16, &[2, 200, 130], seed),
        t("head", DType::F32, &[130, 129], seed),
        t("norm", DType::F32, &[64], seed),
    ]
}

/// Every quantized param holds what quantizing its tensor gives, and the
/// plain one its bytes: in both modes, engine- and library-owned, over
/// two versions (the second from a kept plan).
#[test]
fn a_snapshot_lands_quantized_in_fp8_params_in_both_modes() {
    for (mode, engine) in [
        (Mode::Atomic, false),
        (Mode::Atomic, true),
        (Mode::InPlace, false),
        (Mode::InPlace, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let m = manager();
        let schemes = [Scheme::Fp8Block128, Scheme::Fp8Block128, Scheme::Fp8Tensor];
        let v1 = snapshot_model(1);
        let params: Vec<_> = v1[..3]
            .iter()
            .zip(schemes)
            .map(|(t, s)| {
                quantized(
                    &m,
                    ParamSpec::host(&t.name, DType::F8E4m3, &t.shape),
                    s,
                    engine,
                )
            })
            .collect();
        let norm = m
            .allocate(&ParamSpec::host("norm", DType::F32, &[64]))
            .unwrap();
        // Unverified in place, whole tensors are quantized from the file's
        // mapping (no copy); verified, from the bytes copied in.
        for (seed, step, verify) in [(1, "1", true), (2, "2", false), (3, "3", true)] {
            let ts = snapshot_model(seed);
            write_snapshot(dir.path(), &ts, step);
            let mut req = UpdateRequest::snapshot(dir.path());
            req.mode = mode;
            req.verify = verify;
            let stats = m.update(req).unwrap();
            assert_eq!(stats.version, step);
            // What the params took: FP8 bytes and scales, not the bf16
            // read (audit: it counted the source's bytes).
            let took: usize = params.iter().map(|[q, s]| q.1 + s.1).sum::<usize>() + norm.1;
            assert_eq!(stats.bytes, took as u64, "{mode:?}");
            for ((t, scheme), [q, s]) in ts.iter().zip(schemes).zip(&params) {
                let (want_q, want_s) = reference(t, scheme);
                assert!(
                    read(*q) == want_q,
                    "{mode:?} engine {engine}: '{}' fp8 bytes differ",
                    t.name
                );
                assert_eq!(
                    f32s(&read(*s)),
                    want_s,
                    "{mode:?}: '{}' scales differ",
                    t.name
                );
            }
            assert_eq!(read(norm), ts[3].data);
        }
    }
}

/// A source tensor named like a scales param (a checkpoint's own scales
/// beside its bf16 weights) is refused saying the engine makes those
/// scales; skipping unknown tensors takes the update, the scales made by
/// quantizing.
#[test]
fn a_source_tensor_named_like_a_scales_param_is_refused_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager();
    let w = t("w", DType::Bf16, &[300, 200], 1);
    let [q, s] = quantized(
        &m,
        ParamSpec::host("w", DType::F8E4m3, &w.shape),
        Scheme::Fp8Block128,
        false,
    );
    let theirs = t("w.scale_inv", DType::F32, &[3, 2], 2);
    write_snapshot(dir.path(), &[w.clone(), theirs], "1");
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_MISMATCH, "{e}");
    assert!(
        e.message.contains(
            "tensor 'w.scale_inv' is not a registered param: param 'w.scale_inv' of that name holds the scales of quantized param 'w'"
        ),
        "{e}"
    );
    let mut req = UpdateRequest::snapshot(dir.path());
    req.skip_unknown = true;
    m.update(req).unwrap();
    let (want_q, want_s) = reference(&w, Scheme::Fp8Block128);
    assert!(read(q) == want_q);
    assert_eq!(f32s(&read(s)), want_s);
}

/// A NaN or an infinity fails the update naming the tensor and the
/// element; atomic, every param keeps the old version's bytes, and a
/// staged update fails at staging.
#[test]
fn a_nan_or_infinity_fails_the_update_and_the_old_weights_stay() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(manager());
    let model = |seed| {
        let mut ts = snapshot_model(seed);
        ts.remove(1);
        ts
    };
    let v1 = model(1);
    let [q, s] = quantized(
        &m,
        ParamSpec::host("w", DType::F8E4m3, &[300, 200]),
        Scheme::Fp8Block128,
        false,
    );
    let [hq, hs] = quantized(
        &m,
        ParamSpec::host("head", DType::F8E4m3, &[130, 129]),
        Scheme::Fp8Tensor,
        true,
    );
    let norm = m
        .allocate(&ParamSpec::host("norm", DType::F32, &[64]))
        .unwrap();
    write_snapshot(dir.path(), &v1, "1");
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    let before = [q, s, hq, hs, norm].map(read);
    for (tensor, at, value) in [
        ("w", [7u64, 150u64], f32::NAN),
        ("head", [129, 0], f32::NEG_INFINITY),
    ] {
        let mut v2 = model(2);
        let bad = v2.iter_mut().find(|t| t.name == tensor).unwrap();
        let i = (at[0] * bad.shape[1] + at[1]) as usize;
        match bad.dtype {
            DType::Bf16 => bad.data[2 * i..2 * i + 2]
                .copy_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes()),
            _ => bad.data[4 * i..4 * i + 4].copy_from_slice(&value.to_le_bytes()),
        }
        write_snapshot(dir.path(), &v2, "2");
        let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
        let named = format!("element {at:?} of tensor '{tensor}' is {value}");
        assert!(e.message.contains(&named), "{e}");
        assert_eq!(m.status().state, State::Normal);
        assert_eq!(m.status().version.as_deref(), Some("1"));
        assert!(
            [q, s, hq, hs, norm].map(read) == before,
            "{tensor}: old weights changed"
        );
        let e = m
            .stage(UpdateRequest::snapshot(dir.path()))
            .map(|_| ())
            .unwrap_err();
        assert!(e.message.contains(&named), "staged: {e}");
        assert!(
            [q, s, hq, hs, norm].map(read) == before,
            "{tensor}: staging changed the weights"
        );
    }
}

/// Declarations of `wrong_declarations_are_refused_naming_the_param`:
/// weight, scales, scheme, the error and what it says.
const WRONG: [(&str, &str, Scheme, wm_result, &str); 8] = [
    (
        "bf",
        "s",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 'bf': fp8_block128 quantization writes f8e4m3 params, not bf16",
    ),
    (
        "w",
        "s_wrong",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 's_wrong': the scales of 'w' (fp8_block128 [256, 300]) must be f32 [2, 3]",
    ),
    (
        "w",
        "s_f16",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "must be f32 [2, 3], not f16 [2, 3]",
    ),
    (
        "v",
        "one",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 'v': fp8_block128 quantization needs at least 2 dimensions",
    ),
    (
        "cut",
        "s",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 'cut': piece 0 ('g'",
    ),
    (
        "tp",
        "one",
        Scheme::Fp8Tensor,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 'tp': one scale per tensor needs the whole global tensor",
    ),
    (
        "nope",
        "s",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_NOT_FOUND,
        "param 'nope' is not registered",
    ),
    (
        "w",
        "w",
        Scheme::Fp8Block128,
        wm_result::WM_ERR_INVALID_ARGUMENT,
        "param 'w': cannot hold its own scales",
    ),
];

/// Declarations the engine gets wrong are refused naming the param and
/// what is wrong, and change nothing.
#[test]
fn wrong_declarations_are_refused_naming_the_param() {
    let m = manager();
    let alloc = |name: &str, dtype, shape: &[u64]| {
        m.allocate(&ParamSpec::host(name, dtype, shape)).unwrap()
    };
    alloc("bf", DType::Bf16, &[256, 256]);
    alloc("w", DType::F8E4m3, &[256, 300]);
    alloc("s", DType::F32, &[2, 3]);
    alloc("s_wrong", DType::F32, &[2, 2]);
    alloc("s_f16", DType::F16, &[2, 3]);
    alloc("one", DType::F32, &[1]);
    alloc("v", DType::F8E4m3, &[300]);
    let mut cut = ParamSpec::host("cut", DType::F8E4m3, &[256, 128]);
    cut.pieces = vec![piece("g", &[64, 0], &[256, 128], &[0, 0])];
    m.allocate(&cut).unwrap();
    let mut tp = ParamSpec::host("tp", DType::F8E4m3, &[256, 128]);
    tp.pieces = vec![piece("g", &[0, 128], &[256, 128], &[0, 0])];
    m.allocate(&tp).unwrap();
    // Two experts stacked: the second's piece starts at column 64 of its
    // 2-D tensor (its dimension 1; the param's dimension 2).
    let mut stacked = ParamSpec::host("stacked", DType::F8E4m3, &[2, 128, 128]);
    stacked.pieces = vec![
        piece("e0", &[0, 0], &[128, 128], &[0, 0, 0]),
        piece("e1", &[0, 64], &[128, 128], &[1, 0, 0]),
    ];
    m.allocate(&stacked).unwrap();
    alloc("s_stacked", DType::F32, &[2, 1, 1]);
    for (w, s, scheme, code, says) in WRONG {
        let e = m.quantize(w, s, scheme).unwrap_err();
        assert_eq!(e.code, code, "{w}/{s}: {e}");
        assert!(e.message.contains(says), "{w}/{s}: {e}");
    }
    let e = m.quantize("cut", "s", Scheme::Fp8Block128).unwrap_err();
    assert!(
        e.message
            .contains("dimension 0 starts at offset 64 of the tensor, not a multiple of 128"),
        "{e}"
    );
    let e = m
        .quantize("stacked", "s_stacked", Scheme::Fp8Block128)
        .unwrap_err();
    assert!(
        e.message.contains(
            "piece 1 ('e1' [0:128, 64:192]) cuts a 128x128 block: dimension 1 starts at offset 64 of the tensor"
        ),
        "{e}"
    );
    m.quantize("w", "s", Scheme::Fp8Block128).unwrap();
    let e = m.quantize("w", "s", Scheme::Fp8Block128).unwrap_err();
    assert!(e.message.contains("already quantized"), "{e}");
}

/// What only the sources say is checked when planning, before any byte
/// moves: an integer global tensor, and a partial block inside the tensor.
#[test]
fn planning_refuses_integer_tensors_and_blocks_cut_inside_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let ints = T {
        name: "ints".into(),
        dtype: DType::I32,
        shape: vec![128, 128],
        data: vec![0; 128 * 128 * 4],
    };
    write_snapshot(
        dir.path(),
        &[ints, t("g", DType::Bf16, &[300, 128], 1)],
        "1",
    );
    let m = manager();
    quantized(
        &m,
        ParamSpec::host("ints", DType::F8E4m3, &[128, 128]),
        Scheme::Fp8Block128,
        false,
    );
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert!(
        e.message.contains("param 'ints'")
            && e.message
                .contains("takes bf16, f16 or f32 tensors, not i32"),
        "{e}"
    );
    let m = manager();
    let mut top = ParamSpec::host("top", DType::F8E4m3, &[100, 128]);
    top.pieces = vec![piece("g", &[0, 0], &[100, 128], &[0, 0])];
    quantized(&m, top, Scheme::Fp8Block128, false);
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert!(e.message.contains("param 'top'") && e.message.contains("dimension 0 ends at offset 100 of the global tensor [300, 128], inside a 128x128 block"), "{e}");
    assert_eq!(m.status().state, State::Normal);
}

/// A [300, 256] bf16 tensor in row shards of 75 (every 128-row block split
/// over two or three publishers), from four publishers at once over IPC
/// and over the network: the publishers agree each block's amax through
/// the engine and send FP8, and an engine holding column half 1 (a TP
/// split at a multiple of 128) gets that half of the global tensor's
/// quantization.
#[test]
fn blocks_split_over_four_publishers_are_quantized_as_the_global_tensor() {
    let _serial = serial();
    let g = t("g", DType::Bf16, &[300, 256], 3);
    let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
    let half_q: Vec<u8> = want_q
        .chunks(256)
        .flat_map(|row| row[128..].to_vec())
        .collect();
    let half_s: Vec<f32> = want_s.chunks(2).map(|r| r[1]).collect();
    for via in [SourceKind::Ipc, SourceKind::Rdma] {
        let (q, s, (read_bytes, sent)) = column_half_from_four(via, &g, Scheme::Fp8Block128);
        // The publishers quantized: FP8 on the wire, one byte an element.
        assert_eq!((read_bytes, sent), (300 * 128 * 2, 300 * 128), "{via:?}");
        assert!(q == half_q, "{via:?}: fp8 bytes differ");
        assert_eq!(f32s(&s), half_s, "{via:?}: scales differ");
    }
}

/// An engine holding column half 1 of `g` quantized with `scheme`, updated
/// from four publishers of its row shards over `via` (FP8 on the wire, one
/// byte an element): its FP8 bytes and scales bytes, and the bytes the
/// publishers read for quantizing and sent.
fn column_half_from_four(via: SourceKind, g: &T, scheme: Scheme) -> (Vec<u8>, Vec<u8>, (u64, u64)) {
    let dir = tempfile::tempdir().unwrap();
    let ps = publishers(dir.path(), via, g);
    let m = common::sharded::net_engine("quantized-test-secret");
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
    spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
    let [q, s] = quantized(&m, spec, scheme, false);
    let mut req = UpdateRequest::snapshot(PathBuf::new());
    req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
    req.source = via;
    req.timeout = Duration::from_secs(60);
    let (r, served) = serving(&ps, || m.update(req));
    // What the params took: the FP8 bytes (the wire's) and the scales.
    assert_eq!(r.unwrap().bytes, (q.1 + s.1) as u64, "{via:?}: FP8 params");
    let sessions = served.into_iter().map(|s| s.unwrap().sessions[0].clone());
    let moved = sessions.fold((0, 0), |(a, b), s| (a + s.quantized, b + s.bytes));
    (read(q), read(s), moved)
}

/// Two quantized params of one engine holding the same elements (all of
/// `g`, and its column half as a TP piece): each its own request to every
/// publisher, both the global tensor's quantization, over IPC and UCX.
#[test]
fn two_quantized_params_may_hold_the_same_elements() {
    let _serial = serial();
    std::env::set_var("UCX_TLS", "tcp");
    let g = t("g", DType::Bf16, &[300, 256], 6);
    let (want_q, want_s) = reference(&g, Scheme::Mxfp8);
    for via in [SourceKind::Ipc, SourceKind::Rdma] {
        let dir = tempfile::tempdir().unwrap();
        let ps = publishers(dir.path(), via, &g);
        let m = common::sharded::net_engine("quantized-test-secret");
        let whole = quantized(
            &m,
            ParamSpec::host("g", DType::F8E4m3, &[300, 256]),
            Scheme::Mxfp8,
            false,
        );
        let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
        spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
        let half = quantized(&m, spec, Scheme::Mxfp8, false);
        let mut req = UpdateRequest::snapshot(PathBuf::new());
        req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
        req.source = via;
        req.timeout = Duration::from_secs(60);
        let (r, served) = serving(&ps, || m.update(req));
        r.unwrap();
        served.into_iter().for_each(|s| drop(s.unwrap()));
        assert!(read(whole[0]) == want_q, "{via:?}: whole");
        assert_eq!(
            read(whole[1]),
            scale_bytes(Scheme::Mxfp8, &want_s),
            "{via:?}"
        );
        let half_q: Vec<u8> = want_q.chunks(256).flat_map(|r| r[128..].to_vec()).collect();
        let half_s: Vec<f32> = want_s.chunks(8).flat_map(|r| r[4..].to_vec()).collect();
        assert!(read(half[0]) == half_q, "{via:?}: half");
        assert_eq!(
            read(half[1]),
            scale_bytes(Scheme::Mxfp8, &half_s),
            "{via:?}"
        );
    }
}

/// MXFP8 from the same four publishers into column half 1, with AMAX and
/// SCALES cut into frames of 100 values (`WM_TEST_BLOCK_VALUES_PER_FRAME`;
/// the real bound is 2^23, which a large MXFP8 session outgrows): each
/// publisher's 75 rows x 4 blocks take three frames each way, and the FP8
/// bytes and E8M0 scales are the global tensor's.
#[test]
fn mxfp8_amax_and_scales_cross_several_frames() {
    let _serial = serial();
    std::env::set_var("WM_TEST_BLOCK_VALUES_PER_FRAME", "100");
    let g = t("g", DType::Bf16, &[300, 256], 4);
    let (want_q, want_s) = reference(&g, Scheme::Mxfp8);
    let half_q: Vec<u8> = want_q
        .chunks(256)
        .flat_map(|row| row[128..].to_vec())
        .collect();
    let half_s: Vec<f32> = want_s.chunks(8).flat_map(|r| r[4..].to_vec()).collect();
    for via in [SourceKind::Ipc, SourceKind::Rdma] {
        let (q, s, (_, sent)) = column_half_from_four(via, &g, Scheme::Mxfp8);
        assert_eq!(sent, 300 * 128, "{via:?}");
        assert!(q == half_q, "{via:?}: fp8 bytes differ");
        assert_eq!(
            s,
            scale_bytes(Scheme::Mxfp8, &half_s),
            "{via:?}: scales differ"
        );
    }
    std::env::remove_var("WM_TEST_BLOCK_VALUES_PER_FRAME");
}

fn publishers(dir: &Path, via: SourceKind, g: &T) -> Vec<Publisher> {
    row_publishers(dir, via, g, b"quantized-test-secret")
}

/// Over the network with deltas (the default there): from the second
/// version on, the FP8 param comes as a delta of its FP8 bytes (the
/// publisher keeps the image it made of the base) beside a plain param's
/// delta; then a two-phase update commits them. 128x128 blocks and MXFP8.
#[test]
fn deltas_of_quantized_params_over_the_network_and_a_two_phase_commit() {
    let _serial = serial();
    std::env::set_var("UCX_TLS", "tcp");
    for scheme in [Scheme::Fp8Block128, Scheme::Mxfp8] {
        deltas_over_the_network(scheme);
    }
}

fn deltas_over_the_network(scheme: Scheme) {
    let p = Publisher::bind_net(
        "127.0.0.1:0",
        PublisherConfig {
            secret: Some(b"quantized-test-secret".to_vec()),
            ..Default::default()
        },
    )
    .unwrap();
    let mut w = t("w", DType::Bf16, &[256, 256], 1);
    let versions: Vec<Vec<T>> = (1..=3u32)
        .map(|v| {
            w = nudged(&w, v, 200);
            vec![w.clone(), t("norm", DType::F32, &[4096], 1)]
        })
        .collect();
    let m = Arc::new(common::sharded::net_engine("quantized-test-secret"));
    let [q, s] = quantized(
        &m,
        ParamSpec::host("w", DType::F8E4m3, &[256, 256]),
        scheme,
        false,
    );
    let norm = m
        .allocate(&ParamSpec::host("norm", DType::F32, &[4096]))
        .unwrap();
    let request = || {
        let mut r = UpdateRequest::snapshot(PathBuf::from(p.address()));
        r.source = SourceKind::Rdma;
        r.timeout = Duration::from_secs(60);
        r
    };
    for (k, ts) in versions.iter().enumerate() {
        p.clear_tensors();
        common::add_all(&p, ts);
        p.set_version(Some(format!("v{k}")));
        p.publish().unwrap();
        let (r, served) = serving(std::slice::from_ref(&p), || match k {
            2 => m.stage(request()).and_then(|staged| staged.commit()),
            _ => m.update(request()),
        });
        let stats = r.unwrap();
        served.into_iter().for_each(|s| drop(s.unwrap()));
        let (want_q, want_s) = reference(&ts[0], scheme);
        assert!(read(q) == want_q, "{scheme:?} v{k}: fp8 bytes differ");
        assert_eq!(
            read(s),
            scale_bytes(scheme, &want_s),
            "{scheme:?} v{k}: scales differ"
        );
        assert_eq!(read(norm), ts[1].data, "v{k}");
        if k > 0 {
            let d = &stats.deltas;
            assert_eq!((d.runs_delta, d.runs_whole), (2, 0), "v{k}: {d:?}");
            assert_eq!(d.fallback, DeltaFallback::None, "v{k}: {d:?}");
            assert!(d.wire_bytes < 256 * 256 / 4, "v{k}: {d:?}");
        }
    }
}

/// `t` with `n` of its bf16 elements moved by one unit in the last place
/// (elements picked by `seed`), as a training step moves a few weights.
fn nudged(t: &T, seed: u32, n: usize) -> T {
    let mut out = t.clone();
    let elements = out.data.len() / 2;
    for i in 0..n {
        let h = (i as u32 ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
        let at = 2 * ((h as usize >> 3) % elements);
        let x = u16::from_le_bytes([out.data[at], out.data[at + 1]]);
        out.data[at..at + 2].copy_from_slice(&(x ^ 1).to_le_bytes());
    }
    out
}

/// Four bf16 versions of a [300, 256] tensor, each a few ulps from the
/// one before; at v2 a new largest element changes block (1, 1)'s scale.
fn stepped_versions() -> Vec<T> {
    let mut versions = vec![t("g", DType::Bf16, &[300, 256], 3)];
    for v in 1..4u32 {
        let mut next = nudged(&versions[versions.len() - 1], v, 300);
        if v == 2 {
            let at = 2 * (200 * 256 + 200);
            next.data[at..at + 2].copy_from_slice(&0x4480u16.to_le_bytes());
        }
        versions.push(next);
    }
    versions
}

/// The reference FP8 bytes and scales of `g`'s column half [.., 128..].
fn column_half(g: &T) -> (Vec<u8>, Vec<f32>) {
    let (q, s) = reference(g, Scheme::Fp8Block128);
    let q = q.chunks(256).flat_map(|r| r[128..].to_vec()).collect();
    (q, s.chunks(2).map(|r| r[1]).collect())
}

/// A network engine holding `g`'s column half quantized: (manager, FP8
/// param, scales param).
fn half_engine() -> (Manager, [(*mut u8, usize); 2]) {
    let m = common::sharded::net_engine("quantized-test-secret");
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
    spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
    let params = quantized(&m, spec, Scheme::Fp8Block128, false);
    (m, params)
}

/// Update `m` from publishers `ps` with deltas asked: its delta stats.
fn delta_update(m: &Manager, ps: &[Publisher], via: SourceKind, mode: Mode) -> DeltaStats {
    let mut req = UpdateRequest::snapshot(PathBuf::new());
    req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
    (req.source, req.mode, req.deltas) = (via, mode, DeltaMode::On);
    req.timeout = Duration::from_secs(60);
    let (r, served) = serving(ps, || m.update(req));
    served.into_iter().for_each(|s| drop(s.unwrap()));
    r.unwrap().deltas
}

/// FP8 deltas from four trainer ranks whose shards split every block, into
/// a TP column half, over IPC and UCX, atomic and in place: every
/// version's FP8 bytes and scales are the reference's, every run from the
/// second version on is a delta (but the part of a block whose amax
/// changed, which comes whole: every byte changed), the wire carries a
/// fraction of the FP8 bytes. Then FP8 bytes written since: that run
/// comes whole ("differs").
#[test]
fn fp8_params_take_deltas_of_their_fp8_bytes_from_sharded_publishers() {
    let _serial = serial();
    std::env::set_var("UCX_TLS", "tcp");
    let versions = stepped_versions();
    for (via, mode) in [
        (SourceKind::Ipc, Mode::Atomic),
        (SourceKind::Rdma, Mode::InPlace),
        (SourceKind::Rdma, Mode::Atomic),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let ps = publishers(dir.path(), via, &versions[0]);
        let (m, [q, s]) = half_engine();
        for (k, g) in versions.iter().enumerate() {
            publish_rows(&ps, g, &format!("v{k}"));
            let d = delta_update(&m, &ps, via, mode);
            let (want_q, want_s) = column_half(g);
            let at = format!("{via:?} {mode:?} v{k}");
            assert!(read(q) == want_q, "{at}: fp8 bytes differ");
            assert_eq!(f32s(&read(s)), want_s, "{at}: scales differ");
            if k == 0 {
                assert_eq!(d.fallback, DeltaFallback::NoBase, "{at}: {d:?}");
                continue;
            }
            // At v2 the rank holding most of block (1, 1) sends its part
            // whole: with the block's new scale every byte changed.
            let whole = if k == 2 { 1 } else { 0 };
            assert_eq!(
                (d.runs_delta, d.runs_whole),
                (4 - whole, whole),
                "{at}: {d:?}"
            );
            assert_eq!(d.fallback, DeltaFallback::None, "{at}: {d:?}");
            let most = if k == 2 { 300 * 128 / 2 } else { 300 * 128 / 8 };
            assert!(d.wire_bytes < most, "{at}: {d:?}");
        }
        // SAFETY: no update is running; the param is the engine's.
        unsafe { *q.0.add(5) ^= 1 };
        let g = nudged(&versions[3], 9, 300);
        publish_rows(&ps, &g, "v4");
        let d = delta_update(&m, &ps, via, mode);
        assert!(
            read(q) == column_half(&g).0,
            "{via:?} {mode:?}: after a write"
        );
        assert_eq!(d.fallback, DeltaFallback::Differs, "{d:?}");
        assert_eq!((d.runs_delta, d.runs_whole), (3, 1), "{d:?}");
    }
}

/// A base the engine took from a snapshot: the publishers keep the
/// version but made no FP8 image of it, so the runs come whole ("not
/// kept"), and the next version comes as deltas again.
#[test]
fn fp8_params_whose_base_came_from_a_snapshot_take_it_whole_first() {
    let _serial = serial();
    let versions = stepped_versions();
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    std::fs::create_dir(&snap).unwrap();
    write_snapshot(&snap, &versions[0..1], "v0");
    let ps = publishers(dir.path(), SourceKind::Ipc, &versions[0]);
    let (m, [q, s]) = half_engine();
    m.update(UpdateRequest::snapshot(&snap)).unwrap();
    publish_rows(&ps, &versions[0], "v0");
    for (k, want) in [(1, DeltaFallback::NotKept), (2, DeltaFallback::None)] {
        publish_rows(&ps, &versions[k], &format!("v{k}"));
        let d = delta_update(&m, &ps, SourceKind::Ipc, Mode::Atomic);
        assert_eq!(d.fallback, want, "v{k}: {d:?}");
        assert!(read(q) == column_half(&versions[k]).0, "v{k}");
        assert_eq!(f32s(&read(s)), column_half(&versions[k]).1, "v{k}");
    }
}

/// A NaN in a trainer rank's shard stops the update at that publisher,
/// before any byte moves, naming the tensor and the element of the global
/// tensor; the engine keeps its old weights.
#[test]
fn a_nan_at_a_publisher_is_named_and_the_old_weights_stay() {
    let _serial = serial();
    let good = t("g", DType::Bf16, &[300, 256], 3);
    let mut bad = t("g", DType::Bf16, &[300, 256], 4);
    let i = 100 * 256 + 200;
    bad.data[2 * i..2 * i + 2].copy_from_slice(&((f32::NAN.to_bits() >> 16) as u16).to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let m = common::sharded::net_engine("quantized-test-secret");
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
    spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
    let [q, s] = quantized(&m, spec, Scheme::Fp8Block128, false);
    for (k, g) in [&good, &bad].into_iter().enumerate() {
        let sub = dir.path().join(format!("v{k}"));
        std::fs::create_dir(&sub).unwrap();
        let ps = publishers(&sub, SourceKind::Ipc, g);
        let mut req = UpdateRequest::snapshot(PathBuf::new());
        req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
        req.source = SourceKind::Ipc;
        req.timeout = Duration::from_secs(60);
        let before = (read(q), read(s));
        let (r, _) = serving(&ps, || m.update(req));
        if k == 0 {
            r.unwrap();
            continue;
        }
        let e = r.unwrap_err();
        assert!(
            e.message
                .contains("tensor 'g': element [100, 200] (of the global tensor) is not finite"),
            "{e}"
        );
        assert_eq!((read(q), read(s)), before);
        assert_eq!(m.status().state, State::Normal);
    }
}

/// A publisher answering AMAX with a value too many, and one whose AMAX
/// is fine: the first update fails naming the problem, nothing written;
/// the second's SCALES carries the largest amax of the two publishers.
#[test]
fn a_publisher_with_a_wrong_amax_is_refused_and_scales_are_the_largest() {
    use weight_manager_core::internals::transport::conn::Conn;
    use weight_manager_core::internals::wire::Frame;
    let dir = tempfile::tempdir().unwrap();
    let m = manager();
    let [q, _] = quantized(
        &m,
        ParamSpec::host("w", DType::F8E4m3, &[128, 128]),
        Scheme::Fp8Block128,
        false,
    );
    // Publisher `k` holds rows 64k..64k+64 of "w" [128, 128] bf16 and
    // answers AMAX with `amax`.
    let script = |k: u64, amax: Vec<f32>| {
        let sock = dir.path().join(format!("p{k}.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let thread = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let (stream, _) = listener.accept().unwrap();
            let mut conn = Conn::new(stream, "the engine");
            conn.recv(deadline).unwrap();
            let shard = weight_manager_core::TensorMeta {
                name: "w".into(),
                dtype: DType::Bf16,
                shape: vec![64, 128],
                nbytes: 64 * 128 * 2,
                checksum: None,
                placement: Some(Placement {
                    global_shape: vec![128, 128],
                    offset: vec![64 * k, 0],
                }),
            };
            let manifest = Frame::Manifest {
                version: "1".into(),
                tensors: vec![shard],
                base_kept: false,
            };
            conn.send(&manifest).unwrap();
            let Frame::Want { quant, .. } = conn.recv(deadline).unwrap() else {
                panic!("no WANT")
            };
            assert_eq!(quant, vec![(0, Scheme::Fp8Block128)]);
            conn.send(&Frame::Amax {
                values: vec![(0, amax)],
            })
            .unwrap();
            conn.recv(deadline)
        });
        (sock, thread)
    };
    let update = |socks: Vec<PathBuf>| {
        let mut req = UpdateRequest::snapshot(PathBuf::new());
        req.locations = socks;
        req.source = SourceKind::Ipc;
        req.timeout = Duration::from_secs(10);
        m.update(req)
    };
    let (a, ta) = script(0, vec![1.0, 2.0]);
    let (b, tb) = script(1, vec![3.0]);
    let e = update(vec![a, b]).unwrap_err();
    assert!(
        e.message
            .contains("wire: AMAX: request #0 with values 0..2 where request #0 has 1"),
        "{e}"
    );
    assert!(matches!(
        ta.join().unwrap(),
        Ok(Frame::Error { .. }) | Err(_)
    ));
    drop(tb.join());
    assert!(read(q).iter().all(|&x| x == 0));
    for f in ["p0.sock", "p1.sock"] {
        std::fs::remove_file(dir.path().join(f)).unwrap();
    }
    let (a, ta) = script(0, vec![1.5]);
    let (b, tb) = script(1, vec![3.0]);
    let _ = update(vec![a, b]);
    for t in [ta, tb] {
        let Ok(Frame::Scales { values }) = t.join().unwrap() else {
            panic!("no SCALES")
        };
        assert_eq!(values, vec![(0, vec![3.0])]);
    }
}

/// In place, a NaN found once the bytes are in fails the update after
/// other params were written: FAILED, as any in-place failure after bytes
/// moved; the next good update brings NORMAL back.
#[test]
fn in_place_a_nan_leaves_failed_until_a_good_update() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager();
    let [q, s] = quantized(
        &m,
        ParamSpec::host("w", DType::F8E4m3, &[300, 200]),
        Scheme::Fp8Block128,
        false,
    );
    m.allocate(&ParamSpec::host("norm", DType::F32, &[64]))
        .unwrap();
    let model = |seed| {
        let mut ts = snapshot_model(seed);
        ts.retain(|t| t.name == "w" || t.name == "norm");
        ts
    };
    let mut bad = model(2);
    bad[0].data[0..2].copy_from_slice(&((f32::INFINITY.to_bits() >> 16) as u16).to_le_bytes());
    write_snapshot(dir.path(), &bad, "2");
    let mut req = UpdateRequest::snapshot(dir.path());
    req.mode = Mode::InPlace;
    let e = m.update(req).unwrap_err();
    assert!(
        e.message.contains("element [0, 0] of tensor 'w' is inf"),
        "{e}"
    );
    assert_eq!(m.status().state, State::Failed);
    // Every amax is found before any FP8 byte is written (here, from the
    // file's mapping): the FP8 param still holds its old (zero) bytes.
    assert!(read(q).iter().all(|&b| b == 0), "FP8 bytes written");
    let good = model(3);
    write_snapshot(dir.path(), &good, "3");
    let mut req = UpdateRequest::snapshot(dir.path());
    req.mode = Mode::InPlace;
    m.update(req).unwrap();
    assert_eq!(m.status().state, State::Normal);
    let (want_q, want_s) = reference(&good[0], Scheme::Fp8Block128);
    assert!(read(q) == want_q);
    assert_eq!(f32s(&read(s)), want_s);
}

/// A hand-written engine asking a real publisher for what no engine of
/// ours asks: quantized requests overlapping (more than 4 times the
/// elements the rank holds) and SCALES below the publisher's own amax. Each is refused with an ERROR
/// naming it, before anything is read or sent.
#[test]
fn hostile_quantized_wants_are_refused_by_the_publisher() {
    use weight_manager_core::internals::wire::{Frame, Request};
    let dir = tempfile::tempdir().unwrap();
    let g = t("g", DType::Bf16, &[256, 256], 5);
    let whole = || Request::whole(0, 256 * 256, false);
    let cases: Vec<(Frame, Option<Frame>, &str)> = vec![
        (
            Frame::Want {
                requests: vec![whole(); 5],
                base: None,
                quant: (0..5).map(|k| (k, Scheme::Fp8Block128)).collect(),
            },
            None,
            "asks for 327680 quantized elements, more than 4 times the 65536",
        ),
        (
            Frame::Want {
                requests: vec![whole()],
                base: None,
                quant: vec![(0, Scheme::Fp8Block128)],
            },
            Some(Frame::Scales {
                values: vec![(0, vec![0.0; 4])],
            }),
            "an agreed amax below this publisher's own",
        ),
    ];
    for (k, (want, scales, says)) in cases.into_iter().enumerate() {
        let sock = dir.path().join(format!("p{k}.sock"));
        let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
        let desc = TensorDesc::host("g", DType::Bf16, &[256, 256], g.data.as_ptr(), g.data.len());
        // SAFETY: `g` outlives the serving.
        unsafe { p.add(desc) }.unwrap();
        p.set_version(Some("1".into()));
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(1, Duration::from_secs(10)));
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let mut conn = common::engine_hello(&sock, deadline);
            conn.send(&want).unwrap();
            if let Some(scales) = scales {
                assert!(matches!(conn.recv(deadline), Ok(Frame::Amax { .. })));
                conn.send(&scales).unwrap();
            }
            let e = conn.recv(deadline).unwrap_err();
            assert!(e.message.contains(says), "case {k}: {e}");
            let served = serving.join().unwrap();
            assert!(served.map_or(true, |s| s.sessions.is_empty()), "case {k}");
        });
    }
}

/// Hostile timing and shapes at the publisher: SCALES sent one value a
/// frame, each within the bucket timeout of the last, still ends the
/// session at one bucket timeout from AMAX (it did one per frame: a
/// session of MXFP8 blocks could last hours); and MXFP8 asked of a scalar
/// is one block, answered, not a panic.
#[test]
fn scales_have_one_deadline_and_a_quantized_scalar_is_one_block() {
    use weight_manager_core::internals::wire::{Frame, Request};
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let g = t("g", DType::Bf16, &[256, 256], 5);
    let x = t("x", DType::Bf16, &[], 5);
    let cfg = PublisherConfig {
        bucket_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, cfg).unwrap();
    for t in [&g, &x] {
        let desc = TensorDesc::host(
            &t.name,
            DType::Bf16,
            &t.shape,
            t.data.as_ptr(),
            t.data.len(),
        );
        // SAFETY: the tensors outlive the serving.
        unsafe { p.add(desc) }.unwrap();
    }
    p.set_version(Some("1".into()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(10)));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut conn = common::engine_hello(&sock, deadline);
        let want = Frame::Want {
            requests: vec![
                Request::whole(0, 256 * 256, false),
                Request::whole(1, 1, false),
            ],
            base: None,
            quant: vec![(0, Scheme::Mxfp8), (1, Scheme::Mxfp8)],
        };
        conn.send(&want).unwrap();
        let Ok(Frame::Amax { values }) = conn.recv(deadline) else {
            panic!("no AMAX")
        };
        let counts: Vec<usize> = values.iter().map(|(_, v)| v.len()).collect();
        assert_eq!(counts, [256 * 8, 1], "a scalar is one block");
        let sent = std::time::Instant::now();
        let mut ended = None;
        for k in 0..256 * 8 {
            std::thread::sleep(Duration::from_millis(400));
            let frame = Frame::Scales {
                values: vec![(0, vec![values[0].1[k]])],
            };
            if conn.send(&frame).is_err() {
                ended = Some(sent.elapsed());
                break;
            }
            if sent.elapsed() > Duration::from_secs(8) {
                break;
            }
        }
        let took = ended.unwrap_or_else(|| sent.elapsed());
        assert!(
            took < Duration::from_secs(4),
            "the publisher waited {took:?}"
        );
        assert!(serving.join().unwrap().is_err());
    });
}

/// A weight with no elements is refused when declared.
#[test]
fn a_weight_with_no_elements_is_refused() {
    let m = manager();
    m.allocate(&ParamSpec::host("z", DType::F8E4m3, &[0, 128]))
        .unwrap();
    m.allocate(&ParamSpec::host("s", DType::F32, &[0, 1]))
        .unwrap();
    let e = m.quantize("z", "s", Scheme::Fp8Block128).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT);
    assert!(
        e.message.contains("param 'z': has no elements ([0, 128])"),
        "{e}"
    );
}

/// A publisher holding a whole tensor finds its amax and quantizes it band
/// by band (the images made behind the stream): the same bytes as the
/// reference, and a NaN named by its element as on the walking path.
#[test]
fn a_publisher_holding_whole_blocks_quantizes_them_band_by_band() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for (k, nan) in [(0, false), (1, true)] {
        let mut g = t("g", DType::Bf16, &[300, 256], 8 + k);
        if nan {
            let i = 299 * 256 + 255;
            g.data[2 * i..2 * i + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
        }
        let sock = dir.path().join(format!("p{k}.sock"));
        let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
        let desc = TensorDesc::host("g", DType::Bf16, &[300, 256], g.data.as_ptr(), g.data.len());
        // SAFETY: `g` outlives the serving.
        unsafe { p.add(desc) }.unwrap();
        p.set_version(Some("1".into()));
        let m = manager();
        let [q, s] = quantized(
            &m,
            ParamSpec::host("g", DType::F8E4m3, &[300, 256]),
            Scheme::Fp8Block128,
            false,
        );
        let (r, _) = serving(std::slice::from_ref(&p), || m.update(ipc_pull(&sock)));
        match nan {
            false => {
                let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
                assert_eq!(r.unwrap().bytes, (q.1 + s.1) as u64);
                assert!(read(q) == want_q);
                assert_eq!(f32s(&read(s)), want_s);
            }
            true => {
                let e = r.unwrap_err();
                assert!(
                    e.message.contains(
                        "tensor 'g': element [299, 255] (of the global tensor) is not finite"
                    ),
                    "{e}"
                );
            }
        }
    }
}

/// A 1-D weight (a norm's) from a publisher, MXFP8 and one scale per
/// tensor: the publisher quantizes it as the reference does the same
/// elements as one row (MXFP8 1-D once panicked in the publisher, which
/// read a second dimension it does not have).
#[test]
fn a_one_dimensional_weight_from_a_publisher_is_quantized() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for (k, scheme) in [Scheme::Mxfp8, Scheme::Fp8Tensor].into_iter().enumerate() {
        let g = t("g", DType::Bf16, &[100], 20 + k as u32);
        let sock = dir.path().join(format!("p{k}.sock"));
        let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
        let desc = TensorDesc::host("g", DType::Bf16, &[100], g.data.as_ptr(), g.data.len());
        // SAFETY: `g` outlives the serving.
        unsafe { p.add(desc) }.unwrap();
        p.set_version(Some("1".into()));
        let m = manager();
        let [q, s] = quantized(
            &m,
            ParamSpec::host("g", DType::F8E4m3, &[100]),
            scheme,
            false,
        );
        let (r, served) = serving(std::slice::from_ref(&p), || m.update(ipc_pull(&sock)));
        assert_eq!(r.unwrap().bytes, (q.1 + s.1) as u64, "{scheme:?}");
        assert!(served.iter().all(|r| r.is_ok()), "{scheme:?}: {served:?}");
        let row = T {
            shape: vec![1, 100],
            ..g.clone()
        };
        let (want_q, want_s) = reference(&row, scheme);
        assert!(read(q) == want_q, "{scheme:?}");
        assert_eq!(read(s), scale_bytes(scheme, &want_s), "{scheme:?}");
    }
}

/// An engine that gives up in the middle of an FP8 session (its progress
/// callback cancels after the first bucket) fails that session, which
/// stops quantizing behind the stream; the publisher goes on serving, and
/// the next sessions (their image memory taken from the pool the failed
/// one did not feed, then from the clean one's) land the reference's bytes
/// of the trainer's tensors as they are then, every byte rewritten.
#[test]
fn an_engine_giving_up_mid_stream_leaves_the_fp8_publisher_serving() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let cfg = PublisherConfig {
        bucket_size: 64 << 10,
        ..Default::default()
    };
    let p = Publisher::bind(&sock, cfg).unwrap();
    let shape = [256u64, 256];
    let mut layers: Vec<T> = (0..6u32)
        .map(|i| t(&format!("l{i}"), DType::Bf16, &shape, 40 + i))
        .collect();
    let names: Vec<String> = layers.iter().map(|g| g.name.clone()).collect();
    for g in &layers {
        let desc = TensorDesc::host(&g.name, DType::Bf16, &shape, g.data.as_ptr(), g.data.len());
        // SAFETY: `layers` outlives the serving; its buffers never move
        // (rewritten in place below, between sessions).
        unsafe { p.add(desc) }.unwrap();
    }
    let engine = || {
        let m = manager();
        let params: Vec<_> = (names.iter())
            .map(|name| {
                let spec = ParamSpec::host(name, DType::F8E4m3, &shape);
                quantized(&m, spec, Scheme::Fp8Block128, false)
            })
            .collect();
        (m, params)
    };
    let request = || ipc_pull(&sock);
    p.set_version(Some("1".into()));
    let (m, _) = engine();
    let mut calls = 0;
    let mut give_up = |_: &weight_manager_core::Progress| {
        calls += 1;
        calls < 2
    };
    let mut req = request();
    req.hooks.progress = Some(&mut give_up);
    let (r, served) = serving(std::slice::from_ref(&p), || m.update(req));
    assert_eq!(r.unwrap_err().code, wm_result::WM_ERR_CANCELLED);
    assert!(served[0].is_err(), "the session failed");
    for (k, seed) in [(2, 50), (3, 60)] {
        // The trainer's next step, in place.
        for (i, g) in layers.iter_mut().enumerate() {
            let new = t(&g.name, DType::Bf16, &shape, seed + i as u32);
            g.data.copy_from_slice(&new.data);
        }
        p.set_version(Some(k.to_string()));
        let (m, params) = engine();
        let (r, served) = serving(std::slice::from_ref(&p), || m.update(request()));
        // FP8 on the wire; the params took those bytes and their scales.
        let took: usize = params.iter().map(|[q, s]| q.1 + s.1).sum();
        assert_eq!(r.unwrap().bytes, took as u64, "version {k}: FP8 params");
        assert_eq!(took, 6 * 256 * 256 + 6 * 4 * 4, "version {k}");
        assert!(served[0].is_ok());
        for (g, [q, s]) in layers.iter().zip(&params) {
            let (want_q, want_s) = reference(g, Scheme::Fp8Block128);
            assert!(read(*q) == want_q, "version {k}: {}'s FP8 bytes", g.name);
            assert_eq!(f32s(&read(*s)), want_s, "version {k}: {}'s scales", g.name);
        }
    }
}

/// Engine replicas taking the same version of a published copy share the
/// publisher's images: the first session reads and quantizes, the next
/// ones are served the image it kept (no element read), the same bytes;
/// an engine asking for another part of the tensor gets its own.
#[test]
fn replicas_of_an_fp8_engine_are_served_the_image_the_first_made() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
    let g = t("g", DType::Bf16, &[512, 256], 70);
    common::add_all(&p, std::slice::from_ref(&g));
    p.set_version(Some("1".into()));
    p.publish().unwrap();
    let request = || ipc_pull(&sock);
    let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
    for replica in 0..3 {
        let m = manager();
        let [q, s] = quantized(
            &m,
            ParamSpec::host("g", DType::F8E4m3, &[512, 256]),
            Scheme::Fp8Block128,
            false,
        );
        let (r, served) = serving(std::slice::from_ref(&p), || m.update(request()));
        assert_eq!(r.unwrap().bytes, (q.1 + s.1) as u64);
        let read_for_it = served[0].as_ref().unwrap().sessions[0].quantized;
        match replica {
            0 => assert_eq!(read_for_it, 512 * 256 * 2, "the first session reads"),
            _ => assert_eq!(read_for_it, 0, "replica {replica} is served the kept image"),
        }
        assert!(read(q) == want_q, "replica {replica}: FP8 bytes");
        assert_eq!(f32s(&read(s)), want_s, "replica {replica}: scales");
    }
    // Rows 128..384 only: another request, another image.
    let m = manager();
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[256, 256]);
    spec.pieces = vec![piece("g", &[128, 0], &[256, 256], &[0, 0])];
    let [q, _] = quantized(&m, spec, Scheme::Fp8Block128, false);
    let (r, served) = serving(std::slice::from_ref(&p), || m.update(request()));
    r.unwrap();
    assert_eq!(
        served[0].as_ref().unwrap().sessions[0].quantized,
        256 * 256 * 2
    );
    assert!(read(q) == want_q[128 * 256..384 * 256]);
}

/// Tensors given to one engine rank each, under one name: a rank's kept
/// image is never served to another rank, each lands its own tensor.
#[test]
fn a_ranks_kept_image_is_not_served_to_another_rank() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
    let per_rank: Vec<T> = (0..2u32)
        .map(|r| t("g", DType::Bf16, &[256, 256], 80 + r))
        .collect();
    for (r, g) in per_rank.iter().enumerate() {
        let desc = TensorDesc::host("g", DType::Bf16, &[256, 256], g.data.as_ptr(), g.data.len())
            .for_rank(r as u32);
        // SAFETY: `per_rank` outlives the serving.
        unsafe { p.add(desc) }.unwrap();
    }
    p.set_version(Some("1".into()));
    p.publish().unwrap();
    for (r, g) in per_rank.iter().enumerate() {
        let m = Manager::new(ManagerConfig {
            rank: r as u32,
            world_size: 2,
            fallback_dir: None,
            ..Default::default()
        })
        .unwrap();
        let [q, s] = quantized(
            &m,
            ParamSpec::host("g", DType::F8E4m3, &[256, 256]),
            Scheme::Fp8Block128,
            false,
        );
        let (r_, served) = serving(std::slice::from_ref(&p), || m.update(ipc_pull(&sock)));
        r_.unwrap();
        assert_eq!(
            served[0].as_ref().unwrap().sessions[0].quantized,
            256 * 256 * 2
        );
        let (want_q, want_s) = reference(g, Scheme::Fp8Block128);
        assert!(read(q) == want_q, "rank {r}: its own tensor's FP8 bytes");
        assert_eq!(f32s(&read(s)), want_s, "rank {r}");
    }
}

/// A whole update from the IPC publisher at `sock`, within 30 s.
fn ipc_pull<'h>(sock: &Path) -> UpdateRequest<'h> {
    let mut req = UpdateRequest::snapshot(PathBuf::from(sock));
    req.source = SourceKind::Ipc;
    req.timeout = Duration::from_secs(30);
    req
}
