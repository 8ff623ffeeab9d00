//! `wm bench snapshot`'s atomic rows: atomic updates of library-owned
//! params (page swap) beside in-place ones, of engine-owned params (kept
//! staging) beside the two-pass floor, the first update of a fresh
//! manager, and the PyTorch way (`safetensors.torch.load_file` then
//! `copy_()` into preallocated tensors) when Python has torch.
//!
//! The two-pass floor is what staging then copying costs at the measured
//! floors: 1 / (1 / read + 1 / memcpy).

use crate::bench::{best, engine, timed_update, verdict, Floors};
use crate::fmt::gbps;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use weight_manager::apply::Mode;
use weight_manager::manager::{Manager, ManagerConfig};
use weight_manager::registry::ParamSpec;
use weight_manager::tensor::DType;

/// The model: (name, dtype, shape, bytes) per tensor.
pub(crate) type Model = [(String, DType, Vec<u64>, usize)];

/// A manager with library-owned params for `model`.
fn library(model: &Model, threads: usize) -> Result<Manager, String> {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        threads,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    for (name, dtype, shape, _) in model {
        m.allocate(&ParamSpec::host(name, *dtype, shape))
            .map_err(|e| e.to_string())?;
    }
    Ok(m)
}

/// Print the atomic rows for the snapshot in `dir` (`total` bytes of
/// `model`, in the page cache); `path` is its file.
pub(crate) fn rows(
    model: &Model,
    dir: &Path,
    path: &Path,
    total: u64,
    floors: Floors,
    threads: usize,
) -> Result<(), String> {
    let two_pass = 1.0 / (1.0 / floors.read + 1.0 / floors.memcpy);
    println!("  floor  two passes (read, then memcpy) {two_pass:>7.2} GB/s");

    let run = &mut 0;
    let mut timed = |m: &Manager, mode| timed_update(m, dir, mode, run);
    let (first_lib, inplace_lib, back_to_back, apart) = {
        let m = library(model, threads)?;
        let first = gbps(total, timed(&m, Mode::Atomic)?);
        let inplace = gbps(total, best(|| timed(&m, Mode::InPlace))?);
        let back_to_back = gbps(total, best(|| timed(&m, Mode::Atomic))?);
        let apart = best(|| {
            std::thread::sleep(GAP);
            timed(&m, Mode::Atomic)
        })?;
        (first, inplace, back_to_back, gbps(total, apart))
    };
    println!("  wm     update in-place, library-owned {inplace_lib:>7.2} GB/s");
    println!(
        "  wm     update atomic, library-owned   {back_to_back:>7.2} GB/s   ratio {:.2} to in-place (page swap, back to back: fresh shadows)",
        back_to_back / inplace_lib
    );
    let r = apart / inplace_lib;
    println!(
        "  wm     update atomic, library-owned   {apart:>7.2} GB/s   ratio {r:.2} to in-place (page swap, {} s apart: shadows faulted in ahead; target >= 0.90) {}",
        GAP.as_secs(),
        verdict(r >= 0.9)
    );
    let (first_eng, atomic_eng) = {
        let (m, _bufs) = engine(model, threads)?;
        let first = gbps(total, timed(&m, Mode::Atomic)?);
        let atomic = gbps(total, best(|| timed(&m, Mode::Atomic))?);
        (first, atomic)
    };
    let r = atomic_eng / two_pass;
    println!(
        "  wm     update atomic, engine-owned    {atomic_eng:>7.2} GB/s   ratio {r:.2} to two passes (kept staging; target >= 0.80) {}",
        verdict(r >= 0.8)
    );
    println!(
        "  wm     first update, fresh manager   {first_lib:>7.2} GB/s library-owned, {first_eng:.2} GB/s engine-owned (atomic)"
    );
    match torch_way(path) {
        Ok(t) => {
            let torch = gbps(total, t);
            println!(
                "  torch  load_file + copy_()            {torch:>7.2} GB/s   wm atomic / torch: {:.2} library-owned, {:.2} engine-owned",
                apart / torch,
                atomic_eng / torch
            );
        }
        Err(e) => println!("  torch  load_file + copy_()            skipped: {e}"),
    }
    Ok(())
}

/// Time between atomic updates of library-owned params in the row that
/// models an engine running between updates: the manager faults in the
/// next update's shadows meanwhile (`manager/shadows.rs`).
const GAP: Duration = Duration::from_secs(2);

/// Python for the PyTorch row: `WM_PYTHON`, else `.venv/bin/python`, else
/// `python3`.
fn python() -> String {
    std::env::var("WM_PYTHON").unwrap_or_else(|_| {
        if Path::new(".venv/bin/python").exists() {
            ".venv/bin/python".into()
        } else {
            "python3".into()
        }
    })
}

/// What an engine without this library does: load the file with
/// safetensors into fresh tensors, then `copy_()` each into a preallocated
/// param; best of three, timed in Python.
const TORCH_WAY: &str = r#"
import sys, time, torch
from safetensors.torch import load_file
path = sys.argv[1]
params = {k: torch.empty_like(v).fill_(1) for k, v in load_file(path).items()}
best = float("inf")
for _ in range(3):
    t = time.perf_counter()
    sd = load_file(path)
    with torch.no_grad():
        for k, v in sd.items():
            params[k].copy_(v)
    del sd
    best = min(best, time.perf_counter() - t)
print(best)
"#;

fn torch_way(path: &Path) -> Result<Duration, String> {
    let py = python();
    let out = Command::new(&py)
        .args(["-c", TORCH_WAY])
        .arg(path)
        .output()
        .map_err(|e| format!("running {py}: {e} (set WM_PYTHON)"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        return Err(format!("{py} has no torch and safetensors ({last})"));
    }
    let secs: f64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("{py} printed no time"))?;
    Ok(Duration::from_secs_f64(secs))
}
