//! The steps of a plan: the sources checked and indexed ([`Sources`]),
//! every param's pieces covered, the runs assembled into entries.

use super::params::Params;
use super::{cover, global, runs, Plan, PlanEntry, PlanOptions, Run, Target};
use crate::logging::{LogLevel, Logger};
use crate::manifest::{Manifest, SharedMeta};
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
    Sources::new(sources)?.plan(params, opts, logger)
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
        if manifests.iter().all(|m| m.tensors.is_empty()) {
            return Err(Error::not_found(
                "the source holds no tensors (empty source)",
            ));
        }
        let mut problems = Vec::new();
        check_versions(manifests, &mut problems);
        let globals = global::collect(manifests, &mut problems);
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
        let mut found = Vec::with_capacity(2 * params.count() + shards);
        if !opts.callback {
            let mut used = vec![false; self.globals.tensors.len()];
            for i in 0..params.count() {
                cover::cover_param(
                    i,
                    params.param(i),
                    &self.globals,
                    opts.spread,
                    &mut used,
                    &mut found,
                    &mut problems,
                );
            }
            unknown_tensors(&self.globals, &used, opts, logger, &mut problems);
        }
        let plan = assemble(self.manifests, found, opts.callback);
        if opts.verify {
            unverifiable(&plan, opts, &mut problems);
        }
        fail(problems, Error::mismatch)?;
        if plan.tensors == 0 {
            return Err(Error::mismatch(
                "no tensor of the source matches a registered param",
            ));
        }
        Ok(plan)
    }
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
            if !logger.enabled(LogLevel::Warn) {
                return;
            }
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
fn unverifiable(plan: &Plan, opts: PlanOptions, problems: &mut Vec<String>) {
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
                 to '{}', and this source has no checksums of slices (snapshots: write \
                 block sums with `wm manifest <dir>`)",
                e.meta.name,
                match e.target {
                    Target::Param(_) => "its param",
                    _ => "the callback",
                }
            ));
        }
    }
}
