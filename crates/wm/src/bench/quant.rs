//! `wm bench quant [--gib N] [--runs N] [--update-gib N]`: FP8 E4M3 quantization with
//! 128 x 128 block scales of bf16 weights (the library's `quant`), then
//! the same for MXFP8 (blocks of 32 along a row, E8M0 scales), beside its
//! floor and beside PyTorch doing the same job, in the same run.
//!
//! - Floor: memcpy of the same bf16 bytes (one thread for the one-core
//!   figure, every core for the all-core one). Target: quantizing runs at
//!   >= 0.5 of it per core.
//! - PyTorch peer: the reference expression the library matches bit for bit
//!   (DeepGEMM's `per_block_cast_to_fp8`, and the OCP MX rule as the tests
//!   write it for MXFP8, vectorized by PyTorch) on the
//!   same bytes, in a Python process kept running, with the same number of
//!   threads (`torch.set_num_threads`). Ours and PyTorch's runs alternate
//!   (the order flipping every pair), and the figure is the median of the
//!   per-pair ratios. Target: ours >= 2x faster.
//!
//! Then (`--update-gib`) a bf16 model updated into FP8 params against the
//! same into bf16 params (`quant_update.rs`).
//!
//! Inputs: 64 MiB bf16 tensors of [4096, 8192] with values like trained
//! weights (about 1e-2, a few blocks far larger or smaller).

use super::harness::floors::memcpy_floor;
use super::harness::torch::TorchPeer;
use super::harness::{alternate, verdict, Scratch};
use crate::fmt::gbps;
use std::time::{Duration, Instant};
use weight_manager_core::quant::{self, Scheme, Source};
use weight_manager_core::DType;

const SHAPE: [usize; 2] = [4096, 8192];

/// `wm bench quant` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes of bf16 weights quantized in GiB (tensors of 64 MiB, at least
    /// one); 0 skips that section
    #[arg(long, default_value_t = 0.25, value_parser = crate::gib)]
    gib: f64,
    /// Pairs of alternating runs
    #[arg(long, default_value_t = 5, value_parser = crate::count)]
    runs: usize,
    /// Bytes of the bf16 model updated into FP8 params and into bf16 ones
    /// (over UCX and from a snapshot), in GiB; 0 skips that section
    #[arg(long, default_value_t = 0.25, value_parser = crate::gib)]
    update_gib: f64,
}

/// The block edge of the 128x128 scheme (the inputs' magnitudes change
/// from one such block to the next).
fn block() -> usize {
    Scheme::block_edge()
}

/// The block rows and columns of `scheme` (both measured schemes have
/// blocks).
fn dims(scheme: Scheme) -> (usize, usize) {
    let (bh, bw) = scheme.block_dims().expect("a scheme of blocks");
    (bh as usize, bw as usize)
}

/// PyTorch's side: reads the tensors once, then times the reference
/// expression over all of them on each `run <threads>` line.
const TORCH_PEER: &str = r#"
import sys, time, numpy as np, torch
path, n, M, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
xs = [raw[i * M * N * 2:(i + 1) * M * N * 2].view(torch.bfloat16).reshape(M, N) for i in range(n)]
def quant(x):
    m, n = x.shape
    xp = x
    if m % 128 or n % 128:  # padded only where the shape needs it
        xp = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype)
        xp[:m, :n] = x
    xv = xp.view(-1, 128, xp.size(1) // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (xv * (448.0 / amax)).to(torch.float8_e4m3fn)
    q = q.view_as(xp)
    if xp is not x:
        q = q[:m, :n].contiguous()
    return q, (amax / 448.0).view(xv.size(0), xv.size(2))
def quant_mx(x):
    m, n = x.shape
    v = x.float().view(m, n // 32, 32)
    amax = v.abs().amax(dim=2, keepdim=True)
    e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8).clamp(-127, 127)
    two_e = torch.where(e > -127, (e + 127) << 23, torch.full_like(e, 1 << 22)).view(torch.float32)
    q = (v / two_e).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(m, n), (e + 127).to(torch.uint8).view(m, n // 32)
print("ready", flush=True)
for line in sys.stdin:
    _, threads, scheme = line.split()
    torch.set_num_threads(int(threads))
    f = quant_mx if scheme == "mxfp8" else quant
    t = time.perf_counter()
    for x in xs:
        f(x)
    print(time.perf_counter() - t, flush=True)
"#;

/// Quantize every tensor with `scheme` on `threads` threads (each a band
/// of whole block rows: bands share no block, so each is quantized alone).
fn ours(
    scheme: Scheme,
    inputs: &[Vec<u8>],
    outputs: &mut [(Vec<u8>, Vec<f32>)],
    threads: usize,
) -> Duration {
    let t = Instant::now();
    let (bh, bw) = dims(scheme);
    let band_rows = SHAPE[0].div_ceil(bh).div_ceil(threads.max(1)) * bh;
    for (x, (q, s)) in inputs.iter().zip(outputs.iter_mut()) {
        let row = SHAPE[1];
        let scale_row = SHAPE[1].div_ceil(bw) * band_rows / bh;
        std::thread::scope(|sc| {
            let bands = x
                .chunks(band_rows * row * 2)
                .zip(q.chunks_mut(band_rows * row));
            for ((xb, qb), sb) in bands.zip(s.chunks_mut(scale_row)) {
                sc.spawn(move || {
                    let src = Source {
                        dtype: DType::Bf16,
                        bytes: xb,
                        rows: qb.len() / row,
                        cols: row,
                    };
                    // Bands of whole block rows are tensors of their own.
                    quant::quantize(scheme, src, qb, sb).expect("finite weights");
                });
            }
        });
    }
    t.elapsed()
}

/// bf16 weights: about 1e-2, every 16th block 1e3 times larger or smaller.
fn weights(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(SHAPE[0] * SHAPE[1] * 2);
    for i in 0..SHAPE[0] {
        for j in 0..SHAPE[1] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let scale = match ((i / block()) * 64 + j / block()) % 16 {
                0 => 10.0,
                1 => 1e-5,
                _ => 0.02,
            };
            let bits = (unit * scale).to_bits();
            let h = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            out.extend(h.to_le_bytes());
        }
    }
    out
}

pub fn run(a: &Args) -> Result<(), String> {
    let bytes_each = SHAPE[0] * SHAPE[1] * 2;
    if !(a.gib >= 0.0 && a.update_gib >= 0.0) {
        return Err(format!(
            "--gib {} and --update-gib {}: GiB, 0 or more",
            a.gib, a.update_gib
        ));
    }
    if a.gib > 0.0 {
        quantize_section(a.gib, a.runs)?;
    }
    if a.update_gib > 0.0 {
        let n = ((a.update_gib * (1u64 << 30) as f64) as usize / bytes_each).max(1);
        let layers: Vec<Vec<u8>> = (0..n).map(|i| weights(i as u64 + 1)).collect();
        super::quant_update::run(&layers, a.runs)?;
    }
    Ok(())
}

/// Quantizing `gib` of bf16 weights, 128x128 blocks then MXFP8, on one
/// core and on all, beside memcpy and PyTorch.
fn quantize_section(gib: f64, pairs: usize) -> Result<(), String> {
    let bytes_each = SHAPE[0] * SHAPE[1] * 2;
    let count = ((gib * (1u64 << 30) as f64) as usize / bytes_each).max(1);
    let inputs: Vec<Vec<u8>> = (0..count).map(|i| weights(i as u64 + 1)).collect();
    let total = (count * bytes_each) as u64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "wm bench quant: {count} bf16 tensors of {SHAPE:?} ({:.2} GiB) to FP8 E4M3, 128x128 block scales, then MXFP8; {cores} cores",
        total as f64 / (1u64 << 30) as f64
    );
    let scratch = Scratch::temp("wm-bench-quant")?;
    let file = scratch.0.join("weights.bin");
    std::fs::write(&file, inputs.concat()).map_err(|e| e.to_string())?;
    let args = [file.display().to_string(), count.to_string()];
    let args = [&args[..], &SHAPE.map(|x| x.to_string())].concat();
    let mut torch = TorchPeer::start(TORCH_PEER, &args);
    if let Err(e) = &torch {
        println!("  torch  skipped: {e}");
    }
    for scheme in [Scheme::Fp8Block128, Scheme::Mxfp8] {
        let [sr, sc] = scheme.scales_shape(SHAPE[0], SHAPE[1]);
        let mut outputs: Vec<(Vec<u8>, Vec<f32>)> = (0..count)
            .map(|_| (vec![1u8; SHAPE[0] * SHAPE[1]], vec![0f32; sr * sc]))
            .collect();
        println!("  {}:", scheme.name());
        for threads in [1, cores] {
            section(
                (scheme, &inputs),
                &mut outputs,
                threads,
                torch.as_mut().ok(),
                (total, pairs),
            )?;
            if cores == 1 {
                break;
            }
        }
    }
    drop(torch);
    Ok(())
}

/// One thread count: ours beside memcpy, and beside PyTorch, alternating.
fn section(
    (scheme, inputs): (Scheme, &[Vec<u8>]),
    outputs: &mut [(Vec<u8>, Vec<f32>)],
    threads: usize,
    torch: Option<&mut TorchPeer>,
    (total, pairs): (u64, usize),
) -> Result<(), String> {
    let mut dst: Vec<Vec<u8>> = inputs.iter().map(|x| vec![1u8; x.len()]).collect();
    let outputs = std::cell::RefCell::new(outputs);
    let quantize = || Ok(ours(scheme, inputs, &mut outputs.borrow_mut(), threads));
    // The floor's own time (its fastest way per tensor), not the time
    // around it: `memcpy_floor` copies each tensor three ways.
    let copy = || {
        let mut took = Duration::ZERO;
        for (d, x) in dst.iter_mut().zip(inputs) {
            took += memcpy_floor(x, d, threads)?;
        }
        Ok(took)
    };
    let (r, o, c) = alternate(pairs, quantize, copy)?;
    // One core against memcpy on one core; all cores against memcpy on
    // all of them (the same target: a core quantizes at half memcpy's pace
    // or better, when the others do too).
    let per_core = if threads == 1 {
        " per core"
    } else {
        " on all cores"
    };
    println!(
        "  {threads} thread(s): wm quantize {:.2} GB/s of bf16, memcpy of the same bytes {:.2} GB/s: ratio {r:.2} (median of {pairs} pairs; target >= 0.5{per_core}) {}",
        gbps(total, o),
        gbps(total, c),
        verdict(r >= 0.5)
    );
    let Some(t) = torch else {
        return Ok(());
    };
    let command = format!("run {threads} {}", scheme.name());
    let (r, _, p) = alternate(pairs, quantize, || t.run(&command))?;
    println!(
        "  {threads} thread(s): PyTorch (same expression, same bytes) {:.2} GB/s: wm / torch {r:.2}x (median of {pairs} alternating pairs; target >= 2) {}",
        gbps(total, p),
        verdict(r >= 2.0)
    );
    Ok(())
}
