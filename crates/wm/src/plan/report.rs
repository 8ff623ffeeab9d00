//! What `wm plan` prints: the totals over every engine rank's plan, as a
//! table or as one JSON object with the same numbers.

use super::RankPlan;
use crate::fmt;
use serde_json::json;
use std::fmt::Write;
use std::time::Duration;
use weight_manager_core::plan::layout::{EngineLayout, TrainerLayout};

/// Perplexity's measured weight transfer for Kimi-K2 from 256 training
/// GPUs to 128 inference GPUs, quoted beside the prediction.
const REFERENCE_S: f64 = 1.3;

pub struct Totals {
    /// The engine rank of `ranks[0]` (`--engine-ranks`).
    pub first_rank: usize,
    ranks: Vec<RankPlan>,
    /// Bytes per trainer rank, over every engine rank.
    sent: Vec<u64>,
    /// Bytes on the wire per trainer rank (see [`Wire::wire_bytes`]).
    wired_sent: Vec<f64>,
    /// Bytes of block amax per trainer rank, over every engine rank.
    amax_sent: Vec<u64>,
    read: Vec<bool>,
    /// Checking and indexing the sources, once for every rank.
    index: Duration,
    wall: Duration,
    threads: usize,
}

impl Totals {
    pub fn new(trainer: &TrainerLayout, index: Duration, wall: Duration, threads: usize) -> Totals {
        Totals {
            first_rank: 0,
            ranks: Vec::new(),
            sent: vec![0; trainer.manifests.len()],
            wired_sent: vec![0.0; trainer.manifests.len()],
            amax_sent: vec![0; trainer.manifests.len()],
            read: vec![false; trainer.tensors.len()],
            index,
            wall,
            threads,
        }
    }

    /// The busiest link's bytes as planned and on the wire (as
    /// `--wire-dtype` and `--delta-fraction` say), each with the block
    /// amax quantized params need (whole at every update, so outside what
    /// the wire's dtype and deltas scale).
    fn busiest_links(&self) -> (f64, f64) {
        let (r, amax) = (&self.ranks, &self.amax_sent);
        let plain = (r.iter().map(|p| p.bytes as f64 + p.amax as f64))
            .chain((self.sent.iter().zip(amax)).map(|(&b, &a)| b as f64 + a as f64))
            .fold(0.0, f64::max);
        let wired = (r.iter().map(|p| p.wired + p.amax as f64))
            .chain((self.wired_sent.iter().zip(amax)).map(|(&b, &a)| b + a as f64))
            .fold(0.0, f64::max);
        (plain, wired)
    }

    /// Add rank plan `r`; Err when a trainer rank's bytes overflow a
    /// 64-bit count.
    pub fn add(&mut self, r: RankPlan) -> Result<(), String> {
        for &(k, to) in &r.senders {
            let overflow = || format!("trainer rank {k}: its bytes overflow a 64-bit count");
            self.sent[k] = self.sent[k].checked_add(to.bytes).ok_or_else(overflow)?;
            self.amax_sent[k] = self.amax_sent[k]
                .checked_add(to.amax)
                .ok_or_else(overflow)?;
            self.wired_sent[k] += to.wired;
        }
        for &t in &r.reads {
            self.read[t] = true;
        }
        self.ranks.push(r);
        Ok(())
    }
}

/// (index, value) of the smallest and the largest.
fn min_max(v: impl Iterator<Item = u64> + Clone) -> ((usize, u64), (usize, u64)) {
    let min = v.clone().enumerate().min_by_key(|x| x.1).unwrap_or((0, 0));
    // The first of equal largest (the lowest rank).
    let max = v
        .enumerate()
        .max_by_key(|x| (x.1, std::cmp::Reverse(x.0)))
        .unwrap_or((0, 0));
    (min, max)
}

/// A time in the unit that keeps three significant places readable.
fn seconds(s: f64) -> String {
    match s {
        s if s >= 0.1 => format!("{s:.3} s"),
        s if s >= 1e-4 => format!("{:.3} ms", s * 1e3),
        s => format!("{:.3} us", s * 1e6),
    }
}

/// What the wire carries, for the prediction: the share of line rate a
/// link delivers, the dtype sent, and the share of elements changed since
/// the engine's version (deltas; None: whole).
#[derive(Clone, Copy, Debug)]
pub struct Wire {
    pub goodput: f64,
    pub fp8: bool,
    pub delta_fraction: Option<f64>,
    /// The engine layout quantizes its params: the plan's bytes are FP8
    /// for them already.
    pub planned_fp8: bool,
}

impl Wire {
    pub fn from_args(a: &super::Args) -> Result<Wire, String> {
        let goodput = a.goodput;
        if !(goodput > 0.0 && goodput <= 1.0) {
            return Err(format!(
                "--goodput {goodput}: a share of line rate, in (0, 1]"
            ));
        }
        let fp8 = match a.wire_dtype.as_str() {
            "bf16" => false,
            "fp8" => true,
            other => return Err(format!("--wire-dtype {other}: bf16 or fp8")),
        };
        let delta_fraction = match a.delta_fraction {
            None => None,
            Some(f) if (0.0..=1.0).contains(&f) => Some(f),
            Some(v) => return Err(format!("--delta-fraction {v}: a share in [0, 1]")),
        };
        Ok(Wire {
            goodput,
            fp8,
            delta_fraction,
            planned_fp8: false,
        })
    }

    /// What the wire carries, named: "bf16" (every run planned is of
    /// two-byte elements: `two_byte`), "fp8" (every element at one byte),
    /// or "planned" (the plan's own dtypes: FP8 for quantized params, and
    /// runs of elements of other sizes).
    pub fn dtype(&self, two_byte: bool) -> &'static str {
        match (self.fp8, self.planned_fp8 || !two_byte) {
            (true, _) => "fp8",
            (false, false) => "bf16",
            (false, true) => "planned",
        }
    }

    /// The bytes on the wire for a run of `bytes` of the plan, of
    /// `esize`-byte elements (the tensor's dtype), `quantized` when its
    /// param is (its bytes are FP8 already). `--wire-dtype fp8`: one byte
    /// an element plus a 4-byte scale per 128x128 block. Deltas: what the
    /// codec's model says for that share of changed elements of the size
    /// sent (whole where that is not under half the bytes, as publishers
    /// send it).
    pub fn wire_bytes(&self, bytes: u64, esize: usize, quantized: bool) -> f64 {
        let (sent, esize) = match (self.fp8 && !quantized, quantized) {
            (true, _) => (
                (bytes / esize.max(1) as u64) as f64 * (1.0 + 4.0 / (128.0 * 128.0)),
                1,
            ),
            (false, true) => (bytes as f64, 1),
            (false, false) => (bytes as f64, esize.max(1)),
        };
        let delta = self.delta_fraction.map_or(1.0, |f| {
            weight_manager_core::delta::predicted_wire_ratio(f, esize)
        });
        sent * delta
    }
}

pub struct Report {
    v: serde_json::Value,
}

impl Report {
    pub fn new(
        trainer: &TrainerLayout,
        engine: &EngineLayout,
        t: Totals,
        read_time: Duration,
        (gbps, wire): (f64, Wire),
    ) -> Result<Report, String> {
        let r = &t.ranks;
        let overflow =
            |what: &str| format!("the {what} of every engine rank overflow a 64-bit count");
        let sum = |f: fn(&RankPlan) -> u64| r.iter().try_fold(0u64, |n, p| n.checked_add(f(p)));
        let moved = sum(|p| p.bytes).ok_or_else(|| overflow("bytes"))?;
        let param_bytes = sum(|p| p.param_bytes).ok_or_else(|| overflow("param bytes"))?;
        let sent_total = (t.sent.iter())
            .try_fold(0u64, |n, &b| n.checked_add(b))
            .ok_or_else(|| overflow("trainer ranks' bytes"))?;
        let amax_total = sum(|p| p.amax).ok_or_else(|| overflow("amax bytes"))?;
        let (runs_min, runs_max) = min_max(r.iter().map(|p| p.runs as u64));
        let (recv_min, recv_max) = min_max(r.iter().map(|p| p.bytes));
        let (send_min, send_max) = min_max(t.sent.iter().copied());
        let (time_min, time_max) = min_max(r.iter().map(|p| p.time.as_nanos() as u64));
        let time_sum: u64 = r.iter().map(|p| p.time.as_nanos() as u64).sum();
        let link = gbps * 1e9 / 8.0;
        let (plain, wired) = t.busiest_links();
        let factor = r.iter().map(|p| p.wired).sum::<f64>() / moved.max(1) as f64;
        let (seconds, wire_seconds) = (plain / link, wired / (link * wire.goodput));
        if !(seconds.is_finite() && wire_seconds.is_finite()) {
            return Err(format!(
                "--link-gbps {gbps} at --goodput {}: too slow a link to predict {wired} bytes in \
                 seconds that fit a number",
                wire.goodput
            ));
        }
        let unread: Vec<&str> = trainer
            .tensors
            .iter()
            .zip(&t.read)
            .filter(|(_, &read)| !read)
            .map(|(g, _)| g.name.as_str())
            .collect();
        let v = json!({
            "trainer": {"ranks": trainer.manifests.len(), "tensors": trainer.tensors.len(),
                        "elements": trainer.elements() as f64,
                        "shards": trainer.manifests.iter().map(|m| m.tensors.len()).sum::<usize>()},
            "engine": {"ranks": engine.ranks, "planned": r.len(), "first_planned": t.first_rank,
                       "params": r.iter().map(|p| p.params).sum::<usize>(),
                       "pieces": r.iter().map(|p| p.pieces).sum::<usize>()},
            "read_layouts_s": read_time.as_secs_f64(),
            "planning": {"wall_s": t.wall.as_secs_f64(), "threads": t.threads,
                         "index_sources_s": t.index.as_secs_f64(),
                         "per_rank_ms": {"min": time_min.1 as f64 / 1e6, "max": time_max.1 as f64 / 1e6,
                                         "mean": time_sum as f64 / 1e6 / r.len().max(1) as f64,
                                         "slowest_rank": t.first_rank + time_max.0}},
            "runs": {"total": r.iter().map(|p| p.runs).sum::<usize>(),
                     "per_engine_rank": {"min": runs_min.1, "max": runs_max.1}},
            "bytes": {"moved": moved, "params": param_bytes,
                      "amax": amax_total,
                      "moved_over_params": moved as f64 / param_bytes.max(1) as f64,
                      "per_engine_rank": {"min": recv_min.1, "max": recv_max.1, "total": moved,
                                          "each": r.iter().map(|p| p.bytes).collect::<Vec<_>>()},
                      "per_trainer_rank": {"min": send_min.1, "max": send_max.1,
                                           "total": sent_total, "each": &t.sent}},
            "busiest": {"sender": {"trainer_rank": send_max.0, "bytes": send_max.1},
                        "receiver": {"engine_rank": t.first_rank + recv_max.0, "bytes": recv_max.1}},
            "tensors_no_rank_reads": {"count": unread.len(), "first": unread.first()},
            "prediction": {"link_gbps": gbps, "seconds": seconds,
                           "wire": {"goodput": wire.goodput, "dtype": wire.dtype(r.iter().all(|p| p.two_byte)),
                                    "delta_fraction": wire.delta_fraction, "bytes_per_plan_byte": factor,
                                    "busiest_bytes": wired,
                                    "seconds": wire_seconds},
                           "model": "max(busiest sender bytes, busiest receiver bytes) / link speed: \
                                     every trainer rank sends at once, each rank has its own link; \
                                     quantized params add their block amax (AMAX) to each link",
                           "reference_s": REFERENCE_S,
                           "reference": "Perplexity, Kimi-K2, 256 training -> 128 inference GPUs, measured"},
        });
        Ok(Report { v })
    }

    pub fn json(&self) -> String {
        self.v.to_string()
    }

    pub fn text(&self) -> String {
        let mut s = self.sizes_text();
        s.push_str(&self.moves_text());
        s
    }

    fn num(&self, pointer: &str) -> f64 {
        self.v
            .pointer(pointer)
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0)
    }

    /// The layouts and the planning time.
    fn sizes_text(&self) -> String {
        let n = |p: &str| self.num(p);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "trainer: {} ranks, {} global tensors ({:.3e} parameters), {} shards",
            n("/trainer/ranks"),
            n("/trainer/tensors"),
            n("/trainer/elements"),
            n("/trainer/shards")
        );
        let _ = writeln!(
            s,
            "engine:  {} ranks, {} params, {} pieces (in the ranks planned)",
            n("/engine/ranks"),
            n("/engine/params"),
            n("/engine/pieces")
        );
        if n("/engine/planned") < n("/engine/ranks") {
            let _ = writeln!(
                s,
                "only engine ranks {}..{} planned (--engine-ranks): trainer-side bytes and the \
                 prediction count those ranks only",
                n("/engine/first_planned"),
                n("/engine/first_planned") + n("/engine/planned")
            );
        }
        let _ = writeln!(
            s,
            "planned every engine rank in {:.2} s on {} thread(s) (layouts read in {:.2} s, \
             sources checked and indexed once in {:.2} s); per rank (its params' pieces built \
             and checked, then planned) {:.2} ms mean, {:.2} min, \
             {:.2} max (rank {})",
            n("/planning/wall_s"),
            n("/planning/threads"),
            n("/read_layouts_s"),
            n("/planning/index_sources_s"),
            n("/planning/per_rank_ms/mean"),
            n("/planning/per_rank_ms/min"),
            n("/planning/per_rank_ms/max"),
            n("/planning/per_rank_ms/slowest_rank")
        );
        s
    }

    /// Runs, bytes, links and the prediction.
    fn moves_text(&self) -> String {
        let v = &self.v;
        let n = |p: &str| self.num(p);
        let b = |p: &str| fmt::bytes(n(p) as u64);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "runs: {} in all; per engine rank {} min, {} max",
            n("/runs/total"),
            n("/runs/per_engine_rank/min"),
            n("/runs/per_engine_rank/max")
        );
        let _ = writeln!(
            s,
            "bytes per engine rank:  {} min, {} max, {} total",
            b("/bytes/per_engine_rank/min"),
            b("/bytes/per_engine_rank/max"),
            b("/bytes/per_engine_rank/total")
        );
        let _ = writeln!(
            s,
            "bytes per trainer rank: {} min, {} max, {} total",
            b("/bytes/per_trainer_rank/min"),
            b("/bytes/per_trainer_rank/max"),
            b("/bytes/per_trainer_rank/total")
        );
        let _ = writeln!(
            s,
            "bytes moved / param bytes: {:.2} ({} / {} B)",
            n("/bytes/moved_over_params"),
            n("/bytes/moved"),
            n("/bytes/params")
        );
        let _ = writeln!(
            s,
            "busiest links: trainer rank {} sends {}; engine rank {} receives {}",
            n("/busiest/sender/trainer_rank"),
            b("/busiest/sender/bytes"),
            n("/busiest/receiver/engine_rank"),
            b("/busiest/receiver/bytes")
        );
        if n("/tensors_no_rank_reads/count") > 0.0 {
            let _ = writeln!(
                s,
                "global tensors no engine rank reads: {} (first: {})",
                n("/tensors_no_rank_reads/count"),
                v.pointer("/tensors_no_rank_reads/first")
                    .unwrap_or(&json!(null))
            );
        }
        let _ = writeln!(
            s,
            "predicted transfer at {} Gb/s per rank: {}  (for scale: Perplexity measured {} s \
             for Kimi-K2, 1T parameters, 256 -> 128 GPUs)\n  model: max(busiest sender, busiest receiver bytes) / \
             link speed; assumes every trainer rank sends at once and each rank has its own link",
            n("/prediction/link_gbps"),
            seconds(n("/prediction/seconds")),
            REFERENCE_S
        );
        s.push_str(&self.wire_text());
        s
    }

    /// The prediction with what the wire carries, when it differs from
    /// whole bf16 at line rate.
    fn wire_text(&self) -> String {
        let n = |p: &str| self.num(p);
        let w = |k: &str| self.v.pointer(&format!("/prediction/wire/{k}")).cloned();
        let plain = w("dtype").is_some_and(|d| d == "bf16" || d == "planned")
            && w("delta_fraction").is_some_and(|d| d.is_null())
            && n("/prediction/wire/goodput") == 1.0;
        if plain {
            return String::new();
        }
        let delta = match w("delta_fraction").and_then(|d| d.as_f64()) {
            Some(f) => format!(", deltas of {:.2}% of elements", f * 100.0),
            None => String::new(),
        };
        format!(
            "with {} on the wire{delta} at {:.2} of line rate: busiest link {} ({:.4} of the plan's bytes), predicted {}\n",
            match w("dtype").and_then(|d| d.as_str().map(str::to_string)) {
                Some(d) if d == "planned" => "the plan's dtypes (FP8 for quantized params)".into(),
                d => d.unwrap_or_default(),
            },
            n("/prediction/wire/goodput"),
            fmt::bytes(n("/prediction/wire/busiest_bytes") as u64),
            n("/prediction/wire/bytes_per_plan_byte"),
            seconds(n("/prediction/wire/seconds"))
        )
    }
}
