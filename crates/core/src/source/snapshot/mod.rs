//! The snapshot source: safetensors files on disk (which files: [`layout`];
//! README "Snapshot layouts").
//!
//! Opening reads every file's header (never its data) so the whole plan is
//! checked before any byte moves, even for part files. Streaming then goes
//! file by file: each file is opened, checked to be the size it had when the
//! plan was made, read in batches straight into the applier's destinations
//! with `pread` on every core, and closed before the next file is touched, so
//! at most one part is open at a time.
//!
//! A rank whose params are slices of the stored tensors reads only its
//! segments' bytes, by the rule in `reads.rs` (short segments close together
//! share one covering read), and, when the checksum file has block sums,
//! the blocks covering them, each checked against its sum (`reader.rs`).
//!
//! Trust: a model directory is written by someone else. Every file in it is
//! opened only if it is a regular file (a FIFO or device is an error naming
//! it, never a blocked `open`), every header and side file is read with a
//! size bound the engine controls and within the update's deadline, and
//! every length, offset and name in a header is checked before it is used.
//!
//! A file truncated under a mapped read would raise SIGBUS; every window
//! is registered with the SIGBUS guard (`signal::sigbus`), which puts zero
//! pages over it, and the batch fails with an error naming the file, as a
//! short `pread` does (old weights kept in atomic mode, FAILED in place).

pub mod block_sums;
pub mod checksums;
pub mod layout;
pub mod mapped;
mod reader;
pub mod reads;
pub mod regular_file;
pub mod safetensors_file;
pub mod shard_meta;
pub mod version;

use super::Step;
use crate::apply::Applier;
use crate::logging::Logger;
use crate::manifest::{Manifest, TensorMeta};
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use block_sums::BlockSums;
pub use layout::{gpu_id, Layout, LayoutKind, SnapshotLocation, DEFAULT_FALLBACK_DIR};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes handed to the applier per batch: bounds the memory a callback-mode
/// update holds, and the interval between progress reports.
pub(crate) const BATCH_BYTES: u64 = 256 << 20;

/// The bound on opening a snapshot for a caller that has no deadline of its
/// own (the publisher): every read still ends.
const OPEN_BOUND: Duration = crate::defaults::UPDATE_TIMEOUT;

pub struct SnapshotSource {
    layout: Layout,
    /// Each file and its length when its header was read.
    files: Vec<(PathBuf, u64)>,
    manifest: Manifest,
    /// Per manifest tensor: (file index, absolute offset in that file).
    locations: Vec<(usize, u64)>,
    /// Per manifest tensor: its block sums, when the checksum file has them.
    blocks: Vec<Option<BlockSums>>,
    no_version: String,
}

impl SnapshotSource {
    /// Open with a generous deadline, reading `version.yaml`.
    pub fn open(loc: &SnapshotLocation, logger: &Logger) -> Result<SnapshotSource> {
        SnapshotSource::open_until(loc, logger, Instant::now() + OPEN_BOUND, true)
    }

    /// Resolve the layout and read every header (and the checksum file, and
    /// `version.yaml` when `read_version`: an update that names its version
    /// never reads it) before `deadline`.
    pub fn open_until(
        loc: &SnapshotLocation,
        logger: &Logger,
        deadline: Instant,
        read_version: bool,
    ) -> Result<SnapshotSource> {
        let layout = layout::resolve(loc, logger, deadline)?;
        logger.debug(&format!(
            "rank {}: snapshot layout '{}' with {} file(s)",
            loc.rank,
            layout.kind.describe(),
            layout.files.len()
        ));
        let checksums = checksums::Checksums::load(&layout.dir, deadline)?;
        let mut files = Vec::new();
        let mut manifest = Manifest::default();
        let mut locations = Vec::new();
        let mut blocks = Vec::new();
        let mut stored = HashSet::new();
        for (fi, path) in layout.files.iter().enumerate() {
            let (_file, header) = safetensors_file::open(path, deadline)?;
            let file_name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            let sums = match &checksums {
                Some(c) => c.for_file(file_name, header.file_len)?,
                None => None,
            };
            // Entries move into the manifest: a header is held once. Index
            // and checksums know a tensor by its stored name; the manifest
            // by its global one.
            for t in header.tensors {
                if let Some(index) = &layout.index {
                    check_in_index(index, path, file_name, &t.name)?;
                    stored.insert(t.name.clone());
                }
                let checksum = sums.and_then(|s| s.tensors.get(&t.name).copied());
                blocks.push(match &checksums {
                    Some(c) => c.block_sums(file_name, &t.name, t.nbytes)?,
                    None => None,
                });
                locations.push((fi, t.offset));
                let (name, placement) = match t.shard {
                    Some(s) => (s.tensor, Some(s.placement)),
                    None => (t.name, None),
                };
                manifest.tensors.push(TensorMeta {
                    name,
                    dtype: t.dtype,
                    shape: t.shape,
                    nbytes: t.nbytes,
                    checksum,
                    placement,
                });
            }
            files.push((path.clone(), header.file_len));
        }
        if let Some(index) = &layout.index {
            check_index_covered(index, &stored)?;
        }
        let (version, no_version) = if !read_version {
            (None, "the caller named a version".to_string())
        } else {
            match version::read_version_yaml(&layout.dir, deadline) {
                Ok(v) => (Some(v), String::new()),
                Err(why) => (None, why),
            }
        };
        manifest.version = version;
        Ok(SnapshotSource {
            layout,
            files,
            manifest,
            locations,
            blocks,
            no_version,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// File and absolute byte offset of manifest tensor `t`.
    pub fn tensor_location(&self, t: usize) -> (&std::path::Path, u64) {
        let (fi, offset) = self.locations[t];
        (&self.files[fi].0, offset)
    }

    /// Every file of the snapshot, in reading order.
    pub fn files(&self) -> impl Iterator<Item = &std::path::Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }
}

/// A shard's tensor must be the one the HuggingFace index maps to it.
fn check_in_index(
    index: &HashMap<String, String>,
    path: &Path,
    file_name: &str,
    tensor: &str,
) -> Result<()> {
    let mapped = index.get(tensor).map(String::as_str);
    if mapped != Some(file_name) {
        return Err(Error::format(format!(
            "{}: tensor '{}' is in this shard but {} maps it to {}",
            path.display(),
            tensor.escape_debug(),
            layout::HF_INDEX,
            mapped.unwrap_or("nothing")
        )));
    }
    Ok(())
}

/// Every tensor the HuggingFace index lists must be in some shard file
/// (`stored`: the stored names found).
fn check_index_covered(index: &HashMap<String, String>, stored: &HashSet<String>) -> Result<()> {
    let missing: Vec<&str> = index
        .keys()
        .map(String::as_str)
        .filter(|n| !stored.contains(*n))
        .take(5)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::format(format!(
        "{} lists tensor(s) its shards do not hold: {}",
        layout::HF_INDEX,
        missing.join(", ")
    )))
}

impl super::Source for SnapshotSource {
    fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    fn no_version_reason(&self) -> String {
        self.no_version.clone()
    }

    fn describe(&self) -> String {
        format!(
            "snapshot in {} ({}, {} file(s))",
            self.layout.dir.display(),
            self.layout.kind.describe(),
            self.files.len()
        )
    }

    /// Decided when the source is opened, before the plan (the manager
    /// plans with `slice_sums` from this): every tensor of the snapshot has
    /// block sums.
    fn checks_slices(&self) -> bool {
        !self.blocks.is_empty() && self.blocks.iter().all(Option::is_some)
    }

    fn start(&mut self, _: &Plan, _: usize, _: &mut Applier) -> Result<()> {
        Ok(())
    }

    /// Files are read in one step: their reads do not wait on a peer.
    fn step(&mut self, plan: &Plan, me: usize, applier: &mut Applier, _: Duration) -> Result<Step> {
        self.read_all(plan, me, applier).map(|()| Step::Done)
    }
}

impl SnapshotSource {
    /// Read source `me`'s planned bytes, file by file, batch by batch.
    fn read_all(&self, plan: &Plan, me: usize, applier: &mut Applier) -> Result<()> {
        for (fi, (path, planned_len)) in self.files.iter().enumerate() {
            let wanted: Vec<usize> = (0..plan.entries.len())
                .filter(|&e| {
                    let entry = &plan.entries[e];
                    entry.source == me
                        && self.locations[entry.tensor].0 == fi
                        && entry.target != Target::Skip
                })
                .collect();
            if wanted.is_empty() {
                continue;
            }
            applier.check_deadline()?;
            let shown = path.display().to_string();
            let file = regular_file::open_regular(path)?;
            let len = file
                .metadata()
                .map_err(|e| Error::io(format!("stat {shown}"), e))?
                .len();
            if len != *planned_len {
                return Err(Error::format(format!(
                    "{shown} changed after the plan was made (was {planned_len} bytes, now {len})"
                )));
            }
            let mut reader = reader::FileReader::new(&file, &shown);
            for e in wanted {
                let tensor = plan.entries[e].tensor;
                let sums = self.block_sums(plan, (e, tensor), applier.verifies());
                reader.entry(applier, plan, (e, self.locations[tensor].1), sums)?;
            }
            reader.flush(applier)?;
        }
        Ok(())
    }
}

impl SnapshotSource {
    /// The block sums entry `e` (of manifest tensor `tensor`) is read
    /// through: only when verifying a part of a tensor. Unverified updates
    /// read only their segments; an entry that takes all of its tensor's
    /// bytes (also fused into a param) is checked by the applier against
    /// the tensor's own checksum.
    fn block_sums(
        &self,
        plan: &Plan,
        (e, tensor): (usize, usize),
        verifies: bool,
    ) -> Option<&BlockSums> {
        match verifies && !plan.takes_all(e) {
            true => self.blocks[tensor].as_ref(),
            false => None,
        }
    }
}
