//! The quantizer against PyTorch on the CPU, byte for byte and scale for
//! scale: the reference expression (DeepGEMM's `per_block_cast_to_fp8`, and
//! the same over the whole tensor) runs in the test `.venv`'s PyTorch on
//! the same inputs. Without that Python the comparison is skipped with a
//! printed reason, except under CI (`CI` set), where it fails.
//!
//! `WM_TEST_TORCH_DEVICE=cuda` runs the reference on the GPU instead
//! (scripts/gpu.sh). PyTorch's CUDA kernels differ from its CPU ones in
//! two places, measured on an H200 with PyTorch 2.11, and the comparison
//! allows exactly those: the plain cast does not saturate (a value of
//! magnitude above 464, infinities included, becomes NaN, where the CPU
//! gives 448), and `amax / 448` is taken as `amax * (1 / 448)` (a tensor
//! divided by a scalar is a multiplication by its reciprocal on CUDA), so
//! a scale may be one unit in the last place away. The FP8 bytes of the
//! quantized blocks and tensors must be the same (their products never
//! reach 464).

use super::*;
use crate::test_rng::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;

const REFERENCE: &str = r#"
import os, sys, numpy as np, torch
d = sys.argv[1]
dev = os.environ.get("WM_TEST_TORCH_DEVICE", "cpu")
for job in open(d + "/jobs").read().split("\n"):
    if not job:
        continue
    name, dtype, M, N, scheme = job.split()
    M, N, p = int(M), int(N), d + "/" + name
    t = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    if scheme == "cast":
        x = torch.from_numpy(np.fromfile(p + ".x", dtype=np.float32)).to(dev)
        x.to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy().tofile(p + ".q")
        continue
    x = torch.from_numpy(np.fromfile(p + ".x", dtype=np.uint8)).view(t).reshape(M, N).to(dev)
    if scheme == "blocks":
        bm, bn = -(-M // 128), -(-N // 128)
        xp = torch.zeros((bm * 128, bn * 128), dtype=t, device=dev)
        xp[:M, :N] = x
        xv = xp.view(bm, 128, bn, 128)
        amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        q = (xv * (448.0 / amax)).to(torch.float8_e4m3fn).view_as(xp)[:M, :N].contiguous()
        s = (amax / 448.0).view(bm, bn)
    elif scheme == "mx":
        bn = -(-N // 32)
        xp = torch.zeros((M, bn * 32), dtype=t, device=dev)
        xp[:, :N] = x
        xv = xp.view(M, bn, 32).float()
        amax = xv.abs().amax(dim=2, keepdim=True)
        e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8).clamp(-127, 127)
        two_e = torch.where(e > -127, (e + 127) << 23, torch.full_like(e, 1 << 22))
        scale = two_e.view(torch.float32)
        q = (xv / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(M, bn * 32)[:, :N].contiguous()
        s = scale.view(M, bn)
        (e + 127).to(torch.uint8).cpu().numpy().tofile(p + ".e8m0")
    else:
        amax = x.abs().float().amax().clamp(1e-4)
        q = (x.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
        s = (amax / 448.0).view(1, 1)
    q.view(torch.uint8).cpu().numpy().tofile(p + ".q")
    s.float().cpu().numpy().tofile(p + ".s")
"#;

/// The Python with PyTorch: `WM_TEST_PYTHON`, else the repository's
/// `.venv` (made by `scripts/setup.sh`). None (skip) only outside CI.
pub(super) fn python() -> Option<PathBuf> {
    let p = std::env::var_os("WM_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"));
    let ok = Command::new(&p)
        .args(["-c", "import torch, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    match (ok, std::env::var_os("CI").is_some()) {
        (true, _) => Some(p),
        (false, true) => panic!(
            "{}: no PyTorch to compare with (run scripts/setup.sh)",
            p.display()
        ),
        (false, false) => {
            eprintln!(
                "skipped: {} has no PyTorch (run scripts/setup.sh)",
                p.display()
            );
            None
        }
    }
}

/// One input for the reference: its bytes, dtype name, shape and scheme
/// ("blocks", "tensor", "mx", or "cast": f32 values cast one by one). For
/// "mx" the scales are `2^e` as f32, and the E8M0 bytes are written beside
/// them (`<job>.e8m0`, read by [`reference_e8m0`]).
pub(super) struct Job<'a> {
    pub x: &'a [u8],
    pub dtype: &'a str,
    pub shape: (usize, usize),
    pub scheme: &'a str,
}

/// PyTorch's E4M3 bytes and scales of each job, from one Python process,
/// on the device `WM_TEST_TORCH_DEVICE` names (the CPU by default).
fn reference(py: &Path, jobs: &[Job]) -> Vec<(Vec<u8>, Vec<f32>)> {
    let device = std::env::var("WM_TEST_TORCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    reference_on(py, jobs, &device)
}

/// [`reference`] on `device`.
pub(super) fn reference_on(py: &Path, jobs: &[Job], device: &str) -> Vec<(Vec<u8>, Vec<f32>)> {
    let dir = run_reference(py, jobs, device);
    (0..jobs.len())
        .map(|i| {
            let q = std::fs::read(dir.path().join(format!("{i}.q"))).unwrap();
            let s = std::fs::read(dir.path().join(format!("{i}.s"))).unwrap_or_default();
            (q, f32s(&s))
        })
        .collect()
}

/// PyTorch run over `jobs` on `device`: the folder of its outputs.
pub(super) fn run_reference(py: &Path, jobs: &[Job], device: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut list = String::new();
    for (i, j) in jobs.iter().enumerate() {
        std::fs::write(dir.path().join(format!("{i}.x")), j.x).unwrap();
        let (m, n) = j.shape;
        list.push_str(&format!("{i} {} {m} {n} {}\n", j.dtype, j.scheme));
    }
    std::fs::write(dir.path().join("jobs"), list).unwrap();
    let out = Command::new(py)
        .args(["-c", REFERENCE, dir.path().to_str().unwrap()])
        .env("WM_TEST_TORCH_DEVICE", device)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

pub(super) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Finite f32 values of every kind, block by block: each 128 x 128 block
/// picks a magnitude range (weights around 1e-2, large, tiny with
/// subnormal bf16/f16 values, all zero, or one repeated value at the
/// block's max), so blocks' scales differ.
pub(super) fn values(rng: &mut Rng, (m, n): (usize, usize)) -> Vec<f32> {
    let kinds: Vec<u64> = (0..m.div_ceil(128) * n.div_ceil(128))
        .map(|_| rng.next() % 5)
        .collect();
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let kind = kinds[(i / 128) * n.div_ceil(128) + j / 128];
            let r = rng.next();
            let unit = (r >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0;
            out.push(match kind {
                0 => unit * 0.02,
                1 => unit * 3.0e4,
                2 => unit * 1.0e-6,
                3 => 0.0,
                _ => {
                    if r.is_multiple_of(3) {
                        -7.5
                    } else {
                        unit * 7.5
                    }
                }
            });
        }
    }
    out
}

/// `values` as little-endian bytes of `dtype` (rounded to nearest even).
pub(super) fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    let bf16 = |x: f32| {
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    };
    match dtype {
        DType::Bf16 => v.iter().flat_map(|&x| bf16(x).to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f32_to_f16(x).to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Single to half, to nearest even (for making test inputs only).
fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = f32::from_bits(b & 0x7fff_ffff);
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a < 2f32.powi(-14) {
        // Subnormal: units of 2^-24, rounded to nearest even by the f32 add.
        let m = (a * 2f32.powi(24)).round_ties_even() as u16;
        return sign | m;
    }
    let e = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let m = b & 0x7f_ffff;
    let mut h = ((e as u32) << 10) | (m >> 13);
    let rest = m & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    sign | h as u16
}

pub(super) fn ours(
    scheme: Scheme,
    dtype: DType,
    x: &[u8],
    (m, n): (usize, usize),
) -> (Vec<u8>, Vec<f32>) {
    let [sr, sc] = scheme.scales_shape(m, n);
    let (mut q, mut s) = (vec![0u8; m * n], vec![0f32; sr * sc]);
    let src = Source {
        dtype,
        bytes: x,
        rows: m,
        cols: n,
    };
    quantize(scheme, src, &mut q, &mut s).unwrap();
    (q, s)
}

/// Whether the reference runs on the GPU (`WM_TEST_TORCH_DEVICE=cuda`).
fn torch_on_cuda() -> bool {
    std::env::var("WM_TEST_TORCH_DEVICE").is_ok_and(|d| d.starts_with("cuda"))
}

pub(super) fn same(what: &str, (q, s): (Vec<u8>, Vec<f32>), (rq, rs): (Vec<u8>, Vec<f32>)) {
    assert_eq!(q.len(), rq.len(), "{what}");
    if let Some(i) = (0..q.len()).find(|&i| q[i] != rq[i]) {
        panic!(
            "{what}: byte {i}: ours {:#04x}, PyTorch {:#04x}",
            q[i], rq[i]
        );
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if !torch_on_cuda() {
        assert_eq!(bits(&s), bits(&rs), "{what}: scales");
        return;
    }
    assert_eq!(s.len(), rs.len(), "{what}: scales");
    for (i, (a, b)) in bits(&s).into_iter().zip(bits(&rs)).enumerate() {
        assert!(
            a.abs_diff(b) <= 1,
            "{what}: scale {i}: ours {}, PyTorch (CUDA) {}",
            s[i],
            rs[i]
        );
    }
}

#[test]
fn the_cast_matches_pytorch_for_every_bf16_value_and_its_neighbours() {
    let Some(py) = python() else { return };
    // Every bf16 bit pattern as f32 (NaN and infinities included), then
    // the same moved by an odd number of f32 units (ties and near-ties).
    let mut x: Vec<f32> = (0..=u16::MAX)
        .map(|h| f32::from_bits((h as u32) << 16))
        .collect();
    let more: Vec<f32> = x
        .iter()
        .map(|v| f32::from_bits(v.to_bits() ^ 0x0008_0001))
        .collect();
    x.extend(more);
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let job = Job {
        x: &bytes,
        dtype: "f32",
        shape: (x.len(), 1),
        scheme: "cast",
    };
    let (rq, _) = reference(&py, &[job]).remove(0);
    let cuda = torch_on_cuda();
    for (i, v) in x.iter().enumerate() {
        if cuda && v.abs() > 464.0 {
            assert_eq!(rq[i] & 0x7f, 0x7f, "{v:e}: PyTorch's CUDA cast gave no NaN");
            continue;
        }
        assert_eq!(e4m3::from_f32(*v), rq[i], "{v:e} ({:#010x})", v.to_bits());
    }
}

#[test]
fn blocks_and_whole_tensors_match_pytorch_bit_for_bit() {
    let Some(py) = python() else { return };
    let mut rng = Rng(7);
    let cases = [
        (DType::Bf16, (300, 260)),
        (DType::Bf16, (128, 128)),
        (DType::F16, (129, 385)),
        (DType::F32, (77, 200)),
        (DType::Bf16, (1, 1000)),
    ];
    let inputs: Vec<(DType, (usize, usize), Vec<u8>)> = cases
        .iter()
        .map(|&(dtype, shape)| (dtype, shape, encode(&values(&mut rng, shape), dtype)))
        .collect();
    let name = |dtype: DType| match dtype {
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    };
    let schemes = [
        (Scheme::Fp8Block128, "blocks"),
        (Scheme::Fp8Tensor, "tensor"),
        (Scheme::Mxfp8, "mx"),
    ];
    let mut jobs = Vec::new();
    for (dtype, shape, x) in &inputs {
        for (_, scheme) in schemes {
            jobs.push(Job {
                x,
                dtype: name(*dtype),
                shape: *shape,
                scheme,
            });
        }
    }
    let mut theirs = reference(&py, &jobs).into_iter();
    for (dtype, shape, x) in &inputs {
        for (scheme, s) in schemes {
            let what = format!("{} {shape:?} {s}", name(*dtype));
            same(
                &what,
                ours(scheme, *dtype, x, *shape),
                theirs.next().unwrap(),
            );
        }
    }
}

#[test]
fn a_block_split_over_holders_quantizes_as_the_whole() {
    // Four holders of 28-row FSDP shards (and one of the rest) of a
    // [300, 260] tensor: partial amaxes combined by max, then each part
    // quantized with them, give the whole tensor's bytes and scales.
    let mut rng = Rng(11);
    let (m, n) = (300, 260);
    let x = encode(&values(&mut rng, (m, n)), DType::Bf16);
    let whole = ours(Scheme::Fp8Block128, DType::Bf16, &x, (m, n));
    let cuts = [0, 28, 56, 84, 112, m];
    let part = |k: usize| Source {
        dtype: DType::Bf16,
        bytes: &x[cuts[k] * n * 2..cuts[k + 1] * n * 2],
        rows: cuts[k + 1] - cuts[k],
        cols: n,
    };
    let [sr, sc] = Scheme::Fp8Block128.scales_shape(m, n);
    let mut amax = vec![0f32; sr * sc];
    for (k, &at) in cuts[..cuts.len() - 1].iter().enumerate() {
        let mut mine = vec![0f32; sr * sc];
        block_amax(Scheme::Fp8Block128, part(k), [at, 0], [m, n], &mut mine).unwrap();
        amax.iter_mut().zip(&mine).for_each(|(a, b)| *a = a.max(*b));
    }
    let (mut q, mut s) = (Vec::new(), vec![0f32; sr * sc]);
    for (k, &at) in cuts[..cuts.len() - 1].iter().enumerate() {
        let mut mine = vec![0u8; part(k).rows * n];
        quantize_with(
            Scheme::Fp8Block128,
            part(k),
            ([at, 0], [m, n]),
            &amax,
            &mut mine,
            &mut s,
        )
        .unwrap();
        q.extend(mine);
    }
    same("split over holders", (q, s), whole);
}

#[test]
fn a_non_finite_element_is_named_and_bad_sizes_refused() {
    let mut v = vec![0.5f32; 40 * 30];
    v[7 * 30 + 3] = f32::NAN;
    let x = encode(&v, DType::Bf16);
    let src = Source {
        dtype: DType::Bf16,
        bytes: &x,
        rows: 40,
        cols: 30,
    };
    let (mut q, mut s) = (vec![0u8; 1200], vec![0f32; 1]);
    match quantize(Scheme::Fp8Block128, src, &mut q, &mut s) {
        Err(QuantError::NonFinite { index, value }) => assert!(index == 213 && value.is_nan()),
        other => panic!("{other:?}"),
    }
    v[7 * 30 + 3] = f32::NEG_INFINITY;
    let x = encode(&v, DType::F32);
    let src = Source {
        dtype: DType::F32,
        bytes: &x,
        rows: 40,
        cols: 30,
    };
    assert!(matches!(
        quantize(Scheme::Fp8Tensor, src, &mut q, &mut s),
        Err(QuantError::NonFinite { index: 213, .. })
    ));
    // Past the first band of 128 rows: the index still counts from the
    // tensor's first element.
    let mut tall = vec![0.25f32; 300 * 30];
    tall[200 * 30 + 4] = f32::INFINITY;
    let x = encode(&tall, DType::Bf16);
    let src = Source {
        dtype: DType::Bf16,
        bytes: &x,
        rows: 300,
        cols: 30,
    };
    let (mut q3, mut s3) = (vec![0u8; 9000], vec![0f32; 3]);
    assert!(matches!(
        quantize(Scheme::Fp8Block128, src, &mut q3, &mut s3),
        Err(QuantError::NonFinite { index: 6004, .. })
    ));
    assert!(matches!(
        quantize(Scheme::Fp8Block128, src, &mut q3[1..], &mut s3),
        Err(QuantError::Invalid(_))
    ));
    let ints = Source {
        dtype: DType::I32,
        bytes: &x,
        rows: 40,
        cols: 30,
    };
    assert!(matches!(
        quantize(Scheme::Fp8Tensor, ints, &mut q, &mut s),
        Err(QuantError::Invalid(_))
    ));
    let short = Source {
        dtype: DType::F32,
        bytes: &x[4..],
        rows: 40,
        cols: 30,
    };
    assert!(matches!(
        quantize(Scheme::Fp8Tensor, short, &mut q, &mut s),
        Err(QuantError::Invalid(_))
    ));
}

#[test]
fn f16_widens_exactly() {
    for h in 0..=u16::MAX {
        let v = f16_to_f32(h);
        if v.is_nan() {
            continue;
        }
        assert_eq!(f32_to_f16(v), h, "{h:#06x} = {v:e}");
    }
}
