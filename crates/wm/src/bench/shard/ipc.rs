//! `wm bench shard`, section ipc: 2 trainer ranks × 2 engine ranks over
//! same-node IPC, all four processes at once (`wm bench shard-ipc-rank`).
//!
//! The model: bf16 [8192, 4096] layers (64 MiB each). Trainer rank p holds
//! the FSDP row half p of every layer (rows p·4096.., 32 MiB) and publishes
//! a version of it before each update (one shared buffer; sessions hand it
//! over as WINDOWS). Engine rank e pulls its TP half of every layer from
//! both trainers at once, in place, unverified, in one of two patterns:
//! - **row halves**: the row half e of each trainer's shard (one contiguous
//!   16 MiB range of each; the TP half of a fused [gate; up] weight whose
//!   FSDP halves are gate and up);
//! - **column halves**: columns e·2048.. of every row (a strided run: a
//!   4 KiB block of every 8 KiB row of each shard).
//!
//! Floor: each engine copies the same blocks (same sizes, same layout,
//! into its params) out of shared buffers of its own with the plainest
//! fast copy (memcpy; streaming stores from 1 MiB), on as
//! many threads as its copier, both engines at once, before each update
//! (so the two see the same load; best of all). Figures are aggregate
//! GB/s (both engines' bytes / the time from telling both to go to the
//! last one done) of the first
//! update (which maps the trainers' buffers) and of steady updates (best
//! of the last ones, after both of a trainer's alternating version
//! buffers are mapped), beside the floor, with their ratio (target ≥ 0.8).

use super::{Args, Row};
use crate::bench::harness::process::Proc;
use crate::bench::harness::Scratch;
use crate::fmt::{self, gbps};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::copy::copy_bytes;
use weight_manager_core::internals::memory::shared::SharedBuffer;
use weight_manager_core::internals::memory::SendPtr;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::Placement;
use weight_manager_core::SourceKind;
use weight_manager_core::TensorBox;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig, TensorDesc};

const SHAPE: [u64; 2] = [8192, 4096];
const ROW: u64 = SHAPE[1] * 2;
/// Rows of a trainer's shard (and of an engine's row-halves param).
const SHARD_ROWS: u64 = SHAPE[0] / 2;
const SHARD: u64 = SHARD_ROWS * ROW;
/// Updates per pattern: the first two map the trainers' two alternating
/// version buffers; the rest are steady.
const UPDATES: usize = 7;

/// `wm bench shard-ipc-rank` options (a rank process).
#[derive(clap::Args, Debug)]
pub struct RankArgs {
    /// publisher or engine
    #[arg(long)]
    mode: String,
    /// The folder of the trainers' sockets
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 0)]
    rank: u64,
    #[arg(long, default_value_t = 1.0, value_parser = crate::gib)]
    gib: f64,
    /// The dimension split (engines)
    #[arg(long, default_value_t = 0)]
    split: usize,
    /// Copier threads (engines)
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let gib = a.gib(1.0);
    let layers = layers(gib);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let threads = a.threads.unwrap_or((cores / 2).max(1));
    println!(
        "    {layers} bf16 layers of {SHAPE:?} ({}): 2 trainer processes (FSDP row halves, \
         published), 2 engine processes ({threads} copier thread(s) each), all at once",
        fmt::bytes(layers * 2 * SHARD)
    );
    let mut rows = Vec::new();
    for (pattern, dim) in [("row halves", 0), ("column halves", 1)] {
        let r = run_pattern(dim, gib, threads)?;
        let row = |what: &str, bytes: u64, t: Duration, ok: Option<bool>| {
            let (got, floor) = (gbps(bytes, t), gbps(r.bytes, r.floor));
            Row {
                what: format!("{pattern}: {what}"),
                value: format!("{got:.2} GB/s"),
                beside: format!("memcpy {floor:.2} GB/s"),
                ratio: got / floor,
                ok: ok.map(|_| got / floor >= 0.8),
            }
        };
        rows.push(row(
            "first update (maps the buffers)",
            r.bytes,
            r.first,
            None,
        ));
        rows.push(row(
            "steady update, 4 processes at once",
            r.bytes,
            r.steady,
            Some(true),
        ));
    }
    Ok(rows)
}

fn layers(gib: f64) -> u64 {
    ((gib * (1u64 << 30) as f64) / (2 * SHARD) as f64)
        .ceil()
        .max(1.0) as u64
}

/// One pattern's times: bytes both engines moved per update, the floor
/// (both at once, best), the first update and the best steady one.
struct PatternTimes {
    bytes: u64,
    floor: Duration,
    first: Duration,
    steady: Duration,
}

/// Start the four processes, measure the floor, then the updates.
fn run_pattern(dim: usize, gib: f64, threads: usize) -> Result<PatternTimes, String> {
    let scratch = Scratch::temp(&format!("wm-bench-shard-ipc-{dim}"))?;
    let dir = scratch.0.to_str().ok_or("temp dir is not UTF-8")?;
    let common = ["--dir", dir, "--gib", &gib.to_string()];
    let start = |mode: &str, rank: usize| {
        let rank = rank.to_string();
        let mut args = vec!["bench", "shard-ipc-rank", "--mode", mode, "--rank", &rank];
        args.extend(common);
        let (split, threads) = (dim.to_string(), threads.to_string());
        args.extend(["--split", &split, "--threads", &threads]);
        Proc::wm(&args)
    };
    let mut trainers = vec![start("publisher", 0)?, start("publisher", 1)?];
    for t in &mut trainers {
        t.line_after("ready")?;
    }
    let mut engines = vec![start("engine", 0)?, start("engine", 1)?];
    // Both engines told at once; timed from the first command to the last
    // answer, so engines that did not overlap cannot look faster.
    let mut both = |cmd: &str, answer: &str| -> Result<(u64, Duration), String> {
        let t = Instant::now();
        engines.iter_mut().try_for_each(|e| e.say(cmd))?;
        let got: Vec<Vec<u64>> = engines
            .iter_mut()
            .map(|e| e.numbers_after(answer))
            .collect::<Result<_, _>>()?;
        Ok((got.iter().map(|n| n[0]).sum(), t.elapsed()))
    };
    // The floor alternates with the updates, so both see the same load.
    let mut floor = Duration::MAX;
    let mut times = Vec::new();
    let mut bytes = 0;
    for k in 0..UPDATES {
        // Once the trainers published (and idle), as for the update.
        for t in &mut trainers {
            t.line_after(&format!("published {k}"))?;
        }
        floor = floor.min(both("floor", "floor")?.1);
        let (b, t) = both("update", "updated")?;
        bytes = b;
        times.push(t);
    }
    for p in engines.into_iter().chain(trainers) {
        p.finish()?;
    }
    Ok(PatternTimes {
        bytes,
        floor,
        first: times[0],
        steady: times[2..].iter().copied().min().unwrap_or_default(),
    })
}

/// `wm bench shard-ipc-rank --mode publisher|engine`: one rank process.
pub fn rank(a: &RankArgs) -> Result<(), String> {
    let layers = layers(a.gib);
    match a.mode.as_str() {
        "publisher" => trainer(&a.dir, a.rank, layers),
        "engine" => engine(&a.dir, (a.rank, layers, a.split), a.threads),
        other => Err(format!("--mode {other}: publisher or engine")),
    }
}

fn socket(dir: &Path, rank: u64) -> PathBuf {
    dir.join(format!("trainer{rank}.sock"))
}

/// `n` buffers of `len` varied bytes (`seed` tells them apart).
fn filled(n: u64, len: u64, seed: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let mut b = vec![0u8; len as usize];
            crate::fixtures::fill(&mut b, seed + i);
            b
        })
        .collect()
}

/// Trainer rank `rank`: its row half of every layer, published as a new
/// version before each update, served to both engines.
fn trainer(dir: &Path, rank: u64, layers: u64) -> Result<(), String> {
    let shards = filled(layers, SHARD, 100 * rank);
    let p = Publisher::bind(&socket(dir, rank), PublisherConfig::default())
        .map_err(|e| e.to_string())?;
    let placement = Placement {
        global_shape: SHAPE.to_vec(),
        offset: vec![rank * SHARD_ROWS, 0],
    };
    for (i, s) in shards.iter().enumerate() {
        // SAFETY: `shards` outlives the publisher's use of it.
        unsafe {
            let name = format!("layers.{i}.w");
            let shape = [SHARD_ROWS, SHAPE[1]];
            p.add(
                TensorDesc::host(&name, DType::Bf16, &shape, s.as_ptr(), s.len())
                    .shard_of(placement.clone()),
            )
        }
        .map_err(|e| e.to_string())?;
    }
    println!("ready");
    for k in 0..UPDATES {
        p.set_version(Some(format!("v{k}")));
        p.publish().map_err(|e| e.to_string())?;
        println!("published {k}");
        p.serve(2, Duration::from_secs(600))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The boxes of layer tensor `name` engine rank `rank` holds in `dim`'s
/// pattern, each with where it starts in the param.
fn pieces(name: &str, rank: u64, dim: usize) -> Vec<Piece> {
    let piece = |offset: [u64; 2], len: [u64; 2], at: [u64; 2]| Piece {
        tensor: name.to_string(),
        global: TensorBox {
            offset: offset.to_vec(),
            len: len.to_vec(),
        },
        at: at.to_vec(),
    };
    let (quarter, half_cols) = (SHARD_ROWS / 2, SHAPE[1] / 2);
    match dim {
        0 => (0..2)
            .map(|p| {
                piece(
                    [p * SHARD_ROWS + rank * quarter, 0],
                    [quarter, SHAPE[1]],
                    [p * quarter, 0],
                )
            })
            .collect(),
        _ => vec![piece([0, rank * half_cols], [SHAPE[0], half_cols], [0, 0])],
    }
}

/// The (trainer, byte in its shard, byte in the param, length) blocks of a
/// layer that engine rank `rank` takes in `dim`'s pattern.
fn blocks(rank: u64, dim: usize) -> Vec<(usize, u64, u64, u64)> {
    let half = SHARD / 2;
    match dim {
        0 => (0..2)
            .map(|p| (p, rank * half, p as u64 * half, half))
            .collect(),
        _ => (0..2)
            .flat_map(|p| {
                (0..SHARD_ROWS).map(move |r| {
                    let to = (p as u64 * SHARD_ROWS + r) * ROW / 2;
                    (p, r * ROW + rank * ROW / 2, to, ROW / 2)
                })
            })
            .collect(),
    }
}

/// Engine rank `rank`: answers `floor` and `update` lines on stdin with
/// `floor <bytes> <ns>` and `updated <bytes> <ns>`.
fn engine(
    dir: &Path,
    (rank, layers, dim): (u64, u64, usize),
    threads: usize,
) -> Result<(), String> {
    let m = Manager::new(ManagerConfig {
        threads,
        rank: rank as u32,
        world_size: 2,
        fallback_dir: None,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut shape = SHAPE.to_vec();
    shape[dim] /= 2;
    let params: Vec<SendPtr> = (0..layers)
        .map(|i| {
            let name = format!("layers.{i}.w");
            let spec = ParamSpec {
                pieces: pieces(&name, rank, dim),
                ..ParamSpec::host(&name, DType::Bf16, &shape)
            };
            m.allocate(&spec).map(|p| SendPtr(p.0))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    // The floor's sources: shared memory like the trainers' published
    // buffers (page-aligned tensors: a heap buffer 16 bytes into its page
    // would put memcpy in another case of source and destination offsets).
    let sources = [shared_shards(layers, 7)?, shared_shards(layers, 9)?];
    let layer_blocks = blocks(rank, dim);
    let jobs: Vec<(SendPtr, SendPtr, usize)> = (0..layers as usize)
        .flat_map(|i| {
            let (sources, param) = (&sources, params[i]);
            layer_blocks.iter().map(move |&(p, from, to, len)| {
                let shard = sources[p].ptr().wrapping_add(i * SHARD as usize);
                let src = SendPtr(shard.wrapping_add(from as usize));
                (
                    src,
                    SendPtr(param.0.wrapping_add(to as usize)),
                    len as usize,
                )
            })
        })
        .collect();
    let bytes: u64 = jobs.iter().map(|j| j.2 as u64).sum();
    for line in std::io::stdin().lines().map_while(|l| l.ok()) {
        let t = Instant::now();
        match line.as_str() {
            "floor" => {
                memcpy_blocks(&jobs, threads);
                println!("floor {bytes} {}", t.elapsed().as_nanos());
            }
            "update" => {
                let mut r = UpdateRequest::snapshot(PathBuf::new());
                r.locations = vec![socket(dir, 0), socket(dir, 1)];
                r.source = SourceKind::Ipc;
                r.mode = Mode::InPlace;
                let stats = m.update(r).map_err(|e| e.to_string())?;
                println!("updated {} {}", stats.bytes, t.elapsed().as_nanos());
            }
            other => return Err(format!("unknown command '{other}'")),
        }
    }
    Ok(())
}

/// `layers` shards of varied bytes, back to back in one shared buffer.
fn shared_shards(layers: u64, seed: u64) -> Result<SharedBuffer, String> {
    let b = SharedBuffer::create("floor", (layers * SHARD) as usize).map_err(|e| e.to_string())?;
    // SAFETY: our own buffer, just created.
    crate::fixtures::fill(
        unsafe { std::slice::from_raw_parts_mut(b.ptr(), b.len()) },
        seed,
    );
    Ok(b)
}

/// Copy every (source, destination, length) job with the plainest fast
/// copy (`copy_bytes`: memcpy, and streaming stores from 1 MiB, which
/// glibc's memcpy reaches only at some source and destination offsets: a
/// page-aligned source into a param 16 bytes into its page ran at a third
/// of the speed), the jobs cut into `threads` runs of about equal bytes,
/// one per thread.
fn memcpy_blocks(jobs: &[(SendPtr, SendPtr, usize)], threads: usize) {
    let total: usize = jobs.iter().map(|j| j.2).sum();
    let share = total.div_ceil(threads.max(1));
    let mut runs: Vec<&[(SendPtr, SendPtr, usize)]> = Vec::new();
    let (mut from, mut acc) = (0, 0);
    for (i, j) in jobs.iter().enumerate() {
        acc += j.2;
        if acc >= share || i + 1 == jobs.len() {
            runs.push(&jobs[from..=i]);
            (from, acc) = (i + 1, 0);
        }
    }
    std::thread::scope(|s| {
        for run in runs {
            s.spawn(move || {
                for &(src, dst, len) in run {
                    // SAFETY: each job lies in its source buffer and its own
                    // bytes of a param; no two jobs write the same byte.
                    unsafe { copy_bytes(dst.0, src.0, len) };
                }
            });
        }
    });
}
