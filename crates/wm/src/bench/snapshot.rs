//! `wm bench snapshot`: snapshot updates from the page cache into host
//! params, each figure printed beside floors measured in the same run.
//!
//! Floors use the same number of threads as the library's copier:
//! - memcpy: host buffer to host buffer, one contiguous share per thread;
//! - page-cache read: `pread` of the same file into a buffer, 8 MiB pieces
//!   from a shared counter (the plainest fast loop);
//! - mapped read: each 8 MiB piece mapped, copied with the library's
//!   copy, unmapped (`source/snapshot/reader.rs` maps segments when this
//!   is ahead of `pread`, as it is for files written in large pieces).
//!   The read floor is the faster of the two (until 2026-11-28 it was
//!   `pread` alone, up to 1.8x slower here).
//!
//! Ratio = wm GB/s / the read floor (the same job; target: at least 0.8,
//! in-place; until 2026-11-28 the lower of memcpy and `pread`). The
//! small-tensor run reports time per tensor beyond what its bytes cost at the
//! page-cache floor (target: at most 5 us). The atomic rows: [`super::atomic`].

use super::harness::floors::{mapped_read, read_floor};
use super::harness::{best, buffer, verdict, Floors, Scratch, RUNS};
use super::model::{engine, layer_count, layer_model, timed_update, warm, write_layers, Snapshot};
use crate::fixtures;
use crate::fmt::{self, gbps};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::DType;
use weight_manager_core::Mode;

/// `wm bench snapshot` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in GiB (tensors of 64 MiB)
    #[arg(long, default_value_t = 2.0, value_parser = crate::gib)]
    gib: f64,
    /// Small tensors (f32 [64]) for the per-tensor cost (0: none)
    #[arg(long, default_value_t = 10_000)]
    small: usize,
    /// Copy threads (default: the library's)
    #[arg(long)]
    threads: Option<usize>,
    /// Folder for the scratch snapshot (default: the temporary folder)
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn run(a: &Args) -> Result<(), String> {
    let threads = a
        .threads
        .unwrap_or_else(weight_manager_core::internals::memory::copy::default_threads);
    let root = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = Scratch::new(&root, "wm-bench")?;
    let dir = &scratch.0;
    let count = layer_count(a.gib);
    let big_dir = dir.join("big");
    std::fs::create_dir_all(&big_dir).map_err(|e| e.to_string())?;
    let path = write_layers(&big_dir, count)?;
    let model = layer_model(count);
    let total = count as u64 * super::model::LAYER as u64;
    println!(
        "wm bench snapshot: {} of bf16 in {count} tensors of 64 MiB, {threads} copy threads, best of {RUNS}",
        fmt::bytes(total)
    );
    let snap = Snapshot {
        dir: &big_dir,
        path: &path,
        total,
        model: &model,
    };
    let (floors, read_gbps) = floor_rows(&snap, threads)?;
    let mut run = 0;
    {
        let (m, _bufs) = engine(&model, threads, false)?;
        let t = best(|| timed_update(&m, &big_dir, Mode::InPlace, &mut run))?;
        let inplace = gbps(total, t);
        // The same job as the read floor (mapped file + copy, or pread:
        // the faster), not the lower of it and memcpy.
        let ratio = inplace / read_gbps;
        println!(
            "  wm     update in-place                {inplace:>7.2} GB/s   ratio {ratio:.2} to the page-cache read floor (target >= 0.80) {}",
            verdict(ratio >= 0.8)
        );
    }
    super::atomic::rows(&snap, (floors, read_gbps), threads)?;
    if a.small > 0 {
        small_tensors(dir, a.small, threads, read_gbps, &mut run)?;
    }
    Ok(())
}

/// Measure and print the floors: memcpy and faulting in fresh memory, and
/// the page-cache read (its GB/s returned beside them), with the mapped
/// read beside it.
fn floor_rows(s: &Snapshot, threads: usize) -> Result<(Floors, f64), String> {
    let file = File::open(s.path).map_err(|e| e.to_string())?;
    let header = weight_manager_core::checkpoint::safetensors_file::read_header(
        &file,
        s.path,
        Instant::now() + Duration::from_secs(60),
    )
    .map_err(|e| e.to_string())?;
    let data_offset = header.tensors[0].offset;
    let mut src = buffer(s.total as usize);
    fixtures::fill(&mut src, 7);
    let mut dst = buffer(s.total as usize);
    let floors = Floors::measure(&src, &mut dst, threads)?;
    drop(src);
    let read = best(|| read_floor(&file, data_offset, &mut dst, threads))?;
    let mapped = best(|| mapped_read(&file, data_offset, &mut dst, threads))?;
    let (read_gbps, mapped_gbps) = (gbps(s.total, read), gbps(s.total, mapped));
    println!(
        "  floor  memcpy (host to host)          {:>7.2} GB/s",
        floors.memcpy
    );
    println!("  floor  page-cache read (pread)        {read_gbps:>7.2} GB/s");
    println!(
        "  floor  page-cache read (mmap + copy)  {mapped_gbps:>7.2} GB/s   ratio {:.2} to pread (the library maps segments of 1 MiB or more)",
        mapped_gbps / read_gbps
    );
    println!(
        "  floor  fault in fresh memory          {:>7.2} GB/s (the kernel zeroes every page)",
        floors.fresh
    );
    // The read floor is the faster way of the two: the library reads
    // large segments through mappings, so pread alone could be the slower.
    Ok((floors, read_gbps.max(mapped_gbps)))
}

/// Many small tensors (`small` f32 [64]): the time per tensor beyond what
/// its bytes cost at the page-cache floor (`read_gbps`).
fn small_tensors(
    dir: &Path,
    small: usize,
    threads: usize,
    read_gbps: f64,
    run: &mut u64,
) -> Result<(), String> {
    let small_dir = dir.join("small");
    std::fs::create_dir_all(&small_dir).map_err(|e| e.to_string())?;
    let ts: Vec<_> = (0..small)
        .map(|i| fixtures::tensor(format!("blocks.{i}.bias"), DType::F32, &[64], i as u64))
        .collect();
    let small_path = small_dir.join("model_state.tp0.0.safetensors");
    fixtures::write(&small_path, &ts)?;
    warm(&small_path)?;
    let model: Vec<_> = ts
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.data.len()))
        .collect();
    let bytes: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    let (m, _bufs) = engine(&model, threads, false)?;
    let t = best(|| timed_update(&m, &small_dir, Mode::InPlace, run))?;
    let bytes_time = bytes as f64 / (read_gbps * 1e9);
    let per = (t.as_secs_f64() - bytes_time).max(0.0) / small as f64 * 1e6;
    println!(
        "  wm     {small} tensors of 256 B      {}  total, {per:.2} us per tensor beyond its bytes (target <= 5 us) {}",
        fmt::ms(t),
        verdict(per <= 5.0)
    );
    Ok(())
}
