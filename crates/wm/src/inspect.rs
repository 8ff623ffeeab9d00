//! `wm inspect` and `wm manifest`.

use crate::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::{checksums, layout, safetensors_file, version};
use weight_manager_core::internals::shape_text;
use weight_manager_core::Logger;

const SHOWN: usize = 40;
/// How long `wm inspect` may spend reading a snapshot's headers.
const INSPECT_BOUND: Duration = Duration::from_secs(120);

/// `wm inspect` options.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A safetensors file, or a snapshot folder
    #[arg(value_name = "file|dir")]
    target: PathBuf,
    /// The engine rank whose files to read
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// The GPU id in per-GPU file names
    #[arg(long, default_value = "0")]
    gpu: String,
    /// Show every tensor (default: the first 40)
    #[arg(long)]
    all: bool,
}

/// `wm manifest` options.
#[derive(clap::Args, Debug)]
pub struct ManifestArgs {
    /// The snapshot folder
    dir: PathBuf,
}

pub fn inspect(a: &InspectArgs) -> Result<(), String> {
    let path = a.target.as_path();
    // A file or a folder: what does not exist is neither.
    if let Err(e) = std::fs::symlink_metadata(path) {
        return Err(format!("{}: {e}", path.display()));
    }
    let loc = layout::SnapshotLocation {
        model_dir: path.to_path_buf(),
        fallback_dir: None,
        rank: a.rank,
        gpu_id: a.gpu.clone(),
    };
    // Every read is bounded; a FIFO or device among the files is an error.
    let deadline = Instant::now() + INSPECT_BOUND;
    let found = layout::resolve(&loc, &Logger::default(), deadline).map_err(|e| e.to_string())?;
    // Everything that can fail is read before the report starts: a failed
    // run prints its error alone, not half a report.
    let sums = checksums::Checksums::load(&found.dir, deadline).map_err(|e| e.to_string())?;
    let headers = (found.files.iter())
        .map(|file| safetensors_file::open(file, deadline).map(|(_, header)| header))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    println!("{} ({})", path.display(), found.kind.describe());
    match version::read_version_yaml(&found.dir, deadline) {
        Ok(v) => println!("version: {v}"),
        Err(why) => println!("version: none ({why})"),
    }
    println!(
        "checksums: {}",
        match sums.as_ref().map(|s| s.block_size()) {
            Some(Some(b)) => format!(
                "{} (block sums every {})",
                checksums::CHECKSUM_FILE,
                fmt::bytes(b)
            ),
            Some(None) => format!(
                "{} (no block sums: slices cannot be verified; run `wm manifest <dir>` again)",
                checksums::CHECKSUM_FILE
            ),
            None => "none (write them with `wm manifest <dir>`)".into(),
        }
    );
    let mut total = 0u64;
    let mut count = 0usize;
    println!(
        "{:<48} {:<8} {:<20} {:>12}",
        "tensor", "dtype", "shape", "bytes"
    );
    for (file, header) in found.files.iter().zip(&headers) {
        if found.files.len() > 1 {
            println!(
                "-- {}",
                file.file_name().unwrap_or_default().to_string_lossy()
            );
        }
        for t in &header.tensors {
            if count < SHOWN || a.all {
                println!(
                    "{:<48} {:<8} {:<20} {:>12}",
                    t.name.escape_debug().to_string(),
                    t.dtype.to_string(),
                    shape_text(&t.shape),
                    t.nbytes
                );
            }
            count += 1;
            total += t.nbytes;
        }
    }
    if count > SHOWN && !a.all {
        println!("... {} more (--all shows every tensor)", count - SHOWN);
    }
    println!(
        "total: {count} tensors in {} file(s), {} ({total} bytes)",
        found.files.len(),
        fmt::bytes(total)
    );
    Ok(())
}

pub fn manifest(a: &ManifestArgs) -> Result<(), String> {
    let dir = &a.dir;
    let t = Instant::now();
    let line = parking_lot::Mutex::new(fmt::progress_line("hashing"));
    let progress = |done: u64, total: u64| {
        let p = weight_manager_core::Progress {
            bytes_done: done,
            bytes_total: total,
            ..Default::default()
        };
        (line.lock())(&p);
    };
    let w = checksums::write_with_progress(
        dir,
        weight_manager_core::internals::memory::copy::default_threads(),
        &progress,
    )
    .map_err(|e| e.to_string())?;
    println!(
        "wrote {}/{}: {} tensors in {} file(s) with block sums every {}, {} hashed in {} \
         ({:.2} GB/s)",
        dir.display(),
        checksums::CHECKSUM_FILE,
        w.tensors,
        w.files,
        fmt::bytes(weight_manager_core::checkpoint::block_sums::BLOCK_SIZE),
        fmt::bytes(w.bytes),
        fmt::ms(t.elapsed()),
        fmt::gbps(w.bytes, t.elapsed())
    );
    Ok(())
}
