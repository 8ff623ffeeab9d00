//! `wm bench ipc`: a model over host shared memory from a trainer process
//! (the publisher, its own process) into this engine process, in copy mode
//! (into registered params) and zero-copy mode (per-tensor callback on the
//! shared buffer), beside a memcpy floor measured in the same run.
//!
//! Two ways a trainer serves, each measured:
//! - **published** (the RL loop): the trainer publishes each version
//!   (`Publisher::publish`, one copy into shared memory, reported as its
//!   packing time) and every session hands that memory over as it is; the
//!   engine's copy into its params is the only copy during the update.
//! - **live**: the trainer serves its own tensors and packs them per
//!   session into two alternating bucket buffers, bucket i+1 while the
//!   engine applies bucket i. Both copies run at once, so this one shares
//!   memory bandwidth; its second floor is two memcpys running together.
//!
//! In each way, a TP rank's row half and column half of every layer too,
//! verified with slice checksums and not.
//!
//! Each side gets half of the cores (as on a real node, where both have
//! their own). Each engine's first updates map the trainer's buffers (page
//! faults, slow on a VM); steady RL updates reuse the mappings, as timed
//! after them. A publish that creates its buffer writes it in one pass
//! (`publisher/versions.rs`); its floor is the plain way's two: faulting
//! in fresh memory (the kernel zeroes it), then a memcpy into it.

use super::harness::floors::memcpy_floor;
use super::harness::process::Proc;
use super::harness::{best, buffer, per_byte, verdict, Floors};
use super::model::{self, layer_count, HALVES};
use crate::fmt::{self, gbps};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest, UpdateStats};
use weight_manager_core::{Mode, TensorView};
use weight_manager_core::{Publisher, PublisherConfig};

/// Updates before the timed one: a publisher rotates its published
/// versions through `keep_versions + 1` buffers, which the engine maps
/// once each.
const WARM_UPS: usize = weight_manager_core::defaults::KEEP_VERSIONS + 1;

/// `wm bench ipc` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: model::ModelArgs,
    /// Threads for each side (default: half of the cores)
    #[arg(long)]
    threads: Option<usize>,
}

/// `wm bench ipc-publisher` options (the trainer process).
#[derive(clap::Args, Debug)]
pub struct PublisherArgs {
    #[arg(long)]
    socket: PathBuf,
    /// published or live
    #[arg(long, default_value = "live")]
    mode: String,
    #[arg(long, default_value_t = 4.0, value_parser = crate::gib)]
    gib: f64,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, default_value_t = 512)]
    bucket_mib: usize,
    /// Sessions to serve (default: what `wm bench ipc` runs in that mode)
    #[arg(long)]
    engines: Option<usize>,
}

/// The trainer process: builds the model in memory and serves it, either
/// publishing a new version before each session or live.
pub fn publisher(a: &PublisherArgs) -> Result<(), String> {
    let published = a.mode == "published";
    let count = layer_count(a.gib);
    // A TP rank's halves too, verified and not, after warm-ups (`halves`).
    let halves = (halves_warm_ups(published) + 2) * HALVES.len();
    let engines = a.engines.unwrap_or(2 * (WARM_UPS + 1) + halves);
    let (threads, bucket_mib, socket) = (a.threads, a.bucket_mib, &a.socket);
    let data = model::trainer_layers(count);
    let p = Publisher::bind(
        socket,
        PublisherConfig {
            bucket_size: bucket_mib << 20,
            threads,
            // Live: hashed once, by the first session of the serve call
            // (a warm-up), for the verified halves.
            checksums: !published,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    model::add_layers(&p, &data, None)?;
    // Published: the buffers are made before the first step, as a trainer
    // does with `prepare`; the publishes then all copy into ready ones.
    let t = Instant::now();
    let prepared = match published {
        true => p.prepare(0).map_err(|e| e.to_string())?,
        false => 0,
    };
    println!("ready {prepared} {}", t.elapsed().as_nanos());
    let mut lines = Vec::new();
    if published {
        for k in 0..engines {
            p.set_version(Some(format!("v{k}")));
            let t = Instant::now();
            p.publish().map_err(|e| e.to_string())?;
            let publish = t.elapsed();
            let mut stats = p
                .serve(1, Duration::from_secs(600))
                .map_err(|e| e.to_string())?;
            let s = stats.sessions.pop().ok_or("no session")?;
            lines.push((s.bytes, publish, s.wait));
        }
    } else {
        p.set_version(Some("bench".into()));
        let stats = p
            .serve(engines, Duration::from_secs(600))
            .map_err(|e| e.to_string())?;
        lines.extend(stats.sessions.iter().map(|s| (s.bytes, s.pack, s.wait)));
    }
    for (bytes, pack, wait) in lines {
        println!("session {bytes} {} {}", pack.as_nanos(), wait.as_nanos());
    }
    Ok(())
}

/// A memcpy floor on `bytes` of fresh buffers.
fn memcpy_time(bytes: usize, threads: usize) -> Result<Duration, String> {
    let src = buffer(bytes);
    let mut dst = buffer(bytes);
    best(|| memcpy_floor(&src, &mut dst, threads))
}

/// This bench's floors: the host floors, and two memcpys at once.
struct IpcFloors {
    host: Floors,
    two_at_once: f64,
}

pub fn run(a: &Args) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let side = a.threads.unwrap_or((cores / 2).max(1));
    let count = layer_count(a.model.gib);
    let total = (count * model::LAYER) as u64;
    println!(
        "wm bench ipc: {} of bf16 in {count} tensors, buckets of at most {} MiB, {side} thread(s) each for trainer and engine",
        fmt::bytes(total),
        a.model.bucket_mib
    );
    let floors = measure_floors((1usize << 30).min(total as usize), side)?;
    let mut params = model::layer_params(count);
    for mode in ["published", "live"] {
        run_mode(mode, a, side, &mut params, &floors)?;
    }
    Ok(())
}

/// The floors on `bytes`, printed.
fn measure_floors(bytes: usize, side: usize) -> Result<IpcFloors, String> {
    let host = Floors::measure(&buffer(bytes), &mut buffer(bytes), side)?;
    let memcpy = host.memcpy;
    println!("  floor  memcpy, {side} thread(s)                {memcpy:>7.2} GB/s");
    // Live serving moves every byte twice at once, so its two copies share
    // the memory bandwidth: this floor is two memcpys running together.
    let two = std::thread::scope(|s| {
        let a = s.spawn(|| memcpy_time(bytes, side));
        let b = s.spawn(|| memcpy_time(bytes, side));
        Ok::<_, String>(a.join().expect("floor")?.max(b.join().expect("floor")?))
    })?;
    let two_at_once = gbps(bytes as u64, two);
    println!("  floor  two memcpys at once            {two_at_once:>7.2} GB/s each");
    let floors = IpcFloors { host, two_at_once };
    println!(
        "  floor  fault in fresh memory, memcpy  {:>7.2} GB/s (a first publish done the plain way)",
        per_byte(&[floors.host.fresh, floors.host.memcpy])
    );
    Ok(floors)
}

/// One trainer process serving in `mode`; copy-mode and zero-copy updates
/// from it, each after its warm-ups.
fn run_mode(
    mode: &str,
    a: &Args,
    side: usize,
    params: &mut [Vec<u8>],
    floors: &IpcFloors,
) -> Result<(), String> {
    let scratch = super::harness::Scratch::temp("wm-bench-ipc")?;
    let socket = scratch.0.join("trainer.sock");
    let mut trainer = Proc::wm(&[
        "bench",
        "ipc-publisher",
        "--socket",
        socket.to_str().unwrap_or_default(),
        "--mode",
        mode,
        "--gib",
        &a.model.gib.to_string(),
        "--threads",
        &side.to_string(),
        "--bucket-mib",
        &a.model.bucket_mib.to_string(),
    ])?;
    let prepared = trainer.numbers_after("ready")?;
    let made = prepared.first().zip(prepared.get(1));
    if let Some((&bytes, &nanos)) = made.filter(|(&bytes, _)| bytes > 0) {
        let d = Duration::from_nanos(nanos);
        println!(
            "    trainer prepare (version buffers made before the first step) {} for {} ({:.2} GB/s), {:.2} of faulting in fresh memory",
            fmt::ms(d),
            fmt::bytes(bytes),
            gbps(bytes, d),
            gbps(bytes, d) / per_byte(&[floors.host.fresh])
        );
    }
    let result = measure(&socket, mode, side, params, floors);
    let sessions = trainer.finish();
    let (copy, zero, first) = result?;
    let sessions = sessions?;
    first_rows(mode, &sessions, (&first, &copy), floors);
    let copy_at = WARM_UPS;
    let zero_at = 2 * WARM_UPS + 1;
    for (name, s, engine) in [
        ("copy mode", sessions.get(copy_at), &copy),
        ("zero-copy", sessions.get(zero_at), &zero),
    ] {
        if let Some(s) = s.filter(|s| s.len() == 3) {
            let pack = Duration::from_nanos(s[1]);
            let what = if mode == "published" {
                "trainer publish (its one copy)"
            } else {
                "trainer packing"
            };
            // Steady: the version buffers exist (made by prepare, or by
            // the first publishes); the trainer's copy beside memcpy.
            println!(
                "    {name:<10} {what}, steady {} ({:.2} GB/s, ratio {:.2} to memcpy: target >= 0.80 {}), waiting for acks {}; engine update {}",
                fmt::ms(pack),
                gbps(s[0], pack),
                gbps(s[0], pack) / floors.host.memcpy,
                verdict(gbps(s[0], pack) / floors.host.memcpy >= 0.8),
                fmt::ms(Duration::from_nanos(s[2])),
                fmt::ms(engine.total)
            );
        }
    }
    Ok(())
}

/// What an RL run pays at its start (and whenever buffers are recreated):
/// the trainer's first publishes, which create their shared buffers, and
/// the engine's first updates, which map them; beside the steady ones.
fn first_rows(
    mode: &str,
    sessions: &[Vec<u64>],
    (first, steady): (&[Duration], &UpdateStats),
    floors: &IpcFloors,
) {
    let rate = |bytes: u64, d: Duration| format!("{} ({:.2} GB/s)", fmt::ms(d), gbps(bytes, d));
    let publishes: Vec<(u64, Duration)> = sessions
        .iter()
        .filter(|s| s.len() == 3)
        .take(WARM_UPS + 1)
        .map(|s| (s[0], Duration::from_nanos(s[1])))
        .collect();
    if let (Some(&(bytes, d)), "published") = (publishes.first(), mode) {
        let shown: Vec<String> = publishes.iter().map(|&(b, d)| rate(b, d)).collect();
        println!(
            "    first publishes (into prepared buffers) {}; the first {:.2} of memcpy",
            shown.join(", "),
            gbps(bytes, d) / per_byte(&[floors.host.memcpy])
        );
    }
    let updates: Vec<String> = first.iter().map(|d| rate(steady.bytes, *d)).collect();
    println!(
        "    engine's first updates (map the buffers) {}; steady {}",
        updates.join(", "),
        rate(steady.bytes, steady.total)
    );
}

/// An in-place update from the publisher at `socket`.
fn request<'a>(socket: &std::path::Path) -> UpdateRequest<'a> {
    let mut r = UpdateRequest::snapshot(socket);
    r.source = SourceKind::Ipc;
    r.mode = Mode::InPlace;
    r
}

/// Long enough for the trainer to publish `bytes` (at 1 GB/s, well below
/// what its copy runs at once its buffers exist) before the engine asks.
fn publish_gap(bytes: usize) -> Duration {
    Duration::from_millis(50) + Duration::from_secs_f64(bytes as f64 / 1e9)
}

/// The copy-mode and zero-copy updates of one mode, printed with their ratios.
fn measure(
    socket: &std::path::Path,
    mode: &str,
    side: usize,
    params: &mut [Vec<u8>],
    floors: &IpcFloors,
) -> Result<(UpdateStats, UpdateStats, Vec<Duration>), String> {
    println!("  {mode}:");
    let m = Manager::new(ManagerConfig {
        threads: side,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    model::register_layers(&m, params)?;
    let bytes: usize = params.iter().map(|p| p.len()).sum();
    // The whole update (connecting, planning and committing included), as
    // every other bench times it: receiving alone left them out. A
    // published version is published before the engine asks for it (in
    // an RL loop the engine updates once told the step's version is
    // out), so the engine does not time the trainer's publish.
    let ask = |m: &Manager| {
        if mode == "published" {
            std::thread::sleep(publish_gap(bytes));
        }
        m.update(request(socket)).map_err(|e| e.to_string())
    };
    let mut first = Vec::new();
    for _ in 0..WARM_UPS {
        first.push(ask(&m)?.total);
    }
    let copy = ask(&m)?;
    let rate = gbps(copy.bytes, copy.total);
    let ratio = rate / floors.host.memcpy;
    print!(
        "    copy mode (into params)         {rate:>7.2} GB/s   ratio {ratio:.2} to memcpy (target >= 0.80) {}",
        verdict(ratio >= 0.8),
    );
    if mode == "live" {
        print!("; {:.2} to two memcpys at once", rate / floors.two_at_once);
    }
    println!();
    let zero = Manager::new(ManagerConfig::default()).map_err(|e| e.to_string())?;
    let touched = std::cell::Cell::new(0u64);
    let mut last = None;
    for _ in 0..=WARM_UPS {
        let mut cb = |t: &TensorView| {
            touched.set(touched.get() + t.data[t.data.len() / 2] as u64);
            Ok(())
        };
        let mut r = request(socket);
        r.hooks.tensor = Some(&mut cb);
        if mode == "published" {
            std::thread::sleep(publish_gap(bytes));
        }
        last = Some(zero.update(r).map_err(|e| e.to_string())?);
    }
    let zc = last.expect("updates ran");
    let rate = gbps(zc.bytes, zc.total);
    // The callback reads one byte per tensor, so this times the session
    // itself: for a published version nothing is copied at all.
    println!(
        "    zero-copy (callback on buffer)  {rate:>7.2} GB/s   {} for the update",
        fmt::ms(zc.total)
    );
    std::hint::black_box(touched.get());
    let gap = (mode == "published").then(|| publish_gap(bytes));
    halves(socket, side, params.len(), gap, floors)?;
    Ok((copy, zc, first))
}

/// Updates of a TP half before the timed ones: a published version's
/// rotate through buffers a fresh manager maps once each (as for the copy
/// mode: `WARM_UPS`); live ones through the same two.
fn halves_warm_ups(published: bool) -> usize {
    if published {
        WARM_UPS
    } else {
        1
    }
}

/// A TP rank's halves of every layer (`model::HALVES`), verified with
/// the publisher's slice checksums and unverified, one run each after
/// warm-ups; each after `gap` when the trainer publishes before every
/// session. From a published version the engine copies each half's blocks
/// straight out of the version's buffer (one copy); from live tensors
/// the trainer packs them first (two).
fn halves(
    socket: &std::path::Path,
    side: usize,
    count: usize,
    gap: Option<Duration>,
    floors: &IpcFloors,
) -> Result<(), String> {
    for (what, dim) in HALVES {
        let m = Manager::new(ManagerConfig {
            threads: side,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
        model::half_params(&m, count, dim)?;
        let run = |verify: bool| {
            if let Some(gap) = gap {
                std::thread::sleep(gap);
            }
            let mut r = request(socket);
            r.verify = verify;
            m.update(r).map_err(|e| e.to_string())
        };
        for _ in 0..halves_warm_ups(gap.is_some()) {
            run(true)?; // faults the params, maps the buffers
        }
        let (v, u) = (run(true)?, run(false)?);
        let (vr, ur) = (gbps(v.bytes, v.total), gbps(u.bytes, u.total));
        println!(
            "    {what:<34}{vr:>7.2} GB/s   ratio {:.2} to memcpy; unverified {ur:.2} GB/s ({:.2}); {} (one run each)",
            vr / floors.host.memcpy,
            ur / floors.host.memcpy,
            fmt::bytes(v.bytes)
        );
    }
    Ok(())
}
