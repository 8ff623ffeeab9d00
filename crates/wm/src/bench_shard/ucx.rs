//! `wm bench shard`, section ucx: 2 trainers x 2 engine ranks over UCX, all
//! at once. Two trainer processes (`wm bench shard-ucx-publisher`) each
//! publish their FSDP half (rows) of every layer (bf16 [8192, 4096], 64 MiB
//! each); two engine-rank processes (`wm bench shard-ucx-rank`) each pull
//! their TP half of every layer from both trainers at once, verified (the
//! default: slice sums) and unverified, in place, landing straight in their
//! params (direct).
//!
//! - Row halves: engine rank e's rows are trainer e's, one range of each
//!   tensor: 2 streams, sent from the trainers' tensors in 1 MiB messages.
//! - Column halves: every trainer holds a quarter of each rank's half, as
//!   4 KiB blocks (half of an 8 KiB row): 4 streams, the blocks packed
//!   into 1 MiB messages (`wire::split_entries`), each received as one
//!   range (the rows follow each other in the engine's param).
//!
//! Floor: raw UCX moving the same bytes in the same pattern (the same
//! sender -> receiver pairs, all at once, each on its own two workers) in
//! 1 MiB messages, the session's message size, so as many messages as the
//! sessions send; for column halves, the same 4 KiB blocks gathered by
//! UCX or packed by a copy, the faster (`FloorSet`), with the contiguous
//! floor beside it. Measured in this process before and after every update.
//! Each figure: aggregate GB/s (bytes of both ranks over the wall time
//! from both starting to both done) beside the floors around it, and the
//! median of those ratios (target >= 0.8 for the default, verified).
//! Run with `UCX_TLS=tcp` on a machine without RDMA.

use super::ucx_floors::{FloorSet, DEPTH, HALVES};
use super::Row;
use crate::bench::{buffer, layer_count, TrainerProcess, LAYER, LAYER_SHAPE};
use crate::fmt::{self, gbps};
use crate::Args;
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::apply::Mode;
use weight_manager_core::manager::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::manifest::Placement;
use weight_manager_core::pieces::Piece;
use weight_manager_core::publisher::{Publisher, PublisherConfig};
use weight_manager_core::registry::ParamSpec;
use weight_manager_core::source::SourceKind;
use weight_manager_core::tensor::DType;

const SECRET: &str = "wm-bench-shard-ucx-secret-0123456789";
/// The TP split of each pattern: the dimension halved.
const PATTERNS: [(&str, usize); 2] = [("row halves", 0), ("column halves", 1)];

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let quick = a.flag("quick");
    let gib: f64 = a.number("gib", if quick { 0.25 } else { 1.0 })?;
    let runs: usize = a.number("runs", if quick { 2 } else { 3 })?;
    let bucket_mib: usize = a.number("bucket-mib", 64)?;
    let count = layer_count(gib);
    let total = (count * LAYER) as u64;
    let sessions = PATTERNS.len() * HALVES as usize * (1 + 2 * runs);
    let trainers = (0..HALVES)
        .map(|r| {
            let args = [
                "bench",
                "shard-ucx-publisher",
                "--rank",
                &r.to_string(),
                "--gib",
                &gib.to_string(),
                "--engines",
                &sessions.to_string(),
            ];
            TrainerProcess::start(&args.map(String::from), "listening ")
        })
        .collect::<Result<Vec<_>, String>>()?;
    let addresses: Vec<String> = trainers.iter().map(|t| t.1.clone()).collect();
    println!(
        "    {} of bf16 in {count} layers, {HALVES} trainer processes x {HALVES} engine-rank processes, \
         buckets of {bucket_mib} MiB x {DEPTH}, UCX_TLS={}",
        fmt::bytes(total),
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(all)".into())
    );
    let src = buffer(total as usize);
    let mut rows = Vec::new();
    for (what, dim) in PATTERNS {
        let setup = Setup {
            what,
            dim,
            count,
            runs,
            bucket_mib,
            addresses: &addresses,
        };
        rows.extend(measure(&setup, &src)?);
    }
    for (r, (t, _)) in trainers.into_iter().enumerate() {
        let sessions = t.finish()?;
        // Column sessions move a quarter of the model each.
        let cols: Vec<&Vec<u64>> = sessions
            .iter()
            .filter(|s| s.first() == Some(&(total / 4)))
            .collect();
        if let Some(s) = cols.first().filter(|s| s.len() == 2) {
            println!(
                "    trainer {r}: a column-halves session sent {} UCX messages for {} blocks of 4 KiB ({} sessions)",
                s[1],
                total / 4 / 4096,
                cols.len()
            );
        }
    }
    Ok(rows)
}

/// One pattern's measurement.
struct Setup<'a> {
    what: &'static str,
    dim: usize,
    count: usize,
    runs: usize,
    bucket_mib: usize,
    addresses: &'a [String],
}

/// The floors and the wm runs of one pattern, alternating: the floors, an
/// update of both ranks, the floors, ...; verified, then not. Each run's
/// ratio is to the floors around it.
fn measure(s: &Setup, src: &[u8]) -> Result<Vec<Row>, String> {
    let total = src.len() as u64;
    let mut floors = FloorSet::new(s.dim, s.bucket_mib, src);
    let mut ranks = (0..HALVES)
        .map(|e| EngineRank::start(s, e))
        .collect::<Result<Vec<_>, String>>()?;
    for r in &mut ranks {
        r.expect("ready")?;
    }
    let around = |a: Duration, b: Duration| (gbps(total, a) + gbps(total, b)) / 2.0;
    let mut rows = Vec::new();
    for verify in [true, false] {
        let mut before = floors.measure()?;
        let (mut best, mut pattern, mut contiguous) = (0f64, Vec::new(), Vec::new());
        for _ in 0..s.runs {
            let (bytes, t) = update_all(&mut ranks, verify)?;
            let after = floors.measure()?;
            best = best.max(gbps(bytes, t));
            pattern.push(gbps(bytes, t) / around(before.pattern, after.pattern));
            contiguous.push(gbps(bytes, t) / around(before.contiguous, after.contiguous));
            before = after;
        }
        let how = if verify { "verified" } else { "unverified" };
        let ratio = median(pattern);
        rows.push(Row {
            what: format!("{}, {how}, aggregate of 2 ranks", s.what),
            value: format!("{best:.2} GB/s"),
            beside: "raw UCX floors around".into(),
            ratio,
            ok: verify.then_some(ratio >= 0.8),
        });
        if s.dim != 0 {
            rows.push(Row {
                what: format!("{}, {how}, beside contiguous ranges", s.what),
                value: format!("{best:.2} GB/s"),
                beside: "contiguous floors around".into(),
                ratio: median(contiguous),
                ok: None,
            });
        }
    }
    for r in ranks {
        r.finish()?;
    }
    let mut floor_rows = floors.rows(s.what, total);
    floor_rows.extend(rows);
    Ok(floor_rows)
}
/// The middle of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Update every rank at once; their bytes, and the wall time from the
/// first starting to the last done.
fn update_all(ranks: &mut [EngineRank], verify: bool) -> Result<(u64, Duration), String> {
    let t = Instant::now();
    for r in ranks.iter_mut() {
        let word = if verify { "verified" } else { "unverified" };
        writeln!(r.stdin, "{word}").map_err(|e| e.to_string())?;
    }
    let mut bytes = 0;
    for r in ranks.iter_mut() {
        let line = r.expect("done ")?;
        bytes += line
            .split_whitespace()
            .nth(1)
            .and_then(|b| b.parse::<u64>().ok())
            .ok_or(format!("engine rank: bad line '{line}'"))?;
    }
    Ok((bytes, t.elapsed()))
}

/// An engine-rank process: told "verified" or "unverified" on its stdin,
/// it runs one update and answers `done <bytes>`.
struct EngineRank {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl EngineRank {
    fn start(s: &Setup, e: u64) -> Result<EngineRank, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["bench", "shard-ucx-rank", "--rank", &e.to_string()])
            .args(["--split", &s.dim.to_string(), "--gib"])
            .arg(((s.count * LAYER) as f64 / (1u64 << 30) as f64).to_string())
            .args(["--bucket-mib", &s.bucket_mib.to_string()])
            .args(["--addresses", &s.addresses.join(",")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdin = child.stdin.take().expect("piped");
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        Ok(EngineRank {
            child,
            stdin,
            lines,
        })
    }

    /// The next line, which must start with `what`.
    fn expect(&mut self, what: &str) -> Result<String, String> {
        match self.lines.next() {
            Some(Ok(l)) if l.starts_with(what) => Ok(l),
            other => Err(format!("engine rank: expected '{what}', got {other:?}")),
        }
    }

    /// Close its stdin and wait for it to exit.
    fn finish(self) -> Result<(), String> {
        let EngineRank {
            mut child, stdin, ..
        } = self;
        drop(stdin);
        match child.wait().map_err(|e| e.to_string())?.success() {
            true => Ok(()),
            false => Err("an engine-rank process failed".into()),
        }
    }
}

/// A trainer process: rank `--rank`'s row half of every layer, served to
/// `--engines` sessions; one `session <bytes> <messages>` line each.
pub fn publisher(a: &Args) -> Result<(), String> {
    let r: u64 = a.number("rank", 0)?;
    let count = layer_count(a.number("gib", 1.0)?);
    let half = LAYER_SHAPE[0] / HALVES;
    let data: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let mut b = vec![0u8; LAYER / HALVES as usize];
            crate::fixtures::fill(&mut b, 1 + HALVES * i as u64 + r);
            b
        })
        .collect();
    let p = Publisher::bind_net(
        "127.0.0.1:0",
        PublisherConfig {
            secret: Some(SECRET.into()),
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let placement = Placement {
        global_shape: LAYER_SHAPE.to_vec(),
        offset: vec![r * half, 0],
    };
    for (i, d) in data.iter().enumerate() {
        let shape = [half, LAYER_SHAPE[1]];
        let name = format!("layers.{i}.w");
        // SAFETY: `data` outlives the serving.
        unsafe {
            p.add_shard(
                &name,
                DType::Bf16,
                &shape,
                &placement,
                d.as_ptr(),
                d.len(),
                None,
            )
        }
        .map_err(|e| e.to_string())?;
    }
    p.set_version(Some("bench".into()));
    println!("listening {}", p.address());
    let _ = std::io::stdout().flush();
    let stats = p
        .serve(a.number("engines", 1)?, Duration::from_secs(600))
        .map_err(|e| e.to_string())?;
    for s in &stats.sessions {
        println!("session {} {}", s.bytes, s.messages);
    }
    Ok(())
}

/// An engine-rank process: rank `--rank`'s half along `--split` of every
/// layer, library-owned, updated from every `--addresses` publisher at
/// once. Prints "ready" after a first update (buffers created, params
/// faulted in), then one `done <bytes>` per line it is told.
pub fn rank(a: &Args) -> Result<(), String> {
    let e: u64 = a.number("rank", 0)?;
    let dim: usize = a.number("split", 0)?;
    let count = layer_count(a.number("gib", 1.0)?);
    let bucket_mib: usize = a.number("bucket-mib", 64)?;
    let addresses: Vec<&str> = a.value("addresses").unwrap_or("").split(',').collect();
    let m = Manager::new(ManagerConfig {
        rank: e as u32,
        world_size: HALVES as u32,
        net: NetSettings {
            secret: Some(SECRET.into()),
            bucket_size: bucket_mib << 20,
            depth: DEPTH,
            ..Default::default()
        },
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let full = LAYER_SHAPE;
    let mut shape = full.to_vec();
    shape[dim] /= HALVES;
    for i in 0..count {
        let name = format!("layers.{i}.w");
        let spec = ParamSpec {
            pieces: vec![Piece::narrow(&name, &full, dim, e * shape[dim], shape[dim])],
            ..ParamSpec::host(&name, DType::Bf16, &shape)
        };
        m.allocate(&spec).map_err(|e| e.to_string())?;
    }
    let update = |verify: bool| {
        let mut r = UpdateRequest::snapshot(std::path::PathBuf::new());
        r.locations = addresses.iter().map(std::path::PathBuf::from).collect();
        r.source = SourceKind::Rdma;
        r.mode = Mode::InPlace;
        r.verify = verify;
        r.skip_network_checksums = !verify;
        m.update(r).map_err(|e| e.to_string())
    };
    update(true)?;
    println!("ready");
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lines() {
        let s = update(line.map_err(|e| e.to_string())? == "verified")?;
        println!("done {}", s.bytes);
        let _ = std::io::stdout().flush();
    }
    Ok(())
}
