//! The sources' geometry checked against the engine's memory before an
//! update plans or uses it. How many shards the sources announce, and how
//! finely they cut each param, is theirs to say, and each costs the engine
//! memory (a shard: about 800 bytes of manifest, plan and requests; a
//! block: a 32-byte segment): both are bounded against the bytes the
//! engine takes, which it controls, before the planner iterates over the
//! shards and before any block is listed. The blocks' segments are then
//! worked out with fallible allocations, naming the source when there is
//! no room (an infallible one aborts the process).

use crate::manifest::TensorMeta;
use crate::plan::{Plan, BLOCKS_FLOOR, MIN_BLOCK_BYTES};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::source::Source;
use std::collections::HashMap;

/// Tensors the sources may announce in all, whatever the engine takes.
pub(super) const SHARDS_FLOOR: u64 = 1 << 16;

/// Above [`SHARDS_FLOOR`], at least this many bytes the engine takes per
/// tensor the sources announce: a shard costs the engine about 800 bytes
/// before any of its bytes moves (900,000 one-row shards of a 58 MB param
/// cost 750 MB), so this keeps that under a fifth of the bytes.
pub(super) const MIN_SHARD_BYTES: u64 = 4096;

/// The most tensors the sources may announce for an engine taking `taken`
/// bytes: [`SHARDS_FLOOR`] plus one per [`MIN_SHARD_BYTES`]. Each source's
/// MANIFEST is held to it as it is decoded, all of them together by
/// [`check_shards`].
pub(super) fn tensor_limit(taken: u64) -> u64 {
    SHARDS_FLOOR.saturating_add(taken / MIN_SHARD_BYTES)
}

/// Check how many tensors the `sources` announce against `taken`, the
/// bytes the engine takes (its params', and what its per-tensor callback
/// may stage), before anything is planned: at most [`SHARDS_FLOOR`] plus
/// one per [`MIN_SHARD_BYTES`]. Err: `WM_ERR_OUT_OF_MEMORY` naming the
/// tensor with the most shards and the source announcing most of them.
pub(super) fn check_shards(sources: &[Box<dyn Source>], taken: u64) -> Result<()> {
    let total: u64 = sources
        .iter()
        .map(|s| s.manifest().tensors.len() as u64)
        .sum();
    let limit = tensor_limit(taken);
    if total <= limit {
        return Ok(());
    }
    // Only now, over the limit: which tensor, and from which source.
    let mut per_name: HashMap<&str, (u64, &TensorMeta)> = HashMap::new();
    for s in sources {
        for t in s.manifest().tensors.iter() {
            per_name.entry(t.name.as_str()).or_insert((0, t)).0 += 1;
        }
    }
    let (name, (shards, meta)) = per_name
        .iter()
        .max_by_key(|(_, (n, _))| *n)
        .expect("tensors over the limit have names");
    let announced = |s: &dyn Source| {
        s.manifest()
            .tensors
            .iter()
            .filter(|t| t.name == *name)
            .count()
    };
    let source = sources
        .iter()
        .max_by_key(|s| announced(s.as_ref()))
        .expect("a source announced it");
    Err(Error::out_of_memory(format!(
        "{}: the sources announce {total} tensors, more than the {limit} allowed for \
         the {taken} bytes this engine takes (one per {MIN_SHARD_BYTES} bytes, plus \
         {SHARDS_FLOOR}); {shards} of them are '{name}' {:?} (shards of {})",
        source.describe(),
        meta.shape,
        meta.placement
            .as_ref()
            .map_or_else(|| "itself".to_string(), |p| format!("{:?}", p.global_shape)),
    )))
}

/// Check `plan`'s blocks against the params of `registry`, then work out
/// every entry's segments; `sources` name what the entries come from.
pub(super) fn check_plan_memory(
    plan: &Plan,
    registry: &Registry,
    sources: &[Box<dyn Source>],
) -> Result<()> {
    let params = registry.params();
    let source = |entry: usize| {
        sources
            .get(plan.entries[entry].source)
            .map_or_else(|| "a source".to_string(), |s| s.describe())
    };
    plan.check_blocks(|i| params.get(i).map_or(0, |p| p.nbytes as u64))
        .map_err(|t| {
            let (param, meta) = (&params[t.param], &plan.entries[t.entry].meta);
            Error::out_of_memory(format!(
                "{}: its shards cut param '{}' ({} bytes) into {} blocks, and the params \
                 into {} in all, more than the {} allowed (one per {MIN_BLOCK_BYTES} bytes \
                 of the params, plus {BLOCKS_FLOOR}); its tensor '{}' {:?} alone brings {}",
                source(t.entry),
                param.name,
                param.nbytes,
                t.param_blocks,
                t.blocks,
                t.limit,
                meta.name,
                meta.shape,
                t.entry_blocks
            ))
        })?;
    for entry in 0..plan.entries.len() {
        plan.try_segments(entry)
            .map_err(|e| e.context(source(entry)))?;
    }
    Ok(())
}
