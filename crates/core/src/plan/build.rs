//! The steps of a plan: the sources checked and indexed ([`Sources`]),
//! every param's pieces covered, the runs assembled into entries.

use super::clock::Clock;
use super::cover::Found;
use super::params::{ParamView, Params};
use super::{cover, global, runs, Plan, PlanEntry, PlanOptions, Run, Target};
use crate::logging::{LogLevel, Logger};
use crate::manifest::{Manifest, SharedMeta};
use crate::quant::params::QuantRole;
use crate::result::{Error, Result};

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
    Sources::new_until(sources, opts.deadline)?.plan(params, opts, logger)
}

/// The sources checked (sizes, placements, overlaps, versions) and their
/// shards indexed by global tensor, once: planning many engine ranks
/// against the same sources (`wm plan`) then costs each rank only its own
/// pieces and the entries, not a pass over every shard again.
pub struct Sources<'a> {
    manifests: &'a [&'a Manifest],
    globals: global::Globals<'a>,
}

impl<'a> Sources<'a> {
    pub fn new(manifests: &'a [&'a Manifest]) -> Result<Sources<'a>> {
        Sources::new_until(manifests, None)
    }

    /// [`Sources::new`], stopping with `WM_ERR_TIMEOUT` at `deadline`.
    pub fn new_until(
        manifests: &'a [&'a Manifest],
        deadline: Option<std::time::Instant>,
    ) -> Result<Sources<'a>> {
        if manifests.iter().all(|m| m.tensors.is_empty()) {
            return Err(Error::not_found(
                "the source holds no tensors (empty source)",
            ));
        }
        let mut problems = Vec::new();
        let versions: Vec<_> = manifests.iter().map(|m| m.version.as_deref()).collect();
        let named = source_number(manifests.len());
        if let Err(p) = check_versions(&versions, &named, &|_| None) {
            problems.push(p);
        }
        let mut clock = Clock::until(deadline);
        let globals = global::collect(manifests, &mut clock, &mut problems);
        late(&clock, "checking the sources' shards")?;
        fail(problems, Error::format)?;
        Ok(Sources { manifests, globals })
    }

    /// Check `params` against the sources and say where every byte goes.
    pub fn plan<P: Params + ?Sized>(
        &self,
        params: &P,
        opts: PlanOptions,
        logger: &Logger,
    ) -> Result<Plan> {
        let mut problems = Vec::new();
        // Most pieces meet one or two shards; a split along an inner
        // dimension meets every shard of its tensor. Reserved, not
        // touched: pages never written cost nothing, while growing by
        // doubling would copy every run found so far.
        let shards = self
            .manifests
            .iter()
            .map(|m| m.tensors.len())
            .sum::<usize>();
        let bytes = (0..params.count())
            .map(|i| params.param(i).nbytes())
            .fold(0, u64::saturating_add);
        let limit = usize::try_from(super::max_blocks(bytes)).unwrap_or(usize::MAX);
        let mut found = Found {
            runs: Vec::with_capacity((2 * params.count() + shards).min(limit)),
            limit,
            over: None,
            quantized: Vec::new(),
            on_wire: opts.quantize_at_source,
        };
        if !opts.callback {
            let mut used = vec![false; self.globals.tensors.len()];
            let mut clock = Clock::until(opts.deadline);
            for i in 0..params.count() {
                let into = (&mut found, &mut problems, &mut clock);
                cover::cover_param(
                    i,
                    params.param(i),
                    &self.globals,
                    opts.spread,
                    &mut used,
                    into,
                );
            }
            late(&clock, "covering the params' pieces")?;
            if let Some(i) = found.over {
                return Err(too_finely_cut(params.param(i), bytes, limit));
            }
            let sharded = self.manifests.len() > 1
                || self.globals.placed
                || (0..params.count()).any(|i| !params.param(i).whole);
            if !sharded {
                let into = (logger, &mut problems);
                unknown_tensors(&self.globals, &used, params, opts, into);
            }
        }
        let mut plan = assemble(self.manifests, found.runs, opts.callback);
        plan.quantized = found.quantized;
        // Checked by the update that uses the plan, every time
        // (`Plan::check_replicas`): checksums change every version.
        plan.set_replicas(&self.globals.replicas);
        if opts.verify {
            unverifiable(&plan, params, opts, &mut problems);
        }
        fail(problems, Error::mismatch)?;
        if plan.tensors == 0 {
            // Params of no bytes (an empty piece, a tensor of 0 rows) take
            // nothing: say so, not that nothing matched.
            let empty = (0..params.count()).all(|i| params.param(i).nbytes() == 0);
            return Err(Error::mismatch(match empty && params.count() > 0 {
                true => "every registered param holds no bytes (an empty piece or a tensor \
                         with a dimension of 0): there is nothing to update"
                    .to_string(),
                false => "no tensor of the source matches a registered param".to_string(),
            }));
        }
        Ok(plan)
    }
}

/// The sources' shards and the params' pieces meet in more boxes than the
/// params may be cut into ([`super::max_blocks`]), counted before runs are
/// joined; `param` is the one whose pieces went over.
fn too_finely_cut(param: ParamView, bytes: u64, limit: usize) -> Error {
    Error::out_of_memory(format!(
        "the sources' shards and the params' pieces cut the params ({bytes} bytes) into \
         more than {limit} runs (at most 65,536 plus one per 64 bytes of the params), \
         going over at param '{}' ({} pieces): too finely cut to plan",
        param.name,
        param.pieces.len()
    ))
}

/// Planning stopped at the update's deadline.
fn late(clock: &Clock, doing: &str) -> Result<()> {
    match clock.expired() {
        true => Err(Error::timeout(format!(
            "the update's deadline passed while planning ({doing})"
        ))),
        false => Ok(()),
    }
}

/// Sources serve one version together: all name the same one, or none
/// names any. A source naming none beside ones that name a version is
/// refused: its bytes may be of any version. `name(i)` says who source `i`
/// is (a publisher's address, a directory) in the message, and
/// `why_none(i)` why it names none, when it knows (its `version.yaml`
/// refused, say). Every update checks this, whether its plan is new or
/// kept (a kept plan says nothing about this update's versions).
pub fn check_versions(
    versions: &[Option<&str>],
    name: &dyn Fn(usize) -> String,
    why_none: &dyn Fn(usize) -> Option<String>,
) -> std::result::Result<(), String> {
    let Some(first) = versions.iter().position(Option::is_some) else {
        return Ok(());
    };
    let v0 = versions[first].unwrap_or_default();
    for (i, v) in versions.iter().enumerate() {
        match v {
            Some(v) if *v != v0 => {
                return Err(format!(
                    "the sources serve different versions: {} '{v0}', {} '{v}'",
                    name(first),
                    name(i)
                ))
            }
            Some(_) => {}
            None => {
                let why = why_none(i).map_or_else(String::new, |w| format!(" ({w})"));
                return Err(format!(
                    "the sources serve different versions: {} names no version{why}, while {} \
                     serves '{v0}' (every source must name the same version, or none may)",
                    name(i),
                    name(first)
                ));
            }
        }
    }
    Ok(())
}

/// "source i", for messages that have nothing better.
pub fn source_number(count: usize) -> impl Fn(usize) -> String {
    move |i| match count {
        1 => "the source".to_string(),
        _ => format!("source {i}"),
    }
}

/// In a one-to-one update (one source of whole tensors, every param a whole
/// tensor of its name), a tensor no param names is an error (a misnamed
/// tensor is a bug), or skipped with a warning when the request says so
/// (in the order the source names them). In a sharded update (several
/// sources, placed shards, or params made of pieces) an engine rank reads
/// only what its pieces name: the rest (other ranks' experts, other TP
/// ranks' tensors) is no error and is not read; what a piece names and no
/// source holds is still an error, found by `cover`.
fn unknown_tensors<P: Params + ?Sized>(
    globals: &global::Globals,
    used: &[bool],
    params: &P,
    opts: PlanOptions,
    (logger, problems): (&Logger, &mut Vec<String>),
) {
    let mut scales = None;
    for (t, _) in globals.tensors.iter().zip(used).filter(|(_, &u)| !u) {
        if opts.skip_unknown {
            if !logger.enabled(LogLevel::Warn) {
                return;
            }
            logger.warn(&format!(
                "skipping tensor '{}': not a registered param",
                t.name
            ));
            continue;
        }
        // A quantized param's scales share no name with a source's tensor
        // the engine reads: say so where one does (a checkpoint's own
        // scales beside bf16 weights, say).
        let scales = scales.get_or_insert_with(|| scales_of(params));
        problems.push(match scales.get(t.name) {
            Some(weight) => format!(
                "tensor '{}' is not a registered param: param '{}' of that name holds the scales of quantized param '{weight}', made by quantizing it, never read from a source (skip such tensors with WM_UPDATE_SKIP_UNKNOWN)",
                t.name, t.name
            ),
            None => format!("tensor '{}' is not a registered param", t.name),
        });
    }
}

/// Each scales param's name, with its quantized weight's.
fn scales_of<P: Params + ?Sized>(params: &P) -> std::collections::HashMap<&str, &str> {
    (0..params.count())
        .filter_map(|i| match params.param(i).quant {
            QuantRole::Scales { weight } => Some((params.param(i).name, params.param(weight).name)),
            _ => None,
        })
        .collect()
}

/// One entry per (source, tensor, target) in that order, runs numbered by
/// entry. In callback mode every tensor goes whole to the callback. A
/// tensor no piece needs gets a `Skip` entry when there is one source
/// (entry `i` is then tensor `i`: a source sending every tensor numbers
/// them so), and none when there are several (each is asked for exactly
/// what the entries need, and most of their shards are not).
fn assemble(sources: &[&Manifest], mut runs: Vec<cover::FoundRun>, callback: bool) -> Plan {
    let shards: usize = sources.iter().map(|m| m.tensors.len()).sum();
    runs::order_by_shard(&mut runs, shards);
    let unneeded = match (callback, sources.len()) {
        (true, _) => Some(Target::Callback),
        (false, 1) => Some(Target::Skip),
        (false, _) => None,
    };
    let mut entries = Vec::with_capacity(match unneeded {
        Some(_) => shards,
        None => runs.len(),
    });
    let mut next = 0;
    let mut whole = Vec::new();
    let mut shard = 0;
    for (s, m) in sources.iter().enumerate() {
        for i in 0..m.tensors.len() {
            let mut any = false;
            while next < runs.len() && runs[next].entry == shard {
                let (target, entry) = (runs[next].target, entries.len());
                while next < runs.len() && runs[next].entry == shard && runs[next].target == target
                {
                    runs[next].entry = entry;
                    next += 1;
                }
                entries.push(entry_of(SharedMeta::new(&m.tensors, i), s, i, target));
                any = true;
            }
            if let Some(target) = unneeded.filter(|_| !any) {
                let meta = SharedMeta::new(&m.tensors, i);
                if callback {
                    whole.push(whole_run(entries.len(), meta.nbytes));
                }
                entries.push(entry_of(meta, s, i, target));
            }
            shard += 1;
        }
    }
    // In callback mode no piece was covered: the runs are the whole ones,
    // made in entry order. Otherwise none is whole. Either way the runs are
    // in (entry, source offset) order already.
    runs.append(&mut whole);
    runs::merge_ordered(&mut runs);
    Plan::from_parts(entries, runs)
}

fn entry_of(meta: SharedMeta, source: usize, tensor: usize, target: Target) -> PlanEntry {
    PlanEntry {
        meta,
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
/// and moves all of its tensor unless the sources checksum slices.
fn unverifiable<P: Params + ?Sized>(
    plan: &Plan,
    params: &P,
    opts: PlanOptions,
    problems: &mut Vec<String>,
) {
    for (i, e) in plan.entries.iter().enumerate() {
        if e.target == Target::Skip {
            continue;
        }
        let sliced = opts.slice_sums && !plan.takes_all(i);
        if e.meta.checksum.is_none() && !sliced {
            problems.push(format!(
                "checksum verification was requested but tensor '{}' has no checksum \
                 (for snapshots, write them with `wm manifest <dir>`)",
                e.meta.name
            ));
        } else if !opts.slice_sums && !plan.takes_all(i) {
            problems.push(format!(
                "checksum verification was requested but only part of tensor '{}' moves \
                 to {}, and this source has no checksums of slices (snapshots: write \
                 block sums with `wm manifest <dir>`)",
                e.meta.name,
                match e.target {
                    Target::Param(p) => format!("param '{}'", params.param(p).name),
                    _ => "the callback".to_string(),
                }
            ));
        }
    }
}
