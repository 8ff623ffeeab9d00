//! The benchmarks' model and engines: `layers.<i>.w`, bf16 8192 x 4096
//! (64 MiB each), written as a snapshot, served by a publisher, or held as
//! an engine's params (engine-owned, pre-faulted).

use crate::bench::harness::buffer;
use crate::fixtures;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::host::HostRegion;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig, ServeStats, TensorDesc};

/// The snapshot measured: its folder and file, its bytes, and its model.
pub struct Snapshot<'a> {
    pub dir: &'a Path,
    pub path: &'a Path,
    pub total: u64,
    pub model: &'a Model,
}

/// One layer's bytes.
pub const LAYER: usize = 64 << 20;
pub const LAYER_SHAPE: [u64; 2] = [8192, 4096];

/// A model: (name, dtype, shape, bytes) per tensor.
pub type Model = [(String, DType, Vec<u64>, usize)];

/// Layers in a model of about `gib` GiB (at least one).
pub fn layer_count(gib: f64) -> usize {
    ((gib * (1u64 << 30) as f64) / LAYER as f64).ceil().max(1.0) as usize
}

/// The model of `count` layers.
pub fn layer_model(count: usize) -> Vec<(String, DType, Vec<u64>, usize)> {
    (0..count)
        .map(|i| {
            let name = format!("layers.{i}.w");
            (name, DType::Bf16, LAYER_SHAPE.to_vec(), LAYER)
        })
        .collect()
}

/// A snapshot of `count` bf16 layers in `dir`, read once so it is in the
/// page cache; returns its file.
pub fn write_layers(dir: &Path, count: usize) -> Result<PathBuf, String> {
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

/// Read `path` once, so that it is in the page cache.
pub fn warm(path: &Path) -> Result<(), String> {
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
pub enum EngineMemory {
    Heap(Vec<u8>),
    Huge(HostRegion),
}

impl EngineMemory {
    pub fn new(n: usize, huge: bool) -> Result<EngineMemory, String> {
        if !huge {
            return Ok(EngineMemory::Heap(buffer(n)));
        }
        let r = HostRegion::new("engine param", n).map_err(|e| e.to_string())?;
        r.advise_huge(true);
        // SAFETY: the region is n bytes of our own writable memory.
        unsafe { std::ptr::write_bytes(r.ptr(), 1, n) };
        Ok(EngineMemory::Huge(r))
    }

    pub fn ptr(&mut self) -> *mut u8 {
        match self {
            EngineMemory::Heap(b) => b.as_mut_ptr(),
            EngineMemory::Huge(r) => r.ptr(),
        }
    }
}

/// A manager on `threads` copy threads with no fallback folder.
pub fn manager(threads: usize) -> Result<Manager, String> {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        threads,
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

/// A manager with no fallback folder that takes network updates with
/// `secret`.
pub fn net_manager(secret: &str) -> Result<Manager, String> {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        net: weight_manager_core::NetSettings {
            secret: Some(secret.into()),
            ..Default::default()
        },
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

/// Engine-owned, pre-faulted params for every tensor of `model`, in huge
/// pages when `huge`.
pub fn engine(
    model: &Model,
    threads: usize,
    huge: bool,
) -> Result<(Manager, Vec<EngineMemory>), String> {
    let m = manager(threads)?;
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

/// One update of `m` from the snapshot in `dir`, a new version each
/// (`run` counts them).
pub fn timed_update(
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

/// Stage a new version (`run` counts them) of the snapshot in `dir`, then
/// commit it: how long each took (the commit is the engine's pause).
pub fn stage_and_commit(
    m: &std::sync::Arc<Manager>,
    dir: &Path,
    run: &mut u64,
) -> Result<(Duration, Duration), String> {
    *run += 1;
    let mut req = UpdateRequest::snapshot(dir);
    req.version = Some(format!("bench-{run}"));
    let t = Instant::now();
    let staged = m.stage(req).map_err(|e| e.to_string())?;
    let stage = t.elapsed();
    let t = Instant::now();
    staged.commit().map_err(|e| e.to_string())?;
    Ok((stage, t.elapsed()))
}

/// `count` layers of varied bytes, like real weights (pages of one repeated
/// value can be merged by the host and then cost a copy-on-write fault when
/// written); `seed` tells one model from another.
fn layers(count: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| {
            let mut b = vec![0u8; LAYER];
            fixtures::fill(&mut b, seed + i as u64);
            b
        })
        .collect()
}

/// The IPC and network benchmarks' engine params.
pub fn layer_params(count: usize) -> Vec<Vec<u8>> {
    layers(count, 1000)
}

/// The trainer's model in the IPC and network benchmarks (other bytes than
/// the engine's params, so every update changes them).
pub fn trainer_layers(count: usize) -> Vec<Vec<u8>> {
    layers(count, 1)
}

/// Offer `data` (from [`trainer_layers`]) from publisher `p` to `rank`
/// (None: every rank); the caller keeps `data` alive while `p` serves.
pub fn add_layers(p: &Publisher, data: &[Vec<u8>], rank: Option<u32>) -> Result<(), String> {
    for (i, d) in data.iter().enumerate() {
        let name = format!("layers.{i}.w");
        let t = TensorDesc::host(&name, DType::Bf16, &LAYER_SHAPE, d.as_ptr(), d.len());
        // SAFETY: the caller keeps `data` alive while `p` serves.
        unsafe { p.add(t.for_rank(rank)) }.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Register `params` as `layers.<i>.w` with `m`; the caller keeps `params`
/// alive while `m` updates them.
pub fn register_layers(m: &Manager, params: &mut [Vec<u8>]) -> Result<(), String> {
    for (i, b) in params.iter_mut().enumerate() {
        let spec = ParamSpec::host(&format!("layers.{i}.w"), DType::Bf16, &LAYER_SHAPE);
        // SAFETY: the caller keeps `params` alive while `m` uses them.
        unsafe { m.register(&spec, b.as_mut_ptr(), b.len()) }.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A TP rank's half of every layer, verified with slice checksums: the
/// rows (one range of each tensor; over the network sent from the
/// trainer's tensors in 1 MiB messages), and the columns (a strided run
/// of 4 KiB row halves, packed: over the network 256 to a message).
pub const HALVES: [(&str, usize); 2] = [
    ("row half (TP piece), verified", 0),
    ("column half (TP piece), verified", 1),
];

/// Library-owned params holding part `part` of `parts` of every layer
/// along dimension `dim`.
pub fn part_params(
    m: &Manager,
    count: usize,
    dim: usize,
    (part, parts): (u64, u64),
) -> Result<(), String> {
    let full = LAYER_SHAPE;
    let mut shape = full.to_vec();
    shape[dim] /= parts;
    for i in 0..count {
        let name = format!("layers.{i}.w");
        let piece = Piece::narrow(&name, &full, dim, part * shape[dim], shape[dim]);
        let spec = ParamSpec {
            pieces: vec![piece],
            ..ParamSpec::host(&name, DType::Bf16, &shape)
        };
        m.allocate(&spec).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Library-owned params holding the second half of every layer along
/// dimension `dim` (a first half named like its tensor would read as the
/// whole tensor of the param's shape: `ParamSpec::is_whole_tensor`).
pub fn half_params(m: &Manager, count: usize, dim: usize) -> Result<(), String> {
    part_params(m, count, dim, (1, 2))
}

/// The model and bucket size of the IPC and network benches.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Model size in GiB (tensors of 64 MiB)
    #[arg(long, default_value_t = 4.0, value_parser = crate::gib)]
    pub gib: f64,
    /// Bucket size in MiB
    #[arg(long, default_value_t = 512)]
    pub bucket_mib: usize,
}

/// A trainer process's network publisher on a free loopback port, its
/// engines let in with `secret`.
pub fn net_publisher(secret: &str) -> Result<Publisher, String> {
    let cfg = PublisherConfig {
        secret: Some(secret.into()),
        ..Default::default()
    };
    Publisher::bind_net("127.0.0.1:0", cfg).map_err(|e| e.to_string())
}

/// Say where `p` listens (`listening <address>`, the line the bench
/// waits for), then serve `engines` sessions as version `bench`.
pub fn listen_and_serve(p: &Publisher, engines: usize) -> Result<ServeStats, String> {
    p.set_version(Some("bench".into()));
    println!("listening {}", p.address());
    let _ = std::io::stdout().flush();
    p.serve(engines, Duration::from_secs(600))
        .map_err(|e| e.to_string())
}
