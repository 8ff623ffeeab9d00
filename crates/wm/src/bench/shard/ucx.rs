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
use super::{Args, Row};
use crate::bench::harness::process::Proc;
use crate::bench::harness::{around_floors, buffer, median};
use crate::bench::model::{
    layer_count, listen_and_serve, net_publisher, part_params, LAYER, LAYER_SHAPE,
};
use crate::fmt::{self, gbps};
use std::io::Write;
use std::time::{Duration, Instant};
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::Placement;
use weight_manager_core::SourceKind;
use weight_manager_core::TensorDesc;
use weight_manager_core::{Manager, ManagerConfig, NetSettings, UpdateRequest};

const SECRET: &str = "wm-bench-shard-ucx-secret-0123456789";
/// The TP split of each pattern: the dimension halved.
const PATTERNS: [(&str, usize); 2] = [("row halves", 0), ("column halves", 1)];

/// `wm bench shard-ucx-publisher` options (a trainer process).
#[derive(clap::Args, Debug)]
pub struct PublisherArgs {
    #[arg(long, default_value_t = 0)]
    rank: u64,
    #[arg(long, default_value_t = 1.0, value_parser = crate::gib)]
    gib: f64,
    /// Sessions to serve
    #[arg(long, default_value_t = 1)]
    engines: usize,
}

/// `wm bench shard-ucx-rank` options (an engine-rank process).
#[derive(clap::Args, Debug)]
pub struct RankArgs {
    #[arg(long, default_value_t = 0)]
    rank: u64,
    /// The dimension split
    #[arg(long, default_value_t = 0)]
    split: usize,
    #[arg(long, default_value_t = 1.0, value_parser = crate::gib)]
    gib: f64,
    #[arg(long, default_value_t = 64)]
    bucket_mib: usize,
    /// The trainers' addresses, comma-separated
    #[arg(long, value_delimiter = ',')]
    addresses: Vec<String>,
}

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let gib = a.gib(1.0);
    let runs = a.runs.unwrap_or(if a.quick { 2 } else { 3 });
    let bucket_mib = a.bucket_mib;
    let count = layer_count(gib);
    let total = (count * LAYER) as u64;
    let sessions = PATTERNS.len() * HALVES as usize * (1 + 2 * runs);
    let mut trainers = (0..HALVES)
        .map(|r| {
            Proc::wm(&[
                "bench",
                "shard-ucx-publisher",
                "--rank",
                &r.to_string(),
                "--gib",
                &gib.to_string(),
                "--engines",
                &sessions.to_string(),
            ])
        })
        .collect::<Result<Vec<_>, String>>()?;
    let addresses = trainers
        .iter_mut()
        .map(|t| t.line_after("listening "))
        .collect::<Result<Vec<_>, String>>()?;
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
    for (r, t) in trainers.into_iter().enumerate() {
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
        .map(|e| start_rank(s, e))
        .collect::<Result<Vec<_>, String>>()?;
    for r in &mut ranks {
        r.line_after("ready")?;
    }
    let around = |a: Duration, b: Duration| (gbps(total, a) + gbps(total, b)) / 2.0;
    let mut rows = Vec::new();
    for verify in [true, false] {
        let runs = around_floors(
            s.runs,
            || floors.measure(),
            || update_all(&mut ranks, verify),
        )?;
        let (mut best, mut pattern, mut contiguous) = (0f64, Vec::new(), Vec::new());
        for r in runs {
            let got = gbps(r.run.0, r.run.1);
            best = best.max(got);
            pattern.push(got / around(r.before.pattern, r.after.pattern));
            contiguous.push(got / around(r.before.contiguous, r.after.contiguous));
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
/// Update every rank at once; their bytes, and the wall time from the
/// first starting to the last done.
fn update_all(ranks: &mut [Proc], verify: bool) -> Result<(u64, Duration), String> {
    let t = Instant::now();
    for r in ranks.iter_mut() {
        r.say(if verify { "verified" } else { "unverified" })?;
    }
    let mut bytes = 0;
    for r in ranks.iter_mut() {
        let n = r.numbers_after("done ")?;
        bytes += n.first().ok_or("engine rank: no bytes after 'done'")?;
    }
    Ok((bytes, t.elapsed()))
}

/// An engine-rank process: told "verified" or "unverified" on its stdin,
/// it runs one update and answers `done <bytes>`.
fn start_rank(s: &Setup, e: u64) -> Result<Proc, String> {
    Proc::wm(&[
        "bench",
        "shard-ucx-rank",
        "--rank",
        &e.to_string(),
        "--split",
        &s.dim.to_string(),
        "--gib",
        &((s.count * LAYER) as f64 / (1u64 << 30) as f64).to_string(),
        "--bucket-mib",
        &s.bucket_mib.to_string(),
        "--addresses",
        &s.addresses.join(","),
    ])
}

/// A trainer process: rank `--rank`'s row half of every layer, served to
/// `--engines` sessions; one `session <bytes> <messages>` line each.
pub fn publisher(a: &PublisherArgs) -> Result<(), String> {
    let r = a.rank;
    let count = layer_count(a.gib);
    let half = LAYER_SHAPE[0] / HALVES;
    let data: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let mut b = vec![0u8; LAYER / HALVES as usize];
            crate::fixtures::fill(&mut b, 1 + HALVES * i as u64 + r);
            b
        })
        .collect();
    let p = net_publisher(SECRET)?;
    let placement = Placement {
        global_shape: LAYER_SHAPE.to_vec(),
        offset: vec![r * half, 0],
    };
    for (i, d) in data.iter().enumerate() {
        let shape = [half, LAYER_SHAPE[1]];
        let name = format!("layers.{i}.w");
        // SAFETY: `data` outlives the serving.
        unsafe {
            p.add(
                TensorDesc::host(&name, DType::Bf16, &shape, d.as_ptr(), d.len())
                    .shard_of(placement.clone()),
            )
        }
        .map_err(|e| e.to_string())?;
    }
    let stats = listen_and_serve(&p, a.engines)?;
    for s in &stats.sessions {
        println!("session {} {}", s.bytes, s.messages);
    }
    Ok(())
}

/// An engine-rank process: rank `--rank`'s half along `--split` of every
/// layer, library-owned, updated from every `--addresses` publisher at
/// once. Prints "ready" after a first update (buffers created, params
/// faulted in), then one `done <bytes>` per line it is told.
pub fn rank(a: &RankArgs) -> Result<(), String> {
    let (e, dim, bucket_mib, addresses) = (a.rank, a.split, a.bucket_mib, &a.addresses);
    let count = layer_count(a.gib);
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
    part_params(&m, count, dim, (e, HALVES))?;
    let update = |verify: bool| {
        let mut r = UpdateRequest::snapshot(std::path::PathBuf::new());
        r.locations = addresses.iter().map(std::path::PathBuf::from).collect();
        r.source = SourceKind::Rdma;
        r.mode = Mode::InPlace;
        r.verify = verify;
        r.skip_network_checksums = !verify;
        // Every byte moves (the same version again would come as empty
        // deltas).
        r.deltas = weight_manager_core::DeltaMode::Off;
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
