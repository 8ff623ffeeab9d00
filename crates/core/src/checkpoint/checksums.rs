//! Checksums of a snapshot, kept in a file next to it.
//!
//! safetensors has no place for checksums, so `wm manifest <dir>` writes
//! `wm_checksums.json` beside the weights: per file its size and, per tensor,
//! the xxh3-128 of the tensor's bytes and the xxh3-128 of each of its
//! blocks (`block_size` bytes, `block_sums.rs`), for ranks that read only a
//! slice. Updates attach these to the manifest and verify them when the
//! request asks. A file whose size differs from the recorded one was
//! rewritten after the checksums: that is an error, not a silent skip.
//! Files written before block sums existed have no `block_size` and no
//! `blocks`; they load, and verify whole tensors as before.

use super::block_sums::{self, BlockSums, BLOCK_SIZE};
use super::regular_file::read_bounded;
use super::safetensors_file;
use crate::manifest::checksum_hex;
use crate::result::{Error, Result};
use serde::de::DeserializeSeed;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

pub const CHECKSUM_FILE: &str = "wm_checksums.json";
/// Largest checksum file read: about 100 bytes per tensor and 64 per MiB
/// of block sums (116 MiB for a 2 TB checkpoint, a 1T-parameter bf16 model).
pub(crate) const MAX_CHECKSUM_FILE_BYTES: u64 = 256 << 20;
const FORMAT: &str = "weight_manager.checksums.v1";

#[derive(Serialize, Deserialize)]
struct FileJson {
    format: String,
    algorithm: String,
    /// Bytes per block of `blocks` (absent in files without block sums). A
    /// JSON number of any kind, so that a bad one is named, not a parse
    /// error without a field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_size: Option<serde_json::Number>,
    files: BTreeMap<String, FileEntryJson>,
}

#[derive(Serialize, Deserialize)]
struct FileEntryJson {
    size: u64,
    tensors: BTreeMap<String, String>,
    /// Per tensor, its block sums back to back (32 hex digits each).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    blocks: BTreeMap<String, String>,
}

mod reading;

/// The checksums of one file of the snapshot.
pub struct FileSums {
    pub size: u64,
    /// Per tensor (stored name), the xxh3-128 of its bytes.
    pub tensors: HashMap<String, u128>,
    /// Per tensor, its block sums as written (decoded when a tensor's size
    /// is known: [`Checksums::block_sums`]).
    blocks: HashMap<String, String>,
}

/// The entries a reader keeps: per file name, its tensors' stored names.
pub type Wanted = HashMap<String, HashSet<String>>;

/// Checksums loaded from a directory's checksum file.
pub struct Checksums {
    path: std::path::PathBuf,
    block_size: Option<u64>,
    files: HashMap<String, FileSums>,
}

impl Checksums {
    /// Load `dir/wm_checksums.json` before `deadline`; `Ok(None)` when there
    /// is none. The file must be a regular file of at most
    /// `MAX_CHECKSUM_FILE_BYTES`.
    pub fn load(dir: &Path, deadline: Instant) -> Result<Option<Checksums>> {
        Checksums::load_for(dir, None, deadline)
    }

    /// [`Checksums::load`], keeping the entries of the files and tensors
    /// named in `wanted` only (file name -> its tensors' stored names; None:
    /// everything): the others are skipped as they are read (not checked
    /// beyond their JSON), so entries of files or tensors the snapshot does
    /// not have cost their text, not the 7-14 times it they took kept (3.1
    /// million of them in a 250 MB file: 3.4 GiB).
    pub fn load_for(
        dir: &Path,
        wanted: Option<&Wanted>,
        deadline: Instant,
    ) -> Result<Option<Checksums>> {
        let path = dir.join(CHECKSUM_FILE);
        match read_bounded(&path, MAX_CHECKSUM_FILE_BYTES, deadline)? {
            Some(text) => Checksums::parse_for(&path, &text, wanted).map(Some),
            None => Ok(None),
        }
    }

    /// Parse the text of a checksum file found at `path` (named in errors).
    /// Public so that it can be exercised (fuzzed) without files.
    pub fn parse(path: &Path, text: &[u8]) -> Result<Checksums> {
        Checksums::parse_for(path, text, None)
    }

    /// [`Checksums::parse`], keeping what `wanted` names (None: all).
    fn parse_for(path: &Path, text: &[u8], wanted: Option<&Wanted>) -> Result<Checksums> {
        let bad = |why: String| Error::format(format!("{}: {why}", path.display()));
        let mut de = serde_json::Deserializer::from_slice(text);
        let json = reading::Reading { wanted }
            .deserialize(&mut de)
            .and_then(|json| de.end().map(|()| json))
            .map_err(|e| bad(e.to_string()))?;
        if json.format != FORMAT || json.algorithm != "xxh3-128" {
            return Err(bad(format!(
                "format '{}' / algorithm '{}' not understood",
                json.format.escape_debug(),
                json.algorithm.escape_debug()
            )));
        }
        let block_size = match json.block_size {
            Some(n) => Some(
                n.as_u64()
                    .ok_or_else(|| format!("block_size {n} is not a whole number of bytes"))
                    .and_then(block_sums::check_block_size)
                    .map_err(bad)?,
            ),
            None => None,
        };
        if block_size.is_none() {
            let with_blocks = json.files.iter().filter(|(_, f)| !f.blocks.is_empty());
            if let Some((name, _)) = with_blocks.min_by_key(|(name, _)| name.as_str()) {
                return Err(bad(format!(
                    "blocks of {} given without block_size",
                    name.escape_debug()
                )));
            }
        }
        let files = json.files;
        Ok(Checksums {
            path: path.to_path_buf(),
            block_size,
            files,
        })
    }

    /// Checksums of file `name` (a name in the directory), checked against its
    /// current size.
    pub fn for_file(&self, name: &str, size: u64) -> Result<Option<&FileSums>> {
        match self.files.get(name) {
            None => Ok(None),
            Some(f) if f.size != size => Err(Error::checksum(format!(
                "{} records {name} as {} bytes but it is now {size}: \
                 the file changed after its checksums were written (run `wm manifest` again)",
                self.path.display(),
                f.size
            ))),
            Some(f) => Ok(Some(f)),
        }
    }

    /// The size of the blocks the file has sums of (None: it has none, as
    /// files written before block sums).
    pub fn block_size(&self) -> Option<u64> {
        self.block_size
    }

    /// The block sums of tensor `tensor` (`nbytes` bytes) of file `file`,
    /// decoded and checked against its size; `Ok(None)` when the file has
    /// none for it.
    pub fn block_sums(&self, file: &str, tensor: &str, nbytes: u64) -> Result<Option<BlockSums>> {
        let (Some(block), Some(hex)) = (
            self.block_size,
            self.files.get(file).and_then(|f| f.blocks.get(tensor)),
        ) else {
            return Ok(None);
        };
        BlockSums::decode(hex, block, nbytes)
            .map(Some)
            .map_err(|why| {
                Error::format(format!(
                    "{}: blocks of '{}' in {}: {why}",
                    self.path.display(),
                    tensor.escape_debug(),
                    file.escape_debug()
                ))
            })
    }
}

/// What `write` did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Written {
    pub files: usize,
    pub tensors: usize,
    pub bytes: u64,
}

/// The xxh3-128 of each `(file index, offset, length)` range of `files`, on
/// `threads` threads; `progress(bytes hashed, bytes in all)` as each ends.
pub(crate) fn hash_file_ranges(
    files: &[&File],
    ranges: &[(usize, u64, u64)],
    threads: usize,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Vec<std::io::Result<u128>> {
    hash_ranges_and_blocks(files, ranges, None, threads, progress)
        .into_iter()
        .map(|r| r.map(|(whole, _)| whole))
        .collect()
}

/// [`hash_file_ranges`], with `block` also the sums of each range's blocks.
fn hash_ranges_and_blocks(
    files: &[&File],
    ranges: &[(usize, u64, u64)],
    block: Option<u64>,
    threads: usize,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Vec<std::io::Result<(u128, Vec<u128>)>> {
    let total: u64 = ranges.iter().map(|r| r.2).sum();
    let hashed = std::sync::atomic::AtomicU64::new(0);
    let next = AtomicUsize::new(0);
    let results = parking_lot::Mutex::new(
        (0..ranges.len())
            .map(|_| Ok((0u128, Vec::new())))
            .collect::<Vec<_>>(),
    );
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, ranges.len().max(1)) {
            s.spawn(|| {
                // Powers of two both: a multiple of the block size.
                let mut buf = vec![0u8; block.unwrap_or(0).max(8 << 20) as usize];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(fi, off, len)) = ranges.get(i) else {
                        break;
                    };
                    let r = block_sums::hash_range(files[fi], (off, len), block, &mut buf);
                    results.lock()[i] = r;
                    progress(hashed.fetch_add(len, Ordering::Relaxed) + len, total);
                }
            });
        }
    });
    results.into_inner()
}

/// `wm manifest` has no update deadline; reading headers still gets a bound.
fn far_deadline() -> Instant {
    Instant::now() + crate::defaults::UPDATE_TIMEOUT
}

/// Hash every tensor of every `*.safetensors` / `*.pdparams` file in `dir`
/// and write `dir/wm_checksums.json` (atomically, through a rename).
pub fn write(dir: &Path, threads: usize) -> Result<Written> {
    write_with_progress(dir, threads, &|_, _| {})
}

/// [`write()`], calling `progress(bytes hashed, bytes in all)` as tensors finish
/// (from the hashing threads).
pub fn write_with_progress(
    dir: &Path,
    threads: usize,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Written> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            super::layout::EXTENSIONS
                .iter()
                .any(|x| n.ends_with(&format!(".{x}")))
        })
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(Error::not_found(format!(
            "no .safetensors or .pdparams files in {}",
            dir.display()
        )));
    }
    let mut files = Vec::new();
    let mut jobs = Vec::new();
    for (fi, name) in names.iter().enumerate() {
        let (file, header) = safetensors_file::open(&dir.join(name), far_deadline())?;
        for (ti, t) in header.tensors.iter().enumerate() {
            jobs.push((fi, ti, t.offset, t.nbytes));
        }
        files.push((file, header));
    }
    let handles: Vec<&File> = files.iter().map(|(f, _)| f).collect();
    let ranges: Vec<(usize, u64, u64)> = jobs
        .iter()
        .map(|&(fi, _, off, len)| (fi, off, len))
        .collect();
    let results = hash_ranges_and_blocks(&handles, &ranges, Some(BLOCK_SIZE), threads, progress);
    let mut out = FileJson {
        format: FORMAT.into(),
        algorithm: "xxh3-128".into(),
        block_size: Some(BLOCK_SIZE.into()),
        files: BTreeMap::new(),
    };
    let mut written = Written::default();
    for (name, (_, header)) in names.iter().zip(&files) {
        out.files.insert(
            name.clone(),
            FileEntryJson {
                size: header.file_len,
                tensors: BTreeMap::new(),
                blocks: BTreeMap::new(),
            },
        );
        written.files += 1;
    }
    for (&(fi, ti, _, len), r) in jobs.iter().zip(results) {
        let name = &names[fi];
        let (c, sums) =
            r.map_err(|e| Error::io(format!("reading {}", dir.join(name).display()), e))?;
        let tensor = files[fi].1.tensors[ti].name.clone();
        let entry = out.files.get_mut(name).expect("file entry");
        let blocks = BlockSums {
            block: BLOCK_SIZE,
            sums,
        };
        entry.blocks.insert(tensor.clone(), blocks.encode());
        entry.tensors.insert(tensor, checksum_hex(c));
        written.tensors += 1;
        written.bytes += len;
    }
    let path = dir.join(CHECKSUM_FILE);
    let tmp = dir.join(format!(".{CHECKSUM_FILE}.tmp"));
    let text = serde_json::to_vec_pretty(&out).expect("serialisable");
    std::fs::write(&tmp, text).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &path)
        .map_err(|e| Error::io(format!("renaming to {}", path.display()), e))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loading for some files and tensors keeps only theirs: another
    /// file's entry, or another tensor's of a wanted file, is skipped
    /// unread (even one that is wrong, which reading it whole refuses), a
    /// wanted tensor's sum is decoded, and a bad sum read is refused naming
    /// the tensor and the file.
    #[test]
    fn only_the_wanted_files_entries_are_kept() {
        let good = format!("{:032x}", 0x1234u128);
        let text = |other: &str| {
            format!(
                r#"{{"format":"{FORMAT}","algorithm":"xxh3-128","extra":[1,2],"files":{{
                  "a.safetensors":{{"size":16,"tensors":{{"w":"{good}","ghost":"{other}"}}}},
                  "b.safetensors":{{"size":8,"tensors":{{"v":"{other}"}}}}}}}}"#
            )
        };
        let path = Path::new("/d/wm_checksums.json");
        let wanted: Wanted = [("a.safetensors".to_string(), ["w".to_string()].into())].into();
        let c = Checksums::parse_for(path, text("zz").as_bytes(), Some(&wanted)).unwrap();
        assert_eq!(c.files.len(), 1);
        let a = c.for_file("a.safetensors", 16).unwrap().unwrap();
        // Its tensor the header lacks ("ghost") is skipped unread too.
        assert_eq!(a.tensors.len(), 1);
        assert_eq!(a.tensors["w"], 0x1234);
        assert!(c.for_file("b.safetensors", 8).unwrap().is_none());
        let Err(e) = Checksums::parse(path, text("zz").as_bytes()) else {
            panic!("a bad sum of a file read whole is refused")
        };
        assert!(
            e.message.starts_with(
                "/d/wm_checksums.json: checksum of 'ghost' in a.safetensors is not 32 hex digits"
            ),
            "{e}"
        );
        let all = Checksums::parse(path, text(&good).as_bytes()).unwrap();
        assert_eq!(all.files.len(), 2);
        let Err(e) = Checksums::parse(path, br#"{"format":"x","files":{}}"#) else {
            panic!("a missing field is refused")
        };
        assert!(e.message.contains("missing field `algorithm`"), "{e}");
    }
}
