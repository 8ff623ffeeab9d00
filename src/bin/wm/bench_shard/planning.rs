//! Planning: one engine rank's 10,000 pieces against 8 trainer ranks
//! (`--pieces`, `--sources`), from layouts built with the same rules as
//! `wm plan` reads (`docs/layouts.md`): per layer a fused QKV (3 pieces),
//! a row-parallel o (1), a fused gate_up (2), a row-parallel down (1) and a
//! norm (1), the trainer splitting every tensor along dimension 0 (FSDP),
//! the engine TP over as many ranks as there are sources.
//!
//! Figures: planning from scratch against its 10 ms target; planning
//! against sources checked and indexed once ([`Sources`], what a caller
//! planning many ranks or updates keeps); and what a reused plan costs (the
//! fingerprint showing the layouts did not change) against planning.

use super::Row;
use crate::Args;
use serde_json::json;
use std::time::{Duration, Instant};
use weight_manager::logging::Logger;
use weight_manager::manifest::Manifest;
use weight_manager::plan::layout::{EngineLayout, TrainerLayout};
use weight_manager::plan::{
    fingerprint, make_sharded_plan, PlanEntry, PlanOptions, Sources, Target,
};

/// The target for planning 10,000 pieces over 8 sources.
const TARGET: Duration = Duration::from_millis(10);
const PIECES_PER_LAYER: u64 = 8;

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let pieces: u64 = a.number("pieces", 10_000)?;
    let sources: u64 = a.number("sources", 8)?;
    let runs: usize = a.number("runs", 20)?;
    if pieces < PIECES_PER_LAYER || !(1..=64).contains(&sources) || 64 % sources != 0 {
        return Err(format!(
            "--pieces must be {PIECES_PER_LAYER} or more, --sources divide 64"
        ));
    }
    let layers = pieces / PIECES_PER_LAYER;
    let (trainer, engine) = layouts(layers, sources).map_err(|e| e.to_string())?;
    // Rank 1, not 0: its pieces start inside their tensors.
    let rank = 1.min(engine.ranks - 1);
    let params = engine
        .rank_params(rank, &trainer)
        .map_err(|e| e.to_string())?;
    let count: usize = params.iter().map(|p| p.pieces.len()).sum();
    let manifests: Vec<&Manifest> = trainer.manifests.iter().collect();
    let opts = PlanOptions {
        spread: rank,
        skip_unknown: true,
        ..Default::default()
    };
    let quiet = Logger::stderr(weight_manager::logging::LogLevel::Off);
    let plan = || make_sharded_plan(&manifests, &params, opts, &quiet).map_err(|e| e.to_string());
    let runs_made = plan()?.runs.len();
    let scratch = best(runs, || plan().map(drop))?;
    let indexed = Sources::new(&manifests).map_err(|e| e.to_string())?;
    let again = best(runs, || {
        indexed
            .plan(&params, opts, &quiet)
            .map(drop)
            .map_err(|e| e.to_string())
    })?;
    // The floor: what every plan of these sources builds whatever its
    // params, one entry per shard with a copy of the shard's metadata
    // (`PlanEntry::meta`), then drops.
    let floor = best(runs, || {
        let entries: Vec<PlanEntry> = manifests
            .iter()
            .enumerate()
            .flat_map(|(s, m)| m.tensors.iter().enumerate().map(move |(i, t)| (s, i, t)))
            .map(|(source, tensor, t)| PlanEntry {
                meta: t.clone(),
                source,
                tensor,
                target: Target::Skip,
                bytes: 0,
            })
            .collect();
        drop(std::hint::black_box(entries));
        Ok(())
    })?;
    let check = best(runs, || {
        std::hint::black_box(fingerprint(&manifests, &params));
        Ok(())
    })?;
    let ms = |d: Duration| format!("{:.3} ms", d.as_secs_f64() * 1e3);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-12);
    let what = format!("plan {count} pieces x {sources} sources ({runs_made} runs)");
    Ok(vec![
        Row {
            what,
            value: ms(scratch),
            beside: format!("target {}", ms(TARGET)),
            ratio: ratio(scratch, TARGET),
            ok: scratch <= TARGET,
        },
        Row {
            what: format!(
                "floor: {} plan entries built and dropped",
                shards(&manifests)
            ),
            value: ms(floor),
            beside: format!("planning {}", ms(scratch)),
            ratio: ratio(scratch, floor),
            ok: true,
        },
        Row {
            what: "plan again, sources indexed once".into(),
            value: ms(again),
            beside: format!("target {}", ms(TARGET)),
            ratio: ratio(again, TARGET),
            ok: again <= TARGET,
        },
        Row {
            what: "reuse: fingerprint of the layouts".into(),
            value: ms(check),
            beside: format!("planning {}", ms(scratch)),
            ratio: ratio(check, scratch),
            ok: check < scratch,
        },
    ])
}

fn shards(manifests: &[&Manifest]) -> usize {
    manifests.iter().map(|m| m.tensors.len()).sum()
}

/// The fastest of `runs` timings of `f`.
fn best(runs: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<Duration, String> {
    let mut best = Duration::MAX;
    for _ in 0..runs.max(1) {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed());
    }
    Ok(best)
}

/// A dense model of `layers` layers, hidden size 64, on `tp` trainer
/// ranks (dimension 0 split) and `tp` engine ranks (tensor parallel).
pub fn layouts(layers: u64, tp: u64) -> weight_manager::Result<(TrainerLayout, EngineLayout)> {
    let layered = |name: &str| format!("layers.{{L}}.{name}");
    let t = |name: &str, shape: [u64; 2]| {
        let name = layered(name);
        json!({"name": name, "layers": layers, "shape": shape, "split": 0})
    };
    let trainer = json!({"ranks": tp, "dtype": "bf16", "tensors": [
        t("q", [64, 64]), t("k", [16, 64]), t("v", [16, 64]), t("o", [64, 64]),
        t("gate", [128, 64]), t("up", [128, 64]), t("down", [64, 128]),
        {"name": "layers.{L}.norm", "layers": layers, "shape": [64], "split": 0},
    ]});
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
