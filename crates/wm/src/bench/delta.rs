//! `wm bench delta [--data DIR] [--gib N] [--runs N]`: deltas of weights
//! between training steps (`weight_manager_core::delta`), each figure beside its
//! floor in the same run.
//!
//! - Training data: the steps `scripts/delta_steps.py` writes (a small
//!   transformer, bf16 weights with fp32 masters and AdamW, two learning
//!   rates; made into a temporary folder unless `--data` names one). Per
//!   step: the share of elements that changed, and delta bytes / whole
//!   bytes in bf16 and for the same weights quantized to FP8 with 128x128
//!   blocks (the share of blocks whose scale changed, of FP8 bytes that
//!   changed, and delta / whole FP8 bytes with the scales).
//! - At 0.5%, 2%, 10% and 50% of bf16 elements changed (64 MiB): delta /
//!   whole bytes (target at 2%: <= 0.04); encoding and applying, one core,
//!   against memcpy of the whole bytes (target >= 0.5); and PyTorch doing
//!   the same on the same bytes, one thread, alternating:
//!   `torch.nonzero(new != old)` plus gathering the values, and applying
//!   with `index_put_` (target: ours >= 3x faster at each).
//! - Update time (`delta_update.rs`): a model's next version as deltas
//!   against the engine's version and whole, over IPC and UCX, alternating
//!   (target at 2%: >= 10x faster over UCX); with `--gpu N` into device
//!   params on GPU N, in place and atomic.

use super::harness::floors::memcpy_floor;
use super::harness::torch::TorchPeer;
use super::harness::{alternate, python, verdict, Scratch};
use crate::fmt::gbps;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::delta;
use weight_manager_core::quant::{self, Scheme, Source};
use weight_manager_core::DType;

const TORCH_PEER: &str = r#"
import sys, time, numpy as np, torch
torch.set_num_threads(1)
d, shares = sys.argv[1], sys.argv[2].split(",")
old = torch.from_numpy(np.fromfile(d + "/old.bin", dtype=np.int16))
news = {s: torch.from_numpy(np.fromfile(d + "/new" + s + ".bin", dtype=np.int16)) for s in shares}
enc = {}
run = old.clone()
print("ready", flush=True)
for line in sys.stdin:
    what, s = line.split()
    new = news[s]
    if what == "encode":
        t = time.perf_counter()
        idx = torch.nonzero(new != old).squeeze(1)
        vals = new[idx]
        dt = time.perf_counter() - t
        enc[s] = (idx, vals)
    else:
        idx, vals = enc[s]
        run.copy_(old)
        t = time.perf_counter()
        run.index_put_((idx,), vals)
        dt = time.perf_counter() - t
    print(dt, flush=True)
"#;

/// `wm bench delta` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The training steps `scripts/delta_steps.py` wrote (default: made
    /// in a temporary folder)
    #[arg(long)]
    data: Option<PathBuf>,
    /// Bytes of the random bf16 weights in GiB
    #[arg(long, default_value_t = 0.0625, value_parser = crate::gib)]
    gib: f64,
    /// Pairs of alternating runs
    #[arg(long, default_value_t = 5, value_parser = crate::count)]
    runs: usize,
    /// The update section's model in GiB (0: skip that section)
    #[arg(long, default_value_t = 0.5, value_parser = crate::gib)]
    update_gib: f64,
    /// The update section's shares of changed elements
    #[arg(long, value_delimiter = ',', default_value = "0.02")]
    update_shares: Vec<f64>,
    /// Run the update section only
    #[arg(long)]
    update_only: bool,
    /// The update section's params on this GPU (library-owned device
    /// params, in place and atomic) instead of host memory
    #[arg(long)]
    gpu: Option<i32>,
}

pub fn run(a: &Args) -> Result<(), String> {
    println!("wm bench delta: lossless deltas of bf16 weights between steps");
    let update = || super::delta_update::run(a.update_gib, &a.update_shares, a.runs, a.gpu);
    if a.update_only {
        return update();
    }
    training_steps(a.data.as_deref())?;
    synthetic(
        ((a.gib * (1u64 << 30) as f64) as usize / 2).max(1 << 16),
        a.runs,
    )?;
    if a.update_gib > 0.0 {
        update()?;
    }
    Ok(())
}

/// The steps of each learning rate: per step, what changed and what a
/// delta costs, in bf16 and FP8.
fn training_steps(data: Option<&Path>) -> Result<(), String> {
    // Made (and removed) only when the steps are generated here.
    let mut scratch = None;
    let dir = match data {
        Some(d) => d.to_path_buf(),
        None => {
            let made = scratch.insert(Scratch::temp("wm-bench-delta")?);
            if let Err(e) = generate(&made.0) {
                println!("  training steps skipped: {e}");
                return Ok(());
            }
            made.0.clone()
        }
    };
    let mut lrs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    lrs.sort();
    for lr in lrs {
        println!(
            "  {}:",
            lr.file_name().unwrap_or_default().to_string_lossy()
        );
        let mut prev = read_step(&lr, 0)?;
        for k in 1.. {
            let Ok(next) = read_step(&lr, k) else { break };
            println!("    step {k:>2}: {}", step_line(&prev, &next)?);
            prev = next;
        }
    }
    Ok(())
}

/// Run the generator (`scripts/delta_steps.py`) with the bench's Python.
fn generate(out: &Path) -> Result<(), String> {
    let py = python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/delta_steps.py");
    let status = std::process::Command::new(&py)
        .arg(&script)
        .arg(out)
        .status()
        .map_err(|e| format!("running {py}: {e}"))?;
    match status.success() {
        true => Ok(()),
        false => Err(format!("{py} {} failed (needs torch)", script.display())),
    }
}

/// A step's bf16 tensors: (shape, bytes) in name order.
type Step = Vec<(Vec<usize>, Vec<u8>)>;

fn read_step(dir: &Path, k: usize) -> Result<Step, String> {
    let bytes =
        std::fs::read(dir.join(format!("step{k}.safetensors"))).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut names = st.names();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = st.tensor(n).map_err(|e| e.to_string())?;
            Ok((t.shape().to_vec(), t.data().to_vec()))
        })
        .collect()
}

/// Changed share, bf16 delta / whole; FP8: blocks whose scale changed,
/// bytes changed, delta / whole (2-D tensors; 1-D ones stay bf16).
fn step_line(prev: &Step, next: &Step) -> Result<String, String> {
    let (mut changed, mut elems, mut d16, mut w16) = (0u64, 0u64, 0usize, 0usize);
    let (mut blocks, mut moved_blocks, mut fp8_changed, mut d8, mut w8) = (0, 0, 0u64, 0, 0);
    for ((shape, a), (_, b)) in prev.iter().zip(next) {
        let mut out = Vec::new();
        changed += delta::encode(a, b, 2, &mut out).changed;
        (elems, d16, w16) = (elems + a.len() as u64 / 2, d16 + out.len(), w16 + a.len());
        let [m, n] = shape[..] else { continue };
        let (qa, sa) = fp8(a, m, n)?;
        let (qb, sb) = fp8(b, m, n)?;
        blocks += sa.len();
        moved_blocks += sa
            .iter()
            .zip(&sb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        fp8_changed += qa.iter().zip(&qb).filter(|(x, y)| x != y).count() as u64;
        let (mut dq, mut ds) = (Vec::new(), Vec::new());
        delta::encode(&qa, &qb, 1, &mut dq);
        let bits = |s: &[f32]| s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        delta::encode(&bits(&sa), &bits(&sb), 4, &mut ds);
        (d8, w8) = (d8 + dq.len() + ds.len(), w8 + qa.len() + 4 * sa.len());
    }
    Ok(format!(
        "bf16: {:.2}% of elements changed, delta / whole {:.4}; FP8 128x128: {:.1}% of scales and {:.2}% of bytes changed, delta / whole {:.4}",
        100.0 * changed as f64 / elems as f64,
        d16 as f64 / w16 as f64,
        100.0 * moved_blocks as f64 / blocks.max(1) as f64,
        100.0 * fp8_changed as f64 / (w8 as f64 - 4.0 * blocks as f64).max(1.0),
        d8 as f64 / w8.max(1) as f64,
    ))
}

fn fp8(bf16: &[u8], m: usize, n: usize) -> Result<(Vec<u8>, Vec<f32>), String> {
    let [sr, sc] = Scheme::Fp8Block128.scales_shape(m, n);
    let (mut q, mut s) = (vec![0u8; m * n], vec![0f32; sr * sc]);
    let src = Source {
        dtype: DType::Bf16,
        bytes: bf16,
        rows: m,
        cols: n,
    };
    quant::quantize(Scheme::Fp8Block128, src, &mut q, &mut s).map_err(|e| format!("{e:?}"))?;
    Ok((q, s))
}

const SHARES: [(f64, &str); 4] = [(0.005, "0.5"), (0.02, "2"), (0.10, "10"), (0.50, "50")];

/// Random bf16 weights with each share of elements changed: sizes, speeds
/// against memcpy, and PyTorch beside ours.
fn synthetic(elems: usize, pairs: usize) -> Result<(), String> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let old: Vec<u8> = (0..elems * 2).map(|_| next() as u8).collect();
    let news: Vec<Vec<u8>> = SHARES
        .iter()
        .map(|&(share, _)| {
            let cut = (share * (1u64 << 32) as f64) as u64;
            let mut n = old.clone();
            for e in n.chunks_exact_mut(2) {
                if next() & 0xffff_ffff < cut {
                    e[0] ^= 1;
                }
            }
            n
        })
        .collect();
    let total = old.len() as u64;
    println!(
        "  random bf16, {:.0} MiB, one core:",
        total as f64 / (1u64 << 20) as f64
    );
    let scratch = Scratch::temp("wm-bench-delta-syn")?;
    let scratch = &scratch.0;
    std::fs::write(scratch.join("old.bin"), &old).map_err(|e| e.to_string())?;
    for (n, (_, s)) in news.iter().zip(SHARES) {
        std::fs::write(scratch.join(format!("new{s}.bin")), n).map_err(|e| e.to_string())?;
    }
    let names: Vec<&str> = SHARES.iter().map(|s| s.1).collect();
    let mut torch = TorchPeer::start(
        TORCH_PEER,
        &[scratch.display().to_string(), names.join(",")],
    );
    if let Err(e) = &torch {
        println!("    torch skipped: {e}");
    }
    for (new, (_, share)) in news.iter().zip(SHARES) {
        share_lines(&old, new, share, torch.as_mut().ok(), (total, pairs, 2))?;
    }
    // FP8 params take deltas of their bytes, one byte an element.
    let old = &old[..old.len() / 2];
    println!(
        "  random FP8 (one byte an element), {:.0} MiB, one core:",
        old.len() as f64 / (1u64 << 20) as f64
    );
    for &(share, name) in &SHARES[..2] {
        let cut = (share * (1u64 << 32) as f64) as u64;
        let new: Vec<u8> = (old.iter())
            .map(|&b| if next() & 0xffff_ffff < cut { b ^ 1 } else { b })
            .collect();
        share_lines(old, &new, name, None, (old.len() as u64, pairs, 1))?;
    }
    Ok(())
}

fn share_lines(
    old: &[u8],
    new: &[u8],
    share: &str,
    torch: Option<&mut TorchPeer>,
    (total, pairs, esize): (u64, usize, usize),
) -> Result<(), String> {
    let mut d = Vec::with_capacity(old.len() / 8);
    delta::encode(old, new, esize, &mut d);
    let ratio = d.len() as f64 / old.len() as f64;
    let mut run = old.to_vec();
    // Faulted in before the pairs (a fresh buffer's first copy would pay
    // the page faults), and copied the fastest of the floor's ways.
    let mut copy_dst = vec![1u8; old.len()];
    let timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        Ok::<Duration, String>(t.elapsed())
    };
    let encode = || {
        let mut out = Vec::with_capacity(old.len() / 8);
        timed(&mut || {
            delta::encode(old, new, esize, &mut out);
        })
    };
    let apply = |run: &mut Vec<u8>| {
        run.copy_from_slice(old);
        timed(&mut || {
            delta::apply(&d, run, esize).expect("own delta");
        })
    };
    let memcpy = |dst: &mut Vec<u8>| memcpy_floor(old, dst, 1);
    let (enc_r, enc, _) = alternate(pairs, encode, || memcpy(&mut copy_dst))?;
    let (app_r, app, cp) = alternate(pairs, || apply(&mut run), || memcpy(&mut copy_dst))?;
    let target = if share == "2" && esize == 2 {
        format!(" (target <= 0.04) {}", verdict(ratio <= 0.04))
    } else {
        String::new()
    };
    println!(
        "    {share:>4}% changed: delta / whole {ratio:.4}{target}; encode {:.2} GB/s ({enc_r:.2} of memcpy {:.2} GB/s) {}, apply {:.2} GB/s ({app_r:.2} of memcpy) {}",
        gbps(total, enc),
        gbps(total, cp),
        verdict(enc_r >= 0.5),
        gbps(total, app),
        verdict(app_r >= 0.5),
    );
    let Some(t) = torch else {
        return Ok(());
    };
    let (er, _, te) = alternate(pairs, encode, || t.run(&format!("encode {share}")))?;
    let (ar, _, ta) = alternate(
        pairs,
        || apply(&mut run),
        || t.run(&format!("apply {share}")),
    )?;
    println!(
        "          PyTorch nonzero + gather {:.2} GB/s: wm / torch {er:.1}x {}; index_put_ {:.2} GB/s: wm / torch {ar:.1}x {} (target >= 3x)",
        gbps(total, te),
        verdict(er >= 3.0),
        gbps(total, ta),
        verdict(ar >= 3.0),
    );
    Ok(())
}
