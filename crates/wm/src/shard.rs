//! `wm shard <file|dir> --out DIR --ranks N [--dim D]`: split a snapshot
//! into N per-rank files `model_state.tpR.0.safetensors`, each holding rank
//! R's shard of every tensor with its placement in the file's
//! `__metadata__` (`checkpoint::shard_meta`), as N trainer ranks
//! would write them.
//!
//! A tensor is split along dim D (PyTorch's rule: chunks of ceil(n / N),
//! the last ones shorter) when it has that dim and at least N rows there;
//! any other tensor is copied whole into every file (a replica). A tensor
//! of the input that is itself a shard is split within its box, keeping its
//! global tensor. `version.yaml` is copied, and `wm_checksums.json` written
//! for the new files.

use crate::fmt;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;
use weight_manager_core::checkpoint::shard_meta::{shard_json, SHARD_KEY};
use weight_manager_core::checkpoint::{checksums, layout, version, Checkpoint};
use weight_manager_core::Logger;
use weight_manager_core::{Placement, TensorMeta};

/// `wm shard` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A safetensors file, or a snapshot folder
    #[arg(value_name = "file|dir")]
    input: PathBuf,
    /// Folder for the rank files
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Trainer ranks (files), 1 to 4096 (WM_MAX_SOURCES: the most trainer
    /// ranks one update reads from)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=weight_manager_core::MAX_SOURCES as u64))]
    ranks: u64,
    /// The dimension split
    #[arg(long, value_name = "D", default_value_t = 0)]
    dim: usize,
}

/// A folder of per-rank files holds each rank's part: rank 0's file alone
/// (what a snapshot location of rank 0 reads) is not the model, so such a
/// folder is refused when another rank's file is there.
fn refuse_other_ranks(input: &Path, source: &Checkpoint) -> Result<(), String> {
    use layout::LayoutKind::{Legacy, RankFile, RankParts};
    if !matches!(source.layout.kind, RankFile | RankParts | Legacy) {
        return Ok(());
    }
    let names = std::fs::read_dir(&source.layout.dir)
        .map_err(|e| format!("listing {}: {e}", source.layout.dir.display()))?;
    let read = |e: &std::fs::DirEntry| source.layout.files.iter().any(|f| *f == e.path());
    let other = (names.filter_map(|e| e.ok())).find(|e| {
        e.file_name()
            .to_string_lossy()
            .starts_with("model_state.tp")
            && !read(e)
    });
    match other {
        Some(e) => Err(format!(
            "{} holds per-rank files ({} beside rank 0's): wm shard splits a whole model (a \
             file, HuggingFace shards, or one rank's file), and rank 0's part alone is not one",
            input.display(),
            e.file_name().to_string_lossy()
        )),
        None => Ok(()),
    }
}

/// One stored tensor of an output file: its bytes are `runs` (offset,
/// length) of `src`, in order.
struct Piece<'a> {
    meta: &'a TensorMeta,
    shape: Vec<u64>,
    placement: Placement,
    src: &'a Path,
    runs: Vec<(u64, u64)>,
}

pub fn run(a: &Args) -> Result<(), String> {
    let (input, out, ranks, dim) = (&a.input, &a.out, a.ranks, a.dim);
    let t0 = Instant::now();
    let loc = layout::SnapshotLocation {
        model_dir: input.clone(),
        fallback_dir: None,
        rank: 0,
        gpu_id: "0".into(),
    };
    let source = Checkpoint::read(&loc, &Logger::default()).map_err(|e| e.to_string())?;
    refuse_other_ranks(input, &source)?;
    std::fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    // Rank files written into the input's folder would replace the files
    // the next ranks are read from.
    let same = |a: &std::path::Path, b: &std::path::Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y);
    if same(out, &source.layout.dir) {
        return Err(format!(
            "--out {} is the input's folder: the rank files would overwrite the files they are \
             read from; write them to another folder",
            out.display()
        ));
    }
    let stale = remove_stale_ranks(out, ranks)?;
    let mut bytes = 0;
    let mut split = 0;
    for r in 0..ranks {
        let pieces = rank_pieces(&source, r, ranks, dim);
        if r == 0 {
            split = pieces.iter().filter(|p| p.shape != p.meta.shape).count();
        }
        let path = out.join(format!("model_state.tp{r}.0.safetensors"));
        bytes +=
            write_file(&path, &pieces).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    // Copied as it is, once it reads as a version; else none is left in
    // --out (an earlier run's would name these weights by its version).
    let to = out.join(version::VERSION_FILE);
    if version::read_version_yaml(&source.layout.dir, deadline).is_ok() {
        let from = source.layout.dir.join(version::VERSION_FILE);
        std::fs::copy(&from, &to).map_err(|e| format!("copying {}: {e}", from.display()))?;
    } else if to.exists() {
        std::fs::remove_file(&to).map_err(|e| format!("removing {}: {e}", to.display()))?;
    }
    checksums::write(
        out,
        weight_manager_core::internals::memory::copy::default_threads(),
    )
    .map_err(|e| e.to_string())?;
    println!(
        "wrote {ranks} rank file(s) to {}: {split} of {} tensors split along dim {dim}, {} in {}{}",
        out.display(),
        source.manifest.tensors.len(),
        fmt::bytes(bytes),
        fmt::ms(t0.elapsed()),
        match stale {
            0 => String::new(),
            n => format!(" ({n} rank file(s) of an earlier run with more ranks removed)"),
        }
    );
    Ok(())
}

/// Remove `out`'s rank files of ranks `ranks` and up (an earlier run with
/// more ranks wrote them): the checksums written next would cover them
/// under the new version. Returns how many went.
fn remove_stale_ranks(out: &std::path::Path, ranks: u64) -> Result<usize, String> {
    let entries = std::fs::read_dir(out).map_err(|e| format!("reading {}: {e}", out.display()))?;
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let rank = (name.to_str())
            .and_then(|n| n.strip_prefix("model_state.tp"))
            .and_then(|n| n.strip_suffix(".0.safetensors"))
            .and_then(|r| r.parse::<u64>().ok());
        if rank.is_some_and(|r| r >= ranks) {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| format!("removing {}: {e}", path.display()))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Rank `r`'s piece of every tensor of `source`.
fn rank_pieces(source: &Checkpoint, r: u64, ranks: u64, dim: usize) -> Vec<Piece<'_>> {
    let tensors = &source.manifest.tensors;
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (src, base) = source.tensor_location(i);
            let whole = Placement {
                global_shape: t.shape.clone(),
                offset: vec![0; t.shape.len()],
            };
            let held = t.placement.clone().unwrap_or(whole);
            let splits = t.shape.get(dim).is_some_and(|&n| n >= ranks);
            if !splits {
                let runs = vec![(base, t.nbytes)];
                return Piece {
                    meta: t,
                    shape: t.shape.clone(),
                    placement: held,
                    src,
                    runs,
                };
            }
            let n = t.shape[dim];
            let chunk = n.div_ceil(ranks);
            let start = (chunk * r).min(n);
            let len = (start + chunk).min(n) - start;
            let elem = t.dtype.size() as u64;
            let inner: u64 = t.shape[dim + 1..].iter().product::<u64>() * elem;
            let outer: u64 = t.shape[..dim].iter().product();
            let runs = (0..outer)
                .map(|o| (base + (o * n + start) * inner, len * inner))
                .collect();
            let mut shape = t.shape.clone();
            shape[dim] = len;
            let mut placement = held;
            placement.offset[dim] += start;
            Piece {
                meta: t,
                shape,
                placement,
                src,
                runs,
            }
        })
        // A rank past the last chunk holds nothing of that tensor: left
        // out, as FSDP leaves it (the other ranks' pieces cover it).
        .filter(|p| p.shape == p.meta.shape || p.shape[dim] > 0)
        .collect()
}

/// Write `pieces` as one safetensors file (through a temporary file and a
/// rename); returns the data bytes written.
fn write_file(path: &Path, pieces: &[Piece]) -> std::io::Result<u64> {
    // Larger elements first keeps every tensor aligned to its element size
    // with no gaps between tensors (safetensors readers refuse gaps).
    let mut order: Vec<&Piece> = pieces.iter().collect();
    order.sort_by_key(|p| std::cmp::Reverse(p.meta.dtype.size()));
    let header = header_json(&order);
    let tmp = path.with_extension("safetensors.tmp");
    let mut w = BufWriter::with_capacity(8 << 20, File::create(&tmp)?);
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    let mut open: HashMap<&Path, File> = HashMap::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0;
    for p in &order {
        if !open.contains_key(p.src) {
            open.insert(p.src, File::open(p.src)?);
        }
        let f = &open[p.src];
        for &(mut at, len) in &p.runs {
            let end = at + len;
            while at < end {
                let n = ((end - at) as usize).min(buf.len());
                f.read_exact_at(&mut buf[..n], at)?;
                w.write_all(&buf[..n])?;
                at += n as u64;
            }
            total += len;
        }
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(total)
}

/// The header: each piece under its global name (or, for a second shard of
/// one global tensor in the file, the name and its offset), its placement
/// in `__metadata__`; padded with spaces so that the data starts 8-aligned.
fn header_json(order: &[&Piece]) -> String {
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for p in order {
        let global = &p.meta.name;
        let mut stored = global.clone();
        if header.contains_key(&stored) {
            let offset: Vec<String> = p.placement.offset.iter().map(u64::to_string).collect();
            stored = format!("{global}@{}", offset.join("_"));
        }
        let len: u64 = p.runs.iter().map(|r| r.1).sum();
        let entry = serde_json::json!({
            "dtype": p.meta.dtype.safetensors_name(),
            "shape": p.shape,
            "data_offsets": [at, at + len],
        });
        at += len;
        // A replica of a whole tensor stays a plain tensor.
        if !p.placement.is_whole(&p.shape) {
            let value = shard_json(global, &p.placement);
            meta.insert(format!("{SHARD_KEY}{stored}"), value.into());
        }
        header.insert(stored, entry);
    }
    header.insert("__metadata__".into(), meta.into());
    let mut text = serde_json::Value::Object(header).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    text
}
