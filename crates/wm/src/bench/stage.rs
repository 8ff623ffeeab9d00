//! `wm bench stage`: two-phase updates (stage while serving, then commit),
//! each figure beside its floor measured in the same run:
//!
//! - the pause (the commit) for library-owned host params against the
//!   one-call atomic update of the same model (target: at most 2% of it;
//!   the commit is a page swap per param);
//! - the pause for engine-owned host params against the same job done
//!   plainly: the fastest memcpy (`harness::floors`) from a staging buffer
//!   in huge pages into the same params on the same threads, one before
//!   each commit (target: at least 0.8, the median of the pairs' ratios;
//!   the commit copies the staged bytes in), and against the one-call
//!   update;
//! - a reader thread that sums the params over and over (an engine that
//!   keeps serving): its throughput while a version stages, against the
//!   same reader on a quiet engine (how much staging slows the engine);
//! - device params: `wm bench gpu` on a GPU machine.
//!
//! The model is a snapshot in the page cache; each run stages a new
//! version name, so nothing is skipped as already there.

use super::harness::floors::memcpy_floor;
use super::harness::{alternate, best, buffer, verdict, Scratch, RUNS};
use super::model::{
    engine, layer_count, layer_model, manager, stage_and_commit, timed_update, write_layers,
    EngineMemory,
};
use crate::fmt::{self, gbps};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weight_manager_core::{Manager, Mode, ParamSpec, UpdateRequest};

/// `wm bench stage` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in GiB (tensors of 64 MiB)
    #[arg(long, default_value_t = 1.0, value_parser = crate::gib)]
    gib: f64,
    /// Copy threads (0: the library's default)
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(a: &Args) -> Result<(), String> {
    let count = layer_count(a.gib);
    let model = layer_model(count);
    let total: usize = model.iter().map(|m| m.3).sum();
    let scratch = Scratch::temp("wm-bench-stage")?;
    let dir = &scratch.0;
    write_layers(dir, count)?;
    let threads = match a.threads {
        0 => weight_manager_core::internals::memory::copy::default_threads(),
        n => n,
    };
    println!(
        "wm bench stage: {} in {count} tensors of 64 MiB, {threads} copy threads, best of {RUNS}",
        fmt::bytes(total as u64)
    );
    let src = buffer(total);
    let mut dst = buffer(total);
    let memcpy = gbps(
        total as u64,
        best(|| memcpy_floor(&src, &mut dst, threads))?,
    );
    drop((src, dst));
    println!("  floor  memcpy                         {memcpy:>8.2} GB/s");

    // Library-owned host params: the pause is a page swap per param.
    let lib = Arc::new(manager(threads)?);
    let mut params = Vec::new();
    for (name, dtype, shape, _) in &model {
        let (p, n) =
            (lib.allocate(&ParamSpec::host(name, *dtype, shape))).map_err(|e| e.to_string())?;
        params.push((p as usize, n));
    }
    let (one_call, pause) = pause_and_one_call(&lib, dir)?;
    let r = pause.as_secs_f64() / one_call.as_secs_f64();
    println!(
        "  wm     commit, library-owned          {:>8} ({} per GiB)   {:.2}% of the one-call update ({}; target <= 2%) {}",
        fmt::ms(pause),
        fmt::ms(per_gib(pause, total)),
        r * 100.0,
        fmt::ms(one_call),
        verdict(r <= 0.02)
    );
    reader_rows(&lib, dir, &params)?;
    drop(lib);

    // Engine-owned host params: the pause copies the staged bytes in. Its
    // floor is the same job done plainly: memcpy from a staging buffer in
    // huge pages (as the library's staging is) into the same params, each
    // commit right after one (the machine's speed wanders: the median of
    // the pairs' ratios decides).
    let (m, mut bufs) = engine(&model, threads, false)?;
    let m = Arc::new(m);
    let (one_call, pause) = pause_and_one_call(&m, dir)?;
    let mut staging = EngineMemory::new(total, true)?;
    let run = &mut 2000;
    let (r, best_commit, best_memcpy) = alternate(
        2 * RUNS,
        || stage_and_commit(&m, dir, run).map(|(_, commit)| commit),
        || into_params(staging.ptr(), &mut bufs, &model, threads),
    )?;
    println!(
        "  wm     commit, engine-owned           {:>8.2} GB/s   ratio {r:.2} to memcpy beside it ({:.2} GB/s; median of {} pairs; target >= 0.80) {}; {:.0}% of the one-call update ({})",
        gbps(total as u64, best_commit),
        gbps(total as u64, best_memcpy),
        2 * RUNS,
        verdict(r >= 0.8),
        100.0 * pause.as_secs_f64() / one_call.as_secs_f64(),
        fmt::ms(one_call)
    );
    Ok(())
}

/// memcpy from `src` (the params' bytes one after the other) into every
/// param, on `threads` threads each.
fn into_params(
    src: *mut u8,
    params: &mut [EngineMemory],
    model: &super::model::Model,
    threads: usize,
) -> Result<Duration, String> {
    let mut at = 0;
    let mut took = Duration::ZERO;
    for (p, (.., n)) in params.iter_mut().zip(model) {
        // SAFETY: `src` holds every param's bytes in turn (the model's
        // total) and each param `n`; both outlive the call.
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src.add(at), *n),
                std::slice::from_raw_parts_mut(p.ptr(), *n),
            )
        };
        took += memcpy_floor(s, d, threads)?;
        at += n;
    }
    Ok(took)
}

fn per_gib(d: Duration, total: usize) -> Duration {
    d.div_f64(total as f64 / (1u64 << 30) as f64)
}

/// The best one-call atomic update and the best commit of a staged one
/// (a warm-up of each first).
fn pause_and_one_call(m: &Arc<Manager>, dir: &Path) -> Result<(Duration, Duration), String> {
    let run = &mut 0;
    timed_update(m, dir, Mode::Atomic, run)?;
    let one_call = best(|| timed_update(m, dir, Mode::Atomic, run))?;
    let mut pause = Duration::MAX;
    for _ in 0..=RUNS {
        let (_, p) = stage_and_commit(m, dir, run)?;
        pause = pause.min(p);
    }
    Ok((one_call, pause))
}

/// A reader summing every param over and over, as a serving engine reads
/// its weights: GB/s while versions stage, against the same time quiet.
fn reader_rows(m: &Arc<Manager>, dir: &Path, params: &[(usize, usize)]) -> Result<(), String> {
    let run = &mut 1000;
    let mut staging = Duration::ZERO;
    let busy = read_while(params, || {
        for _ in 0..RUNS {
            *run += 1;
            let mut req = UpdateRequest::snapshot(dir);
            req.version = Some(format!("bench-{run}"));
            let t = Instant::now();
            let staged = m.stage(req).map_err(|e| e.to_string())?;
            staging += t.elapsed();
            staged.abort().map_err(|e| e.to_string())?;
        }
        Ok(())
    })?;
    let quiet = read_while(params, || {
        std::thread::sleep(staging);
        Ok(())
    })?;
    let r = busy / quiet;
    println!(
        "  wm     reader while staging           {busy:>8.2} GB/s   ratio {r:.2} to the same reader quiet ({quiet:.2} GB/s; the engine's slowdown while a version stages)"
    );
    Ok(())
}

/// GB/s one thread reads `params` (summing 8-byte words) while `work`
/// runs on this one.
fn read_while(
    params: &[(usize, usize)],
    work: impl FnOnce() -> Result<(), String>,
) -> Result<f64, String> {
    let stop = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let t = Instant::now();
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let mut sum = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for &(p, n) in params {
                    // SAFETY: library-owned params stay mapped at their
                    // addresses for the manager's life; staging never
                    // writes them (an abort follows every stage).
                    let words = unsafe { std::slice::from_raw_parts(p as *const u64, n / 8) };
                    sum = words.iter().fold(sum, |a, w| a.wrapping_add(*w));
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            std::hint::black_box(sum);
        });
        let r = work();
        stop.store(true, Ordering::Relaxed);
        r
    });
    r?;
    Ok(gbps(bytes.load(Ordering::Relaxed), t.elapsed()))
}
