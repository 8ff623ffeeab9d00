//! Which files hold a rank's snapshot (README "Snapshot layouts").
//!
//! Looked up in this order, first match wins:
//! 1. part files `model_state.tpR.G.partN.<ext>` in the model dir, in
//!    ascending numeric N (names with no parsable N are warned about, skipped);
//! 2. `model_state.tpR.G.<ext>`;
//! 3. the legacy name `model_state.tp0G.<ext>`;
//! 4. a HuggingFace shard directory: `model.safetensors.index.json` naming
//!    the shards, or else every `*.safetensors` in the dir (files named
//!    `model_state.*` excluded: they belong to other ranks);
//! 5. `model_state.tpR.G.<ext>` in the fallback directory.
//!
//! `<ext>` is `safetensors` or `pdparams` (whose content must be
//! safetensors). The fallback directory comes last, after HuggingFace
//! shards, because a model directory that holds a complete model should win
//! over a shared, possibly stale, fallback location. The model dir may also be a single file.

use super::regular_file::read_bounded;
use crate::logging::Logger;
use crate::result::{Error, Result};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const EXTENSIONS: [&str; 2] = ["safetensors", "pdparams"];
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// Largest HuggingFace index read.
pub(crate) const MAX_INDEX_BYTES: u64 = 32 << 20;
pub use crate::defaults::FALLBACK_DIR as DEFAULT_FALLBACK_DIR;

/// Where to look for one rank's snapshot.
#[derive(Clone, Debug)]
pub struct SnapshotLocation {
    pub model_dir: PathBuf,
    pub fallback_dir: Option<PathBuf>,
    pub rank: u32,
    /// Physical GPU id `G` (see [`gpu_id`]).
    pub gpu_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    File,
    RankParts,
    RankFile,
    Legacy,
    HfIndex,
    HfShards,
    Fallback,
}

impl LayoutKind {
    pub fn describe(self) -> &'static str {
        match self {
            LayoutKind::File => "single file",
            LayoutKind::RankParts => "per-rank part files",
            LayoutKind::RankFile => "per-rank file",
            LayoutKind::Legacy => "legacy per-rank file",
            LayoutKind::HfIndex => "HuggingFace shards (index)",
            LayoutKind::HfShards => "HuggingFace shards",
            LayoutKind::Fallback => "per-rank file in the fallback directory",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Layout {
    pub kind: LayoutKind,
    pub files: Vec<PathBuf>,
    /// HuggingFace index: tensor name -> shard file name.
    pub index: Option<HashMap<String, String>>,
    /// Directory holding the checksum file and `version.yaml`.
    pub dir: PathBuf,
    /// Files found in the fallback directory: the model directory, whose
    /// `version.yaml` is read first (the version is named in the model
    /// directory; the fallback's own is read when it has none).
    pub model_dir: Option<PathBuf>,
}

/// `G` for a rank: the entry of `CUDA_VISIBLE_DEVICES` at the rank's device
/// index (index 0 for host-only engines), or "0" when the variable is unset
/// or empty (as FastDeploy names its files).
pub fn gpu_id(cuda_visible_devices: Option<&str>, device_index: i32) -> Result<String> {
    let Some(list) = cuda_visible_devices.filter(|s| !s.trim().is_empty()) else {
        return Ok("0".to_string());
    };
    let idx = device_index.max(0) as usize;
    let entries: Vec<&str> = list.split(',').map(str::trim).collect();
    match entries.get(idx) {
        Some(e) if !e.is_empty() && !e.contains('/') => Ok(e.to_string()),
        _ => Err(Error::invalid_argument(format!(
            "CUDA_VISIBLE_DEVICES='{list}' has no usable entry at device index {idx}"
        ))),
    }
}

/// `path` when something is there: a FIFO, device or directory named
/// like a snapshot file is taken too, and so is a symbolic link that does
/// not resolve (dangling, or a loop), so that opening it fails naming it
/// (`regular_file::open_regular`) instead of the file going unseen.
fn existing(path: PathBuf) -> Option<PathBuf> {
    there(&path).then_some(path)
}

/// Something is at `path` (a link that does not resolve included).
fn there(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

fn per_rank(dir: &Path, stem: &str) -> Option<PathBuf> {
    EXTENSIONS
        .iter()
        .find_map(|ext| existing(dir.join(format!("{stem}.{ext}"))))
}

fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let rd =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut names = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The part number N of a part file's name, or why it has none. Digits only:
/// `part+1` or `part 1` are not part 1.
fn part_number(n: &str) -> std::result::Result<u64, &'static str> {
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return Err("is not a number");
    }
    n.parse::<u64>().map_err(|_| "does not fit in 64 bits")
}

fn part_files(dir: &Path, names: &[String], stem: &str, logger: &Logger) -> Vec<PathBuf> {
    let prefix = format!("{stem}.part");
    let mut parts = Vec::new();
    for name in names {
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        let Some((n, ext)) = rest.rsplit_once('.') else {
            continue;
        };
        if !EXTENSIONS.contains(&ext) {
            continue;
        }
        match part_number(n) {
            Ok(n) => parts.push((n, ext == "pdparams", dir.join(name))),
            Err(why) => logger.warn(&format!(
                "skipping {}: part number '{}' {why}",
                dir.join(name).display(),
                n.escape_debug()
            )),
        }
    }
    parts.sort();
    parts.into_iter().map(|p| p.2).collect()
}

#[derive(serde::Deserialize)]
struct IndexJson {
    weight_map: HashMap<String, String>,
}

fn hf_layout(dir: &Path, names: &[String], deadline: Instant) -> Result<Option<Layout>> {
    let index_path = dir.join(HF_INDEX);
    if let Some(text) = read_bounded(&index_path, MAX_INDEX_BYTES, deadline)? {
        let bad = |why: String| Error::format(format!("{}: {why}", index_path.display()));
        // Typed, not a generic JSON tree: memory stays a small multiple of
        // the (bounded) file.
        let json: IndexJson = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("not a weight_map index: {e}")))?;
        let index = json.weight_map;
        let mut files = BTreeSet::new();
        for (tensor, file) in &index {
            // A NUL would end the name at the system call (and cut error
            // texts read through C): refused like a path.
            if file.is_empty() || file.contains(['/', '\0']) || file == "." || file == ".." {
                return Err(bad(format!(
                    "weight_map['{}'] ('{}') is not a file name in the directory",
                    tensor.escape_debug(),
                    file.escape_debug()
                )));
            }
            files.insert(file.as_str());
        }
        if index.is_empty() {
            return Err(bad("weight_map is empty".into()));
        }
        let mut paths = Vec::new();
        for f in files {
            let p = dir.join(f);
            if !p.exists() {
                return Err(Error::not_found(format!(
                    "{} names shard {}, which does not exist",
                    index_path.display(),
                    f.escape_debug()
                )));
            }
            paths.push(p);
        }
        return Ok(Some(Layout {
            kind: LayoutKind::HfIndex,
            files: paths,
            index: Some(index),
            dir: dir.to_path_buf(),
            model_dir: None,
        }));
    }
    let shards: Vec<PathBuf> = names
        .iter()
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with("model_state."))
        .map(|n| dir.join(n))
        .filter(|p| there(p))
        .collect();
    check_numbered_shards(dir, names)?;
    Ok((!shards.is_empty()).then(|| Layout {
        kind: LayoutKind::HfShards,
        files: shards,
        index: None,
        dir: dir.to_path_buf(),
        model_dir: None,
    }))
}

/// HuggingFace shards named `P-<i>-of-<N>.safetensors` (no index to say
/// which files hold the model): every number from 1 to N (0 to N - 1 when
/// one is numbered 0) must be there for each (P, N), else the model would
/// load without a shard's tensors (a partial download, say). Work is in
/// the files listed, whatever N a name claims.
fn check_numbered_shards(dir: &Path, names: &[String]) -> Result<()> {
    // By (P, N as written), the numbers there.
    let mut sets: HashMap<(&str, &str), Vec<u64>> = HashMap::new();
    for name in names {
        let Some((prefix, i, n)) = numbered_shard(name) else {
            continue;
        };
        sets.entry((prefix, n)).or_default().push(i);
    }
    for ((prefix, n_text), mut have) in sets {
        let n = part_number(n_text).unwrap_or(0);
        have.sort_unstable();
        have.dedup();
        let first = have.first().map_or(1, |&i| i.min(1));
        // N shards from `first` (0 or 1): none when N is 0.
        let Some(last) = n.checked_sub(1 - first).filter(|_| n > 0) else {
            continue;
        };
        // The first number from `first` up that is not there.
        let mut first_missing = first;
        for &i in &have {
            if i == first_missing {
                first_missing += 1;
            } else if i > first_missing {
                break;
            }
        }
        if first_missing <= last {
            let count = have
                .iter()
                .filter(|&&i| (first..=last).contains(&i))
                .count();
            return Err(Error::not_found(format!(
                "{}: shard {first_missing} of {prefix}-*-of-{n_text}.safetensors is missing \
                 ({count} of {n} there)",
                dir.display()
            )));
        }
    }
    Ok(())
}

/// `(P, i, N)` of a file named `P-<i>-of-<N>.safetensors` (digits only;
/// N as written).
fn numbered_shard(name: &str) -> Option<(&str, u64, &str)> {
    let stem = name.strip_suffix(".safetensors")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, i) = rest.rsplit_once('-')?;
    part_number(n).ok()?;
    Some((prefix, part_number(i).ok()?, n))
}

/// Find the files of `loc`'s snapshot, before `deadline`. The not-found
/// error names every place checked.
pub fn resolve(loc: &SnapshotLocation, logger: &Logger, deadline: Instant) -> Result<Layout> {
    let dir = &loc.model_dir;
    // Not a directory but there (a file, or a FIFO or device that opening
    // refuses, naming it): the snapshot is that one file.
    if dir.exists() && !dir.is_dir() {
        return Ok(Layout {
            kind: LayoutKind::File,
            files: vec![dir.clone()],
            index: None,
            dir: dir
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
            model_dir: None,
        });
    }
    if !dir.is_dir() {
        return Err(Error::not_found(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let (r, g) = (loc.rank, &loc.gpu_id);
    let stem = format!("model_state.tp{r}.{g}");
    let names = list_dir(dir)?;
    let one = |kind, path: PathBuf, at: &Path| Layout {
        kind,
        files: vec![path],
        index: None,
        dir: at.to_path_buf(),
        model_dir: (kind == LayoutKind::Fallback).then(|| dir.to_path_buf()),
    };
    let parts = part_files(dir, &names, &stem, logger);
    if !parts.is_empty() {
        return Ok(Layout {
            kind: LayoutKind::RankParts,
            files: parts,
            index: None,
            dir: dir.clone(),
            model_dir: None,
        });
    }
    if let Some(p) = per_rank(dir, &stem) {
        return Ok(one(LayoutKind::RankFile, p, dir));
    }
    let legacy = format!("model_state.tp0{g}");
    if let Some(p) = per_rank(dir, &legacy) {
        return Ok(one(LayoutKind::Legacy, p, dir));
    }
    if let Some(layout) = hf_layout(dir, &names, deadline)? {
        return Ok(layout);
    }
    let mut checked = vec![
        format!("{}/{stem}.partN.{{safetensors,pdparams}}", dir.display()),
        format!("{}/{stem}.{{safetensors,pdparams}}", dir.display()),
        format!("{}/{legacy}.{{safetensors,pdparams}}", dir.display()),
        format!(
            "{}/{HF_INDEX} or *.safetensors{}",
            dir.display(),
            // Other ranks' files are there: say why none was taken.
            match names
                .iter()
                .filter(|n| n.starts_with("model_state."))
                .count()
            {
                0 => String::new(),
                n => format!(" (not the {n} model_state.* file(s) there: other ranks' files)"),
            }
        ),
    ];
    if let Some(fb) = &loc.fallback_dir {
        if let Some(p) = per_rank(fb, &stem) {
            return Ok(one(LayoutKind::Fallback, p, fb));
        }
        checked.push(format!("{}/{stem}.{{safetensors,pdparams}}", fb.display()));
    }
    Err(Error::not_found(format!(
        "no snapshot for rank {r} (GPU {g}); checked: {}",
        checked.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    fn touch(dir: &Path, name: &str) {
        std::fs::write(dir.join(name), b"x").unwrap();
    }

    fn loc(dir: &Path, fb: Option<&Path>) -> SnapshotLocation {
        SnapshotLocation {
            model_dir: dir.to_path_buf(),
            fallback_dir: fb.map(Path::to_path_buf),
            rank: 1,
            gpu_id: "3".into(),
        }
    }

    /// HuggingFace shards without an index: a link among them that does
    /// not resolve is taken (opening it fails naming it; it went unseen,
    /// and the model loaded without its tensors), and a numbered set with
    /// a number missing is refused naming it, however large its N.
    #[test]
    fn hf_shards_are_all_there_or_named() {
        let logger = Logger::default();
        let d = tempfile::tempdir().unwrap();
        let at = |l: &Layout| names(l);
        touch(d.path(), "model-00002-of-00002.safetensors");
        let e = resolve(&loc(d.path(), None), &logger, later()).unwrap_err();
        assert!(
            e.message
                .contains("shard 1 of model-*-of-00002.safetensors is missing (1 of 2 there)"),
            "{e}"
        );
        let looped = d.path().join("model-00001-of-00002.safetensors");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        let l = resolve(&loc(d.path(), None), &logger, later()).unwrap();
        assert_eq!(
            at(&l),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        // Numbered from 0: 0 to N - 1.
        touch(d.path(), "zero-00000-of-00002.safetensors");
        touch(d.path(), "zero-00001-of-00002.safetensors");
        assert!(resolve(&loc(d.path(), None), &logger, later()).is_ok());
        std::fs::remove_file(d.path().join("zero-00001-of-00002.safetensors")).unwrap();
        let e = resolve(&loc(d.path(), None), &logger, later()).unwrap_err();
        assert!(
            e.message
                .contains("shard 1 of zero-*-of-00002.safetensors is missing (1 of 2"),
            "{e}"
        );
        std::fs::remove_file(d.path().join("zero-00000-of-00002.safetensors")).unwrap();
        touch(d.path(), "big-7-of-18446744073709551615.safetensors");
        let e = resolve(&loc(d.path(), None), &logger, later()).unwrap_err();
        assert!(
            e.message
                .contains("shard 1 of big-*-of-18446744073709551615"),
            "{e}"
        );
    }

    fn names(l: &Layout) -> Vec<String> {
        l.files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn gpu_id_follows_cuda_visible_devices() {
        assert_eq!(gpu_id(None, 2).unwrap(), "0");
        assert_eq!(gpu_id(Some(""), 2).unwrap(), "0");
        assert_eq!(gpu_id(Some("4,5,6"), 1).unwrap(), "5");
        assert_eq!(gpu_id(Some("4,5,6"), -1).unwrap(), "4");
        assert!(gpu_id(Some("4"), 3)
            .unwrap_err()
            .message
            .contains("device index 3"));
    }

    #[test]
    fn lookup_order_and_numeric_parts() {
        let d = tempfile::tempdir().unwrap();
        let fb = tempfile::tempdir().unwrap();
        let logged = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
        let l2 = logged.clone();
        let logger = Logger::closure(crate::logging::LogLevel::Debug, move |_, m| {
            l2.lock().push(m.into())
        });
        let e = resolve(&loc(d.path(), Some(fb.path())), &logger, later()).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_NOT_FOUND);
        for want in [
            "model_state.tp1.3.partN",
            "model_state.tp1.3.{",
            "model_state.tp03.",
            "index.json",
            "shared",
        ] {
            let want = if want == "shared" {
                fb.path().to_str().unwrap()
            } else {
                want
            };
            assert!(e.message.contains(want), "{want} missing in {e}");
        }
        // Other ranks' files only: the error says why none was taken.
        touch(d.path(), "model_state.tp0.3.safetensors");
        let e = resolve(&loc(d.path(), None), &logger, later()).unwrap_err();
        assert!(
            e.message.contains("not the 1 model_state.* file(s) there"),
            "{e}"
        );
        std::fs::remove_file(d.path().join("model_state.tp0.3.safetensors")).unwrap();
        touch(fb.path(), "model_state.tp1.3.safetensors");
        assert_eq!(
            resolve(&loc(d.path(), Some(fb.path())), &logger, later())
                .unwrap()
                .kind,
            LayoutKind::Fallback
        );
        touch(d.path(), "shard-00001.safetensors");
        touch(d.path(), "model_state.tp7.3.safetensors");
        let l = resolve(&loc(d.path(), Some(fb.path())), &logger, later()).unwrap();
        assert_eq!(
            (l.kind, names(&l)),
            (LayoutKind::HfShards, vec!["shard-00001.safetensors".into()])
        );
        touch(d.path(), "model_state.tp03.pdparams");
        assert_eq!(
            resolve(&loc(d.path(), None), &logger, later())
                .unwrap()
                .kind,
            LayoutKind::Legacy
        );
        touch(d.path(), "model_state.tp1.3.safetensors");
        assert_eq!(
            resolve(&loc(d.path(), None), &logger, later())
                .unwrap()
                .kind,
            LayoutKind::RankFile
        );
        for n in ["part10", "part2", "part1", "partX", "part"] {
            touch(d.path(), &format!("model_state.tp1.3.{n}.safetensors"));
        }
        let l = resolve(&loc(d.path(), None), &logger, later()).unwrap();
        assert_eq!(l.kind, LayoutKind::RankParts);
        assert_eq!(
            names(&l),
            vec![
                "model_state.tp1.3.part1.safetensors",
                "model_state.tp1.3.part2.safetensors",
                "model_state.tp1.3.part10.safetensors"
            ]
        );
        let logged = logged.lock();
        assert!(logged.iter().any(|m| m.contains("partX")), "{logged:?}");
    }

    #[test]
    fn hf_index_names_its_shards() {
        let d = tempfile::tempdir().unwrap();
        touch(d.path(), "a.safetensors");
        std::fs::write(
            d.path().join(HF_INDEX),
            r#"{"metadata":{},"weight_map":{"x":"a.safetensors","y":"b.safetensors"}}"#,
        )
        .unwrap();
        let e = resolve(&loc(d.path(), None), &Logger::default(), later()).unwrap_err();
        assert!(e.message.contains("b.safetensors"), "{e}");
        touch(d.path(), "b.safetensors");
        let l = resolve(&loc(d.path(), None), &Logger::default(), later()).unwrap();
        assert_eq!(l.kind, LayoutKind::HfIndex);
        assert_eq!(l.files.len(), 2);
        assert_eq!(l.index.unwrap()["y"], "b.safetensors");
    }
}
