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

use super::harness::{alternate, best, per_byte, python, verdict, Floors};
use super::model::{engine, manager, timed_update, Model, Snapshot};
use crate::fmt::gbps;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use weight_manager_core::Manager;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;

/// A manager with library-owned params for `model`.
fn library(model: &Model, threads: usize) -> Result<Manager, String> {
    let m = manager(threads)?;
    for (name, dtype, shape, _) in model {
        m.allocate(&ParamSpec::host(name, *dtype, shape))
            .map_err(|e| e.to_string())?;
    }
    Ok(m)
}

/// The GB/s of atomic and first updates measured for the rows.
struct Atomic {
    inplace_lib: f64,
    first_lib: f64,
    back_to_back: f64,
    apart: f64,
    first_eng: f64,
    atomic_eng: f64,
}

/// Print the atomic rows and the PyTorch comparison for the snapshot `s`
/// (in the page cache) beside `floors` and the page-cache read (`read`,
/// GB/s).
pub fn rows(s: &Snapshot, (floors, read): (Floors, f64), threads: usize) -> Result<(), String> {
    let two_pass = per_byte(&[read, floors.memcpy]);
    let fresh_read = per_byte(&[floors.fresh, read]);
    let fresh_two_pass = per_byte(&[floors.fresh, read, floors.memcpy]);
    println!("  floor  two passes (read, then memcpy) {two_pass:>7.2} GB/s");
    println!("  floor  fault in fresh memory, read    {fresh_read:>7.2} GB/s");
    let a = measure(s, threads)?;
    println!(
        "  wm     update in-place, library-owned {:>7.2} GB/s",
        a.inplace_lib
    );
    let r = a.apart / a.inplace_lib;
    println!(
        "  wm     update atomic, library-owned   {:>7.2} GB/s   ratio {r:.2} to in-place (page swap, {} s apart: shadows faulted in ahead; target >= 0.90) {}",
        a.apart,
        GAP.as_secs(),
        verdict(r >= 0.9)
    );
    println!(
        "  wm     update atomic, library-owned   {:>7.2} GB/s   ratio {:.2} to in-place, {:.2} to fault in + read (back to back: shadows not ready, faulted in on every thread)",
        a.back_to_back,
        a.back_to_back / a.inplace_lib,
        a.back_to_back / fresh_read
    );
    let r = a.atomic_eng / two_pass;
    println!(
        "  wm     update atomic, engine-owned    {:>7.2} GB/s   ratio {r:.2} to two passes (kept staging; target >= 0.80) {}",
        a.atomic_eng,
        verdict(r >= 0.8)
    );
    println!(
        "  wm     first update, fresh manager    {:>7.2} GB/s   ratio {:.2} to fault in + read (atomic, library-owned)",
        a.first_lib,
        a.first_lib / fresh_read
    );
    println!(
        "  wm     first update, fresh manager    {:>7.2} GB/s   ratio {:.2} to fault in + two passes (atomic, engine-owned)",
        a.first_eng,
        a.first_eng / fresh_two_pass
    );
    torch_rows(s, &a, threads)
}

/// The atomic and first updates, each manager of its own.
fn measure(s: &Snapshot, threads: usize) -> Result<Atomic, String> {
    let run = &mut 0;
    let mut timed = |m: &Manager, mode| timed_update(m, s.dir, mode, run);
    let total = s.total;
    // A manager of its own: after an atomic update the manager faults in
    // the next shadows on one core, which in-place updates would share.
    let inplace_lib = {
        let m = library(s.model, threads)?;
        gbps(total, best(|| timed(&m, Mode::InPlace))?)
    };
    let (first_lib, back_to_back, apart) = {
        let m = library(s.model, threads)?;
        let first = gbps(total, timed(&m, Mode::Atomic)?);
        let back_to_back = gbps(total, best(|| timed(&m, Mode::Atomic))?);
        let apart = best(|| {
            std::thread::sleep(GAP);
            timed(&m, Mode::Atomic)
        })?;
        (first, back_to_back, gbps(total, apart))
    };
    let (first_eng, atomic_eng) = {
        let (m, _bufs) = engine(s.model, threads, false)?;
        let first = gbps(total, timed(&m, Mode::Atomic)?);
        let atomic = gbps(total, best(|| timed(&m, Mode::Atomic))?);
        (first, atomic)
    };
    Ok(Atomic {
        inplace_lib,
        first_lib,
        back_to_back,
        apart,
        first_eng,
        atomic_eng,
    })
}

/// Pairs of PyTorch's way and ours, alternating, for the in-place rows.
const TORCH_PAIRS: usize = 3;

/// PyTorch's way beside ours, also with both sides' params in huge pages:
/// in place (the same job on both sides) alternating [`TORCH_PAIRS`]
/// times, each side the best of three per pair, on the same threads, the
/// median of the pairs' ratios; the atomic rows beside the in-place
/// torch figure.
fn torch_rows(s: &Snapshot, a: &Atomic, threads: usize) -> Result<(), String> {
    let total = s.total;
    if let Err(e) = torch_way(s.path, false, threads) {
        println!("  torch  load_file + copy_()            skipped: {e}");
        return Ok(());
    }
    let side_by_side = |huge: bool| -> Result<(f64, f64, f64), String> {
        let (m, _bufs) = engine(s.model, threads, huge)?;
        let mut run = 0;
        let (r, o, t) = alternate(
            TORCH_PAIRS,
            || best(|| timed_update(&m, s.dir, Mode::InPlace, &mut run)),
            || torch_way(s.path, huge, threads),
        )?;
        Ok((r, gbps(total, o), gbps(total, t)))
    };
    let (r, ours, torch) = side_by_side(false)?;
    println!("  torch  load_file + copy_()            {torch:>7.2} GB/s   (mapped file, one copy)");
    println!("  wm     update in-place, beside it      {ours:>6.2} GB/s");
    let (r_huge, ours_huge, torch_huge) = side_by_side(true)?;
    println!("  torch  load_file + copy_(), huge pages {torch_huge:>6.2} GB/s   (THP_MEM_ALLOC_ENABLE=1)");
    println!("  wm     update in-place, huge pages     {ours_huge:>6.2} GB/s   (engine params in huge pages)");
    for (what, r) in [("in-place", r), ("in-place, both in huge pages", r_huge)] {
        println!(
            "  wm / torch  {what:<36} {r:.2} (median of {TORCH_PAIRS} alternating pairs; target >= 1.00) {}",
            verdict(r >= 1.0)
        );
    }
    // Torch's way is never atomic (it writes into the live tensors), so
    // the atomic rows say what atomicity costs against it, with no target.
    for (what, ours) in [
        ("atomic, library-owned", a.apart),
        ("atomic, library-owned, back to back", a.back_to_back),
        ("atomic, engine-owned", a.atomic_eng),
    ] {
        let r = ours / torch;
        println!("  wm / torch  {what:<36} {r:.2} (torch is not atomic)");
    }
    Ok(())
}

/// Time between atomic updates of library-owned params in the row that
/// models an engine running between updates: the manager faults in the
/// next update's shadows meanwhile (`manager/shadows.rs`).
const GAP: Duration = Duration::from_secs(2);

/// What an engine without this library does: load the file with
/// safetensors into fresh tensors, then `copy_()` each into a preallocated
/// param; best of three, timed in Python.
const TORCH_WAY: &str = r#"
import sys, time, torch
from safetensors.torch import load_file
path = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]))
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

/// `huge`: PyTorch allocates the params in huge pages; on `threads`
/// threads, as the library's copier.
fn torch_way(path: &Path, huge: bool, threads: usize) -> Result<Duration, String> {
    let py = python();
    let out = Command::new(&py)
        .env("THP_MEM_ALLOC_ENABLE", if huge { "1" } else { "0" })
        .args(["-c", TORCH_WAY])
        .arg(path)
        .arg(threads.to_string())
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
