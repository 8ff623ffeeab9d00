//! The plan: what the sources hold checked against what the params need,
//! before any byte moves.
//!
//! The sources' manifests say which boxes of which global tensors each
//! holds (a whole tensor is the box covering it); each param says which
//! boxes of which global tensors it is made of (its pieces; one whole
//! tensor of the param's name unless registered otherwise). The plan
//! intersects every piece with every shard and cuts the common boxes into
//! [`Run`]s, byte ranges contiguous on both sides.
//!
//! Every problem is found here, not halfway through a copy: sizes that do
//! not match dtype and shape, shards outside their global shape or
//! overlapping, sources that disagree on a tensor or a version, unknown
//! names, dtype then shape mismatches (naming the param and both values),
//! pieces outside their tensor, any part of a param that no source holds
//! (named as a box), missing checksums when verification is asked for, and
//! an empty source.
//!
//! Files: `global.rs` (the shards by global tensor), `cover.rs` (pieces
//! against shards), `runs.rs` (common boxes into runs and segments).

mod cover;
mod fingerprint;
mod global;
mod params;
mod runs;
#[cfg(test)]
mod sharded_tests;
#[cfg(test)]
mod tests;

use crate::logging::Logger;
use crate::manifest::{Manifest, TensorMeta};
use crate::result::{Error, Result};
use std::ops::Range;
use std::sync::OnceLock;

pub use fingerprint::fingerprint;
pub use params::{ParamLayout, ParamView, Params};

/// Where one plan entry's bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Copied into registered param `usize`.
    Param(usize),
    /// Handed to the engine's per-tensor callback.
    Callback,
    /// Not wanted (unknown name with `skip_unknown`, or a shard no piece of
    /// this engine needs); its bytes are not read.
    Skip,
}

/// One source tensor's bytes for one target. A tensor that feeds several
/// params (a whole-row shard of experts split over params) has an entry
/// per param; a tensor nobody wants has one `Skip` entry. Entries are in
/// (source, tensor) order, so with one source whose tensors each go to one
/// target, entry `i` is tensor `i` of the manifest.
#[derive(Clone, Debug)]
pub struct PlanEntry {
    pub meta: TensorMeta,
    /// Which source (its index among those the plan was made from).
    pub source: usize,
    /// The tensor's index in its source's manifest.
    pub tensor: usize,
    pub target: Target,
    /// Bytes of the tensor this entry moves: the sum of its segments.
    pub bytes: u64,
}

impl PlanEntry {
    /// Tensor `tensor` of the only source, going to `target`.
    pub fn new(meta: TensorMeta, tensor: usize, target: Target) -> PlanEntry {
        entry_of(&meta, 0, tensor, target)
    }

    /// The entry moves all of its tensor, in order, to the same offsets
    /// (a whole-tensor update; whole-tensor checksums apply).
    pub fn is_whole(&self, segments: &[Segment]) -> bool {
        matches!(segments, [s] if s.source == 0 && s.param == 0 && s.len == self.meta.nbytes)
            || (self.meta.nbytes == 0 && segments.is_empty())
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PlanOptions {
    /// Unknown names are skipped with a warning instead of failing the plan.
    pub skip_unknown: bool,
    /// Every tensor goes to the per-tensor callback; registered params are
    /// then the engine's business and need not be covered.
    pub callback: bool,
    /// Checksums will be verified: every tensor must carry one.
    pub verify: bool,
    /// Which replica of a box to read (the engine's rank, so that ranks
    /// spread over the sources holding the same bytes).
    pub spread: usize,
}

/// `rows` blocks of equal length move from entry `entry`'s tensor to
/// `target`: block `i` is bytes `source + i * source_stride` of the tensor
/// into bytes `param + i * param_stride` of the param (for the callback,
/// the tensor itself). A split along the outermost dimension is one block;
/// a split along an inner one is a block per row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub entry: usize,
    pub target: Target,
    /// The first block in the tensor's bytes.
    pub source: Range<u64>,
    /// The first block in the param's bytes.
    pub param: Range<u64>,
    pub rows: u64,
    pub source_stride: u64,
    pub param_stride: u64,
}

impl Run {
    pub fn bytes(&self) -> u64 {
        (self.source.end - self.source.start) * self.rows
    }

    /// One past the last param byte the run writes.
    pub fn param_end(&self) -> u64 {
        self.param.end + self.rows.saturating_sub(1) * self.param_stride
    }
}

/// A stretch of an entry's bytes contiguous in the tensor and in the
/// param: `len` bytes at `source` in the tensor go to `param` in the param.
/// A source sends an entry's segments in order and nothing else, so the
/// bytes received for the entry are its segments back to back; `wanted`
/// is where this one starts among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub source: u64,
    pub wanted: u64,
    pub param: u64,
    pub len: u64,
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// In (source, tensor, target) order.
    pub entries: Vec<PlanEntry>,
    /// Every run, ordered by entry then source offset.
    pub runs: Vec<Run>,
    /// Entries and bytes that will move (Skip excluded).
    pub tensors: usize,
    pub bytes: u64,
    /// Per entry, its segments, worked out from the runs on first use (by
    /// the applier and the source alike). The runs do not change after.
    segments: Vec<OnceLock<Vec<Segment>>>,
}

impl Plan {
    /// The plan of `entries` (one per tensor of one source, in manifest
    /// order), each moving tensor one whole-tensor run.
    pub fn new(entries: Vec<PlanEntry>) -> Plan {
        let runs = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.target != Target::Skip)
            .map(|(entry, e)| Run {
                entry,
                target: e.target,
                source: 0..e.meta.nbytes,
                param: 0..e.meta.nbytes,
                rows: 1,
                source_stride: e.meta.nbytes,
                param_stride: e.meta.nbytes,
            })
            .collect();
        Plan::from_parts(entries, runs)
    }

    fn from_parts(mut entries: Vec<PlanEntry>, runs: Vec<Run>) -> Plan {
        for e in entries.iter_mut() {
            e.bytes = 0;
        }
        for r in &runs {
            entries[r.entry].bytes += r.bytes();
        }
        let moving = entries.iter().filter(|e| e.target != Target::Skip);
        Plan {
            tensors: moving.clone().count(),
            bytes: moving.map(|e| e.bytes).sum(),
            segments: entries.iter().map(|_| OnceLock::new()).collect(),
            entries,
            runs,
        }
    }

    /// The runs of entry `entry`, in source order.
    pub fn runs_of(&self, entry: usize) -> &[Run] {
        let from = self.runs.partition_point(|r| r.entry < entry);
        let to = self.runs.partition_point(|r| r.entry <= entry);
        &self.runs[from..to]
    }

    /// Entry `entry`'s segments, in source order.
    pub fn segments(&self, entry: usize) -> &[Segment] {
        self.segments[entry].get_or_init(|| runs::segments(self.runs_of(entry)))
    }

    /// Entry `entry` moves its whole tensor unchanged (whole-tensor
    /// checksums and zero-copy views apply).
    pub fn moves_whole(&self, entry: usize) -> bool {
        self.entries[entry].is_whole(self.segments(entry))
    }

    /// Every entry moves its whole tensor, and entry `i` is tensor `i` of
    /// the only source (what sources that cannot send parts of tensors yet
    /// need).
    pub fn is_whole_tensors(&self) -> bool {
        self.entries.iter().enumerate().all(|(i, e)| {
            e.source == 0 && e.tensor == i && (e.target == Target::Skip || e.bytes == e.meta.nbytes)
        }) && self.runs.iter().all(|r| r.rows == 1 && r.source == r.param)
    }
}

/// At most this many problems are listed in one error message.
const MAX_LISTED: usize = 5;

fn fail(problems: Vec<String>, code: fn(String) -> Error) -> Result<()> {
    if problems.is_empty() {
        return Ok(());
    }
    let n = problems.len();
    let mut msg = problems
        .into_iter()
        .take(MAX_LISTED)
        .collect::<Vec<_>>()
        .join("; ");
    if n > MAX_LISTED {
        msg.push_str(&format!("; and {} more", n - MAX_LISTED));
    }
    Err(code(msg))
}

/// Check one source's `manifest` against `params` (a `Registry`, or
/// layouts without memory) and say where every byte goes.
pub fn make_plan<P: Params + ?Sized>(
    manifest: &Manifest,
    params: &P,
    opts: PlanOptions,
    logger: &Logger,
) -> Result<Plan> {
    make_sharded_plan(&[manifest], params, opts, logger)
}

/// Check the manifests of `sources`, which serve one version together,
/// against `params` and say where every byte goes.
pub fn make_sharded_plan<P: Params + ?Sized>(
    sources: &[&Manifest],
    params: &P,
    opts: PlanOptions,
    logger: &Logger,
) -> Result<Plan> {
    if sources.iter().all(|m| m.tensors.is_empty()) {
        return Err(Error::not_found(
            "the source holds no tensors (empty source)",
        ));
    }
    let mut problems = Vec::new();
    check_versions(sources, &mut problems);
    let globals = global::collect(sources, &mut problems);
    fail(problems, Error::format)?;
    let mut problems = Vec::new();
    let mut found = Vec::new();
    if !opts.callback {
        let mut used = vec![false; globals.tensors.len()];
        for i in 0..params.count() {
            cover::cover_param(
                i,
                params.param(i),
                &globals,
                opts.spread,
                &mut used,
                &mut found,
                &mut problems,
            );
        }
        unknown_tensors(&globals, &used, opts, logger, &mut problems);
    }
    let plan = assemble(sources, found, opts.callback);
    if opts.verify {
        unverifiable(&plan, &mut problems);
    }
    fail(problems, Error::mismatch)?;
    if plan.tensors == 0 {
        return Err(Error::mismatch(
            "no tensor of the source matches a registered param",
        ));
    }
    Ok(plan)
}

/// Sources that name a version must name the same one.
fn check_versions(sources: &[&Manifest], problems: &mut Vec<String>) {
    let named: Vec<(usize, &str)> = sources
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.version.as_deref().map(|v| (i, v)))
        .collect();
    if let Some(&(i, v)) = named.iter().find(|(_, v)| *v != named[0].1) {
        problems.push(format!(
            "the sources serve different versions: source {} '{}', source {i} '{v}'",
            named[0].0, named[0].1
        ));
    }
}

/// Global tensors no piece names are an error, or skipped with a warning
/// (in the order the sources name them).
fn unknown_tensors(
    globals: &global::Globals,
    used: &[bool],
    opts: PlanOptions,
    logger: &Logger,
    problems: &mut Vec<String>,
) {
    for (t, _) in globals.tensors.iter().zip(used).filter(|(_, &u)| !u) {
        if opts.skip_unknown {
            logger.warn(&format!(
                "skipping tensor '{}': not a registered param",
                t.name
            ));
        } else {
            problems.push(format!("tensor '{}' is not a registered param", t.name));
        }
    }
}

/// One entry per (source, tensor, target) in that order, runs numbered by
/// entry. In callback mode every tensor goes whole to the callback.
fn assemble(sources: &[&Manifest], mut found: Vec<cover::FoundRun>, callback: bool) -> Plan {
    found.sort_by_key(|(s, param, r)| (s.source, s.tensor, *param, r.source.start));
    let mut entries = Vec::new();
    let mut runs = Vec::with_capacity(found.len());
    let mut next = found.into_iter().peekable();
    for (s, m) in sources.iter().enumerate() {
        for (i, meta) in m.tensors.iter().enumerate() {
            let mut any = false;
            while let Some((at, param, _)) = next.peek() {
                if (at.source, at.tensor) != (s, i) {
                    break;
                }
                let param = *param;
                let entry = entries.len();
                while let Some((_, _, mut r)) =
                    next.next_if(|(a, p, _)| (a.source, a.tensor, *p) == (s, i, param))
                {
                    r.entry = entry;
                    runs.push(r);
                }
                entries.push(entry_of(meta, s, i, Target::Param(param)));
                any = true;
            }
            if !any {
                let target = if callback {
                    Target::Callback
                } else {
                    Target::Skip
                };
                entries.push(entry_of(meta, s, i, target));
                if callback {
                    runs.push(whole_run(entries.len() - 1, meta.nbytes));
                }
            }
        }
    }
    runs::sort_and_merge(&mut runs);
    Plan::from_parts(entries, runs)
}

fn entry_of(meta: &TensorMeta, source: usize, tensor: usize, target: Target) -> PlanEntry {
    PlanEntry {
        meta: meta.clone(),
        source,
        tensor,
        target,
        bytes: 0,
    }
}

fn whole_run(entry: usize, n: u64) -> Run {
    Run {
        entry,
        target: Target::Callback,
        source: 0..n,
        param: 0..n,
        rows: 1,
        source_stride: n,
        param_stride: n,
    }
}

/// With verification on, every moving entry needs its tensor's checksum,
/// and (until slices carry their own sums) must move its whole tensor.
fn unverifiable(plan: &Plan, problems: &mut Vec<String>) {
    for (i, e) in plan.entries.iter().enumerate() {
        if e.target == Target::Skip {
            continue;
        }
        if e.meta.checksum.is_none() {
            problems.push(format!(
                "checksum verification was requested but tensor '{}' has no checksum \
                 (for snapshots, write them with `wm manifest <dir>`)",
                e.meta.name
            ));
        } else if !plan.moves_whole(i) {
            problems.push(format!(
                "checksum verification was requested but only part of tensor '{}' moves \
                 to '{}', and slices carry no checksums yet: turn verification off for \
                 sharded updates",
                e.meta.name,
                match e.target {
                    Target::Param(_) => "its param",
                    _ => "the callback",
                }
            ));
        }
    }
}
