//! `wm serve --ipc | --net` (trainer side) and `wm pull --ipc | --net` (an
//! engine rank that checks what it received).

use crate::fmt;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::layout::SnapshotLocation;
use weight_manager_core::checkpoint::Checkpoint;
use weight_manager_core::defaults;
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::Logger;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::{Mode, TensorView};
use weight_manager_core::{Publisher, PublisherConfig, TensorDesc};

/// `wm serve` options.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("transport").required(true).args(["ipc", "net"])))]
pub struct ServeArgs {
    /// Serve over same-node IPC at this socket
    #[arg(long, value_name = "SOCKET")]
    ipc: Option<PathBuf>,
    /// Serve over the network at this address (secret: WM_NET_SECRET)
    #[arg(long, value_name = "HOST:PORT")]
    net: Option<String>,
    /// The snapshot folders to serve (over the network each is a version)
    #[arg(value_name = "DIR", required = true)]
    dirs: Vec<PathBuf>,
    /// Engine sessions to serve before exiting
    #[arg(long, value_name = "N", default_value_t = 1)]
    engines: usize,
    /// Bucket size in MiB (1 to 4096)
    #[arg(long, value_name = "M", default_value_t = defaults::BUCKET_SIZE >> 20, value_parser = crate::bucket_mib)]
    bucket_mib: usize,
    /// Versions kept (network), at least 1
    #[arg(long, value_name = "K", default_value_t = defaults::KEEP_VERSIONS)]
    keep: usize,
    /// Seconds to wait for the engines
    #[arg(long, value_name = "S", default_value_t = defaults::UPDATE_TIMEOUT.as_secs_f64(), value_parser = crate::seconds)]
    accept_timeout: f64,
    /// Corrupt this tensor (test builds only)
    #[arg(long, value_name = "TENSOR")]
    corrupt: Option<String>,
    /// Name of the version (default: the folder's version.yaml)
    #[arg(long, value_name = "V")]
    version: Option<String>,
    /// Publish the snapshot from the memory of this GPU
    #[arg(long, value_name = "ORDINAL")]
    gpu: Option<i32>,
}

/// `wm pull` options.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("transport").required(true).args(["ipc", "net"])))]
pub struct PullArgs {
    /// Pull over same-node IPC from this socket
    #[arg(long, value_name = "SOCKET")]
    ipc: Option<String>,
    /// Pull over the network from this address
    #[arg(long, value_name = "HOST:PORT")]
    net: Option<String>,
    /// Network: straight into GPU memory (GPUDirect RDMA)
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth, conflicts_with = "ipc")]
    gdr: bool,
    /// Network: fall back to staging when GPUDirect cannot work
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth, conflicts_with = "ipc")]
    gdr_fallback: bool,
    /// Network: receive into staging slots, then copy
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth, conflicts_with = "ipc")]
    staged: bool,
    /// Network: keyed BLAKE3 digests of every entry
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth, conflicts_with = "ipc")]
    keyed_digests: bool,
    /// Verify what arrives with the checksums
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth)]
    verify: bool,
    /// Network: bucket size in MiB (1 to 4096; over IPC the publisher's)
    #[arg(long, value_name = "M", default_value_t = defaults::BUCKET_SIZE >> 20, value_parser = crate::bucket_mib, conflicts_with = "ipc")]
    bucket_mib: usize,
    /// Network: bucket size in bytes (instead of --bucket-mib)
    #[arg(long, value_name = "BYTES", conflicts_with_all = ["ipc", "bucket_mib"])]
    bucket_bytes: Option<usize>,
    /// Network: buckets in flight
    #[arg(long, value_name = "D", default_value_t = defaults::BUFFERS_IN_FLIGHT, conflicts_with = "ipc")]
    depth: usize,
    /// This engine's rank
    #[arg(long, value_name = "R", default_value_t = 0)]
    rank: u32,
    /// Engine ranks in all
    #[arg(long, value_name = "W", default_value_t = 1)]
    world: u32,
    /// The GPU id in per-GPU file names (--check)
    #[arg(long, value_name = "G", default_value = "0")]
    gpu: String,
    /// Compare every tensor with the snapshot in this folder
    #[arg(long, value_name = "DIR")]
    check: Option<PathBuf>,
    /// The version to ask for (default: the latest)
    #[arg(long, value_name = "V")]
    version: Option<String>,
    /// Seconds the update may take
    #[arg(long, value_name = "SECONDS", default_value_t = defaults::UPDATE_TIMEOUT.as_secs_f64(), value_parser = crate::seconds)]
    timeout: f64,
    /// IPC: take bytes from a publisher running as another uid (refused by
    /// default; the publisher checks this engine's uid too)
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth, conflicts_with = "net")]
    allow_other_uids: bool,
}

/// Serve the snapshot in DIR to `--engines` engine sessions, then exit.
/// Over the network, every DIR given is published as a version (named by its
/// `version.yaml`), and engines ask for one by name or for the latest.
pub fn serve(a: &ServeArgs) -> Result<(), String> {
    check_dirs(a)?;
    let cfg = PublisherConfig {
        bucket_size: a.bucket_mib << 20,
        keep_versions: a.keep,
        logger: Logger::default(),
        ..Default::default()
    };
    // --corrupt TENSOR: the publisher's corruption test hook, in test builds only.
    let cfg = match &a.corrupt {
        Some(t) => cfg
            .with_corrupt_tensor(t.to_string())
            .map_err(|e| format!("wm serve: {e}"))?,
        None => cfg,
    };
    let p = match (&a.ipc, &a.net) {
        (Some(socket), _) => Publisher::bind(socket, cfg),
        (None, Some(addr)) => Publisher::bind_net(addr, cfg),
        (None, None) => unreachable!("clap requires --ipc or --net"),
    }
    .map_err(|e| e.to_string())?;
    // The publisher removes its socket when dropped; a stopping signal too.
    let _socket = a.ipc.as_deref().map(crate::leftovers::Listed::new);
    // Kept alive while serving: the trainer's own GPU tensors (--gpu).
    let _on_gpu = publish(&p, a)?;
    // Tests read the address (a port 0 is resolved here) from this line.
    println!(
        "wm serve: listening on {}, waiting for {} engine(s)",
        p.address(),
        a.engines
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let accept = Duration::from_secs_f64(a.accept_timeout);
    let stats = p.serve(a.engines, accept).map_err(|e| e.to_string())?;
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

/// The DIRs `wm serve` was given, checked before anything listens (an
/// engine would only learn of them later): they exist, and several only
/// over the network, where each is a version.
fn check_dirs(a: &ServeArgs) -> Result<(), String> {
    if a.dirs.len() > 1 && (a.net.is_none() || a.gpu.is_some()) {
        return Err(format!(
            "{} folders given: several are served only over the network (--net), each as a version; \
             over IPC or from a GPU, give one",
            a.dirs.len()
        ));
    }
    // Each folder is a version: all of them must stay served.
    if a.dirs.len() > 1 && a.version.is_some() {
        return Err(format!(
            "--version names one version, and {} folders are {} versions: let each folder's \
             version.yaml name its own (or serve one folder)",
            a.dirs.len(),
            a.dirs.len()
        ));
    }
    if a.dirs.len() > a.keep.max(1) {
        return Err(format!(
            "{} folders given, and --keep {} keeps {} version(s): pass --keep {} to serve them all",
            a.dirs.len(),
            a.keep,
            a.keep.max(1),
            a.dirs.len()
        ));
    }
    match a.dirs.iter().find(|d| !d.exists()) {
        Some(missing) => Err(format!("{}: no such folder or file", missing.display())),
        None => Ok(()),
    }
}

/// Offer what `wm serve` serves: the first DIR's tensors from GPU memory
/// (`--gpu`; the memory returned must outlive the serving), every DIR as a
/// version (`--net`), or the first DIR as it is.
fn publish(p: &Publisher, a: &ServeArgs) -> Result<Vec<ExportedDeviceBuffer>, String> {
    let first = &a.dirs[0];
    if let Some(gpu) = a.gpu {
        let on_gpu = load_to_gpu(p, first, gpu)?;
        // Named as a served folder is: --version, else its version.yaml.
        let version = match &a.version {
            Some(v) => v.clone(),
            None => weight_manager_core::checkpoint::version::read_version_yaml(
                first,
                std::time::Instant::now() + defaults::UPDATE_TIMEOUT,
            )
            .map_err(|e| format!("{}: {e}", first.display()))?,
        };
        p.set_version(Some(version));
        let v = p
            .publish()
            .map_err(|e| format!("{}: {e}", first.display()))?;
        println!(
            "wm serve: published {} from GPU {gpu} as version {v}",
            first.display()
        );
        return Ok(on_gpu);
    }
    if a.net.is_some() {
        let mut named: Vec<(String, &PathBuf)> = Vec::new();
        for dir in &a.dirs {
            p.set_dir(dir);
            p.set_version(a.version.clone());
            let v = p.publish().map_err(|e| format!("{}: {e}", dir.display()))?;
            // A name published again replaces the version before it.
            if let Some((_, other)) = named.iter().find(|(n, _)| *n == v) {
                return Err(format!(
                    "{} and {} both name version {v}: each folder served is its own version",
                    other.display(),
                    dir.display()
                ));
            }
            println!("wm serve: published {} as version {v}", dir.display());
            named.push((v, dir));
        }
    } else {
        p.set_dir(first);
        p.set_version(a.version.clone());
    }
    Ok(Vec::new())
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
            p.add(TensorDesc::device(
                &t.name,
                t.dtype,
                &t.shape,
                mem.ptr(),
                bytes.len(),
                gpu,
            ))
        }
        .map_err(|e| e.to_string())?;
        held.push(mem);
    }
    Ok(held)
}

/// Where each tensor of the snapshot in `--check DIR` is, as rank
/// `--rank` would read it: (file, offset, bytes) by name.
type Expected = HashMap<String, (PathBuf, u64, u64)>;

fn expected(a: &PullArgs) -> Result<Expected, String> {
    let Some(dir) = &a.check else {
        return Ok(HashMap::new());
    };
    let loc = SnapshotLocation {
        model_dir: dir.clone(),
        fallback_dir: None,
        rank: a.rank,
        gpu_id: a.gpu.clone(),
    };
    let src = Checkpoint::read(&loc, &Logger::default()).map_err(|e| e.to_string())?;
    Ok(src
        .manifest
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (path, off) = src.tensor_location(i);
            (t.name.clone(), (path.to_path_buf(), off, t.nbytes))
        })
        .collect())
}

/// The engine rank `wm pull` runs.
fn pull_manager(a: &PullArgs) -> Result<Manager, String> {
    Manager::new(ManagerConfig {
        rank: a.rank,
        world_size: a.world,
        allow_other_uids: a.allow_other_uids,
        net: NetSettings {
            bucket_size: a.bucket_bytes.unwrap_or(a.bucket_mib << 20),
            depth: a.depth,
            gdr_fallback: a.gdr_fallback,
            staged: a.staged,
            keyed_digests: a.keyed_digests,
            ..Default::default()
        },
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

/// What the zero-copy callback saw: tensors received, checked against
/// the snapshot, and those that differ.
#[derive(Default)]
struct Checked {
    received: usize,
    checked: usize,
    mismatches: Vec<String>,
}

impl Checked {
    fn tensor(&mut self, t: &TensorView, expected: &Expected) -> Result<(), String> {
        self.received += 1;
        if let Some((path, off, n)) = expected.get(t.name) {
            let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
            let mut want = vec![0u8; *n as usize];
            f.read_exact_at(&mut want, *off)
                .map_err(|e| e.to_string())?;
            if want != t.data {
                self.mismatches.push(t.name.to_string());
            }
            self.checked += 1;
        }
        Ok(())
    }

    /// Every tensor of the snapshot received and equal to it.
    fn all_equal(&self, rank: u32, expected: &Expected) -> Result<(), String> {
        let (received, checked, n) = (self.received, self.checked, expected.len());
        if n > 0 && (checked != n || received != n) {
            return Err(format!(
                "rank {rank}: received {received} tensors, checked {checked}, the snapshot has {n}"
            ));
        }
        if !self.mismatches.is_empty() {
            return Err(format!(
                "rank {rank}: tensors differ from the snapshot: {}",
                self.mismatches.join(", ")
            ));
        }
        Ok(())
    }
}

/// Receive this rank's shard (zero-copy callback) and, with `--check DIR`,
/// compare every tensor with the snapshot files the rank would read.
pub fn pull(a: &PullArgs) -> Result<(), String> {
    let (source, location) = match (&a.ipc, &a.net) {
        (Some(socket), _) => (SourceKind::Ipc, socket),
        (None, Some(addr)) if a.gdr => (SourceKind::Gdr, addr),
        (None, Some(addr)) => (SourceKind::Rdma, addr),
        (None, None) => unreachable!("clap requires --ipc or --net"),
    };
    let rank = a.rank;
    let expected = expected(a)?;
    let m = pull_manager(a)?;
    let mut seen = Checked::default();
    let mut on_tensor = |t: &TensorView| seen.tensor(t, &expected);
    let mut req = UpdateRequest::snapshot(location);
    req.source = source;
    req.mode = Mode::InPlace;
    req.verify = a.verify;
    req.version = a.version.clone();
    req.timeout = Duration::from_secs_f64(a.timeout);
    req.hooks.tensor = Some(&mut on_tensor);
    let t = Instant::now();
    let stats = m.update(req).map_err(|e| format!("rank {rank}: {e}"))?;
    let elapsed = t.elapsed();
    seen.all_equal(rank, &expected)?;
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
            format!(", all {} equal to the snapshot", seen.checked)
        }
    );
    Ok(())
}
