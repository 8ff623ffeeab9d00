//! `wm plan --trainer TRAINER.json --engine ENGINE.json [--link-gbps G]
//! [--json]`: plan every engine rank of a layout against every trainer
//! rank, as the manager would (spread = engine rank), without a byte of
//! weights or a param's memory, and report what would move where and how
//! long the busiest link would take (`docs/layouts.md`). `--goodput`,
//! `--wire-dtype fp8` and `--delta-fraction` scale the prediction by what
//! the link really carries, FP8 with 128x128 block scales on the wire, and
//! deltas of that share of elements (the codec's own size model).

mod report;

use report::{Report, Totals};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use weight_manager_core::plan::layout::{read_engine, read_trainer, EngineLayout, TrainerLayout};
use weight_manager_core::plan::{Params, PlanOptions, Sources, Target};
use weight_manager_core::quant::params::QuantRole;
use weight_manager_core::Manifest;
use weight_manager_core::{LogLevel, Logger};

/// `wm plan` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The trainer's layout (docs/layouts.md)
    #[arg(long, value_name = "TRAINER.json")]
    trainer: PathBuf,
    /// The engine's layout (docs/layouts.md)
    #[arg(long, value_name = "ENGINE.json")]
    engine: PathBuf,
    /// Line rate of each link, in Gb/s
    #[arg(long, default_value_t = 400.0)]
    link_gbps: f64,
    /// The share of line rate a link delivers, in (0, 1]
    #[arg(long, default_value_t = 1.0)]
    goodput: f64,
    /// The dtype on the wire: bf16 (the layout's own dtypes, as the
    /// trainer holds them), or fp8 with 128x128 block scales (one byte an
    /// element, whatever the layout's dtype)
    #[arg(long, value_name = "bf16|fp8", default_value = "bf16")]
    wire_dtype: String,
    /// Send deltas of this share of elements, in [0, 1] (default: whole)
    #[arg(long, value_name = "F")]
    delta_fraction: Option<f64>,
    /// Plan only these engine ranks (default: all)
    #[arg(long, value_name = "FIRST:END")]
    engine_ranks: Option<String>,
    /// Print one JSON object instead of the text report
    #[arg(long)]
    json: bool,
}

pub fn run(a: &Args) -> Result<(), String> {
    let gbps = a.link_gbps;
    if !(gbps > 0.0 && gbps.is_finite()) {
        return Err(format!(
            "--link-gbps {gbps}: must be a finite number above 0"
        ));
    }
    let mut wire = report::Wire::from_args(a)?;
    let t0 = Instant::now();
    let trainer = read_trainer(&a.trainer).map_err(|e| e.to_string())?;
    let engine = read_engine(&a.engine).map_err(|e| e.to_string())?;
    if wire.fp8 && engine.quantizes() {
        return Err(format!(
            "--wire-dtype fp8 scales a bf16 layout's bytes; {} quantizes its params (\"quant\"), \
             so its plan's bytes are FP8 already",
            a.engine.display()
        ));
    }
    wire.planned_fp8 = engine.quantizes();
    let read = t0.elapsed();
    let ranks = engine_ranks(a.engine_ranks.as_deref(), engine.ranks)?;
    let totals = plan_all(&trainer, &engine, ranks, &wire)?;
    let report = Report::new(&trainer, &engine, totals, read, (gbps, wire))?;
    match a.json {
        true => println!("{}", report.json()),
        false => print!("{}", report.text()),
    }
    Ok(())
}

/// `--engine-ranks FIRST:END` (default all): plan only those engine ranks.
fn engine_ranks(v: Option<&str>, ranks: usize) -> Result<Range<usize>, String> {
    let Some(v) = v else {
        return Ok(0..ranks);
    };
    let bad = || format!("--engine-ranks {v}: needs FIRST:END with FIRST < END <= {ranks}");
    let (first, end) = v.split_once(':').ok_or_else(bad)?;
    let (first, end) = (
        first.parse().map_err(|_| bad())?,
        end.parse().map_err(|_| bad())?,
    );
    if first >= end || end > ranks {
        return Err(bad());
    }
    Ok(first..end)
}

/// What one engine rank's plan moves.
pub struct RankPlan {
    pub runs: usize,
    pub bytes: u64,
    /// Bytes on the wire, as `--wire-dtype` and `--delta-fraction` say
    /// (each run by its own element size).
    pub wired: f64,
    pub param_bytes: u64,
    pub params: usize,
    pub pieces: usize,
    /// What each trainer rank it takes bytes from sends it, by trainer
    /// rank (only those: a rank of a large layout reads from a few of
    /// many trainer ranks, and a list as long as the trainer's ranks per
    /// engine rank grew as the product of the two counts).
    pub senders: Vec<(usize, Sent)>,
    /// Bytes of block amax (AMAX) this rank receives: whole at every
    /// update, deltas or not.
    pub amax: u64,
    /// Global tensors (trainer layout indexes) this rank reads.
    pub reads: Vec<usize>,
    /// Every run it takes is of two-byte elements (bf16 on the wire).
    pub two_byte: bool,
    pub time: Duration,
}

/// What one trainer rank sends one engine rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sent {
    pub bytes: u64,
    pub wired: f64,
    pub amax: u64,
}

/// Plan engine rank `rank` against all trainer ranks.
pub fn plan_rank(
    (trainer, engine): (&TrainerLayout, &EngineLayout),
    sources: &Sources,
    rank: usize,
    wire: &report::Wire,
) -> Result<RankPlan, String> {
    let fail = |e: weight_manager_core::Error| format!("engine rank {rank}: {e}");
    // The rank's time includes building and checking its params' pieces
    // (as a registration does), not only the plan: that check was once
    // the slowest part and the figure hid it.
    let t0 = Instant::now();
    // Its errors name the engine rank already.
    let params = engine
        .rank_params(rank, trainer)
        .map_err(|e| e.to_string())?;
    // The manager's rule, not a looser one: in a sharded layout (several
    // trainer ranks, split tensors or params with pieces) what this rank
    // does not read is skipped (the report counts what no rank reads); a
    // one-to-one layout refuses a tensor no param names, as an update would.
    // Publishers quantize what quantized params take (FP8 on the wire):
    // their runs count elements, one byte each.
    let opts = PlanOptions {
        spread: rank,
        quantize_at_source: true,
        ..Default::default()
    };
    let quiet = Logger::stderr(LogLevel::Off);
    let plan = sources.plan(&params, opts, &quiet).map_err(fail)?;
    let time = t0.elapsed();
    let overflow = || format!("engine rank {rank}: its bytes overflow a 64-bit count");
    let mut senders = std::collections::BTreeMap::<usize, Sent>::new();
    let (mut reads, mut amax, mut bytes, mut wired) = (Vec::new(), 0u64, 0u64, 0f64);
    let mut two_byte = true;
    for e in plan.entries.iter().filter(|e| e.target != Target::Skip) {
        // A quantized param's block amax crosses toward the engine too
        // (AMAX: 4 bytes a block, MXFP8's a byte), counted per full block's
        // elements: partial edge blocks, and a run cut off the block grid,
        // send a few more than counted here (the docs say so).
        let scheme = match e.target {
            Target::Param(i) => match params.param(i).quant {
                QuantRole::Weight { scheme, .. } => Some(scheme),
                _ => None,
            },
            _ => None,
        };
        let amax_bytes = scheme.map_or(0, |s| match s.block_dims() {
            None => 4,
            Some((1, bw)) => e.bytes.div_ceil(bw),
            Some((bh, bw)) => 4 * e.bytes.div_ceil(bh * bw),
        });
        let on_wire = wire.wire_bytes(e.bytes, e.meta.dtype.size(), scheme.is_some());
        two_byte &= e.meta.dtype.size() == 2 && scheme.is_none();
        let to = senders.entry(e.source).or_default();
        to.bytes = to.bytes.checked_add(e.bytes).ok_or_else(overflow)?;
        to.amax = to.amax.checked_add(amax_bytes).ok_or_else(overflow)?;
        to.wired += on_wire;
        bytes = bytes.checked_add(e.bytes).ok_or_else(overflow)?;
        amax = amax.checked_add(amax_bytes).ok_or_else(overflow)?;
        wired += on_wire;
        reads.extend(trainer.index_of(&e.meta.name));
    }
    let param_bytes = (0..params.count())
        .try_fold(0u64, |n, i| n.checked_add(params.param(i).nbytes()))
        .ok_or_else(overflow)?;
    Ok(RankPlan {
        runs: plan.runs.len(),
        bytes,
        wired,
        amax,
        param_bytes,
        params: params.len(),
        pieces: params.iter().map(|p| p.pieces.len()).sum(),
        senders: senders.into_iter().collect(),
        reads,
        two_byte,
        time,
    })
}

/// Every engine rank's plan, on as many threads as there are cores; the
/// first error (lowest rank) wins.
fn plan_all(
    trainer: &TrainerLayout,
    engine: &EngineLayout,
    ranks: Range<usize>,
    wire: &report::Wire,
) -> Result<Totals, String> {
    let manifests: Vec<&Manifest> = trainer.manifests.iter().collect();
    let t0 = Instant::now();
    let sources = Sources::new(&manifests).map_err(|e| format!("trainer layout: {e}"))?;
    let index = t0.elapsed();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = Mutex::new(ranks.start);
    let failed = AtomicBool::new(false);
    let done: Mutex<Vec<(usize, Result<RankPlan, String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.min(ranks.len()) {
            s.spawn(|| loop {
                let rank = {
                    let mut n = next.lock().unwrap();
                    *n += 1;
                    *n - 1
                };
                if rank >= ranks.end || failed.load(Ordering::Relaxed) {
                    return;
                }
                let r = plan_rank((trainer, engine), &sources, rank, wire);
                failed.fetch_or(r.is_err(), Ordering::Relaxed);
                done.lock().unwrap().push((rank, r));
            });
        }
    });
    let wall = t0.elapsed() - index;
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(r, _)| *r);
    let mut totals = Totals::new(trainer, index, wall, threads);
    totals.first_rank = ranks.start;
    for (_, r) in done {
        totals.add(r?)?;
    }
    Ok(totals)
}
