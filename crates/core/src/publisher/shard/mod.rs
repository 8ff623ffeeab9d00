//! One rank's shard of a version: its manifest (checksums filled in) and
//! where its bytes come from; `pack.rs` packs those bytes into a bucket
//! buffer.

mod pack;

pub(super) use pack::{fill, hash_entry, BLOCK_BATCH};

use super::config::PublisherConfig;
use super::offer::{Content, Offer, Published, ServedTensor};
use crate::checkpoint::checksums::hash_file_ranges;
use crate::checkpoint::layout::SnapshotLocation;
use crate::checkpoint::Checkpoint;
use crate::manifest::{Manifest, TensorMeta};
use crate::memory::copy::default_threads;
use crate::memory::hashing::hash_all;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where one shard's tensor bytes come from.
enum ShardBytes {
    Memory(Vec<SendPtr>),
    Files {
        checkpoint: Box<Checkpoint>,
        open: HashMap<PathBuf, File>,
    },
}

pub(super) struct Shard {
    /// Per tensor of the manifest, the engine rank it is given to alone
    /// (None: every rank's): what tells two tensors of one name apart.
    pub(super) for_rank: Vec<Option<u32>>,
    pub(super) manifest: Manifest,
    bytes: ShardBytes,
    /// The published version's buffer, which every tensor of the shard
    /// lies in (None: live tensors or files, packed per session).
    pub(super) published: Option<Published>,
    /// Bytes hashed to build the manifest.
    pub(super) hashed: u64,
    /// Bytes made for this session (FP8 images of quantized requests,
    /// `quantize.rs`), served as tensors numbered after the manifest's.
    images: Vec<Arc<HostRegion>>,
}

impl Shard {
    /// Serve `image` as a tensor of this session's: its number (after
    /// the manifest's and earlier images). A shard in memory lists it with
    /// its tensors; a shard of files reads it from memory.
    pub(super) fn add_image(&mut self, image: Arc<HostRegion>) -> u32 {
        let t = self.manifest.tensors.len() + self.images.len();
        if let ShardBytes::Memory(ptrs) = &mut self.bytes {
            ptrs.push(SendPtr(image.ptr()));
        }
        self.images.push(image);
        t as u32
    }

    /// The session's images, once it is done with them.
    pub(super) fn take_images(&mut self) -> Vec<Arc<HostRegion>> {
        std::mem::take(&mut self.images)
    }

    /// Whether the session serves images of its own (they are packed:
    /// no window into a published buffer holds them).
    pub(super) fn has_images(&self) -> bool {
        !self.images.is_empty()
    }

    /// Where each tensor's bytes already are in this process's memory
    /// (published copies, or tensors the trainer added), so they can be sent
    /// without packing; None for a shard read from files.
    pub(super) fn in_memory(&self) -> Option<&[SendPtr]> {
        match &self.bytes {
            ShardBytes::Memory(ptrs) => Some(ptrs),
            ShardBytes::Files { .. } => None,
        }
    }

    /// The tensors' addresses when every one is in host memory (not a
    /// snapshot's files, not a GPU version).
    pub(super) fn in_host_memory(&self) -> Option<&[SendPtr]> {
        match self.published {
            Some(Published::Device(_)) => None,
            _ => self.in_memory(),
        }
    }
}

/// The shard of `offer` for engine rank `rank` on GPU `gpu_id`.
pub(super) fn shard_for(
    offer: &Offer,
    rank: u32,
    gpu_id: &str,
    cfg: &PublisherConfig,
) -> Result<Shard> {
    match &offer.content {
        Content::Dir(dir) => dir_shard(offer, dir, rank, gpu_id, cfg),
        Content::Tensors(all) => tensors_shard(offer, all, rank, cfg),
    }
}

/// A served directory's shard: the files the snapshot layout rules pick
/// for the rank, checksums missing from `wm_checksums.json` hashed now.
fn dir_shard(
    offer: &Offer,
    dir: &Path,
    rank: u32,
    gpu_id: &str,
    cfg: &PublisherConfig,
) -> Result<Shard> {
    let version = offer.version.clone();
    let loc = SnapshotLocation {
        model_dir: dir.to_path_buf(),
        fallback_dir: None,
        rank,
        gpu_id: gpu_id.to_string(),
    };
    let deadline = std::time::Instant::now() + crate::checkpoint::OPEN_BOUND;
    let checkpoint = Checkpoint::open(&loc, &cfg.logger, deadline, true)?;
    let mut manifest = checkpoint.manifest.clone();
    let hashed = if cfg.checksums {
        fill_missing_checksums(&checkpoint, &mut manifest)?
    } else {
        0
    };
    if version.is_some() {
        manifest.version = version;
    }
    Ok(Shard {
        // A rank's files are its own.
        for_rank: vec![Some(rank); manifest.tensors.len()],
        manifest,
        bytes: ShardBytes::Files {
            checkpoint: Box::new(checkpoint),
            open: HashMap::new(),
        },
        published: None,
        hashed,
        images: Vec::new(),
    })
}

/// Tensors in memory: the rank's own and those for every rank, checksums
/// hashed once per serve call (published copies have theirs already).
fn tensors_shard(
    offer: &Offer,
    all: &[ServedTensor],
    rank: u32,
    cfg: &PublisherConfig,
) -> Result<Shard> {
    let version = offer.version.clone();
    // This rank's tensors, with their index in the content.
    let mine: Vec<(usize, &ServedTensor)> = all
        .iter()
        .enumerate()
        .filter(|(_, t)| t.rank.is_none_or(|r| r == rank))
        .collect();
    if let (Some((_, t)), None) = (
        mine.iter().find(|(_, t)| t.device.is_some()),
        &offer.published,
    ) {
        return Err(Error::invalid_argument(format!(
            "tensor '{}' is GPU memory: GPU tensors are served once published \
             (publish copies them into a buffer engines read)",
            t.name
        )));
    }
    // Hash what has no checksum yet: published copies have theirs,
    // live tensors another session of this serve call may have
    // hashed. The lock is held while hashing, so sessions wanting
    // the same tensors wait for the sums instead of hashing again.
    let mut known = offer.live_sums.lock();
    let todo: Vec<(usize, &ServedTensor)> = mine
        .iter()
        .copied()
        .filter(|(i, t)| cfg.checksums && t.checksum.is_none() && !known.contains_key(i))
        .collect();
    let regions: Vec<(SendPtr, usize)> = todo.iter().map(|(_, t)| (t.data, t.len)).collect();
    // SAFETY: add's contract keeps the memory valid and unchanged.
    let fresh = unsafe { hash_all(&regions, default_threads()) };
    known.extend(todo.iter().map(|(i, _)| *i).zip(fresh));
    let tensors = mine
        .iter()
        .map(|(i, t)| TensorMeta {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            nbytes: t.len as u64,
            checksum: t.checksum.or_else(|| known.get(i).copied()),
            placement: t.placement.clone(),
        })
        .collect();
    drop(known);
    Ok(Shard {
        for_rank: mine.iter().map(|(_, t)| t.rank).collect(),
        manifest: Manifest { tensors, version },
        bytes: ShardBytes::Memory(mine.iter().map(|(_, t)| t.data).collect()),
        published: offer.published.clone(),
        hashed: regions.iter().map(|(_, n)| *n as u64).sum(),
        images: Vec::new(),
    })
}

/// Hash the tensors a snapshot has no `wm_checksums.json` entry for, so the
/// engine can verify them (the network paths verify by default). Returns
/// the bytes hashed.
fn fill_missing_checksums(checkpoint: &Checkpoint, manifest: &mut Manifest) -> Result<u64> {
    let todo: Vec<usize> = (0..manifest.tensors.len())
        .filter(|&i| manifest.tensors[i].checksum.is_none())
        .collect();
    if todo.is_empty() {
        return Ok(0);
    }
    let paths: Vec<&std::path::Path> = checkpoint.files().collect();
    let files = paths
        .iter()
        .map(|p| checkpoint.open_data(p))
        .collect::<Result<Vec<File>>>()?;
    let ranges: Vec<(usize, u64, u64)> = todo
        .iter()
        .map(|&t| {
            let (fi, offset) = checkpoint.tensor_file(t);
            (fi, offset, manifest.tensors[t].nbytes)
        })
        .collect();
    let handles: Vec<&File> = files.iter().collect();
    let sums = hash_file_ranges(&handles, &ranges, default_threads(), &|_, _| {});
    for ((&t, r), &(fi, _, _)) in todo.iter().zip(sums).zip(&ranges) {
        let sum = r.map_err(|e| Error::io(format!("hashing {}", paths[fi].display()), e))?;
        manifest.tensors[t].checksum = Some(sum);
    }
    // Sums of a file rewritten while it was hashed would vouch for a mix.
    for (path, file) in paths.iter().zip(&files) {
        checkpoint.check_unchanged(path, file, "while it was hashed")?;
    }
    Ok(ranges.iter().map(|&(_, _, n)| n).sum())
}
