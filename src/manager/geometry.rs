//! A plan checked against the engine's memory before an update uses it:
//! how finely the sources' shards cut each param is their geometry, not
//! the engine's choice, so it is bounded against the param's bytes
//! (`Plan::check_blocks`) before any block is listed, and the blocks'
//! segments are then worked out with fallible allocations, naming the
//! source when there is no room (an infallible one aborts the process).

use crate::plan::{Plan, BLOCKS_FLOOR, MIN_BLOCK_BYTES};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::source::Source;

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
                "{}: its shards cut param '{}' ({} bytes) into {} blocks, at most {} \
                 allowed (one per {MIN_BLOCK_BYTES} bytes of the param, or {BLOCKS_FLOOR}); \
                 its tensor '{}' {:?} alone brings {} of them",
                source(t.entry),
                param.name,
                param.nbytes,
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
