//! `wm bench snapshot`'s atomic rows: atomic updates of library-owned
//! params (page swap) beside in-place ones, apart and back to back, of
//! engine-owned params (kept staging) beside the two-pass floor, the first
//! update of a fresh manager, and the PyTorch way
//! (`safetensors.torch.load_file`, which maps the file, then `copy_()`
//! into preallocated tensors: one copy) when Python has torch, also with
//! both sides' params in huge pages.
//!
//! Floors of passes done one after the other cost the sum of their times
//! per byte: two passes (staging, then copying) is 1 / (1 / read +
//! 1 / memcpy); a first update or a back-to-back one also faults in fresh
//! memory (the kernel zeroes it) before the bytes land.

use crate::bench::{best, engine, timed_update, verdict, Floors};
use crate::fmt::gbps;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use weight_manager_core::apply::Mode;
use weight_manager_core::manager::{Manager, ManagerConfig};
use weight_manager_core::registry::ParamSpec;
use weight_manager_core::tensor::DType;

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

/// Print the atomic rows and the PyTorch comparison for the snapshot in
/// `dir` (its file `path`, `total` bytes of `model`, in the page cache);
/// `inplace`: the in-place update's GB/s into engine-owned params.
pub(crate) fn rows(
    model: &Model,
    (dir, path): (&Path, &Path),
    total: u64,
    (floors, inplace): (Floors, f64),
    threads: usize,
) -> Result<(), String> {
    let two_pass = per_byte(&[floors.read, floors.memcpy]);
    let fresh_read = per_byte(&[floors.fresh, floors.read]);
    let fresh_two_pass = per_byte(&[floors.fresh, floors.read, floors.memcpy]);
    println!("  floor  two passes (read, then memcpy) {two_pass:>7.2} GB/s");
    println!("  floor  fault in fresh memory, read    {fresh_read:>7.2} GB/s");

    let run = &mut 0;
    let mut timed = |m: &Manager, mode| timed_update(m, dir, mode, run);
    // A manager of its own: after an atomic update the manager faults in
    // the next shadows on one core, which in-place updates would share.
    let inplace_lib = {
        let m = library(model, threads)?;
        gbps(total, best(|| timed(&m, Mode::InPlace))?)
    };
    let (first_lib, back_to_back, apart) = {
        let m = library(model, threads)?;
        let first = gbps(total, timed(&m, Mode::Atomic)?);
        let back_to_back = gbps(total, best(|| timed(&m, Mode::Atomic))?);
        let apart = best(|| {
            std::thread::sleep(GAP);
            timed(&m, Mode::Atomic)
        })?;
        (first, back_to_back, gbps(total, apart))
    };
    println!("  wm     update in-place, library-owned {inplace_lib:>7.2} GB/s");
    let r = apart / inplace_lib;
    println!(
        "  wm     update atomic, library-owned   {apart:>7.2} GB/s   ratio {r:.2} to in-place (page swap, {} s apart: shadows faulted in ahead; target >= 0.90) {}",
        GAP.as_secs(),
        verdict(r >= 0.9)
    );
    println!(
        "  wm     update atomic, library-owned   {back_to_back:>7.2} GB/s   ratio {:.2} to in-place, {:.2} to fault in + read (back to back: shadows not ready, faulted in on every thread)",
        back_to_back / inplace_lib,
        back_to_back / fresh_read
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
        "  wm     first update, fresh manager    {first_lib:>7.2} GB/s   ratio {:.2} to fault in + read (atomic, library-owned)",
        first_lib / fresh_read
    );
    println!(
        "  wm     first update, fresh manager    {first_eng:>7.2} GB/s   ratio {:.2} to fault in + two passes (atomic, engine-owned)",
        first_eng / fresh_two_pass
    );
    let torch = match torch_way(path, false) {
        Ok(t) => gbps(total, t),
        Err(e) => {
            println!("  torch  load_file + copy_()            skipped: {e}");
            return Ok(());
        }
    };
    println!("  torch  load_file + copy_()            {torch:>7.2} GB/s   (mapped file, one copy)");
    // Both with params in huge pages (PyTorch: THP_MEM_ALLOC_ENABLE=1).
    let torch_huge = gbps(total, torch_way(path, true)?);
    let inplace_huge = {
        let (m, _bufs) = crate::bench::engine_in(model, threads, true)?;
        gbps(total, best(|| timed(&m, Mode::InPlace))?)
    };
    println!("  torch  load_file + copy_(), huge pages {torch_huge:>6.2} GB/s   (THP_MEM_ALLOC_ENABLE=1)");
    println!("  wm     update in-place, huge pages     {inplace_huge:>6.2} GB/s   (engine params in huge pages)");
    // In place both sides do the same job, so ours must be ahead; torch's
    // way is never atomic (it writes into the live tensors), so the atomic
    // rows say what atomicity costs against it, with no target.
    for (what, ours, theirs, target) in [
        ("in-place", inplace, torch, true),
        (
            "in-place, both in huge pages",
            inplace_huge,
            torch_huge,
            true,
        ),
        ("atomic, library-owned", apart, torch, false),
        (
            "atomic, library-owned, back to back",
            back_to_back,
            torch,
            false,
        ),
        ("atomic, engine-owned", atomic_eng, torch, false),
    ] {
        let r = ours / theirs;
        match target {
            true => println!(
                "  wm / torch  {what:<36} {r:.2} (target >= 1.00) {}",
                verdict(r >= 1.0)
            ),
            false => println!("  wm / torch  {what:<36} {r:.2} (torch is not atomic)"),
        }
    }
    Ok(())
}

/// GB/s of passes done one after the other at these GB/s each.
fn per_byte(passes: &[f64]) -> f64 {
    1.0 / passes.iter().map(|g| 1.0 / g).sum::<f64>()
}

/// Time between atomic updates of library-owned params in the row that
/// models an engine running between updates: the manager faults in the
/// next update's shadows meanwhile (`manager/shadows.rs`).
const GAP: Duration = Duration::from_secs(2);

/// Python for the PyTorch row: `WM_PYTHON`, else `.venv/bin/python`, else
/// `python3`.
pub(crate) fn python() -> String {
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

/// `huge`: PyTorch allocates the params in huge pages.
fn torch_way(path: &Path, huge: bool) -> Result<Duration, String> {
    let py = python();
    let out = Command::new(&py)
        .env("THP_MEM_ALLOC_ENABLE", if huge { "1" } else { "0" })
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
