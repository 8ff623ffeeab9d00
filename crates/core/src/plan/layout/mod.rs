//! Layouts: a trainer's shards and an engine's params described in JSON
//! (`docs/layouts.md`), so that a plan can be made and measured at any
//! scale without a byte of weights or a param's memory: `wm plan` and
//! `wm bench shard` use them.
//!
//! A trainer layout becomes one [`crate::manifest::Manifest`] per trainer
//! rank (shards with placements, no bytes); an engine layout becomes, rank
//! by rank, the [`crate::plan::ParamLayout`]s that rank would register.
//! Rules keep a 1T-parameter model's layout a few dozen lines: tensors
//! templated over layers (`{L}`) and experts (`{E}`), split evenly over a
//! range of ranks or replicated, experts spread over rank groups; engine
//! pieces split by a TP degree, stacked into fused params, experts of an
//! EP rank stacked into one param. Explicit boxes are always possible.
//!
//! Everything read is bounded (file size, ranks, tensors, shards, pieces,
//! dimensions) and every error names the field (`engine.params[3].ep`).

mod engine;
mod json;
#[cfg(test)]
mod tests;
mod trainer;

pub use engine::EngineLayout;
pub use trainer::{GlobalSpec, TrainerLayout};

use crate::result::Result;
use std::path::Path;

/// Bounds on what a layout may describe.
pub mod limits {
    /// Bytes of one layout file.
    pub const MAX_FILE_BYTES: u64 = 64 << 20;
    /// Trainer or engine ranks.
    pub const MAX_RANKS: u64 = 65_536;
    pub const MAX_LAYERS: u64 = 100_000;
    pub const MAX_EXPERTS: u64 = 100_000;
    /// Global tensors of a trainer layout.
    pub const MAX_TENSORS: usize = 1_000_000;
    /// Shards of all trainer ranks together.
    pub const MAX_SHARDS: usize = 4_000_000;
    /// `params` entries of an engine layout.
    pub const MAX_PARAM_RULES: usize = 100_000;
    /// Pieces of one engine rank's params together.
    pub const MAX_PIECES: usize = 1_000_000;
}

/// Read the trainer layout at `path`.
pub fn read_trainer(path: &Path) -> Result<TrainerLayout> {
    let v = json::read_file(path, limits::MAX_FILE_BYTES)?;
    TrainerLayout::from_json(&v).map_err(|e| e.context(format!("layout {}", path.display())))
}

/// Read the engine layout at `path`.
pub fn read_engine(path: &Path) -> Result<EngineLayout> {
    let v = json::read_file(path, limits::MAX_FILE_BYTES)?;
    EngineLayout::from_json(&v).map_err(|e| e.context(format!("layout {}", path.display())))
}
