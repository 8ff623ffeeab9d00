//! The plan is kept and reused while the layouts do not change: an RL run
//! updates the same params from the same trainer layout every step, so
//! after the first update the cost is the bytes, not the planning (a
//! static schedule). What decides reuse is a fingerprint of everything the
//! plan depends on: every source's tensors (names, dtypes, shapes, sizes,
//! placements), every param (name, dtype, shape, pieces) and the plan's
//! options (`plan::fingerprint`, with the options). Checksums change every
//! version and are not part of it: a reused plan takes the new ones.
//!
//! What changes every update is checked on every update, reused plan or
//! not: the sources name the same version (`plan::check_versions`) and
//! replicas carry the same checksums (`Plan::check_replicas`). A kept plan
//! once let rank 0 at v2 and rank 1 at v1 commit as "v2".

use crate::checksum::Checksum;
use crate::logging::Logger;
use crate::manifest::Manifest;
use crate::plan::{check_versions, make_sharded_plan, Plan, PlanOptions};
use crate::registry::Registry;
use crate::result::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A plan, how long it took to get, and whether it was the last one again.
pub(super) struct Planned {
    pub plan: Arc<Plan>,
    pub took: Duration,
    pub reused: bool,
}

#[derive(Default)]
pub(super) struct PlanCache {
    last: Mutex<Option<(u128, Arc<Plan>)>>,
}

/// Where a plan's messages come from: the log, who source `i` is, and why
/// it names no version (when it knows).
pub type Naming<'a> = (
    &'a Logger,
    &'a dyn Fn(usize) -> String,
    &'a dyn Fn(usize) -> Option<String>,
);

impl PlanCache {
    /// The plan of `sources` against `registry`: the last one when nothing
    /// it depends on changed, else a new one (kept for next time). `name(i)`
    /// says who source `i` is, in messages, and `why_none(i)` why it names
    /// no version.
    pub fn plan(
        &self,
        sources: &[&Manifest],
        registry: &Registry,
        opts: PlanOptions,
        (logger, name, why_none): Naming,
    ) -> Result<Planned> {
        let start = Instant::now();
        let versions: Vec<_> = sources.iter().map(|m| m.version.as_deref()).collect();
        check_versions(&versions, name, why_none).map_err(Error::format)?;
        let key = fingerprint(sources, registry, opts);
        // Taken, not cloned: the cache then holds the only reference (the
        // last update's is gone), so new checksums are written in place
        // instead of copying the whole plan.
        let last = self.last.lock().take();
        let (plan, reused) = match last.filter(|(k, _)| *k == key) {
            Some((_, plan)) => (with_checksums(plan, sources), true),
            // A failed plan keeps nothing: the cache was emptied above.
            None => {
                let plan = make_sharded_plan(sources, registry, opts, logger)
                    .map_err(|e| name_sources(e, sources.len(), name))?;
                (Arc::new(plan), false)
            }
        };
        *self.last.lock() = Some((key, plan.clone()));
        plan.check_replicas(sources, name).map_err(Error::format)?;
        Ok(Planned {
            plan,
            took: start.elapsed(),
            reused,
        })
    }

    /// Forget the kept plan if it is `plan`: a failed update's plan (and the
    /// segments it worked out) is not kept for the next one.
    pub fn forget(&self, plan: &Arc<Plan>) {
        let mut last = self.last.lock();
        if last
            .as_ref()
            .is_some_and(|(_, kept)| Arc::ptr_eq(kept, plan))
        {
            *last = None;
        }
    }
}

/// Most of an error the plan found: who "the source" or "source i" is
/// (the plan numbers its sources; the engine knows them), for at most 8
/// of the sources it mentions.
fn name_sources(e: Error, count: usize, name: &dyn Fn(usize) -> String) -> Error {
    let said = |i: usize| {
        let word = format!("source {i}");
        (e.message.match_indices(&word))
            .any(|(at, _)| !e.message[at + word.len()..].starts_with(|c: char| c.is_ascii_digit()))
    };
    let legend: Vec<String> = match count {
        1 if e.message.contains("the source") || e.message.contains("its shards") => {
            vec![format!("the source: {}", name(0))]
        }
        1 => Vec::new(),
        _ => (0..count)
            .filter(|&i| said(i))
            .take(8)
            .map(|i| format!("source {i}: {}", name(i)))
            .collect(),
    };
    match legend.is_empty() {
        true => e,
        false => Error::new(e.code, format!("{} ({})", e.message, legend.join("; "))),
    }
}

/// `plan` with the metadata of `sources` (their checksums), taken in place
/// when the cache holds the only reference; entries refer into the
/// manifests, so taking them copies no tensor's metadata either.
fn with_checksums(mut plan: Arc<Plan>, sources: &[&Manifest]) -> Arc<Plan> {
    if !plan.has_sources(sources) {
        Arc::make_mut(&mut plan).take_sources(sources);
    }
    plan
}

/// What the plan depends on: the layouts (`plan::fingerprint`) and the
/// options, hashed together.
fn fingerprint(sources: &[&Manifest], registry: &Registry, opts: PlanOptions) -> u128 {
    let PlanOptions {
        skip_unknown,
        callback,
        verify,
        spread,
        slice_sums,
        deadline: _,
        quantize_at_source,
    } = opts;
    let layouts = crate::plan::fingerprint(sources, registry);
    let mut h = Checksum::default();
    h.update(&layouts.to_le_bytes());
    for x in [
        skip_unknown,
        callback,
        verify,
        slice_sums,
        quantize_at_source,
    ] {
        h.update(&[x as u8]);
    }
    h.update(&(spread as u64).to_le_bytes());
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan's "source i" and "the source" get the engine's names for
    /// them (audit: "tensor 'q': sources disagree on it" and "shards ...
    /// (the source) and ... (the source) overlap" named no file or peer).
    #[test]
    fn plan_errors_name_the_sources_they_mention() {
        let name = |i: usize| format!("the publisher at p{i}.sock");
        let e = Error::format(
            "tensor 'q': sources disagree on it: source 1 has f32 [8], source 12 f32 [9]",
        );
        let named = name_sources(e, 13, &name);
        assert!(
            named.message.ends_with(
                "(source 1: the publisher at p1.sock; source 12: the publisher at p12.sock)"
            ),
            "{named}"
        );
        let e = Error::format("shards [0:5] (the source) and [4:8] (the source) overlap");
        let named = name_sources(e, 1, &name);
        assert!(
            named
                .message
                .ends_with("(the source: the publisher at p0.sock)"),
            "{named}"
        );
        let e = Error::mismatch("param 'w': dtype mismatch");
        assert_eq!(
            name_sources(e, 2, &name).message,
            "param 'w': dtype mismatch"
        );
    }
}
