//! `wm serve --ipc | --net` (trainer side) and `wm pull --ipc | --net` (an
//! engine rank that checks what it received).

use crate::fmt;
use crate::Args;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager_core::apply::{Mode, TensorView};
use weight_manager_core::checkpoint::layout::SnapshotLocation;
use weight_manager_core::checkpoint::Checkpoint;
use weight_manager_core::defaults;
use weight_manager_core::logging::Logger;
use weight_manager_core::manager::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::publisher::{Publisher, PublisherConfig};
use weight_manager_core::source::SourceKind;

pub const SERVE_OPTIONS: &[&str] = &[
    "ipc",
    "net",
    "keep",
    "engines",
    "bucket-mib",
    "accept-timeout",
    "corrupt",
    "version",
    "gpu",
];
pub const PULL_OPTIONS: &[&str] = &[
    "ipc",
    "net",
    "gdr",
    "gdr-fallback",
    "staged",
    "keyed-digests",
    "bucket-mib",
    "bucket-bytes",
    "depth",
    "rank",
    "world",
    "gpu",
    "verify",
    "check",
    "version",
    "timeout",
];

/// Serve the snapshot in DIR to `--engines` engine sessions, then exit.
/// Over the network, every DIR given is published as a version (named by its
/// `version.yaml`), and engines ask for one by name or for the latest.
pub fn serve(a: &Args) -> Result<(), String> {
    let usage =
        "usage: wm serve (--ipc SOCKET | --net HOST:PORT) DIR... [--engines N] [--bucket-mib M] [--gpu ORDINAL]";
    if a.positional.is_empty() {
        return Err("wm serve: name the snapshot directory to serve".into());
    }
    let engines: usize = a.number("engines", 1)?;
    let bucket_mib: usize = a.number("bucket-mib", defaults::BUCKET_SIZE >> 20)?;
    let cfg = PublisherConfig {
        bucket_size: bucket_mib << 20,
        keep_versions: a.number("keep", defaults::KEEP_VERSIONS)?,
        logger: Logger::default(),
        ..Default::default()
    };
    // --corrupt TENSOR: the publisher's corruption test hook, in test builds only.
    let cfg = match a.value("corrupt") {
        Some(t) => cfg
            .with_corrupt_tensor(t.to_string())
            .map_err(|e| format!("wm serve: {e}"))?,
        None => cfg,
    };
    let p = match (a.value("ipc"), a.value("net")) {
        (Some(socket), None) => Publisher::bind(Path::new(socket), cfg),
        (None, Some(addr)) => Publisher::bind_net(addr, cfg),
        _ => return Err(usage.into()),
    }
    .map_err(|e| e.to_string())?;
    // Kept alive while serving: the trainer's own GPU tensors (--gpu).
    let mut _on_gpu = Vec::new();
    if let Some(gpu) = a.value("gpu") {
        let gpu: i32 = gpu
            .parse()
            .map_err(|_| format!("--gpu {gpu}: not a number"))?;
        let dir = Path::new(&a.positional[0]);
        _on_gpu = load_to_gpu(&p, dir, gpu)?;
        p.set_version(a.value("version").map(str::to_string));
        let v = p.publish().map_err(|e| format!("{}: {e}", dir.display()))?;
        println!(
            "wm serve: published {} from GPU {gpu} as version {v}",
            dir.display()
        );
    } else if a.value("net").is_some() {
        for dir in &a.positional {
            p.set_dir(Path::new(dir));
            p.set_version(a.value("version").map(str::to_string));
            let v = p.publish().map_err(|e| format!("{dir}: {e}"))?;
            println!("wm serve: published {dir} as version {v}");
        }
    } else {
        p.set_dir(Path::new(&a.positional[0]));
        p.set_version(a.value("version").map(str::to_string));
    }
    // Tests read the address (a port 0 is resolved here) from this line.
    println!(
        "wm serve: listening on {}, waiting for {engines} engine(s)",
        p.address()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let accept = Duration::from_secs_f64(
        a.number("accept-timeout", defaults::UPDATE_TIMEOUT.as_secs_f64())?,
    );
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

/// Read rank 0's tensors of the snapshot in `dir` into memory of GPU `gpu`
/// (as a trainer holds them) and add them to `p` as GPU tensors for every
/// rank. Returns the GPU memory, which must outlive the publish.
fn load_to_gpu(p: &Publisher, dir: &Path, gpu: i32) -> Result<Vec<ExportedDeviceBuffer>, String> {
    let loc = SnapshotLocation {
        model_dir: dir.into(),
        fallback_dir: None,
        rank: 0,
        gpu_id: "0".into(),
    };
    let src = Checkpoint::read(&loc, &Logger::default()).map_err(|e| e.to_string())?;
    let mut held = Vec::new();
    for (i, t) in src.manifest.tensors.iter().enumerate() {
        let (path, off) = src.tensor_location(i);
        let mut bytes = vec![0u8; t.nbytes as usize];
        std::fs::File::open(path)
            .and_then(|f| f.read_exact_at(&mut bytes, off))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let what = format!("tensor '{}'", t.name);
        let mem = ExportedDeviceBuffer::new(&what, gpu, bytes.len()).map_err(|e| e.to_string())?;
        // SAFETY: `bytes` is host memory of that length; the buffer fits it.
        unsafe { mem.copy_in(0, bytes.as_ptr() as u64, bytes.len()) }.map_err(|e| e.to_string())?;
        // SAFETY: the GPU memory is kept (returned) until serving ends.
        unsafe {
            p.add_device_tensor(
                &t.name,
                t.dtype,
                &t.shape,
                mem.ptr(),
                bytes.len(),
                gpu,
                None,
            )
        }
        .map_err(|e| e.to_string())?;
        held.push(mem);
    }
    Ok(held)
}

/// Receive this rank's shard (zero-copy callback) and, with `--check DIR`,
/// compare every tensor with the snapshot files the rank would read.
pub fn pull(a: &Args) -> Result<(), String> {
    let (source, location) = match (a.value("ipc"), a.value("net")) {
        (Some(socket), None) => (SourceKind::Ipc, socket),
        (None, Some(addr)) if a.value("gdr").is_some_and(|v| v != "false") => (SourceKind::Gdr, addr),
        (None, Some(addr)) => (SourceKind::Rdma, addr),
        _ => {
            return Err("usage: wm pull (--ipc SOCKET | --net HOST:PORT [--gdr true]) [--rank R --world W] [--check DIR] [--verify true]".into())
        }
    };
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
            let src = Checkpoint::read(&loc, &Logger::default()).map_err(|e| e.to_string())?;
            src.manifest
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
        net: NetSettings {
            bucket_size: a.number(
                "bucket-bytes",
                a.number::<usize>("bucket-mib", defaults::BUCKET_SIZE >> 20)? << 20,
            )?,
            depth: a.number("depth", defaults::BUFFERS_IN_FLIGHT)?,
            gdr_fallback: a.value("gdr-fallback").is_some_and(|v| v != "false"),
            staged: a.value("staged").is_some_and(|v| v != "false"),
            keyed_digests: a.value("keyed-digests").is_some_and(|v| v != "false"),
            ..Default::default()
        },
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
    let mut req = UpdateRequest::snapshot(location);
    req.source = source;
    req.mode = Mode::InPlace;
    req.verify = a.value("verify").is_some_and(|v| v != "false");
    req.version = a.value("version").map(str::to_string);
    req.timeout =
        Duration::from_secs_f64(a.number("timeout", defaults::UPDATE_TIMEOUT.as_secs_f64())?);
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
