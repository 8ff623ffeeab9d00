//! `wm bench snapshot`: snapshot updates from the page cache into host
//! params, each figure printed beside floors measured in the same run.
//!
//! Floors use the same number of threads as the library's copier:
//! - memcpy: host buffer to host buffer, one contiguous share per thread;
//! - page-cache read: `pread` of the same file into a buffer, 8 MiB pieces
//!   from a shared counter (the plainest fast loop);
//! - mapped read (not a floor: beside it, how the reader reads): each
//!   8 MiB piece mapped, copied with the library's copy, unmapped
//!   (`source/snapshot/reader.rs` maps segments when this is ahead of
//!   `pread`, as it is for files written in large pieces).
//!
//! Ratio = wm GB/s / the lower floor (target: at least 0.8, in-place). The
//! small-tensor run reports time per tensor beyond what its bytes cost at the
//! page-cache floor (target: at most 5 us).

use crate::fixtures;
use crate::fmt::{self, gbps};
use crate::Args;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::apply::Mode;
use weight_manager_core::manager::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::registry::ParamSpec;
use weight_manager_core::tensor::DType;

const RUNS: usize = 3;

/// The floors measured in a run, in GB/s.
#[derive(Clone, Copy)]
pub(crate) struct Floors {
    pub memcpy: f64,
    pub read: f64,
    /// Faulting in fresh memory ([`fresh_memory_floor`]).
    pub fresh: f64,
}

pub(crate) struct Scratch(pub(crate) PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn best(mut f: impl FnMut() -> Result<Duration, String>) -> Result<Duration, String> {
    let mut best = Duration::MAX;
    for _ in 0..RUNS {
        best = best.min(f()?);
    }
    Ok(best)
}

/// A buffer with every page already touched (filled with 1s).
pub(crate) fn buffer(n: usize) -> Vec<u8> {
    vec![1u8; n]
}

pub(crate) use crate::bench_floors::{fresh_memory_floor, mapped_read, memcpy_floor, read_floor};

/// A snapshot of `count` bf16 layers (`layers.<i>.w`, 64 MiB each) in
/// `dir`, read once so it is in the page cache; returns its file.
pub(crate) fn write_layers(dir: &Path, count: usize) -> Result<PathBuf, String> {
    let path = dir.join("model_state.tp0.0.safetensors");
    let mut ts = Vec::new();
    for i in 0..count {
        let mut data = vec![0u8; LAYER];
        fixtures::fill(&mut data, i as u64 + 1);
        ts.push(fixtures::FakeTensor {
            name: format!("layers.{i}.w"),
            dtype: DType::Bf16,
            shape: LAYER_SHAPE.to_vec(),
            data,
        });
    }
    fixtures::write(&path, &ts)?;
    warm(&path)?;
    Ok(path)
}

fn warm(path: &Path) -> Result<(), String> {
    let f = File::open(path).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    loop {
        let n = f.read_at(&mut buf, off).map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(());
        }
        off += n as u64;
    }
}

/// An engine's param memory, every page touched (filled with 1s): a heap
/// buffer (4 KiB pages), or a 2 MiB aligned mapping with the huge-page
/// hint, as PyTorch allocates with `THP_MEM_ALLOC_ENABLE=1`.
pub(crate) enum EngineMemory {
    Heap(Vec<u8>),
    Huge(weight_manager_core::memory::host::HostRegion),
}

impl EngineMemory {
    fn new(n: usize, huge: bool) -> Result<EngineMemory, String> {
        if !huge {
            return Ok(EngineMemory::Heap(buffer(n)));
        }
        let r = weight_manager_core::memory::host::HostRegion::new("engine param", n)
            .map_err(|e| e.to_string())?;
        r.advise_huge(true);
        // SAFETY: the region is n bytes of our own writable memory.
        unsafe { std::ptr::write_bytes(r.ptr(), 1, n) };
        Ok(EngineMemory::Huge(r))
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            EngineMemory::Heap(b) => b.as_mut_ptr(),
            EngineMemory::Huge(r) => r.ptr(),
        }
    }
}

/// Engine-owned, pre-faulted params for every tensor of `model`.
pub(crate) fn engine(
    model: &crate::bench_atomic::Model,
    threads: usize,
) -> Result<(Manager, Vec<EngineMemory>), String> {
    engine_in(model, threads, false)
}

/// [`engine`], its params in huge pages when `huge`.
pub(crate) fn engine_in(
    model: &crate::bench_atomic::Model,
    threads: usize,
    huge: bool,
) -> Result<(Manager, Vec<EngineMemory>), String> {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        threads,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut bufs = Vec::new();
    for (name, dtype, shape, n) in model {
        let mut b = EngineMemory::new(*n, huge)?;
        // SAFETY: the buffers are returned with the manager and outlive it.
        unsafe { m.register(&ParamSpec::host(name, *dtype, shape), b.ptr(), *n) }
            .map_err(|e| e.to_string())?;
        bufs.push(b);
    }
    Ok((m, bufs))
}

pub(crate) fn timed_update(
    m: &Manager,
    dir: &Path,
    mode: Mode,
    run: &mut u64,
) -> Result<Duration, String> {
    *run += 1;
    let mut req = UpdateRequest::snapshot(dir);
    req.mode = mode;
    req.version = Some(format!("bench-{run}"));
    let t = Instant::now();
    m.update(req).map_err(|e| e.to_string())?;
    Ok(t.elapsed())
}

pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

pub fn snapshot(a: &Args) -> Result<(), String> {
    let gib: f64 = a.number("gib", 2.0)?;
    let small: usize = a.number("small", 10_000)?;
    let threads: usize = a.number(
        "threads",
        weight_manager_core::memory::copy::default_threads(),
    )?;
    let root = a
        .value("dir")
        .map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = root.join(format!("wm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let _scratch = Scratch(dir.clone());

    // Large model: bf16 tensors of 64 MiB.
    const TENSOR: u64 = LAYER as u64;
    let count = layer_count(gib);
    let shape = LAYER_SHAPE.to_vec();
    let big_dir = dir.join("big");
    std::fs::create_dir_all(&big_dir).map_err(|e| e.to_string())?;
    let path = write_layers(&big_dir, count)?;
    let total = count as u64 * TENSOR;
    println!(
        "wm bench snapshot: {} of bf16 in {count} tensors of 64 MiB, {threads} copy threads, best of {RUNS}",
        fmt::bytes(total)
    );

    let file = File::open(&path).map_err(|e| e.to_string())?;
    let header = weight_manager_core::checkpoint::safetensors_file::read_header(
        &file,
        &path,
        Instant::now() + Duration::from_secs(60),
    )
    .map_err(|e| e.to_string())?;
    let data_offset = header.tensors[0].offset;
    let (mem_floor, read_floor_t, mapped_t) = {
        let mut src = buffer(total as usize);
        fixtures::fill(&mut src, 7);
        let mut dst = buffer(total as usize);
        let m = best(|| memcpy_floor(&src, &mut dst, threads))?;
        let r = best(|| read_floor(&file, data_offset, &mut dst, threads))?;
        let mapped = best(|| mapped_read(&file, data_offset, &mut dst, threads))?;
        (m, r, mapped)
    };
    let mem_gbps = gbps(total, mem_floor);
    let read_gbps = gbps(total, read_floor_t);
    let fresh_gbps = gbps(total, best(|| fresh_memory_floor(total as usize, threads))?);
    let floor = mem_gbps.min(read_gbps);
    println!("  floor  memcpy (host to host)          {mem_gbps:>7.2} GB/s");
    println!("  floor  page-cache read (pread)        {read_gbps:>7.2} GB/s");
    let mapped_gbps = gbps(total, mapped_t);
    println!(
        "  plain  page-cache read (mmap + copy)  {mapped_gbps:>7.2} GB/s   ratio {:.2} to pread (the library maps segments of 1 MiB or more)",
        mapped_gbps / read_gbps
    );
    println!("  floor  fault in fresh memory          {fresh_gbps:>7.2} GB/s (the kernel zeroes every page)");

    let model: Vec<_> = (0..count)
        .map(|i| {
            (
                format!("layers.{i}.w"),
                DType::Bf16,
                shape.clone(),
                TENSOR as usize,
            )
        })
        .collect();
    let mut run = 0;
    let inplace = {
        let (m, _bufs) = engine(&model, threads)?;
        let inplace = gbps(
            total,
            best(|| timed_update(&m, &big_dir, Mode::InPlace, &mut run))?,
        );
        let ratio = inplace / floor;
        println!(
            "  wm     update in-place                {inplace:>7.2} GB/s   ratio {ratio:.2} to lower floor (target >= 0.80) {}",
            verdict(ratio >= 0.8)
        );
        inplace
    };
    let floors = Floors {
        memcpy: mem_gbps,
        read: read_gbps,
        fresh: fresh_gbps,
    };
    crate::bench_atomic::rows(&model, (&big_dir, &path), total, (floors, inplace), threads)?;

    if small > 0 {
        small_tensors(&dir, small, threads, read_gbps, &mut run)?;
    }
    Ok(())
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
    let (m, _bufs) = engine(&model, threads)?;
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

/// The benchmarks' model: `layers.<i>.w`, bf16 8192 x 4096 (64 MiB each).
pub(crate) const LAYER: usize = 64 << 20;
pub(crate) const LAYER_SHAPE: [u64; 2] = [8192, 4096];

/// Layers in a model of about `gib` GiB (at least one).
pub(crate) fn layer_count(gib: f64) -> usize {
    ((gib * (1u64 << 30) as f64) / LAYER as f64).ceil().max(1.0) as usize
}

/// `count` layers of varied bytes, like real weights (pages of one repeated
/// value can be merged by the host and then cost a copy-on-write fault when
/// written); `seed` tells one model from another.
fn layers(count: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| {
            let mut b = vec![0u8; LAYER];
            crate::fixtures::fill(&mut b, seed + i as u64);
            b
        })
        .collect()
}

/// The IPC and network benchmarks' engine params.
pub(crate) fn layer_params(count: usize) -> Vec<Vec<u8>> {
    layers(count, 1000)
}

/// The trainer's model in the IPC and network benchmarks (other bytes than
/// the engine's params, so every update changes them).
pub(crate) fn trainer_layers(count: usize) -> Vec<Vec<u8>> {
    layers(count, 1)
}

/// Offer `data` (from [`trainer_layers`]) from publisher `p` to `rank`
/// (None: every rank); the caller keeps `data` alive while `p` serves.
pub(crate) fn add_layers(
    p: &weight_manager_core::publisher::Publisher,
    data: &[Vec<u8>],
    rank: Option<u32>,
) -> Result<(), String> {
    for (i, d) in data.iter().enumerate() {
        // SAFETY: the caller keeps `data` alive while `p` serves.
        unsafe {
            p.add_tensor(
                &format!("layers.{i}.w"),
                weight_manager_core::tensor::DType::Bf16,
                &LAYER_SHAPE,
                d.as_ptr(),
                d.len(),
                rank,
            )
        }
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Register `params` as `layers.<i>.w` (bf16 8192 x 4096) with `m`; the
/// caller keeps `params` alive while `m` updates them.
pub(crate) fn register_layers(
    m: &weight_manager_core::manager::Manager,
    params: &mut [Vec<u8>],
) -> Result<(), String> {
    for (i, b) in params.iter_mut().enumerate() {
        let spec = weight_manager_core::registry::ParamSpec::host(
            &format!("layers.{i}.w"),
            weight_manager_core::tensor::DType::Bf16,
            &LAYER_SHAPE,
        );
        // SAFETY: the caller keeps `params` alive while `m` uses them.
        unsafe { m.register(&spec, b.as_mut_ptr(), b.len()) }.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A benchmark's trainer: this program run again as a separate publisher
/// process (`wm bench <kind>-publisher ...`), which prints a greeting line
/// when it serves and one `session <numbers>` line per session at the end.
pub(crate) struct TrainerProcess {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl TrainerProcess {
    /// Start `wm <args>` and wait for its greeting; returns the process and
    /// the rest of the greeting line.
    pub(crate) fn start(args: &[String], greeting: &str) -> Result<(Self, String), String> {
        use std::io::BufRead;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(exe)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = std::io::BufReader::new(stdout).lines();
        match lines.next() {
            Some(Ok(l)) if l.starts_with(greeting) => {
                let rest = l[greeting.len()..].to_string();
                Ok((TrainerProcess { child, lines }, rest))
            }
            other => Err(format!("the trainer process did not start: {other:?}")),
        }
    }

    /// Wait for the trainer to exit; the numbers of each session it reported.
    pub(crate) fn finish(mut self) -> Result<Vec<Vec<u64>>, String> {
        let sessions = self
            .lines
            .by_ref()
            .map_while(|l| l.ok())
            .filter(|l| l.starts_with("session "))
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
            .collect();
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err("the trainer process failed".into());
        }
        Ok(sessions)
    }
}
