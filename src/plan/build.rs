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
        // Most pieces meet one or two shards.
        let mut found = Vec::with_capacity(2 * params.count());
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
/// entry. In callback mode every tensor goes whole to the callback.
fn assemble(sources: &[&Manifest], found: Vec<cover::FoundRun>, callback: bool) -> Plan {
    let by_shard = ByShard::new(sources, &found);
    let mut entries = Vec::with_capacity(by_shard.shards());
    let mut runs = Vec::with_capacity(found.len());
    let shards = sources
        .iter()
        .enumerate()
        .flat_map(|(s, m)| (0..m.tensors.len()).map(move |i| (s, i, &m.tensors)));
    for (k, (s, i, tensors)) in shards.enumerate() {
        let mut here = by_shard
            .of(k)
            .iter()
            .map(|&f| &found[f as usize])
            .peekable();
        let mut any = false;
        while let Some(target) = here.peek().map(|r| r.target) {
            let entry = entries.len();
            while let Some(r) = here.next_if(|r| r.target == target) {
                runs.push(Run { entry, ..r.clone() });
            }
            entries.push(entry_of(SharedMeta::new(tensors, i), s, i, target));
            any = true;
        }
        if !any {
            let target = if callback {
                Target::Callback
            } else {
                Target::Skip
            };
            let meta = SharedMeta::new(tensors, i);
            if callback {
                runs.push(whole_run(entries.len(), meta.nbytes));
            }
            entries.push(entry_of(meta, s, i, target));
        }
    }
    drop(found);
    runs::sort_and_merge(&mut runs);
    Plan::from_parts(entries, runs)
}

/// The runs found, grouped by shard (`Run::entry` until entries are made)
/// in the order they were found, which is param order: a counting sort,
/// linear in shards and runs.
struct ByShard {
    /// The runs of shard `k` are `order[first[k]..first[k + 1]]`.
    first: Vec<u32>,
    order: Vec<u32>,
}

impl ByShard {
    fn new(sources: &[&Manifest], found: &[cover::FoundRun]) -> ByShard {
        let shards: usize = sources.iter().map(|m| m.tensors.len()).sum();
        let mut first = vec![0u32; shards + 1];
        for r in found {
            first[r.entry + 1] += 1;
        }
        for k in 0..shards {
            first[k + 1] += first[k];
        }
        let mut next = first.clone();
        let mut order = vec![0u32; found.len()];
        for (i, r) in found.iter().enumerate() {
            let at = &mut next[r.entry];
            order[*at as usize] = i as u32;
            *at += 1;
        }
        ByShard { first, order }
    }

    fn shards(&self) -> usize {
        self.first.len() - 1
    }

    fn of(&self, shard: usize) -> &[u32] {
        &self.order[self.first[shard] as usize..self.first[shard + 1] as usize]
    }
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
