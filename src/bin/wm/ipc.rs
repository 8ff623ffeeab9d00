//! `wm serve --ipc` (trainer side) and `wm pull --ipc` (an engine rank that
//! checks what it received).

use crate::fmt;
use crate::Args;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager::apply::{Mode, TensorView};
use weight_manager::logging::Logger;
use weight_manager::manager::{Manager, ManagerConfig, UpdateRequest};
use weight_manager::publisher::{Publisher, PublisherConfig};
use weight_manager::source::snapshot::{SnapshotLocation, SnapshotSource};
use weight_manager::source::{Source, SourceKind};

pub const SERVE_OPTIONS: &[&str] = &[
    "ipc",
    "engines",
    "bucket-mib",
    "accept-timeout",
    "corrupt",
    "version",
];
pub const PULL_OPTIONS: &[&str] = &[
    "ipc", "rank", "world", "gpu", "verify", "check", "version", "timeout",
];

/// Serve the snapshot in DIR to `--engines` engine sessions, then exit.
pub fn serve(a: &Args) -> Result<(), String> {
    let socket = a
        .value("ipc")
        .ok_or("usage: wm serve --ipc SOCKET DIR [--engines N] [--bucket-mib M]")?;
    let dir = a
        .positional
        .first()
        .ok_or("wm serve: name the snapshot directory to serve")?;
    let engines: usize = a.number("engines", 1)?;
    let bucket_mib: usize = a.number("bucket-mib", 512)?;
    let cfg = PublisherConfig {
        bucket_size: bucket_mib << 20,
        corrupt_tensor: a.value("corrupt").map(str::to_string),
        logger: Logger::default(),
        ..Default::default()
    };
    let p = Publisher::bind(Path::new(socket), cfg).map_err(|e| e.to_string())?;
    p.set_dir(Path::new(dir));
    p.set_version(a.value("version").map(str::to_string));
    println!("wm serve: {dir} on {socket}, waiting for {engines} engine(s)");
    let accept = Duration::from_secs_f64(a.number("accept-timeout", 600.0)?);
    let stats = p.serve(engines, accept).map_err(|e| e.to_string())?;
    for s in &stats.sessions {
        println!(
            "  rank {}: version {}, {} tensors, {} in {} buckets; packing {}, waiting for acks {}, total {}",
            s.rank,
            s.version,
            s.tensors,
            fmt::bytes(s.bytes),
            s.buckets,
            fmt::ms(s.pack),
            fmt::ms(s.wait),
            fmt::ms(s.total)
        );
    }
    Ok(())
}

/// Receive this rank's shard (zero-copy callback) and, with `--check DIR`,
/// compare every tensor with the snapshot files the rank would read.
pub fn pull(a: &Args) -> Result<(), String> {
    let socket = a
        .value("ipc")
        .ok_or("usage: wm pull --ipc SOCKET [--rank R --world W] [--check DIR] [--verify true]")?;
    let rank: u32 = a.number("rank", 0)?;
    let world: u32 = a.number("world", 1)?;
    let expected: HashMap<String, (std::path::PathBuf, u64, u64)> = match a.value("check") {
        None => HashMap::new(),
        Some(dir) => {
            let loc = SnapshotLocation {
                model_dir: dir.into(),
                fallback_dir: None,
                rank,
                gpu_id: a.value("gpu").unwrap_or("0").to_string(),
            };
            let src = SnapshotSource::open(&loc, &Logger::default()).map_err(|e| e.to_string())?;
            src.manifest()
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let (path, off) = src.tensor_location(i);
                    (t.name.clone(), (path.to_path_buf(), off, t.nbytes))
                })
                .collect()
        }
    };
    let m = Manager::new(ManagerConfig {
        rank,
        world_size: world,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut mismatches = Vec::new();
    let mut checked = 0usize;
    let mut received = 0usize;
    let mut on_tensor = |t: &TensorView| -> Result<(), String> {
        received += 1;
        if let Some((path, off, n)) = expected.get(t.name) {
            let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
            let mut want = vec![0u8; *n as usize];
            f.read_exact_at(&mut want, *off)
                .map_err(|e| e.to_string())?;
            if want != t.data {
                mismatches.push(t.name.to_string());
            }
            checked += 1;
        }
        Ok(())
    };
    let mut req = UpdateRequest::snapshot(socket);
    req.source = SourceKind::Ipc;
    req.mode = Mode::InPlace;
    req.verify = a.value("verify").is_some_and(|v| v != "false");
    req.version = a.value("version").map(str::to_string);
    req.timeout = Duration::from_secs_f64(a.number("timeout", 600.0)?);
    req.hooks.tensor = Some(&mut on_tensor);
    let t = Instant::now();
    let stats = m.update(req).map_err(|e| format!("rank {rank}: {e}"))?;
    let elapsed = t.elapsed();
    if !expected.is_empty() && (checked != expected.len() || received != expected.len()) {
        return Err(format!(
            "rank {rank}: received {received} tensors, checked {checked}, the snapshot has {}",
            expected.len()
        ));
    }
    if !mismatches.is_empty() {
        return Err(format!(
            "rank {rank}: tensors differ from the snapshot: {}",
            mismatches.join(", ")
        ));
    }
    println!(
        "rank {rank}: version {}, {} tensors, {} in {} ({:.2} GB/s){}",
        stats.version,
        stats.tensors,
        fmt::bytes(stats.bytes),
        fmt::ms(elapsed),
        fmt::gbps(stats.bytes, elapsed),
        if expected.is_empty() {
            String::new()
        } else {
            format!(", all {checked} equal to the snapshot")
        }
    );
    Ok(())
}
