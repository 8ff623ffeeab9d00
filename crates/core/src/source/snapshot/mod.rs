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
//! is registered with the SIGBUS guard (`memory::sigbus`), which puts zero
//! pages over it, and the batch fails with an error naming the file, as a
//! short `pread` does (old weights kept in atomic mode, FAILED in place).

mod reader;
pub mod reads;

use super::Step;
use crate::apply::Applier;
use crate::checkpoint::block_sums::BlockSums;
pub use crate::checkpoint::layout::{gpu_id, SnapshotLocation, DEFAULT_FALLBACK_DIR};
use crate::checkpoint::Checkpoint;
use crate::logging::Logger;
use crate::manifest::Manifest;
use crate::plan::{Plan, Target};
use crate::result::Result;
use std::time::{Duration, Instant};

/// Bytes handed to the applier per batch: bounds the memory a callback-mode
/// update holds, and the interval between progress reports.
pub(crate) const BATCH_BYTES: u64 = 256 << 20;

/// A rank's checkpoint as a source of an update: read file by file, batch
/// by batch, straight into the applier's destinations.
pub struct SnapshotSource {
    checkpoint: Checkpoint,
}

impl SnapshotSource {
    /// Open the checkpoint ([`Checkpoint::open`]) before `deadline`.
    /// `most`: the most tensors its files may announce (the engine's bound).
    pub fn open_until(
        loc: &SnapshotLocation,
        logger: &Logger,
        (deadline, read_version): (Instant, bool),
        most: usize,
    ) -> Result<SnapshotSource> {
        let checkpoint = Checkpoint::open_within(loc, logger, (deadline, read_version), most)?;
        Ok(SnapshotSource { checkpoint })
    }
}

impl SnapshotSource {
    /// Name this snapshot's version `v` when its folder names none (one of
    /// several folders the request names the version of, beside folders
    /// that name theirs: it holds no version to disagree with).
    pub fn name_if_unnamed(&mut self, v: &str) {
        let version = &mut self.checkpoint.manifest.version;
        // A folder whose `version.yaml` names no version (broken, no
        // `step`) may be another step's: it stays unnamed, and refused.
        if version.is_none() && !self.checkpoint.has_version_file {
            *version = Some(v.to_string());
        }
    }
}

impl super::Source for SnapshotSource {
    fn manifest(&self) -> &Manifest {
        &self.checkpoint.manifest
    }

    fn no_version_reason(&self) -> String {
        self.checkpoint.no_version.clone()
    }

    fn describe(&self) -> String {
        format!(
            "snapshot in {} ({}, {} file(s))",
            self.checkpoint.layout.dir.display(),
            self.checkpoint.layout.kind.describe(),
            self.checkpoint.files.len()
        )
    }

    /// Decided when the source is opened, before the plan (the manager
    /// plans with `slice_sums` from this): every tensor of the snapshot has
    /// block sums.
    fn checks_slices(&self) -> bool {
        let blocks = &self.checkpoint.blocks;
        !blocks.is_empty() && blocks.iter().all(Option::is_some)
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
        let c = &self.checkpoint;
        for (fi, (path, planned)) in c.files.iter().enumerate() {
            let wanted: Vec<usize> = (0..plan.entries.len())
                .filter(|&e| {
                    let entry = &plan.entries[e];
                    entry.source == me
                        && c.locations[entry.tensor].0 == fi
                        && entry.target != Target::Skip
                })
                .collect();
            if wanted.is_empty() {
                continue;
            }
            applier.check_deadline()?;
            let shown = path.display().to_string();
            // Replaced or rewritten since its header was read (opened again
            // by its path), or rewritten while it was read (the open file):
            // its bytes may be another version's, which an unverified update
            // would not notice. A file renamed or removed once read was read
            // whole: no error.
            let file = c.open_data(path)?;
            let mut reader = reader::FileReader::new(&file, &shown, (path, *planned));
            for e in wanted {
                let tensor = plan.entries[e].tensor;
                let sums = self.block_sums(plan, (e, tensor), applier.verifies());
                reader.entry(applier, plan, (e, c.locations[tensor].1), sums)?;
            }
            reader.flush(applier)?;
            c.check_unchanged(path, &file, "while it was read")?;
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
            true => self.checkpoint.blocks[tensor].as_ref(),
            false => None,
        }
    }
}
