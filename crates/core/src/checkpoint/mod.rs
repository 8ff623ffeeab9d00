//! Checkpoints on disk, for both wings: the engine's snapshot source reads
//! them, the trainer's publisher serves them, `wm` inspects and writes them.
//! Nothing here knows of params, plans or peers.
//!
//! - [`layout`]: which files hold a rank's snapshot (README "Snapshot
//!   layouts").
//! - [`safetensors_file`]: strict reading of a safetensors header;
//!   [`shard_meta`]: a shard's placement in its global tensor, kept in the
//!   header's metadata.
//! - [`checksums`]: the checksums file next to a snapshot, and
//!   [`block_sums`], sums of fixed-size blocks for checking parts of a
//!   tensor.
//! - [`version`]: the rule for a version's name, and `version.yaml`.
//! - [`regular_file`]: opening and reading files without trusting what sits
//!   at a path (a FIFO or device is an error, every read bounded).
//! - [`Checkpoint`]: one rank's checkpoint opened: its files, every header
//!   read and checked, a manifest of what it holds.

pub mod block_sums;
pub mod checksums;
mod json_shape;
pub mod layout;
pub mod regular_file;
pub mod safetensors_file;
pub mod shard_meta;
pub mod version;

use crate::logging::Logger;
use crate::manifest::{Manifest, TensorMeta};
use crate::result::{Error, Result};
use block_sums::BlockSums;
use layout::{Layout, SnapshotLocation};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The bound on opening a checkpoint for a caller that has no deadline of
/// its own (the publisher, `wm`): every read still ends.
pub const OPEN_BOUND: Duration = crate::defaults::UPDATE_TIMEOUT;

/// One rank's checkpoint, opened: every header read and checked (never any
/// tensor data), the checksum file and `version.yaml` read.
pub struct Checkpoint {
    pub layout: Layout,
    /// Each file and its stamp (length, inode, modification time) when its
    /// header was read.
    pub files: Vec<(PathBuf, regular_file::FileStamp)>,
    /// Each file's index in `files`, by path: a check per file read looks
    /// its stamp up here (a scan of `files` made 8,000 files quadratic).
    file_index: HashMap<PathBuf, usize>,
    pub manifest: Manifest,
    /// Per manifest tensor: (file index, absolute offset in that file).
    pub locations: Vec<(usize, u64)>,
    /// Per manifest tensor: its block sums, when the checksum file has them.
    pub blocks: Vec<Option<BlockSums>>,
    /// Why the manifest names no version ("" when it names one).
    pub no_version: String,
    /// A `version.yaml` was there to read (in the model directory, or in
    /// the fallback directory where the model directory has none), whether
    /// or not it named a version; false when none was read.
    pub has_version_file: bool,
}

impl Checkpoint {
    /// [`Checkpoint::open`] within [`OPEN_BOUND`], reading `version.yaml`:
    /// for callers without a deadline of their own.
    pub fn read(loc: &SnapshotLocation, logger: &Logger) -> Result<Checkpoint> {
        Checkpoint::open(loc, logger, Instant::now() + OPEN_BOUND, true)
    }

    /// Resolve the layout and read every header (and the checksum file, and
    /// `version.yaml` when `read_version`: an update that names its version
    /// never reads it) before `deadline`.
    pub fn open(
        loc: &SnapshotLocation,
        logger: &Logger,
        deadline: Instant,
        read_version: bool,
    ) -> Result<Checkpoint> {
        Checkpoint::open_within(loc, logger, (deadline, read_version), usize::MAX)
    }

    /// [`Checkpoint::open`], refusing (`WM_ERR_OUT_OF_MEMORY`) as soon as
    /// the headers read so far announce more than `most` tensors: each
    /// header is bounded, their number is not, and a parsed header holds
    /// several times its size, so the engine's bound is applied file by
    /// file rather than once every header is held.
    pub fn open_within(
        loc: &SnapshotLocation,
        logger: &Logger,
        (deadline, read_version): (Instant, bool),
        most: usize,
    ) -> Result<Checkpoint> {
        let layout = layout::resolve(loc, logger, deadline)?;
        logger.debug(&format!(
            "rank {}: snapshot layout '{}' with {} file(s)",
            loc.rank,
            layout.kind.describe(),
            layout.files.len()
        ));
        let headers = read_headers(&layout, most, deadline)?;
        let checksums = own_checksums(&layout, &headers, deadline)?;
        let mut c = Checkpoint {
            files: Vec::new(),
            file_index: HashMap::new(),
            manifest: Manifest::default(),
            locations: Vec::new(),
            blocks: Vec::new(),
            no_version: String::new(),
            has_version_file: false,
            layout,
        };
        let mut stored = HashSet::new();
        for (fi, (header, stamp)) in headers.into_iter().enumerate() {
            c.add_file(fi, (header, stamp), checksums.as_ref(), &mut stored)?;
        }
        c.check_each_once()?;
        if let Some(index) = &c.layout.index {
            check_index_covered(index, &stored)?;
        }
        if !read_version {
            c.no_version = "the caller named a version".to_string();
        } else {
            // A step that is no version name (too long, a NUL) is the
            // file's fault, not the caller's: "no version", naming it.
            let read = |dir: &Path| {
                let v = version::read_version_yaml(dir, deadline)?;
                version::check_version(&v).map(|()| v).map_err(|e| {
                    let file = dir.join(version::VERSION_FILE);
                    format!(
                        "{}: its step is not a version ({})",
                        file.display(),
                        e.message
                    )
                })
            };
            // The fallback directory's, only where the model directory has
            // none: a broken one there is the error.
            let absent =
                |dir: &Path| std::fs::symlink_metadata(dir.join(version::VERSION_FILE)).is_err();
            c.has_version_file = match &c.layout.model_dir {
                Some(model_dir) if absent(model_dir) => !absent(&c.layout.dir),
                Some(_) => true,
                None => !absent(&c.layout.dir),
            };
            let found = match &c.layout.model_dir {
                Some(model_dir) if absent(model_dir) => read(model_dir).or_else(|first| {
                    read(&c.layout.dir).map_err(|then| format!("{first}, and {then}"))
                }),
                Some(model_dir) => read(model_dir),
                None => read(&c.layout.dir),
            };
            match found {
                Ok(v) => c.manifest.version = Some(v),
                Err(why) => c.no_version = why,
            }
        }
        Ok(c)
    }

    /// File `fi`'s header (read with its stamp) into the manifest
    /// (`stored`: the stored names found, for the HuggingFace index check).
    fn add_file(
        &mut self,
        fi: usize,
        (header, stamp): (safetensors_file::SafetensorsHeader, regular_file::FileStamp),
        checksums: Option<&checksums::Checksums>,
        stored: &mut HashSet<String>,
    ) -> Result<()> {
        let path = self.layout.files[fi].clone();
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let sums = match checksums {
            Some(c) => c.for_file(file_name, header.file_len)?,
            None => None,
        };
        // Entries move into the manifest: a header is held once. Index and
        // checksums know a tensor by its stored name; the manifest by its
        // global one.
        for t in header.tensors {
            if let Some(index) = &self.layout.index {
                check_in_index(index, &path, file_name, &t.name)?;
                stored.insert(t.name.clone());
            }
            let checksum = sums.and_then(|s| s.tensors.get(&t.name).copied());
            self.blocks.push(match checksums {
                Some(c) => c.block_sums(file_name, &t.name, t.nbytes)?,
                None => None,
            });
            self.locations.push((fi, t.offset));
            let (name, placement) = match t.shard {
                Some(s) => (s.tensor, Some(s.placement)),
                None => (t.name, None),
            };
            self.manifest.tensors.push(TensorMeta {
                name,
                dtype: t.dtype,
                shape: t.shape,
                nbytes: t.nbytes,
                checksum,
                placement,
            });
        }
        self.file_index.insert(path.clone(), self.files.len());
        self.files.push((path, stamp));
        Ok(())
    }

    /// No tensor (or shard: the same box of one global tensor) is in two
    /// files of the checkpoint: refused naming both files. (The plan would
    /// refuse it too, without naming the files.) Linear in the tensors.
    fn check_each_once(&self) -> Result<()> {
        let mut seen = HashMap::with_capacity(self.manifest.tensors.len());
        for (t, meta) in self.manifest.tensors.iter().enumerate() {
            let key = (
                &meta.name,
                meta.placement.as_ref().map(|p| (&p.offset, &meta.shape)),
            );
            if let Some(first) = seen.insert(key, t) {
                let (a, b) = (self.locations[first].0, self.locations[t].0);
                if a != b {
                    let which = match &meta.placement {
                        Some(p) => format!(" (its shard at {:?})", p.offset),
                        None => String::new(),
                    };
                    return Err(Error::format(format!(
                        "tensor '{}'{which} is in both {} and {}: duplicate names are refused",
                        meta.name,
                        self.files[a].0.display(),
                        self.files[b].0.display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Index in [`Checkpoint::files`] and absolute byte offset of manifest
    /// tensor `t`.
    pub fn tensor_file(&self, t: usize) -> (usize, u64) {
        self.locations[t]
    }

    /// File and absolute byte offset of manifest tensor `t`.
    pub fn tensor_location(&self, t: usize) -> (&Path, u64) {
        let (fi, offset) = self.locations[t];
        (&self.files[fi].0, offset)
    }

    /// Every file of the checkpoint, in reading order.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// Open file `path` of this checkpoint to read its data: a regular
    /// file, and the one its header was read from (not replaced or
    /// rewritten since: its bytes would be another version's).
    pub fn open_data(&self, path: &Path) -> Result<std::fs::File> {
        let file = regular_file::open_regular(path)?;
        self.check_unchanged(path, &file, "after the plan was made")?;
        Ok(file)
    }

    /// Err naming `path` when the open `file` changed since its header was
    /// read (`when` says when it was noticed): checked after reading its
    /// data, a rewrite during the read.
    pub fn check_unchanged(&self, path: &Path, file: &std::fs::File, when: &str) -> Result<()> {
        match self.file_index.get(path).map(|&i| &self.files[i]) {
            Some((_, planned)) => {
                planned.check(&regular_file::FileStamp::of(file, path)?, path, when)
            }
            None => Ok(()),
        }
    }
}

/// Every file's header and stamp, refused (`WM_ERR_OUT_OF_MEMORY`) as soon
/// as the headers read so far announce more than `most` tensors.
fn read_headers(
    layout: &Layout,
    most: usize,
    deadline: Instant,
) -> Result<Vec<(safetensors_file::SafetensorsHeader, regular_file::FileStamp)>> {
    let (mut headers, mut announced) = (Vec::new(), 0usize);
    for (fi, path) in layout.files.iter().enumerate() {
        let (file, header) = safetensors_file::open(path, deadline)?;
        let stamp = regular_file::FileStamp::of(&file, path)?;
        // Tensors were checked to lie inside the length the header was read
        // at; the stamp, which later reads are checked against (and a
        // publisher maps), must be of that length.
        if stamp.len != header.file_len {
            return Err(Error::format(format!(
                "{} changed while its header was read ({} bytes, then {})",
                path.display(),
                header.file_len,
                stamp.len
            )));
        }
        announced += header.tensors.len();
        if announced > most {
            return Err(Error::out_of_memory(format!(
                "snapshot in {}: its files announce {announced} tensors in the first {} of {} \
                 file(s) (the last {}), more than the {most} this engine can still take \
                 from its sources (in all, one per 4 KiB of the bytes it takes, plus 65,536)",
                layout.dir.display(),
                fi + 1,
                layout.files.len(),
                path.display()
            )));
        }
        headers.push((header, stamp));
    }
    Ok(headers)
}

/// The checksum file's entries of the tensors `headers` hold (of
/// `layout`'s files) only: it may name every rank's files, or files and
/// tensors that are not there, and is read after the headers so that those
/// cost their text only.
fn own_checksums(
    layout: &Layout,
    headers: &[(safetensors_file::SafetensorsHeader, regular_file::FileStamp)],
    deadline: Instant,
) -> Result<Option<checksums::Checksums>> {
    let mut wanted = checksums::Wanted::new();
    for (path, (header, _)) in layout.files.iter().zip(headers) {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let tensors = wanted.entry(name.to_string()).or_default();
        tensors.extend(header.tensors.iter().map(|t| t.name.clone()));
    }
    checksums::Checksums::load_for(&layout.dir, Some(&wanted), deadline)
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
