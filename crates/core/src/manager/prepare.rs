//! Before anything moves: open the sources, name the version and plan
//! (what `prepare` leaves for [`Manager::apply`]). A plan the engine
//! refuses is told to every publisher it reached.

use super::deltas::{self, DeltaFallback};
use super::geometry::{check_plan_memory, check_shards, tensor_limit};
use super::plan_cache::Planned;
use super::update::UpdateRun;
use super::{Manager, UpdateRequest};
use crate::checkpoint::version::check_version;
use crate::plan::{Plan, PlanOptions};
use crate::result::{Error, Result};
use crate::source::{Source, SourceKind};
use std::sync::Arc;
use std::time::Duration;

/// The sources opened, the version named and the plan made: nothing moved
/// yet.
pub(super) struct Prepared {
    /// Source `i` of the plan is `sources[i]`.
    pub sources: Vec<Box<dyn Source>>,
    pub version: String,
    pub plan: Arc<Plan>,
    /// How long planning took, and whether the last plan was reused.
    pub plan_time: Duration,
    pub plan_reused: bool,
    /// A gdr request that lands in GPU memory (else it runs as rdma).
    pub gdr: bool,
    /// The version the params hold, named to the sources as the base of
    /// deltas, or why none is (`deltas.rs`).
    pub delta_base: std::result::Result<String, DeltaFallback>,
}

impl Manager {
    /// Open the sources, name the version and plan (nothing moves yet).
    pub(super) fn prepare(&self, run: &mut UpdateRun) -> Result<Prepared> {
        let (registry, req) = (&*run.registry, &mut run.req);
        // gdr lands in device params; when it may not, it runs as rdma.
        let gdr = req.source == SourceKind::Gdr && self.check_gdr(registry)?;
        let keyed = self.config.net.keyed_digests;
        let delta_base = deltas::base_of(run.prev, req, self.record.lock().version.clone(), keyed);
        // The bytes this engine takes bound how many shards it plans over,
        // and what one publisher's MANIFEST may announce.
        let staged = match req.hooks.tensor.is_some() {
            true => self.config.callback_staging_limit,
            false => 0,
        };
        let params: u64 = registry.params().iter().map(|p| p.nbytes as u64).sum();
        let taken = params.saturating_add(staged);
        let most = usize::try_from(tensor_limit(taken)).unwrap_or(usize::MAX);
        let mut sources = self.open_sources(req, gdr, delta_base.as_ref().ok(), most)?;
        // A plan refused here is the engine's reason, not a crash: every
        // publisher is told it (an ERROR frame) before the sources close.
        match self.plan_over(run, &sources, taken) {
            Ok((version, planned)) => Ok(Prepared {
                sources,
                version,
                plan: planned.plan,
                plan_time: planned.took,
                plan_reused: planned.reused,
                gdr,
                delta_base,
            }),
            Err(e) => {
                for s in sources.iter_mut() {
                    s.abort(&e);
                }
                Err(e)
            }
        }
    }

    /// Name the version and plan over the opened `sources`, the engine
    /// taking `taken` bytes; the plan's memory is checked before any
    /// source is asked for a byte.
    fn plan_over(
        &self,
        run: &mut UpdateRun,
        sources: &[Box<dyn Source>],
        taken: u64,
    ) -> Result<(String, Planned)> {
        let (registry, req) = (&*run.registry, &mut run.req);
        let version = self.name_version(req, sources)?;
        if matches!(req.source, SourceKind::Rdma | SourceKind::Gdr) && !req.skip_network_checksums {
            req.verify = true;
        }
        let opts = PlanOptions {
            skip_unknown: req.skip_unknown,
            callback: req.hooks.tensor.is_some(),
            verify: req.verify,
            spread: self.config.rank as usize,
            slice_sums: sources.iter().all(|s| s.checks_slices()),
            deadline: Some(run.start + req.timeout),
            // Publishers quantize what quantized params take, so the wire
            // carries FP8. The fan-out serves device params, never
            // quantized ones: its plans are made as they always were.
            quantize_at_source: req.source != SourceKind::Snapshot
                && self.signal.fanout_size() <= 1,
        };
        check_shards(sources, taken)?;
        let manifests: Vec<_> = sources.iter().map(|s| s.manifest()).collect();
        let name = |i: usize| sources[i].describe();
        // A reason that only repeats who the source is adds nothing.
        let why_none = |i: usize| {
            let (who, why) = (sources[i].describe(), sources[i].no_version_reason());
            Some(why).filter(|w| !w.is_empty() && !w.starts_with(&who))
        };
        let planned = (self.kept.plans).plan(
            &manifests,
            registry,
            opts,
            (&self.config.logger, &name, &why_none),
        )?;
        // Before any source is asked for a byte (a WANT lists the blocks).
        // A refused plan is not kept for the next update.
        if let Err(e) = check_plan_memory(&planned.plan, registry, sources) {
            self.kept.plans.forget(&planned.plan);
            return Err(e);
        }
        Ok((version, planned))
    }

    /// The version the update brings in. A publisher (ipc, rdma, gdr)
    /// serves the version asked for and names it ("latest" becomes its
    /// real name); a snapshot request's version overrides the snapshot's
    /// version.yaml. Several sources must agree (the plan checks).
    fn name_version(&self, req: &UpdateRequest, sources: &[Box<dyn Source>]) -> Result<String> {
        let from_source = sources.iter().find_map(|s| s.manifest().version.clone());
        let named = match req.source {
            SourceKind::Snapshot => req.version.clone().or(from_source),
            _ => from_source.or_else(|| req.version.clone().filter(|v| v != "latest")),
        };
        let version = named.ok_or_else(|| {
            Error::no_version(format!(
                "no version: the request names none and {}",
                sources[0].no_version_reason()
            ))
        })?;
        check_version(&version)?;
        Ok(version)
    }
}
