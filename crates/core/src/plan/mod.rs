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
//! Files: `build.rs` (the steps, and [`Sources`]: the sources checked and
//! indexed once, planned against many engine ranks' params), `global.rs`
//! (the shards by global tensor), `cover.rs` (pieces against shards),
//! `runs.rs` (common boxes into runs and segments), `params.rs` (what the
//! plan needs of params: a `Registry`, or [`ParamLayout`]s without
//! memory), `fingerprint.rs` (has what a plan was made from changed),
//! `layout/` (trainer and engine layouts in JSON, for `wm plan`).

mod build;
mod clock;
mod cover;
mod fingerprint;
mod global;
pub mod layout;
mod params;
mod region;
#[cfg(test)]
mod reuse_tests;
mod runs;
mod shard_check;
#[cfg(test)]
mod sharded_tests;
#[cfg(test)]
mod tests;

use crate::manifest::{Manifest, SharedMeta, TensorMeta};
use crate::quant::blocks::BlockRuns;
use crate::result::{Error, Result};
use crate::tensor::DType;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

pub use build::{check_versions, make_plan, make_sharded_plan, source_number, Sources};
pub use fingerprint::fingerprint;
pub use params::{ParamLayout, ParamView, Params};

/// Where one plan entry's bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Copied into registered param `usize`.
    Param(usize),
    /// Handed to the engine's per-tensor callback.
    Callback,
    /// Not wanted (unknown name with `skip_unknown`, or a tensor no piece
    /// of this engine needs, when there is one source); its bytes are not
    /// read.
    Skip,
}

/// One source tensor's bytes for one target. A tensor that feeds several
/// params (a whole-row shard of experts split over params) has an entry
/// per param. With one source, a tensor nobody wants has one `Skip` entry,
/// so that when its tensors each go to one target, entry `i` is tensor `i`
/// of the manifest. With several, a shard nobody wants has no entry: each
/// source is asked for exactly what the entries need, and an engine rank
/// reads few of 80,000 FSDP shards. Entries are in (source, tensor) order.
#[derive(Clone, Debug)]
pub struct PlanEntry {
    /// The tensor's metadata, shared with its source's manifest (not a
    /// copy: a plan of 80,000 shards would otherwise spend most of its
    /// time copying names and shapes).
    pub meta: SharedMeta,
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
        PlanEntry {
            meta: meta.into(),
            source: 0,
            tensor,
            target,
            bytes: 0,
        }
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
    /// The sources checksum every part of a tensor they serve
    /// (`Applier::expect_checksum`), so entries that move part of a tensor
    /// can be verified too.
    pub slice_sums: bool,
    /// When the update must be over: planning stops there with
    /// `WM_ERR_TIMEOUT` (None: no deadline).
    pub deadline: Option<std::time::Instant>,
    /// The sources quantize what quantized params take (publishers, over
    /// the wire in FP8): see [`QuantizedParam::on_wire`].
    pub quantize_at_source: bool,
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

/// Blocks the params may be cut into whatever their size: small params
/// may be cut into rows of a few bytes.
pub(crate) const BLOCKS_FLOOR: u64 = 1 << 16;

/// Above [`BLOCKS_FLOOR`], the params' blocks average at least this many
/// bytes: a block costs the engine a 32-byte segment kept with the plan
/// (and a step of every copy), so params cut finer cost more memory than
/// half their bytes. Tensor-parallel column splits cut rows of hundreds of
/// bytes and more (a 896-wide bf16 embedding over 8 ranks: 224); 4,096
/// one-column f32 shards of a param cut it into rows of 4 bytes.
pub(crate) const MIN_BLOCK_BYTES: u64 = 64;

/// The most blocks params of `nbytes` bytes in all may be cut into.
pub fn max_blocks(nbytes: u64) -> u64 {
    BLOCKS_FLOOR.saturating_add(nbytes / MIN_BLOCK_BYTES)
}

/// Params the runs cut into more blocks than [`max_blocks`] allows
/// ([`Plan::check_blocks`]): the blocks and limit of all of them, the
/// param furthest over its share with its blocks, and the entry (a
/// source tensor) bringing the most of those.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooManyBlocks {
    pub blocks: u64,
    pub limit: u64,
    pub param: usize,
    pub param_blocks: u64,
    pub entry: usize,
    pub entry_blocks: u64,
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
    /// The entries that move (not `Skip`), in order; `segments[i]` is
    /// entry `moving[i]`'s. Skipped entries have no runs, so no segments,
    /// and most tensors of a source with unknown names can be skipped.
    moving: Vec<u32>,
    /// Per moving entry, its segments, worked out from the runs on first
    /// use (by the applier and the source alike). The runs do not change
    /// after.
    segments: Vec<OnceLock<Vec<Segment>>>,
    /// Per moving entry into a param the publishers quantize, the param's
    /// block of each global block it touches (by global block), worked
    /// out on first use: walking every row of a large tensor took longer
    /// than quantizing it, and a reused plan asks again every update.
    quant_blocks: Vec<OnceLock<Arc<BlockRuns>>>,
    /// Shards announced for the same box as another source's, as
    /// `(first holder, replica)` pairs of (source, tensor): their
    /// checksums are compared on every update ([`Plan::check_replicas`]).
    replicas: Vec<[(u32, u32); 2]>,
    /// Params quantized from their global tensors, in param order.
    pub quantized: Vec<QuantizedParam>,
}

/// A param quantized from global tensors of dtype `source`. Quantized
/// here (`on_wire` false), the runs lay its bytes out in `source` (its
/// elements, wider) and the applier quantizes them at the end; quantized
/// by the publishers (`on_wire`), the runs count elements and bring its
/// FP8 bytes, and the applier writes the scales the sources agreed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantizedParam {
    pub param: usize,
    pub source: DType,
    pub on_wire: bool,
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
        let moving: Vec<u32> = (0..entries.len())
            .filter(|&i| entries[i].target != Target::Skip)
            .map(|i| u32::try_from(i).expect("a plan's entries are numbered in 32 bits"))
            .collect();
        Plan {
            tensors: moving.len(),
            bytes: moving.iter().map(|&i| entries[i as usize].bytes).sum(),
            segments: moving.iter().map(|_| OnceLock::new()).collect(),
            quant_blocks: moving.iter().map(|_| OnceLock::new()).collect(),
            moving,
            entries,
            runs,
            replicas: Vec::new(),
            quantized: Vec::new(),
        }
    }

    fn set_replicas(&mut self, pairs: &[(global::ShardRef, global::ShardRef)]) {
        let pair = |r: global::ShardRef| (r.source, r.tensor);
        self.replicas = pairs.iter().map(|&(a, b)| [pair(a), pair(b)]).collect();
    }

    /// Replicas (the same box from two sources) must hold the same bytes:
    /// engine ranks spread their reads over them, so replicas that differ
    /// would leave ranks with different weights under one version. Where
    /// both manifests carry a checksum they are compared; without
    /// checksums replicas are trusted to be equal (nothing can tell before
    /// the bytes move, and each rank's verification checks only the
    /// replica it read). `name(i)` says who source `i` is.
    pub fn check_replicas(
        &self,
        sources: &[&Manifest],
        name: &dyn Fn(usize) -> String,
    ) -> std::result::Result<(), String> {
        let meta = |(s, t): (u32, u32)| &sources[s as usize].tensors[t as usize];
        for &[a, b] in &self.replicas {
            let (x, y) = (meta(a), meta(b));
            if let (Some(cx), Some(cy)) = (x.checksum, y.checksum) {
                if cx != cy {
                    return Err(format!(
                        "tensor '{}' {}: replicas disagree: {} and {} hold the same box \
                         with different checksums ({cx:032x} and {cy:032x})",
                        x.name,
                        crate::tensor_box::TensorBox {
                            offset: x.offset(),
                            len: x.shape.clone()
                        },
                        name(a.0 as usize),
                        name(b.0 as usize)
                    ));
                }
            }
        }
        Ok(())
    }

    /// The runs of entry `entry`, in source order.
    pub fn runs_of(&self, entry: usize) -> &[Run] {
        let from = self.runs.partition_point(|r| r.entry < entry);
        let to = self.runs.partition_point(|r| r.entry <= entry);
        &self.runs[from..to]
    }

    /// Take the metadata of `sources` (checksums, version), which must
    /// have the layouts this plan was made from (`fingerprint`): every
    /// entry then refers into their manifests instead (a reference count
    /// each; the old manifests are released).
    pub fn take_sources(&mut self, sources: &[&Manifest]) {
        for e in &mut self.entries {
            let tensors = &sources[e.source].tensors;
            if !e.meta.is_in(tensors) {
                e.meta = SharedMeta::new(tensors, e.tensor);
            }
        }
    }

    /// Whether every entry already refers into `sources`' manifests.
    pub fn has_sources(&self, sources: &[&Manifest]) -> bool {
        self.entries
            .iter()
            .all(|e| e.meta.is_in(&sources[e.source].tensors))
    }

    /// Entry `entry`'s segments, in source order. An update works them
    /// out fallibly first ([`Plan::try_segments`]); elsewhere (tools,
    /// tests) memory running out here aborts, as any allocation does.
    pub fn segments(&self, entry: usize) -> &[Segment] {
        self.try_segments(entry)
            .unwrap_or_else(|e| panic!("the segments of a plan entry: {e}"))
    }

    /// Entry `entry`'s segments, in source order, worked out on first use:
    /// `WM_ERR_OUT_OF_MEMORY` naming the tensor and its source (by
    /// number) when there is no room for them.
    pub fn try_segments(&self, entry: usize) -> Result<&[Segment]> {
        let Some(slot) = self.moving_slot(entry) else {
            // A skipped entry (or none): no runs.
            return Ok(&[]);
        };
        if let Some(segs) = self.segments[slot].get() {
            return Ok(segs);
        }
        let runs = self.runs_of(entry);
        let segs = runs::segments(runs).map_err(|e| {
            let rows: u64 = runs.iter().map(|r| r.rows).sum();
            let who = &self.entries[entry];
            Error::out_of_memory(format!(
                "tensor '{}' of source #{}: no room for its {rows} segments: {e}",
                who.meta.name, who.source
            ))
        })?;
        Ok(self.segments[slot].get_or_init(|| segs))
    }

    /// Where entry `entry` is among the moving ones (its segments' and
    /// quantized blocks' slot); None: skipped, or no entry.
    fn moving_slot(&self, entry: usize) -> Option<usize> {
        let entry = u32::try_from(entry).ok()?;
        self.moving.binary_search(&entry).ok()
    }

    /// Entry `entry`'s quantized blocks ([`Plan::quant_blocks`]'s field),
    /// `find` working them out the first time. A skipped entry has none.
    pub fn quant_blocks(
        &self,
        entry: usize,
        find: impl FnOnce() -> Result<BlockRuns>,
    ) -> Result<Arc<BlockRuns>> {
        let Some(slot) = self.moving_slot(entry) else {
            return Ok(Arc::default());
        };
        if let Some(blocks) = self.quant_blocks[slot].get() {
            return Ok(blocks.clone());
        }
        let blocks = Arc::new(find()?);
        Ok(self.quant_blocks[slot].get_or_init(|| blocks).clone())
    }

    /// Check that the runs cut the params (`param_bytes(i)` bytes each)
    /// into at most [`max_blocks`] of their bytes in all, before any block
    /// is listed: each block costs a segment kept with the plan and a step
    /// of every copy, and the sources' geometry (4,096 one-column shards
    /// of a param) is what decides how many there are. Err: the param
    /// furthest over its share, with its blocks, and the entry bringing
    /// the most of them.
    pub fn check_blocks(
        &self,
        param_bytes: impl Fn(usize) -> u64,
    ) -> std::result::Result<(), TooManyBlocks> {
        // Per param: blocks, and the entry with the most (entry, blocks).
        let mut per: std::collections::HashMap<usize, (u64, usize, u64)> = Default::default();
        for same in self
            .runs
            .chunk_by(|a, b| a.entry == b.entry && a.target == b.target)
        {
            let Target::Param(i) = same[0].target else {
                continue;
            };
            let rows = same.iter().map(|r| r.rows).fold(0, u64::saturating_add);
            let p = per.entry(i).or_insert((0, same[0].entry, 0));
            p.0 = p.0.saturating_add(rows);
            if rows > p.2 {
                (p.1, p.2) = (same[0].entry, rows);
            }
        }
        let bytes: u64 = per.keys().map(|&i| param_bytes(i)).sum();
        let blocks = per.values().map(|p| p.0).fold(0, u64::saturating_add);
        let limit = max_blocks(bytes);
        if blocks <= limit {
            return Ok(());
        }
        let excess = |(&i, p): (&usize, &(u64, usize, u64))| {
            p.0.saturating_sub(param_bytes(i) / MIN_BLOCK_BYTES)
        };
        let worst = per
            .iter()
            .max_by_key(|&kv| excess(kv))
            .expect("blocks over the limit are some param's");
        let (&param, &(param_blocks, entry, entry_blocks)) = worst;
        Err(TooManyBlocks {
            param,
            param_blocks,
            blocks,
            limit,
            entry,
            entry_blocks,
        })
    }

    /// How param `param` is quantized, when it is.
    pub fn quantized(&self, param: usize) -> Option<QuantizedParam> {
        // Made in param order.
        let k = self
            .quantized
            .binary_search_by_key(&param, |q| q.param)
            .ok()?;
        Some(self.quantized[k])
    }

    /// The dtype param `param`'s runs lay its bytes out in, when it is
    /// quantized here (not by the publishers) from its global tensors.
    pub fn quantized_from(&self, param: usize) -> Option<DType> {
        self.quantized(param)
            .filter(|q| !q.on_wire)
            .map(|q| q.source)
    }

    /// Entry `entry` moves its whole tensor unchanged (whole-tensor
    /// checksums and zero-copy views apply).
    pub fn moves_whole(&self, entry: usize) -> bool {
        self.entries[entry].is_whole(self.segments(entry))
    }

    /// Entry `entry` takes every byte of its tensor once, in order (to the
    /// same offsets of its param or not: a whole tensor fused into a
    /// param), so the tensor's own checksum covers what it receives. The
    /// byte count alone is not enough: pieces reading overlapping rows can
    /// add up to the tensor's size (each segment's bytes must come from
    /// where they sit in what it receives).
    pub fn takes_all(&self, entry: usize) -> bool {
        let e = &self.entries[entry];
        e.bytes == e.meta.nbytes && self.segments(entry).iter().all(|s| s.source == s.wanted)
    }

    /// Per param a run writes, in order of its first run: `(param, end,
    /// covered)`, the furthest byte written and the bytes written. Runs
    /// never overlap (checked when planning), so `covered == end == size`
    /// means every byte of the param is written (a page swap may replace it
    /// whole).
    pub fn param_cover(&self) -> Vec<(usize, u64, u64)> {
        let mut params: Vec<(usize, u64, u64)> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for run in &self.runs {
            if let Target::Param(i) = run.target {
                let k = *index.entry(i).or_insert_with(|| {
                    params.push((i, 0, 0));
                    params.len() - 1
                });
                params[k].1 = params[k].1.max(run.param_end());
                params[k].2 += run.bytes();
            }
        }
        params
    }
}
