//! `wm bench gpu`: device params on a real GPU, each figure beside its
//! floor measured in the same run (issue 6's targets):
//!
//! - snapshot from the page cache into device params (pinned staging,
//!   asynchronous uploads) beside pinned host-to-device bandwidth (a
//!   `cuMemcpyHtoDAsync` of the same bytes from page-locked memory);
//!   target at least 0.85;
//! - IPC device to device (a `wm serve --gpu` trainer process publishing
//!   GPU tensors, this engine's device params written from its CUDA IPC
//!   buffer) beside a plain `cuMemcpyDtoD` of the same bytes; target at
//!   least 0.9;
//! - clear and restore of library-owned device params (CUDA VMM), per GiB;
//! - gdr from a `wm serve --net --gpu` trainer process straight into
//!   device params, beside raw UCX moving the same bytes into GPU memory
//!   (when this UCX reaches CUDA memory: `WM_UCX_LIB`);
//! - PyTorch's way beside ours, alternating (`torch_peers`): snapshot
//!   into CUDA params, and CUDA tensors shared by `torch.multiprocessing`;
//! - the FP8 quantizer's kernels on GPU memory beside a device-to-device
//!   copy and PyTorch's reference expression (`quant`);
//! - the checksum of GPU params on the GPU (what delta updates of them
//!   run) beside a device-to-device copy and reading back + hashing on
//!   the host (`hash`);
//! - atomic updates of library-owned device params with the device page
//!   swap (`swap_device_pages`) beside the same updates uploading into the
//!   params (informational: the swap buys atomicity, not speed), and the
//!   pause of a staged update of them (its commit: the remap) beside the
//!   one-call update (target: at most 2%), where that pause went (the
//!   manager's debug lines), and its floor: the same driver calls alone
//!   (`swap_floor`).
//!
//! Without a GPU it says so and exits with an error.

mod gdr;
mod hash;
mod quant;
mod swap_floor;
mod torch_peers;

use super::harness::process::Proc;
use super::harness::{best, verdict, Scratch, RUNS};
use super::model::{layer_count, write_layers, LAYER, LAYER_SHAPE};
use crate::fmt::{self, gbps};
use cudarc::driver::sys;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::cuda::cuda;
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::SourceKind;
use weight_manager_core::{LogLevel, Logger, Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

/// `wm bench gpu` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in GiB (tensors of 64 MiB)
    #[arg(long, default_value_t = 4.0, value_parser = crate::gib)]
    gib: f64,
}

fn ok(r: sys::CUresult, call: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call}: {r:?}"))
    }
}

/// Pinned host-to-device bandwidth: `total` bytes copied from one
/// page-locked buffer of 256 MiB into `dst`, asynchronously on one stream.
fn pinned_floor(dst: &ExportedDeviceBuffer, total: usize) -> Result<Duration, String> {
    const PIECE: usize = 256 << 20;
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers; every copy stays
    // inside `dst` (total bytes) and the pinned piece.
    unsafe {
        ok(sys::cuMemHostAlloc(&mut host, PIECE, 0), "cuMemHostAlloc")?;
        std::ptr::write_bytes(host.cast::<u8>(), 0x5a, PIECE);
        ok(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate")?;
        let r = best(|| {
            let t = Instant::now();
            let mut at = 0;
            while at < total {
                let n = PIECE.min(total - at);
                ok(
                    sys::cuMemcpyHtoDAsync_v2(dst.ptr() + at as u64, host, n, stream),
                    "cuMemcpyHtoDAsync",
                )?;
                at += n;
            }
            ok(sys::cuStreamSynchronize(stream), "cuStreamSynchronize")?;
            Ok(t.elapsed())
        });
        sys::cuStreamDestroy_v2(stream);
        sys::cuMemFreeHost(host);
        r
    }
}

/// A plain device-to-device copy of `total` bytes.
fn dtod_floor(
    dst: &ExportedDeviceBuffer,
    src: &ExportedDeviceBuffer,
    total: usize,
) -> Result<Duration, String> {
    best(|| {
        let t = Instant::now();
        // SAFETY: both buffers hold `total` bytes.
        unsafe {
            ok(
                sys::cuMemcpyDtoD_v2(dst.ptr(), src.ptr(), total),
                "cuMemcpyDtoD",
            )?;
            ok(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        Ok(t.elapsed())
    })
}

fn device_spec(i: usize) -> ParamSpec {
    let mut spec = ParamSpec::host(&format!("layers.{i}.w"), DType::Bf16, &LAYER_SHAPE);
    spec.memory = MemoryKind::Device;
    spec.device_ordinal = 0;
    spec
}

/// An engine whose params are `count` layers of engine-owned GPU memory.
fn engine(count: usize) -> Result<(Manager, Vec<ExportedDeviceBuffer>), String> {
    engine_with(count, NetSettings::default())
}

/// [`engine`] with these network settings.
fn engine_with(
    count: usize,
    net: NetSettings,
) -> Result<(Manager, Vec<ExportedDeviceBuffer>), String> {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        net,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut params = Vec::new();
    for i in 0..count {
        let p = ExportedDeviceBuffer::new("param", 0, LAYER).map_err(|e| e.to_string())?;
        // SAFETY: the GPU memory is returned with the manager and outlives it.
        unsafe { m.register(&device_spec(i), p.ptr() as *mut u8, LAYER) }
            .map_err(|e| e.to_string())?;
        params.push(p);
    }
    Ok((m, params))
}

fn timed(m: &Manager, req: UpdateRequest) -> Result<Duration, String> {
    let t = Instant::now();
    m.update(req).map_err(|e| e.to_string())?;
    Ok(t.elapsed())
}

/// A fresh manager with library-owned device params of `count` layers,
/// updated once from the snapshot in `dir`.
fn library_owned(dir: &Path, count: usize, swap: bool) -> Result<Manager, String> {
    library_owned_logged(dir, count, swap, Logger::default())
}

fn library_owned_logged(
    dir: &Path,
    count: usize,
    swap: bool,
    logger: Logger,
) -> Result<Manager, String> {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        swap_device_pages: swap,
        logger,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    for i in 0..count {
        m.allocate(&device_spec(i)).map_err(|e| e.to_string())?;
    }
    m.update(UpdateRequest::snapshot(dir))
        .map_err(|e| e.to_string())?;
    Ok(m)
}

/// Library-owned device params updated atomically, best of [`RUNS`]
/// after a warm-up, with the device page swap on or off.
fn library_owned_atomic(dir: &Path, count: usize, swap: bool) -> Result<Duration, String> {
    let m = library_owned(dir, count, swap)?;
    best(|| timed(&m, UpdateRequest::snapshot(dir)))
}

pub fn run(a: &Args) -> Result<(), String> {
    let c = cuda().map_err(|e| format!("wm bench gpu needs a GPU: {e}"))?;
    let (name, _) = c.device_info(0).map_err(|e| e.to_string())?;
    let count = layer_count(a.gib);
    let total = count * LAYER;
    let scratch = Scratch::temp("wm-bench-gpu")?;
    let dir = &scratch.0;
    write_layers(dir, count)?;
    std::fs::write(dir.join("version.yaml"), "step: gpu-bench\n").map_err(|e| e.to_string())?;
    println!(
        "wm bench gpu: {} of bf16 in {count} tensors of 64 MiB on GPU 0 ({name}), best of {RUNS}",
        fmt::bytes(total as u64)
    );
    let a_buf = ExportedDeviceBuffer::new("floor", 0, total).map_err(|e| e.to_string())?;
    let b_buf = ExportedDeviceBuffer::new("floor", 0, total).map_err(|e| e.to_string())?;
    let htod = gbps(total as u64, pinned_floor(&a_buf, total)?);
    let dtod = gbps(total as u64, dtod_floor(&b_buf, &a_buf, total)?);
    drop((a_buf, b_buf));
    println!("  floor  pinned host to device       {htod:>8.2} GB/s");
    println!("  floor  device to device            {dtod:>8.2} GB/s");
    snapshot_rows(dir, count, htod)?;
    ipc_row(dir, count, dtod)?;
    clear_rows(dir, count)?;
    gdr::gdr_rows(dir, count, total)?;
    torch_peers::torch_rows(dir, count, total as u64)?;
    quant::quant_rows(total.min(1 << 30), dtod)?;
    hash::hash_rows(count, LAYER, dtod)?;
    let plain = gbps(total as u64, library_owned_atomic(dir, count, false)?);
    let one_call = library_owned_atomic(dir, count, true)?;
    let swapped = gbps(total as u64, one_call);
    println!(
        "  wm     atomic, device page swap    {swapped:>8.2} GB/s   ratio {:.2} to uploading into the params ({plain:.2} GB/s; informational)",
        swapped / plain
    );
    staged_row(dir, count, one_call)
}

/// Two-phase updates of library-owned device params with the device page
/// swap: the pause (the commit: uploads happened while staging, so it is
/// the remap) beside the one-call atomic update with the swap
/// (`one_call`; target: at most 2% of it).
fn staged_row(dir: &Path, count: usize, one_call: Duration) -> Result<(), String> {
    let log = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
    let keep = Arc::clone(&log);
    let logger = Logger::closure(LogLevel::Debug, move |_, line| {
        keep.lock()
            .unwrap()
            .push((Instant::now(), line.to_string()))
    });
    let m = Arc::new(library_owned_logged(dir, count, true, logger)?);
    let run = &mut 0;
    let (pause, parts) = best_pause(&m, dir, &log, run)?;
    let gib = (count * LAYER) as f64 / (1u64 << 30) as f64;
    let r = pause.as_secs_f64() / one_call.as_secs_f64();
    println!(
        "  wm     staged commit (device swap)  {:>8} ({} per GiB)   {:.2}% of the one-call update ({}; target <= 2%) {}",
        fmt::ms(pause),
        fmt::ms(pause.div_f64(gib)),
        r * 100.0,
        fmt::ms(one_call),
        verdict(r <= 0.02)
    );
    println!("         where that pause went: {parts}");
    match swap_floor::swap_floors(count, LAYER, 2 * RUNS) {
        Ok((apart, together, [u, m, a])) => println!(
            "  floor  the swaps' driver calls alone {:>8} a param at a time (unmap {}, map {}, access {}); {} in one reservation (one unmap, a map per param, one access)",
            fmt::ms(apart),
            fmt::ms(u),
            fmt::ms(m),
            fmt::ms(a),
            fmt::ms(together)
        ),
        Err(e) => println!("  floor  the swaps' driver calls alone: {e}"),
    }
    Ok(())
}

/// The shortest staged commit of [`RUNS`] + 1 (and its breakdown from the
/// manager's debug lines in `log`).
fn best_pause(
    m: &Arc<Manager>,
    dir: &Path,
    log: &Mutex<Vec<(Instant, String)>>,
    run: &mut u64,
) -> Result<(Duration, String), String> {
    let (mut pause, mut parts) = (Duration::MAX, String::new());
    for _ in 0..=RUNS {
        *run += 1;
        let mut req = UpdateRequest::snapshot(dir);
        req.version = Some(format!("bench-{run}"));
        let staged = m.stage(req).map_err(|e| e.to_string())?;
        log.lock().unwrap().clear();
        let start = Instant::now();
        staged.commit().map_err(|e| e.to_string())?;
        let end = Instant::now();
        if end - start < pause {
            pause = end - start;
            parts = pause_parts(&log.lock().unwrap(), start, end);
        }
    }
    Ok((pause, parts))
}

/// A staged commit's pause (`start..end`) cut at the manager's debug
/// lines: the decision reaching the update thread, the applier's commit
/// (and its device page swap), what the update did after, and the thread
/// ending (its resources dropped) until `commit` returned.
fn pause_parts(log: &[(Instant, String)], start: Instant, end: Instant) -> String {
    let at = |needle: &str| log.iter().find(|(_, l)| l.contains(needle));
    let (Some((gate, _)), Some((applied, line))) = (at(": committing"), at("committed in")) else {
        return "(the manager's debug lines were not logged)".into();
    };
    let commit = line.split("committed in ").nth(1).unwrap_or("?");
    format!(
        "decision to the update thread {}, commit {commit} ended {} later, then the thread's end {}",
        fmt::ms(gate.saturating_duration_since(start)),
        fmt::ms(applied.saturating_duration_since(*gate)),
        fmt::ms(end.saturating_duration_since(*applied)),
    )
}

/// Snapshot into engine-owned device params, in place and atomic, beside
/// pinned host-to-device (`htod`, GB/s).
fn snapshot_rows(dir: &Path, count: usize, htod: f64) -> Result<(), String> {
    let total = (count * LAYER) as u64;
    let read = page_cache_floor(dir, total as usize)?;
    println!("  floor  page cache -> host memory     {read:>8.2} GB/s   (the snapshot's other bound: its bytes read on every core)");
    let (m, _params) = engine(count)?;
    for (mode, label) in [(Mode::InPlace, "in-place"), (Mode::Atomic, "atomic  ")] {
        let d = best(|| {
            let mut req = UpdateRequest::snapshot(dir);
            req.mode = mode;
            timed(&m, req)
        })?;
        let r = gbps(total, d) / htod;
        let target = if mode == Mode::InPlace {
            format!(
                "(target >= 0.85) {}; {:.2} to the slower bound",
                verdict(r >= 0.85),
                gbps(total, d) / htod.min(read)
            )
        } else {
            "(stages the whole update first: informational)".into()
        };
        println!(
            "  wm     snapshot -> GPU, {label}    {:>8.2} GB/s   ratio {r:.2} to pinned HtoD {target}",
            gbps(total, d)
        );
    }
    Ok(())
}

/// The snapshot file's bytes read from the page cache into ordinary
/// (pre-faulted) host memory on every core, GB/s: the host half of the
/// snapshot's pipeline, as pinned HtoD is the device half.
fn page_cache_floor(dir: &Path, total: usize) -> Result<f64, String> {
    let file = std::fs::File::open(dir.join("model_state.tp0.0.safetensors"))
        .map_err(|e| e.to_string())?;
    let mut dst = super::harness::buffer(total);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let d = best(|| super::harness::floors::read_floor(&file, 0, &mut dst, threads))?;
    Ok(gbps(total as u64, d))
}

/// IPC device to device from a `wm serve --gpu` trainer process, beside
/// a plain device-to-device copy (`dtod`, GB/s).
fn ipc_row(dir: &Path, count: usize, dtod: f64) -> Result<(), String> {
    let total = (count * LAYER) as u64;
    let sock = dir.join("trainer.sock");
    let trainer = serve_from_gpu(dir, &sock, RUNS + 1)?;
    let (m, _params) = engine(count)?;
    first_session(&m, &sock)?;
    let d = best(|| timed(&m, ipc_request(&sock)))?;
    let r = gbps(total, d) / dtod;
    println!(
        "  wm     IPC device -> device        {:>8.2} GB/s   ratio {r:.2} to DtoD (target >= 0.90) {}",
        gbps(total, d),
        verdict(r >= 0.9)
    );
    trainer.finish()?;
    Ok(())
}

/// `wm serve --ipc sock` of `dir` from GPU 0 for `sessions` engine
/// sessions, once it has published.
fn serve_from_gpu(dir: &Path, sock: &Path, sessions: usize) -> Result<Proc, String> {
    let sessions = sessions.to_string();
    let mut trainer = Proc::wm(&[
        "serve".as_ref(),
        "--ipc".as_ref(),
        sock.as_os_str(),
        dir.as_os_str(),
        "--gpu".as_ref(),
        "0".as_ref(),
        "--engines".as_ref(),
        sessions.as_ref(),
    ])?;
    trainer.line_after("wm serve: published")?;
    Ok(trainer)
}

/// An in-place IPC update from the trainer at `sock`.
fn ipc_request(sock: &Path) -> UpdateRequest<'_> {
    let mut req = UpdateRequest::snapshot(sock);
    req.source = SourceKind::Ipc;
    req.mode = Mode::InPlace;
    req
}

/// The first session: waits for the trainer to listen, and opens its
/// buffer for the first time (untimed).
fn first_session(m: &Manager, sock: &Path) -> Result<(), String> {
    let start = Instant::now();
    while let Err(e) = m.update(ipc_request(sock)) {
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!("the trainer did not serve: {e}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Clear and restore of library-owned device params, per GiB.
fn clear_rows(dir: &Path, count: usize) -> Result<(), String> {
    let m = library_owned(dir, count, false)?;
    let steady = best(|| timed(&m, UpdateRequest::snapshot(dir)))?;
    let t = Instant::now();
    let cleared = m.clear().map_err(|e| e.to_string())?;
    let clear = t.elapsed();
    let after = timed(&m, UpdateRequest::snapshot(dir))?;
    let gib = (count * LAYER) as f64 / (1u64 << 30) as f64;
    println!(
        "  wm     clear (library-owned)       {:>8} per GiB ({} freed, by the driver's count)",
        fmt::ms(clear.div_f64(gib)),
        fmt::bytes(cleared.device_bytes_freed)
    );
    println!(
        "  wm     restore (map + zero)        {:>8} per GiB (update after clear {} - steady update {})",
        fmt::ms(after.saturating_sub(steady).div_f64(gib)),
        fmt::ms(after),
        fmt::ms(steady)
    );
    Ok(())
}
