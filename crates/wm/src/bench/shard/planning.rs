//! Planning: one engine rank's 10,000 pieces against 8 trainer ranks
//! (`--pieces`, `--sources`), from layouts built with the same rules as
//! `wm plan` reads (`docs/layouts.md`): per layer a fused QKV (3 pieces),
//! a column-split o (1), a fused gate_up (2), a column-split down (1) and
//! a norm (1), the engine TP over as many ranks as there are sources.
//!
//! Two trainers: FSDP (every tensor split along dimension 0 over all
//! ranks: 8 shards per tensor, 80,000 in all) and whole layers per rank
//! (pipeline stages, or a checkpoint in 8 files: 10,000 shards). A plan
//! of several sources has an entry per shard the rank reads (sharing its
//! metadata with the manifest, `PlanEntry`), so the FSDP figure is printed
//! beside that floor too: building and dropping those entries alone.
//!
//! Figures: planning from scratch against its 10 ms target; planning
//! against sources checked and indexed once ([`Sources`], what a caller
//! planning many ranks or updates keeps); and what a reused plan costs
//! against planning: the fingerprint showing the layouts did not change,
//! then the plan taking the next version's manifests (`take_sources`, what
//! the manager's plan cache does).

use super::{Args, Row};
use crate::bench::harness::best_timed;
use serde_json::json;
use std::time::Duration;
use weight_manager_core::plan::layout::{EngineLayout, TrainerLayout};
use weight_manager_core::plan::{
    fingerprint, make_sharded_plan, ParamLayout, Plan, PlanEntry, PlanOptions, Sources, Target,
};
use weight_manager_core::Logger;
use weight_manager_core::{Manifest, SharedMeta};

/// The target for planning 10,000 pieces over 8 sources.
const TARGET: Duration = Duration::from_millis(10);
const PIECES_PER_LAYER: u64 = 8;

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let (pieces, sources) = (a.pieces, a.sources);
    let runs = a.runs.unwrap_or(20);
    if pieces < PIECES_PER_LAYER || !(1..=64).contains(&sources) || 64 % sources != 0 {
        return Err(format!(
            "--pieces must be {PIECES_PER_LAYER} or more, --sources divide 64"
        ));
    }
    let layers = pieces.div_ceil(PIECES_PER_LAYER);
    let mut rows = Vec::new();
    for split in [true, false] {
        let (trainer, engine) = layouts(layers, sources, split).map_err(|e| e.to_string())?;
        rows.extend(measure(&trainer, &engine, runs, split)?);
    }
    Ok(rows)
}

/// The figures for one pair of layouts (FSDP sources when `split`, whole
/// layers per source otherwise).
fn measure(
    trainer: &TrainerLayout,
    engine: &EngineLayout,
    runs: usize,
    split: bool,
) -> Result<Vec<Row>, String> {
    // Rank 1, not 0: its pieces start inside their tensors.
    let rank = 1.min(engine.ranks - 1);
    let params = engine
        .rank_params(rank, trainer)
        .map_err(|e| e.to_string())?;
    let count: usize = params.iter().map(|p| p.pieces.len()).sum();
    // Each source's manifest as a source holds it: its tensors' metadata
    // allocated together, as decoding its frame or reading its files does
    // (the layout builds all ranks' shards of a tensor at once instead).
    let held: Vec<Manifest> = trainer.manifests.iter().map(copied).collect();
    let manifests: Vec<&Manifest> = held.iter().collect();
    let opts = PlanOptions {
        spread: rank,
        skip_unknown: true,
        ..Default::default()
    };
    let quiet = Logger::stderr(weight_manager_core::LogLevel::Off);
    let plan = || make_sharded_plan(&manifests, &params, opts, &quiet).map_err(|e| e.to_string());
    let runs_made = plan()?.runs.len();
    let scratch = best_timed(runs, || plan().map(drop))?;
    let how = if split {
        "dim-0 shards (FSDP)"
    } else {
        "whole layers (PP)"
    };
    let sources = manifests.len();
    let mut rows = vec![timed_row(
        format!("plan {count} pieces x {sources} sources, {how}, {runs_made} runs"),
        scratch,
        ("target", TARGET),
        Some(scratch <= TARGET),
    )];
    if split {
        let planned = Planned {
            manifests: &manifests,
            params: &params,
            opts,
            quiet: &quiet,
            runs,
        };
        rows.extend(fsdp_rows(&planned, scratch)?);
    }
    Ok(rows)
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-12)
}

/// A figure `t` beside `(name, against)`, their ratio.
fn timed_row(
    what: String,
    t: Duration,
    (name, against): (&str, Duration),
    ok: Option<bool>,
) -> Row {
    Row {
        what,
        value: ms(t),
        beside: format!("{name} {}", ms(against)),
        ratio: ratio(t, against),
        ok,
    }
}

/// One engine rank's planning against its sources.
struct Planned<'a> {
    manifests: &'a [&'a Manifest],
    params: &'a [ParamLayout],
    opts: PlanOptions,
    quiet: &'a Logger,
    runs: usize,
}

/// The rows of FSDP sources beyond planning from scratch (`scratch`):
/// planning again against sources indexed once, the floor of the entries
/// a plan builds, and what reusing a plan costs.
fn fsdp_rows(p: &Planned, scratch: Duration) -> Result<Vec<Row>, String> {
    let (manifests, params, runs) = (p.manifests, p.params, p.runs);
    let plan = || make_sharded_plan(manifests, params, p.opts, p.quiet).map_err(|e| e.to_string());
    let indexed = Sources::new(manifests).map_err(|e| e.to_string())?;
    let again = best_timed(runs, || {
        indexed
            .plan(params, p.opts, p.quiet)
            .map(drop)
            .map_err(|e| e.to_string())
    })?;
    // The floor: what this plan builds whatever else it does, one entry
    // per shard read (sharing the shard's metadata, `PlanEntry::meta`),
    // then drops.
    let read: Vec<(usize, usize)> = plan()?
        .entries
        .iter()
        .map(|e| (e.source, e.tensor))
        .collect();
    let floor = best_timed(runs, || {
        let entries: Vec<PlanEntry> = read
            .iter()
            .map(|&(source, tensor)| PlanEntry {
                meta: SharedMeta::new(&manifests[source].tensors, tensor),
                source,
                tensor,
                target: Target::Skip,
                bytes: 0,
            })
            .collect();
        drop(std::hint::black_box(entries));
        Ok(())
    })?;
    let reuse = reuse_cost(manifests, params, plan()?, runs)?;
    let floor_what = format!(
        "  floor: {} plan entries built and dropped (of {} shards)",
        read.len(),
        shards(manifests)
    );
    Ok(vec![
        Row {
            ratio: ratio(scratch, floor),
            ..timed_row(floor_what, floor, ("planning", scratch), None)
        },
        timed_row(
            "  plan again, sources indexed once".into(),
            again,
            ("target", TARGET),
            Some(again <= TARGET),
        ),
        timed_row(
            "  reuse: fingerprint of the layouts".into(),
            reuse.check,
            ("planning", scratch),
            Some(reuse.check < scratch),
        ),
        timed_row(
            "  reuse: fingerprint, then the next version's manifests taken".into(),
            reuse.total,
            ("planning", scratch),
            Some(reuse.total < scratch),
        ),
    ])
}

/// What reusing a plan costs: the fingerprint alone, and the fingerprint
/// of the next version's manifests (the same layouts in new lists) plus the
/// plan taking their metadata.
struct Reuse {
    check: Duration,
    total: Duration,
}

fn reuse_cost(
    manifests: &[&Manifest],
    params: &[ParamLayout],
    mut plan: Plan,
    runs: usize,
) -> Result<Reuse, String> {
    let check = best_timed(runs, || {
        std::hint::black_box(fingerprint(manifests, params));
        Ok(())
    })?;
    // Two versions in turn, so that every round takes new manifests.
    let next: Vec<Manifest> = manifests.iter().map(|m| copied(m)).collect();
    let next: Vec<&Manifest> = next.iter().collect();
    let was = fingerprint(manifests, params);
    let mut round = 0;
    let total = best_timed(runs, || {
        round += 1;
        let sources = if round % 2 == 1 { &next } else { manifests };
        if fingerprint(sources, params) != was {
            return Err("the next version's layouts differ".into());
        }
        plan.take_sources(sources);
        Ok(())
    })?;
    Ok(Reuse { check, total })
}

/// A new manifest with the same tensors (a new list of copies).
fn copied(m: &Manifest) -> Manifest {
    Manifest {
        tensors: m.tensors.to_vec().into(),
        version: m.version.clone(),
    }
}

fn shards(manifests: &[&Manifest]) -> usize {
    manifests.iter().map(|m| m.tensors.len()).sum()
}

/// A dense model of `layers` layers, hidden size 64, on `tp` trainer ranks
/// and `tp` engine ranks (tensor parallel). With `split` every trainer
/// tensor is split along dimension 0 over all trainer ranks (FSDP);
/// otherwise trainer rank r holds layers r*n/tp.. whole (pipeline stages,
/// or a checkpoint in `tp` files).
pub fn layouts(
    layers: u64,
    tp: u64,
    split: bool,
) -> weight_manager_core::Result<(TrainerLayout, EngineLayout)> {
    let layered = |name: &str| format!("layers.{{L}}.{name}");
    let shapes: [(&str, &[u64]); 8] = [
        ("q", &[64, 64]),
        ("k", &[16, 64]),
        ("v", &[16, 64]),
        ("o", &[64, 64]),
        ("gate", &[128, 64]),
        ("up", &[128, 64]),
        ("down", &[64, 128]),
        ("norm", &[64]),
    ];
    let per = layers.div_ceil(tp);
    let mut tensors = Vec::new();
    for (name, shape) in shapes {
        let name = layered(name);
        match split {
            true => tensors.push(json!({"name": name, "layers": layers, "shape": shape, "split": 0})),
            false => tensors.extend((0..tp).filter(|r| r * per < layers).map(|r| {
                let (l, ranks) = ([r * per, ((r + 1) * per).min(layers)], [r, r + 1]);
                json!({"name": name, "layers": l, "shape": shape, "ranks": ranks, "replicate": true})
            })),
        }
    }
    let trainer = json!({"ranks": tp, "dtype": "bf16", "tensors": tensors});
    let piece = |name: &str, dim: u64| json!({"tensor": layered(name), "split": dim, "tp": tp});
    let param = |name: &str, pieces: Vec<serde_json::Value>| {
        let name = layered(name);
        json!({"name": name, "layers": layers, "pieces": pieces})
    };
    let engine = json!({"ranks": tp, "dtype": "bf16", "params": [
        param("qkv", vec![piece("q", 0), piece("k", 0), piece("v", 0)]),
        param("o", vec![piece("o", 1)]),
        param("gate_up", vec![piece("gate", 0), piece("up", 0)]),
        param("down", vec![piece("down", 1)]),
        {"name": "layers.{L}.norm", "layers": layers},
    ]});
    Ok((
        TrainerLayout::from_json(&trainer)?,
        EngineLayout::from_json(&engine)?,
    ))
}
