//! The FP8 quantizer's GPU kernels (`quant::device`, compiled by NVRTC at
//! run time) against the CPU quantizer, byte for byte and amax for amax:
//! whole tensors of every source dtype and both schemes, edge blocks,
//! all-zero blocks, subnormals, a shard of a global tensor read through a
//! strided run, a NaN found by its element, and a param written from host
//! bytes a band at a time. The CPU quantizer is checked against PyTorch's
//! reference in the core crate's tests (and the kernel against PyTorch
//! directly there, on a GPU).
//!
//! Without a GPU (CI) the checks run under the test driver
//! (`tests/fake_cuda.c`), which answers as NVRTC too and runs each launch's
//! threads on the host over the kernels' own source. On a GPU
//! (scripts/gpu.sh) the same checks run on the real driver and NVRTC.

mod common;

use common::fake_cuda::{under_fake_driver, Fake};
use weight_manager_core::internals::memory::cuda::cuda;
use weight_manager_core::internals::memory::cuda_ipc;
use weight_manager_core::internals::memory::device::DeviceAllocation;
use weight_manager_core::quant::bands::Wide;
use weight_manager_core::quant::blocks::Placed;
use weight_manager_core::quant::device::{self, OnDevice, Rows};
use weight_manager_core::quant::{self as q, Scheme, Source};
use weight_manager_core::DType;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A finite value of every kind: normal, subnormal, zero, large.
    fn value(&mut self) -> f32 {
        match self.next() % 16 {
            0 => 0.0,
            1 => f32::from_bits((self.next() % 0x7f_ffff) as u32 + 1) * 1e3,
            2 => (self.next() % 1000) as f32 * 1e3,
            _ => ((self.next() % 20001) as f32 - 10000.0) / 997.0,
        }
    }
}

/// `n` finite elements of `dtype`, little-endian; every 5th 128-column
/// stretch all zero (all-zero blocks).
fn elements(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let v = if (i / 128) % 5 == 4 { 0.0 } else { rng.value() };
        match dtype {
            DType::Bf16 => out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16_bits(v).to_le_bytes()),
            _ => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    out
}

/// A half's bits near `v` (truncated; any finite half will do).
fn f16_bits(v: f32) -> u16 {
    let v = v.clamp(-65504.0, 65504.0);
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let e = ((b >> 23) & 0xff) as i32 - 127 + 15;
    match e {
        ..=0 => sign | ((v.abs() * 16_777_216.0) as u16 & 0x3ff),
        1..=30 => sign | ((e as u16) << 10) | ((b >> 13) & 0x3ff) as u16,
        _ => sign | 0x7bff,
    }
}

/// `bytes` in new device memory of GPU `ordinal`.
fn upload(ordinal: i32, bytes: &[u8]) -> DeviceAllocation {
    let d = DeviceAllocation::new("a test tensor", ordinal, bytes.len()).unwrap();
    // SAFETY: the allocation holds `bytes.len()` bytes.
    unsafe { cuda_ipc::upload(ordinal, d.ptr(), bytes.as_ptr(), bytes.len()) }.unwrap();
    d
}

/// `len` bytes of GPU 0's memory at `ptr`.
fn download(ptr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` holds `len` bytes; the caller names device memory.
    unsafe { cuda_ipc::download(0, out.as_mut_ptr(), ptr, len) }.unwrap();
    out
}

/// Whole tensors: the kernels' amax and bytes are the CPU's.
fn whole_tensors() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        for scheme in [Scheme::Fp8Block128, Scheme::Fp8Tensor, Scheme::Mxfp8] {
            for (rows, cols) in [(1, 1), (5, 130), (128, 128), (129, 257), (300, 200)] {
                let what = format!("{dtype} {scheme:?} [{rows}, {cols}]");
                let bytes = elements(&mut rng, dtype, rows * cols);
                let src = Source {
                    dtype,
                    bytes: &bytes,
                    rows,
                    cols,
                };
                let [sr, sc] = scheme.scales_shape(rows, cols);
                let mut want_amax = vec![0f32; sr * sc];
                q::block_amax(scheme, src, [0, 0], [rows, cols], &mut want_amax).unwrap();
                let mut want = (vec![0u8; rows * cols], vec![0f32; sr * sc]);
                q::quantize(scheme, src, &mut want.0, &mut want.1).unwrap();

                let d = upload(0, &bytes);
                let shape = [rows as u64, cols as u64];
                let t = OnDevice {
                    ordinal: 0,
                    ptr: d.ptr(),
                    dtype,
                    scheme,
                    placed: Placed::whole(&shape),
                };
                let all = (rows * cols) as u64;
                let runs = [Rows::all(all)];
                let amax = device::amax(&t, &runs).unwrap().unwrap();
                assert_eq!(bits(&amax), bits(&want_amax), "{what}: amax");
                let out = DeviceAllocation::new("out", 0, rows * cols).unwrap();
                device::quantize(&t, &runs, &amax, out.ptr()).unwrap();
                assert_same(&download(out.ptr(), rows * cols), &want.0, &what);

                // The engine's way: host bytes a band at a time.
                let fp8 = DeviceAllocation::new("param", 0, rows * cols).unwrap();
                let wide = Wide {
                    dtype,
                    shape: &shape,
                    bytes: &bytes,
                };
                device::write_from_host(0, scheme, wide, &want_amax, fp8.ptr()).unwrap();
                assert_same(
                    &download(fp8.ptr(), rows * cols),
                    &want.0,
                    &format!("{what} (from host)"),
                );
            }
        }
    }
}

/// A shard of a global tensor, read through a strided run and a whole one:
/// blocks split across shards get the CPU's partial amax, and the bytes
/// quantized with the agreed (global) amax are the CPU's.
fn a_shard_through_runs() {
    let mut rng = Rng(7);
    let (global, shard_at, shard) = ([300u64, 260u64], [75u64, 0u64], [75u64, 260u64]);
    let dtype = DType::Bf16;
    let bytes = elements(&mut rng, dtype, (shard[0] * shard[1]) as usize);
    let d = upload(0, &bytes);
    let placed = Placed {
        shape: &shard,
        offset: &shard_at,
        global: &global,
    };
    let t = OnDevice {
        ordinal: 0,
        ptr: d.ptr(),
        dtype,
        scheme: Scheme::Fp8Block128,
        placed,
    };
    // Rows 3..40, columns 100..230 of the shard.
    let (r0, nr, c0, nc) = (3usize, 37usize, 100usize, 130usize);
    let run = Rows {
        offset: (r0 * 260 + c0) as u64,
        len: nc as u64,
        rows: nr as u64,
        stride: 260,
    };
    let mut part = Vec::new();
    for r in r0..r0 + nr {
        part.extend_from_slice(&bytes[(r * 260 + c0) * 2..(r * 260 + c0 + nc) * 2]);
    }
    let src = Source {
        dtype,
        bytes: &part,
        rows: nr,
        cols: nc,
    };
    let origin = [75 + r0, c0];
    let whole = [300usize, 260usize];
    let mut want = vec![0f32; 3 * 3];
    q::block_amax(Scheme::Fp8Block128, src, origin, whole, &mut want).unwrap();
    let local = device::amax(&t, &[run]).unwrap().unwrap();
    assert_eq!(
        t.local_blocks(),
        2 * 3,
        "rows 75..150 span block rows 0 and 1"
    );
    for (b, w) in want.iter().enumerate() {
        let got = t.local_block(b as u64).map_or(0.0, |l| local[l]);
        assert_eq!(got.to_bits(), w.to_bits(), "block {b}");
    }
    // Agreed amax: larger than this shard's own for some blocks.
    let agreed: Vec<f32> = want
        .iter()
        .enumerate()
        .map(|(b, a)| a * (1.0 + b as f32 / 3.0))
        .collect();
    let mut local_agreed = vec![0f32; t.local_blocks()];
    for (b, a) in agreed.iter().enumerate() {
        if let Some(l) = t.local_block(b as u64) {
            local_agreed[l] = *a;
        }
    }
    let out = DeviceAllocation::new("out", 0, nr * nc).unwrap();
    device::quantize(&t, &[run], &local_agreed, out.ptr()).unwrap();
    let (mut bytes_cpu, mut scales) = (vec![0u8; nr * nc], vec![0f32; 9]);
    q::quantize_with(
        Scheme::Fp8Block128,
        src,
        (origin, whole),
        &agreed,
        &mut bytes_cpu,
        &mut scales,
    )
    .unwrap();
    assert_same(
        &download(out.ptr(), nr * nc),
        &bytes_cpu,
        "a strided run of a shard",
    );
}

/// MXFP8 over a shard cut by columns at 50 (blocks of 32 split with the
/// shard beside it) and stacked: a strided run's partial amax and bytes
/// with agreed amax are the CPU's, block for block in the global grid.
fn an_mxfp8_shard_through_runs() {
    let mut rng = Rng(17);
    let (global, shard_at, shard) = ([2u64, 40, 200], [1u64, 0, 50], [1u64, 40, 50]);
    let dtype = DType::Bf16;
    let bytes = elements(&mut rng, dtype, (40 * 50) as usize);
    let d = upload(0, &bytes);
    let placed = Placed {
        shape: &shard,
        offset: &shard_at,
        global: &global,
    };
    let t = OnDevice {
        ordinal: 0,
        ptr: d.ptr(),
        dtype,
        scheme: Scheme::Mxfp8,
        placed,
    };
    assert_eq!(t.local_blocks(), 40 * 3, "columns 50..100 span blocks 1..3");
    // Rows 3..20, columns 5..45 of the shard (global columns 55..95).
    let (r0, nr, c0, nc) = (3usize, 17usize, 5usize, 40usize);
    let run = Rows {
        offset: (r0 * 50 + c0) as u64,
        len: nc as u64,
        rows: nr as u64,
        stride: 50,
    };
    let mut part = Vec::new();
    for r in r0..r0 + nr {
        part.extend_from_slice(&bytes[(r * 50 + c0) * 2..(r * 50 + c0 + nc) * 2]);
    }
    let src = Source {
        dtype,
        bytes: &part,
        rows: nr,
        cols: nc,
    };
    // The CPU's view: the second matrix's rows as a [40, 200] tensor, the
    // global block numbers offset by the first matrix's 40 x 7.
    let (origin, whole) = ([r0, 50 + c0], [40usize, 200usize]);
    let mut want = vec![0f32; 40 * 7];
    q::block_amax(Scheme::Mxfp8, src, origin, whole, &mut want).unwrap();
    let local = device::amax(&t, &[run]).unwrap().unwrap();
    for (b, w) in want.iter().enumerate() {
        let got = t.local_block(40 * 7 + b as u64).map_or(0.0, |l| local[l]);
        assert_eq!(got.to_bits(), w.to_bits(), "block {b}");
    }
    assert_eq!(
        t.local_block(3),
        None,
        "the first matrix is not the shard's"
    );
    let agreed: Vec<f32> = (want.iter().enumerate())
        .map(|(b, a)| a * (1.0 + (b % 5) as f32 / 3.0))
        .collect();
    let mut local_agreed = vec![0f32; t.local_blocks()];
    for (b, a) in agreed.iter().enumerate() {
        if let Some(l) = t.local_block(40 * 7 + b as u64) {
            local_agreed[l] = *a;
        }
    }
    let out = DeviceAllocation::new("out", 0, nr * nc).unwrap();
    device::quantize(&t, &[run], &local_agreed, out.ptr()).unwrap();
    let (mut cpu, mut scales) = (vec![0u8; nr * nc], vec![0f32; want.len()]);
    let whole_shape = (origin, whole);
    q::quantize_with(
        Scheme::Mxfp8,
        src,
        whole_shape,
        &agreed,
        &mut cpu,
        &mut scales,
    )
    .unwrap();
    assert_same(
        &download(out.ptr(), nr * nc),
        &cpu,
        "an MXFP8 shard's strided run",
    );
}

/// A shard of more than 2^32 elements (the kernels' 64-bit index
/// arithmetic; smaller ones take 32-bit): a run over its first rows, which
/// are all the memory it reads, gives the CPU's amax and bytes.
fn indices_past_32_bits() {
    let shape = [1u64 << 20, 8192];
    let (rows, cols) = (3usize, 8192usize);
    let bytes = elements(&mut Rng(13), DType::Bf16, rows * cols);
    let d = upload(0, &bytes);
    let placed = Placed::whole(&shape);
    let t = OnDevice {
        ordinal: 0,
        ptr: d.ptr(),
        dtype: DType::Bf16,
        scheme: Scheme::Fp8Block128,
        placed,
    };
    let n = (rows * cols) as u64;
    let runs = [Rows::all(n)];
    let src = Source {
        dtype: DType::Bf16,
        bytes: &bytes,
        rows,
        cols,
    };
    let whole = [1usize << 20, cols];
    let mut want = vec![0f32; t.local_blocks()];
    q::block_amax(Scheme::Fp8Block128, src, [0, 0], whole, &mut want).unwrap();
    let amax = device::amax(&t, &runs).unwrap().unwrap();
    assert_eq!(bits(&amax), bits(&want), "amax past 32 bits");
    let out = DeviceAllocation::new("out", 0, rows * cols).unwrap();
    device::quantize(&t, &runs, &amax, out.ptr()).unwrap();
    let (mut cpu, mut scales) = (vec![0u8; rows * cols], vec![0f32; want.len()]);
    q::quantize_with(
        Scheme::Fp8Block128,
        src,
        ([0, 0], whole),
        &want,
        &mut cpu,
        &mut scales,
    )
    .unwrap();
    assert_same(
        &download(out.ptr(), rows * cols),
        &cpu,
        "bytes past 32 bits",
    );
}

/// A NaN or an infinity is found, named by its (first) shard element.
fn non_finite_elements() {
    for (at, v) in [
        (1000usize, f32::NAN),
        (77, f32::INFINITY),
        (5, f32::NEG_INFINITY),
    ] {
        let mut bytes = elements(&mut Rng(3), DType::F32, 64 * 40);
        bytes[at * 4..at * 4 + 4].copy_from_slice(&v.to_le_bytes());
        bytes[2000 * 4..2000 * 4 + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let d = upload(0, &bytes);
        let shape = [64u64, 40u64];
        let t = OnDevice {
            ordinal: 0,
            ptr: d.ptr(),
            dtype: DType::F32,
            scheme: Scheme::Fp8Block128,
            placed: Placed::whole(&shape),
        };
        let all = [Rows::all(64 * 40)];
        assert_eq!(
            device::amax(&t, &all).unwrap(),
            Err(at as u64),
            "{v} at {at}"
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i}: kernel {:#04x}, CPU {:#04x}",
            got[i], want[i]
        );
    }
    assert_eq!(got.len(), want.len(), "{what}");
}

fn all_checks() {
    whole_tensors();
    a_shard_through_runs();
    an_mxfp8_shard_through_runs();
    indices_past_32_bits();
    non_finite_elements();
}

#[test]
fn fp8_kernels_under_the_test_driver() {
    if !under_fake_driver("fp8_kernels_under_the_test_driver", false) {
        return;
    }
    let fake = Fake::open();
    all_checks();
    assert!(fake.calls("cuLaunchKernel") > 0, "the kernels ran");
}

/// Whether this process runs on a real GPU (not the test driver's child;
/// without one the test says it is skipped).
fn real_gpu() -> bool {
    if std::env::var_os("WM_UNDER_FAKE_CUDA").is_some() {
        return false;
    }
    if let Err(e) = cuda() {
        println!("skipped: no usable GPU here: {e}");
        return false;
    }
    true
}

#[test]
fn fp8_kernels_on_a_gpu() {
    if !real_gpu() {
        return;
    }
    all_checks();
}

#[test]
fn without_nvrtc_the_quantizer_says_so() {
    if !under_fake_driver("without_nvrtc_the_quantizer_says_so", false) {
        return;
    }
    // Read once: this child process has the test to itself.
    std::env::set_var("WM_NVRTC_LIB", "/nonexistent/libnvrtc.so");
    let d = upload(0, &[0u8; 8]);
    let shape = [2u64, 2u64];
    let t = OnDevice {
        ordinal: 0,
        ptr: d.ptr(),
        dtype: DType::Bf16,
        scheme: Scheme::Fp8Tensor,
        placed: Placed::whole(&shape),
    };
    let e = device::amax(&t, &[Rows::all(4)]).unwrap_err();
    assert!(
        e.message.contains("NVRTC is not available") && e.message.contains("WM_NVRTC_LIB"),
        "{}",
        e.message
    );
}

// ---- FP8 params in GPU memory (the engine's side) ----

use common::quant::{f32s, reference, row_publishers, scale_bytes, write_snapshot};
use common::sharded::{piece, serving};
use common::T;
use std::path::{Path, PathBuf};
use std::time::Duration;
use weight_manager_core::quant::params::scales_shape;
use weight_manager_core::{
    wm_result, Manager, ManagerConfig, MemoryKind, Mode, ParamSpec, Placement, Publisher,
    PublisherConfig, SourceKind, TensorDesc, UpdateRequest,
};

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

fn device(spec: ParamSpec) -> ParamSpec {
    ParamSpec {
        memory: MemoryKind::Device,
        device_ordinal: 0,
        ..spec
    }
}

/// FP8 param `spec` and its scales `<name>.scale_inv` on GPU 0,
/// library-owned or engine-owned (`engine`), declared quantized: their
/// device addresses and sizes.
fn quantized_on_gpu(
    m: &Manager,
    spec: ParamSpec,
    scheme: Scheme,
    engine: bool,
) -> [(u64, usize); 2] {
    let s = ParamSpec::host(
        &format!("{}.scale_inv", spec.name),
        scheme.scale_dtype(),
        &scales_shape(scheme, &spec.shape),
    );
    let out = [device(spec.clone()), device(s.clone())].map(|spec| {
        let n = spec.shape.iter().product::<u64>() as usize * spec.dtype.size();
        if engine {
            let d = Box::leak(Box::new(
                DeviceAllocation::new("a test param", 0, n).unwrap(),
            ));
            unsafe { m.register(&spec, d.ptr() as *mut u8, n) }.unwrap();
            (d.ptr(), n)
        } else {
            let (p, n) = m.allocate(&spec).unwrap();
            (p as u64, n)
        }
    });
    m.quantize(&spec.name, &s.name, scheme).unwrap();
    out
}

fn tensor(name: &str, dtype: DType, shape: &[u64], seed: u64) -> T {
    let n = shape.iter().product::<u64>() as usize;
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data: elements(&mut Rng(seed * 31 + 1), dtype, n),
    }
}

/// An update pulling from publishers `ps` over `via`.
fn pull(ps: &[Publisher], via: SourceKind) -> UpdateRequest<'static> {
    let mut req = UpdateRequest::snapshot(PathBuf::new());
    req.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
    req.source = via;
    req.timeout = Duration::from_secs(60);
    req
}

/// A bf16/f16/f32 snapshot into FP8 params on the GPU (every scheme), in
/// both modes, library- and engine-owned, two versions: the kernels
/// quantize what was read, byte for byte the CPU quantizer's, and the
/// scales are uploaded.
fn snapshot_into_device_params() {
    let schemes = [
        Scheme::Fp8Block128,
        Scheme::Fp8Block128,
        Scheme::Fp8Tensor,
        Scheme::Mxfp8,
    ];
    let model = |seed| {
        vec![
            tensor("w", DType::Bf16, &[300, 200], seed),
            tensor("experts", DType::F16, &[2, 200, 130], seed),
            tensor("head", DType::F32, &[130, 129], seed),
            tensor("mx", DType::Bf16, &[3, 70, 100], seed),
        ]
    };
    // (mode, engine-owned, the device page swap on)
    for (mode, engine, swap) in [
        (Mode::Atomic, false, false),
        (Mode::Atomic, false, true),
        (Mode::Atomic, true, false),
        (Mode::InPlace, false, false),
        (Mode::InPlace, true, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let m = Manager::new(ManagerConfig {
            fallback_dir: None,
            swap_device_pages: swap,
            ..Default::default()
        })
        .unwrap();
        let params: Vec<_> = (model(1).iter().zip(schemes))
            .map(|(t, s)| {
                quantized_on_gpu(
                    &m,
                    ParamSpec::host(&t.name, DType::F8E4m3, &t.shape),
                    s,
                    engine,
                )
            })
            .collect();
        for (seed, step) in [(1, "1"), (2, "2")] {
            let ts = model(seed);
            write_snapshot(dir.path(), &ts, step);
            let mut req = UpdateRequest::snapshot(dir.path());
            req.mode = mode;
            req.verify = true;
            assert_eq!(m.update(req).unwrap().version, step);
            for ((t, scheme), [w, s]) in ts.iter().zip(schemes).zip(&params) {
                let (want_q, want_s) = reference(t, scheme);
                let what = format!(
                    "{mode:?} engine-owned {engine} swap {swap} v{step} '{}'",
                    t.name
                );
                assert_same(&download(w.0, w.1), &want_q, &what);
                let want_s = scale_bytes(scheme, &want_s);
                assert_eq!(download(s.0, s.1), want_s, "{what}: scales");
            }
        }
    }
}

/// A [300, 256] bf16 tensor in row shards of 75 from four publishers
/// (every 128-row block split over two or three of them), quantized by the
/// publishers from host memory, into FP8 params on the GPU holding column
/// half 1: the FP8 bytes arrive as any device param's, the scales are
/// uploaded at the commit.
fn publishers_into_device_params(via: SourceKind) {
    let g = tensor("g", DType::Bf16, &[300, 256], 3);
    let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
    let half_q: Vec<u8> = want_q
        .chunks(256)
        .flat_map(|row| row[128..].to_vec())
        .collect();
    let half_s: Vec<f32> = want_s.chunks(2).map(|r| r[1]).collect();
    let dir = tempfile::tempdir().unwrap();
    let ps = row_publishers(dir.path(), via, &g, b"device-quant-test-secret");
    let m = common::sharded::net_engine("device-quant-test-secret");
    let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
    spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
    let [w, s] = quantized_on_gpu(&m, spec, Scheme::Fp8Block128, false);
    let req = pull(&ps, via);
    let (r, _) = serving(&ps, || m.update(req));
    // The params took the FP8 bytes (the wire's) and 3 f32 scales.
    assert_eq!(r.unwrap().bytes, 300 * 128 + 3 * 4, "{via:?}: FP8 params");
    assert_same(&download(w.0, w.1), &half_q, &format!("{via:?}: fp8 bytes"));
    assert_eq!(f32s(&download(s.0, s.1)), half_s, "{via:?}: scales");
}

/// The same row shards published as a GPU version by four IPC publishers
/// (each copies its shard into a GPU buffer): the publishers' kernels find
/// the blocks' amax and quantize on the GPU, copy only the FP8 image to
/// host memory, and the engine (FP8 params in host memory, then on the
/// GPU) gets the global tensor's quantization; a NaN in one shard fails
/// the update naming the tensor and its element, and the old weights stay.
fn gpu_versions_quantized_by_their_publishers() {
    let g = tensor("g", DType::Bf16, &[300, 256], 5);
    let (want_q, want_s) = reference(&g, Scheme::Fp8Block128);
    let half_q: Vec<u8> = want_q
        .chunks(256)
        .flat_map(|row| row[128..].to_vec())
        .collect();
    let half_s: Vec<f32> = want_s.chunks(2).map(|r| r[1]).collect();
    let dir = tempfile::tempdir().unwrap();
    let (ps, _tensors) = gpu_publishers(dir.path(), &g);
    for on_gpu in [true, false] {
        let m = manager();
        let mut spec = ParamSpec::host("half", DType::F8E4m3, &[300, 128]);
        spec.pieces = vec![piece("g", &[0, 128], &[300, 128], &[0, 0])];
        let [w, s] = if on_gpu {
            quantized_on_gpu(&m, spec, Scheme::Fp8Block128, false)
        } else {
            let sc = ParamSpec::host("half.scale_inv", DType::F32, &[3, 1]);
            let (w, wn) = m.allocate(&spec).unwrap();
            let (s, sn) = m.allocate(&sc).unwrap();
            m.quantize("half", "half.scale_inv", Scheme::Fp8Block128)
                .unwrap();
            [(w as u64, wn), (s as u64, sn)]
        };
        let req = pull(&ps, SourceKind::Ipc);
        let (r, served) = serving(&ps, || m.update(req));
        assert_eq!(
            r.unwrap().bytes,
            300 * 128 + 3 * 4,
            "on GPU {on_gpu}: FP8 params and their scales"
        );
        let quantized: u64 = served
            .into_iter()
            .map(|s| s.unwrap().sessions[0].quantized)
            .sum();
        assert_eq!(
            quantized,
            300 * 128 * 2,
            "the publishers read each element once"
        );
        assert_same(
            &download_any(w, on_gpu),
            &half_q,
            &format!("GPU version, params on GPU {on_gpu}"),
        );
        assert_eq!(
            f32s(&download_any(s, on_gpu)),
            half_s,
            "GPU version: scales"
        );
        if on_gpu {
            continue;
        }
        a_nan_in_a_gpu_version(&ps, &m, &g, (w, &half_q));
    }
}

/// Four IPC publishers, each with its 75 rows of `g` published as a GPU
/// version (copied into a GPU buffer of its own by `publish`), and the
/// device memory of their tensors (a later publish copies it again: the
/// caller keeps it).
fn gpu_publishers(dir: &Path, g: &T) -> (Vec<Publisher>, Vec<DeviceAllocation>) {
    let row = 256 * 2;
    (0..4u64)
        .map(|r| {
            let p = Publisher::bind(&dir.join(format!("g{r}.sock")), PublisherConfig::default())
                .unwrap();
            let bytes = &g.data[(r * 75 * row) as usize..((r + 1) * 75 * row) as usize];
            let d = upload(0, bytes);
            let placement = Placement {
                global_shape: g.shape.clone(),
                offset: vec![r * 75, 0],
            };
            let desc = TensorDesc::device("g", DType::Bf16, &[75, 256], d.ptr(), bytes.len(), 0);
            // SAFETY: the caller keeps the device memory while `p` lives.
            unsafe { p.add(desc.shard_of(placement)) }.unwrap();
            p.set_version(Some("1".into()));
            p.publish().unwrap();
            (p, d)
        })
        .unzip()
}

/// Version 2 of `ps` with a NaN in rank 2's shard at its row 3, column
/// 200 (global [153, 200]): the update fails naming it, and the host FP8
/// param `w` keeps version 1's bytes `old`.
fn a_nan_in_a_gpu_version(ps: &[Publisher], m: &Manager, g: &T, (w, old): ((u64, usize), &[u8])) {
    let row = 256 * 2usize;
    let mut bad = g.data[150 * row..225 * row].to_vec();
    let at = (3 * 256 + 200) * 2;
    bad[at..at + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let d = upload(0, &bad);
    let placement = Placement {
        global_shape: g.shape.clone(),
        offset: vec![150, 0],
    };
    for (r, p) in ps.iter().enumerate() {
        p.set_version(Some("2".into()));
        if r == 2 {
            p.clear_tensors();
            let desc = TensorDesc::device("g", DType::Bf16, &[75, 256], d.ptr(), bad.len(), 0);
            // SAFETY: the device copy lives until publish returns.
            unsafe { p.add(desc.shard_of(placement.clone())) }.unwrap();
        }
        p.publish().unwrap();
    }
    let (r, _) = serving(ps, || m.update(pull(ps, SourceKind::Ipc)));
    let e = r.unwrap_err();
    assert!(
        e.message.contains("tensor 'g'") && e.message.contains("[153, 200]"),
        "{}",
        e.message
    );
    assert_same(&download_any(w, false), old, "version 1 stays");
}

/// A param's bytes: downloaded from the GPU, or read from host memory.
fn download_any((ptr, len): (u64, usize), on_gpu: bool) -> Vec<u8> {
    match on_gpu {
        true => download(ptr, len),
        // SAFETY: a registered host param, not written while read.
        false => unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec(),
    }
}

/// A weight and its scales in different places are refused, naming both.
fn scales_elsewhere_are_refused() {
    let m = manager();
    m.allocate(&device(ParamSpec::host("w", DType::F8E4m3, &[256, 256])))
        .unwrap();
    m.allocate(&ParamSpec::host("w.scale_inv", DType::F32, &[2, 2]))
        .unwrap();
    let e = m
        .quantize("w", "w.scale_inv", Scheme::Fp8Block128)
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT);
    assert!(
        e.message.contains("'w'")
            && e.message.contains("GPU 0")
            && e.message.contains("host memory"),
        "{}",
        e.message
    );
}

#[test]
fn fp8_device_params_under_the_test_driver() {
    if !under_fake_driver("fp8_device_params_under_the_test_driver", false) {
        return;
    }
    let fake = Fake::open();
    let before = fake.calls("cuLaunchKernel");
    snapshot_into_device_params();
    assert!(
        fake.calls("cuLaunchKernel") > before,
        "the kernels quantized the snapshot"
    );
    publishers_into_device_params(SourceKind::Ipc);
    // A CUDA-enabled UCX (scripts/gpu.sh sets WM_REQUIRE_GDR with one)
    // loads its CUDA transport against the test driver, which lacks the
    // driver's full API: the network run is then tests/gpu.rs's, on the
    // real driver.
    if std::env::var_os("WM_REQUIRE_GDR").is_none() {
        publishers_into_device_params(SourceKind::Rdma);
    }
    let before = fake.calls("cuLaunchKernel");
    gpu_versions_quantized_by_their_publishers();
    assert!(
        fake.calls("cuLaunchKernel") > before,
        "the publishers' kernels quantized"
    );
    scales_elsewhere_are_refused();
}

#[test]
fn fp8_device_params_on_a_gpu() {
    if !real_gpu() {
        return;
    }
    snapshot_into_device_params();
    publishers_into_device_params(SourceKind::Ipc);
    publishers_into_device_params(SourceKind::Rdma);
    gpu_versions_quantized_by_their_publishers();
    scales_elsewhere_are_refused();
}
