//! Deltas into GPU params (`delta::device`, `apply/base.rs`): the GPU's
//! XXH3-128 against the host's for every length class (short, one block,
//! many blocks, unaligned, runs cut across rounds); then a trainer
//! publishing 5 versions (about 2% of elements changed a step) over IPC
//! and rdma into device params, engine-owned and library-owned, in place
//! (the kernel writes the changes on the GPU) and atomic (the base read
//! back into the host staging and patched there): every version's bytes
//! read back and checked, deltas from the second version on; a param
//! written on the GPU since goes whole; a two-phase update; FP8 params on
//! the GPU from four sharded trainer ranks quantizing their rows; without
//! NVRTC every run goes whole and the update still lands.
//!
//! Without a GPU (CI) the checks run under the test driver
//! (`tests/fake_cuda.c`), which answers as NVRTC too and runs each launch's
//! threads on the host over the kernels' own source. On a GPU
//! (scripts/gpu.sh) the same checks run on the real driver and NVRTC.

mod common;

use common::fake_cuda::{under_fake_driver, Fake};
use common::quant::{f32s, publish_rows, reference, row_publishers};
use common::sharded::{net_engine, piece, serving};
use common::steps::{bind_trainer, first, next, publish_step};
use common::T;
use std::path::PathBuf;
use std::time::Duration;
use weight_manager_core::delta::device::{checksums, checksums_in_rounds};
use weight_manager_core::internals::memory::cuda::cuda;
use weight_manager_core::internals::memory::cuda_ipc;
use weight_manager_core::internals::memory::device::DeviceAllocation;
use weight_manager_core::quant::Scheme;
use weight_manager_core::{
    checksum, DType, DeltaFallback, DeltaMode, Manager, ManagerConfig, MemoryKind, Mode,
    NetSettings, ParamSpec, Publisher, PublisherConfig, SourceKind, UpdateRequest,
};

const SECRET: &[u8] = b"device-delta-test-secret";

fn upload(bytes: &[u8]) -> DeviceAllocation {
    let d = DeviceAllocation::new("a test buffer", 0, bytes.len()).unwrap();
    unsafe { cuda_ipc::upload(0, d.ptr(), bytes.as_ptr(), bytes.len()) }.unwrap();
    d
}

fn download(ptr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    unsafe { cuda_ipc::download(0, out.as_mut_ptr(), ptr, len) }.unwrap();
    out
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Every length class, at aligned and unaligned addresses, in one call and
/// in rounds of a few blocks (runs continued across rounds).
fn gpu_checksums_are_the_hosts() {
    let lens = [
        0usize, 1, 16, 17, 128, 129, 240, 241, 1000, 1023, 1024, 1025, 2048, 4097, 65_536, 300_001,
    ];
    let data = bytes(lens.iter().sum::<usize>() + 64, 9);
    let d = upload(&data);
    let mut runs = Vec::new();
    let mut at = 3usize; // unaligned first
    for &n in &lens {
        runs.push((
            d.ptr() + at as u64,
            n as u64,
            checksum::of(&data[at..at + n]),
        ));
        at += n;
    }
    let spans: Vec<(u64, u64)> = runs.iter().map(|r| (r.0, r.1)).collect();
    let want: Vec<u128> = runs.iter().map(|r| r.2).collect();
    assert_eq!(checksums(0, &spans).unwrap(), want, "one round");
    for round in [1, 3, 64] {
        let got = checksums_in_rounds(0, &spans, round).unwrap();
        assert_eq!(got, want, "rounds of {round} blocks");
    }
}

/// Deltas of every form written on the GPU (`delta::device::apply`), in
/// one slice and in many (a scratch of a few changes): the run holds the
/// new bytes exactly.
fn deltas_written_on_the_gpu() {
    use weight_manager_core::delta::device::{apply, apply_in_slices, OnGpu};
    use weight_manager_core::delta::{encode, list_changes};
    let old = bytes(2 * 70_000, 3);
    let mut new = old.clone();
    for (i, e) in new.chunks_exact_mut(2).enumerate() {
        // Sparse in the first chunk (gaps), dense in the second (bitmask),
        // all in the third (whole).
        if i < 32_768 && i % 97 == 0 || (32_768..65_536).contains(&i) && i % 3 == 0 || i >= 65_536 {
            e[0] ^= 0x5a;
        }
    }
    let mut delta = Vec::new();
    let stats = encode(&old, &new, 2, &mut delta);
    assert!(
        stats.gaps == 1 && stats.bitmask == 1 && stats.whole == 1,
        "{stats:?}"
    );
    let changes = list_changes(&delta, old.len(), 2).unwrap();
    for scratch in [usize::MAX, 64, 7] {
        let d = upload(&old);
        let job = OnGpu {
            dst: d.ptr(),
            changes: &changes,
            delta: &delta,
            esize: 2,
        };
        match scratch {
            usize::MAX => unsafe { apply(0, &[job]) }.unwrap(),
            n => unsafe { apply_in_slices(0, &[job], n) }.unwrap(),
        }
        assert!(
            download(d.ptr(), new.len()) == new,
            "a scratch of {scratch} bytes"
        );
    }
}

fn engine() -> Manager {
    engine_with(false)
}

/// An engine; `swap`: atomic updates of library-owned device params swap
/// their pages in (`swap_device_pages`).
fn engine_with(swap: bool) -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        net: NetSettings {
            secret: Some(SECRET.to_vec()),
            ..Default::default()
        },
        swap_device_pages: swap,
        ..Default::default()
    })
    .unwrap()
}

/// Device params on GPU 0 for `ts`: library-owned, or the engine's own
/// (`cuMemAlloc`, kept for the test's life). Their addresses and sizes.
fn device_params(m: &Manager, ts: &[T], engine_owned: bool) -> Vec<(u64, usize)> {
    ts.iter()
        .map(|t| {
            let mut spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
            spec.memory = MemoryKind::Device;
            spec.device_ordinal = 0;
            if !engine_owned {
                let (p, n) = m.allocate(&spec).unwrap();
                return (p as u64, n);
            }
            let n = t.data.len();
            let d = Box::leak(Box::new(
                DeviceAllocation::new("a test param", 0, n).unwrap(),
            ));
            unsafe { m.register(&spec, d.ptr() as *mut u8, n) }.unwrap();
            (d.ptr(), n)
        })
        .collect()
}

fn assert_on_gpu(params: &[(u64, usize)], ts: &[T], what: &str) {
    for (&(p, n), t) in params.iter().zip(ts) {
        assert!(download(p, n) == t.data, "{what}: param {}", t.name);
    }
}

struct Trainer {
    publisher: Publisher,
    location: String,
    via: SourceKind,
}

impl Trainer {
    fn new(via: SourceKind, dir: &std::path::Path) -> Trainer {
        let cfg = PublisherConfig {
            keep_versions: 2,
            secret: Some(SECRET.to_vec()),
            ..Default::default()
        };
        let (publisher, location) = bind_trainer(via, dir, cfg);
        Trainer {
            publisher,
            location,
            via,
        }
    }

    fn publish(&self, ts: &[T], v: u64) {
        publish_step(&self.publisher, ts, v);
    }

    fn update(&self, m: &Manager, mode: Mode) -> weight_manager_core::UpdateStats {
        let mut r = UpdateRequest::snapshot(PathBuf::from(&self.location));
        r.source = self.via;
        r.deltas = DeltaMode::On;
        r.mode = mode;
        r.timeout = Duration::from_secs(60);
        std::thread::scope(|s| {
            let serving = s.spawn(|| self.publisher.serve(1, Duration::from_secs(60)));
            let stats = m.update(r);
            serving.join().unwrap().unwrap();
            stats.unwrap()
        })
    }
}

/// Five versions into device params, `mode`, engine- or library-owned:
/// every version's bytes exact on the GPU, deltas from the second on,
/// a small share of the bytes on the wire; then a param written on the GPU
/// behind the library's back goes whole.
fn five_versions(via: SourceKind, mode: Mode, engine_owned: bool) {
    let what = format!("{via:?} {mode:?} engine-owned {engine_owned}");
    let dir = tempfile::tempdir().unwrap();
    let trainer = Trainer::new(via, dir.path());
    let m = engine();
    let mut ts = first();
    let params = device_params(&m, &ts, engine_owned);
    let whole: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    for v in 1..=5u64 {
        if v > 1 {
            ts = next(&ts, v);
        }
        trainer.publish(&ts, v);
        let stats = trainer.update(&m, mode);
        assert_on_gpu(&params, &ts, &format!("{what}: version {v}"));
        let d = &stats.deltas;
        if v == 1 {
            assert_eq!(d.fallback, DeltaFallback::NoBase, "{what}: {d:?}");
            continue;
        }
        assert_eq!(
            d.fallback,
            DeltaFallback::None,
            "{what}: version {v}: {d:?}"
        );
        assert_eq!(
            (d.runs_delta, d.runs_whole),
            (4, 0),
            "{what}: version {v}: {d:?}"
        );
        assert!(
            d.wire_bytes * 10 < whole,
            "{what}: version {v}: {d:?} of {whole}"
        );
        assert!(
            d.rewritten_bytes > 0 && d.rewritten_bytes < whole / 10,
            "{what}: {d:?}"
        );
    }
    // Written on the GPU since: its fingerprint disagrees, it comes whole.
    let (p, n) = params[1];
    unsafe { cuda_ipc::upload(0, p, vec![0x5au8; 64].as_ptr(), 64) }.unwrap();
    ts = next(&ts, 6);
    trainer.publish(&ts, 6);
    let d = trainer.update(&m, mode).deltas;
    assert_on_gpu(&params, &ts, &format!("{what}: written since"));
    assert_eq!(
        (d.runs_delta, d.runs_whole),
        (3, 1),
        "{what}: written since: {d:?}"
    );
    assert!(download(p, n) == ts[1].data);
}

/// A two-phase update into GPU params takes deltas like a one-call one:
/// staged (the params keep the old version meanwhile), then committed;
/// with the device page swap (`swap`) too, the deltas' results uploaded
/// into the shadows the commit swaps in.
fn a_staged_delta_update(swap: bool) {
    let dir = tempfile::tempdir().unwrap();
    let trainer = Trainer::new(SourceKind::Ipc, dir.path());
    let m = std::sync::Arc::new(engine_with(swap));
    let v1 = first();
    let params = device_params(&m, &v1, false);
    trainer.publish(&v1, 1);
    trainer.update(&m, Mode::Atomic);
    let v2 = next(&v1, 2);
    trainer.publish(&v2, 2);
    let mut r = UpdateRequest::snapshot(PathBuf::from(&trainer.location));
    (r.source, r.deltas) = (SourceKind::Ipc, DeltaMode::On);
    let staged = std::thread::scope(|s| {
        let serving = s.spawn(|| trainer.publisher.serve(1, Duration::from_secs(60)));
        let staged = m.stage(r).unwrap();
        serving.join().unwrap().unwrap();
        staged
    });
    assert_on_gpu(&params, &v1, "staged: the params serve the old version");
    let d = staged.commit().unwrap().deltas;
    assert_on_gpu(&params, &v2, "committed");
    assert_eq!((d.runs_delta, d.runs_whole), (4, 0), "{d:?}");
}

// ---- FP8 params on the GPU from sharded publishers ----

/// Finite bf16 values of every sign and a range of magnitudes.
fn finite_bf16(shape: &[u64], seed: u64) -> T {
    let n = shape.iter().product::<u64>() as usize;
    let mut x = seed | 1;
    let data = (0..n)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let exp = 110 + (x >> 8) % 30;
            let bits = ((x & 1) << 15) | (exp << 7) | ((x >> 16) & 0x7f);
            (bits as u16).to_le_bytes()
        })
        .collect();
    T {
        name: "g".into(),
        dtype: DType::Bf16,
        shape: shape.to_vec(),
        data,
    }
}

/// `g` with 300 elements changed by about 10% (mantissa bit 4 flipped:
/// enough to change most of their FP8 bytes).
fn nudged(g: &T, seed: u64) -> T {
    let mut out = g.clone();
    let elements = out.data.len() / 2;
    for i in 0..300u64 {
        let at = 2 * ((i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed) as usize % elements);
        out.data[at] ^= 0x10;
    }
    out
}

/// A [300, 256] bf16 tensor from four trainer ranks (row shards splitting
/// the 128x128 blocks), quantized by them, into an FP8 column half and its
/// scales on the GPU: from the second version on each rank's run comes as
/// a delta of its FP8 bytes (or whole, where a block's new amax changed
/// them all), patched on the GPU in place, through the staging atomic.
fn sharded_fp8_into_gpu_params(via: SourceKind, mode: Mode) {
    let what = format!("FP8 {via:?} {mode:?}");
    let mut g = finite_bf16(&[300, 256], 5);
    let dir = tempfile::tempdir().unwrap();
    let ps = row_publishers(dir.path(), via, &g, SECRET);
    let m = net_engine(std::str::from_utf8(SECRET).unwrap());
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
    spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
    let scales = ParamSpec::host("half.scale_inv", DType::F32, &[3, 1]);
    let [q, s] = [spec.clone(), scales.clone()].map(|mut p| {
        (p.memory, p.device_ordinal) = (MemoryKind::Device, 0);
        let (ptr, n) = m.allocate(&p).unwrap();
        (ptr as u64, n)
    });
    m.quantize(&spec.name, &scales.name, Scheme::Fp8Block128)
        .unwrap();
    for k in 0..4u64 {
        if k > 0 {
            g = nudged(&g, k);
        }
        publish_rows(&ps, &g, &format!("v{k}"));
        let mut req = UpdateRequest::snapshot(PathBuf::new());
        req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
        (req.source, req.mode, req.deltas) = (via, mode, DeltaMode::On);
        req.timeout = Duration::from_secs(60);
        let (r, served) = serving(&ps, || m.update(req));
        served.into_iter().for_each(|s| drop(s.unwrap()));
        let d = r.unwrap_or_else(|e| panic!("{what} v{k}: {e}")).deltas;
        let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
        let half_q: Vec<u8> = want_q.chunks(256).flat_map(|r| r[128..].to_vec()).collect();
        let half_s: Vec<f32> = want_s.chunks(2).map(|r| r[1]).collect();
        assert!(download(q.0, q.1) == half_q, "{what} v{k}: FP8 bytes");
        assert_eq!(f32s(&download(s.0, s.1)), half_s, "{what} v{k}: scales");
        if k > 0 {
            assert_eq!(d.runs_delta + d.runs_whole, 4, "{what} v{k}: {d:?}");
            assert!(
                d.runs_delta >= 2 && d.rewritten_bytes > 50,
                "{what} v{k}: {d:?}"
            );
            assert!(d.wire_bytes < 300 * 128 / 2, "{what} v{k}: {d:?}");
        }
    }
}

/// Without NVRTC the GPU cannot hash: every run comes whole and the update
/// lands as without deltas.
fn without_nvrtc_runs_come_whole() {
    std::env::set_var("WM_NVRTC_LIB", "/nonexistent/libnvrtc.so");
    let dir = tempfile::tempdir().unwrap();
    let trainer = Trainer::new(SourceKind::Ipc, dir.path());
    let m = engine();
    let mut ts = first();
    let params = device_params(&m, &ts, false);
    for v in 1..=2u64 {
        if v > 1 {
            ts = next(&ts, v);
        }
        trainer.publish(&ts, v);
        let d = trainer.update(&m, Mode::InPlace).deltas;
        assert_on_gpu(&params, &ts, "without NVRTC");
        assert_eq!(d.runs_delta, 0, "{d:?}");
        if v > 1 {
            assert_eq!(d.fallback, DeltaFallback::NotApplicable, "{d:?}");
        }
    }
}

fn ucx() -> bool {
    let ok = weight_manager_core::internals::transport::ucx::ucx().is_ok();
    if ok {
        std::env::set_var("UCX_TLS", "tcp");
    } else {
        println!("rdma skipped: no UCX");
    }
    ok
}

fn all_checks(rdma: bool) {
    gpu_checksums_are_the_hosts();
    deltas_written_on_the_gpu();
    for mode in [Mode::InPlace, Mode::Atomic] {
        for engine_owned in [false, true] {
            five_versions(SourceKind::Ipc, mode, engine_owned);
        }
    }
    a_staged_delta_update(false);
    a_staged_delta_update(true);
    sharded_fp8_into_gpu_params(SourceKind::Ipc, Mode::InPlace);
    sharded_fp8_into_gpu_params(SourceKind::Ipc, Mode::Atomic);
    if rdma && ucx() {
        five_versions(SourceKind::Rdma, Mode::InPlace, false);
        five_versions(SourceKind::Rdma, Mode::Atomic, true);
        sharded_fp8_into_gpu_params(SourceKind::Rdma, Mode::InPlace);
    }
}

#[test]
fn device_deltas_under_the_test_driver() {
    if !under_fake_driver("device_deltas_under_the_test_driver", false) {
        return;
    }
    let fake = Fake::open();
    let before = fake.calls("cuLaunchKernel");
    // A CUDA-enabled UCX (scripts/gpu.sh sets WM_REQUIRE_GDR with one)
    // loads its CUDA transport against the test driver, which lacks the
    // driver's full API: the network run is then the real GPU's.
    all_checks(std::env::var_os("WM_REQUIRE_GDR").is_none());
    assert!(fake.calls("cuLaunchKernel") > before, "the kernels ran");
}

#[test]
fn device_deltas_without_nvrtc() {
    if !under_fake_driver("device_deltas_without_nvrtc", false) {
        return;
    }
    without_nvrtc_runs_come_whole();
}

#[test]
fn device_deltas_on_a_gpu() {
    if std::env::var_os("WM_UNDER_FAKE_CUDA").is_some() {
        return;
    }
    if let Err(e) = cuda() {
        println!("skipped: no usable GPU here: {e}");
        return;
    }
    all_checks(true);
}
