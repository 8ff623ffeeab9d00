//! `wm bench signal`: per-step latency of `wm_broadcast_signal`, with real
//! processes as ranks, beside two floors measured in the same run:
//! (a) the old loop's CPU cost, a Python multiprocessing broadcast plus a
//! barrier per step; (b) one uncontended shared-memory read, timed the same
//! way as the calls (so both include the clock reads).
//!
//! Every rank times each call and reports its p50 and p99; the figure shown is
//! the worst rank's. Ranks do `--work-us` of sleep between steps, as an engine
//! does its forward pass; on a machine with fewer cores than ranks, the p99
//! includes scheduling delays of the oversubscribed cores.

use super::harness::process::Proc;
use super::harness::{python, verdict};
use std::process::Command;
use std::time::{Duration, Instant};
use weight_manager_core::internals::signal::shm::{self, OpenMode, SharedMapping};
use weight_manager_core::{GroupSettings, Manager, ManagerConfig};

const BASELINE: &str = include_str!("signal_baseline.py");

/// `wm bench signal` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Steps per rank
    #[arg(long, default_value_t = 20_000, value_parser = crate::count)]
    steps: usize,
    /// Rank counts to run, comma-separated
    #[arg(long, default_value = "2,4,8", value_delimiter = ',', value_parser = crate::rank_count)]
    ranks: Vec<u32>,
    /// Sleep between steps, in microseconds (an engine's forward pass)
    #[arg(long, default_value_t = 50)]
    work_us: u64,
}

/// `wm bench signal-rank` options (one rank, a child process).
#[derive(clap::Args, Debug)]
pub struct RankArgs {
    #[arg(long)]
    group: String,
    #[arg(long, default_value_t = 0)]
    rank: u32,
    #[arg(long, default_value_t = 2)]
    world: u32,
    #[arg(long, default_value_t = 20_000, value_parser = crate::count)]
    steps: usize,
    #[arg(long, default_value_t = 50)]
    work_us: u64,
    /// The control cell (default: none, the signal is NORMAL)
    #[arg(long)]
    cell: Option<String>,
}

fn percentiles(mut v: Vec<u64>) -> (u64, u64) {
    v.sort_unstable();
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

/// One rank of the benchmark (a child process).
pub fn rank(a: &RankArgs) -> Result<(), String> {
    let (rank, steps) = (a.rank, a.steps);
    let work = Duration::from_micros(a.work_us);
    let m = Manager::new(ManagerConfig {
        rank,
        world_size: a.world,
        control_cell: a.cell.clone(),
        group: Some(GroupSettings {
            name: a.group.clone(),
            local_rank: None,
            local_world_size: None,
            node_rank: 0,
            addr: None,
            timeout: Duration::from_secs(30),
        }),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let warmup = steps / 10;
    let mut lat = Vec::with_capacity(steps);
    for i in 0..steps + warmup {
        let t = Instant::now();
        m.broadcast_signal()
            .map_err(|e| format!("rank {rank}: {e}"))?;
        let dt = t.elapsed().as_nanos() as u64;
        if i >= warmup {
            lat.push(dt);
        }
        if !work.is_zero() {
            std::thread::sleep(work);
        }
    }
    let (p50, p99) = percentiles(lat);
    println!("{p50} {p99}");
    Ok(())
}

fn run_ranks(n: u32, steps: usize, work_us: u64, cell: Option<&str>) -> Result<(u64, u64), String> {
    let group = format!("wmbench{}n{n}{}", std::process::id(), cell.is_some() as u8);
    let (world, steps, work_us) = (n.to_string(), steps.to_string(), work_us.to_string());
    let children: Vec<Proc> = (0..n)
        .map(|r| {
            let rank = r.to_string();
            let mut args = vec!["bench", "signal-rank", "--group", &group, "--rank", &rank];
            args.extend(["--world", &world, "--steps", &steps, "--work-us", &work_us]);
            if let Some(cell) = cell {
                args.extend(["--cell", cell]);
            }
            Proc::wm(&args)
        })
        .collect::<Result<_, _>>()?;
    let mut worst = (0, 0);
    for mut c in children {
        let v = c.numbers_after("")?;
        c.finish()
            .map_err(|e| format!("a benchmark rank failed: {e}"))?;
        if v.len() != 2 {
            return Err(format!("unexpected rank output {v:?}"));
        }
        worst = (worst.0.max(v[0]), worst.1.max(v[1]));
    }
    Ok(worst)
}

fn shm_read_floor() -> Result<(u64, u64), String> {
    let name = format!("wmbench_floor_{}", std::process::id());
    let _ = shm::unlink(&name);
    let map = SharedMapping::open(&name, 4, OpenMode::CreateNew)
        .map_err(|e| e.to_string())?
        .ok_or("the floor's shared word exists already")?;
    let _ = shm::unlink(&name);
    // SAFETY: a 4-byte aligned shared word read atomically.
    let word = unsafe { &*(map.ptr() as *const std::sync::atomic::AtomicI32) };
    let lat: Vec<u64> = (0..200_000)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(word.load(std::sync::atomic::Ordering::Acquire));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    Ok(percentiles(lat))
}

fn python_baseline(n: u32, steps: usize) -> Result<(u64, u64), String> {
    let python = python();
    let out = Command::new(&python)
        .args(["-c", BASELINE, &n.to_string(), &steps.to_string()])
        .output()
        .map_err(|e| format!("running {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "python baseline failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    match v.as_slice() {
        [a, b] => Ok((*a, *b)),
        _ => Err("python baseline printed no figures".into()),
    }
}

fn us(ns: u64) -> String {
    format!("{:.2} us", ns as f64 / 1e3)
}

pub fn run(a: &Args) -> Result<(), String> {
    let (steps, work_us, ranks) = (a.steps, a.work_us, &a.ranks);
    println!(
        "wm bench signal: {steps} steps per rank, {work_us} us of work between steps, {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let (floor50, floor99) = shm_read_floor()?;
    println!(
        "  floor  one shared-memory read               p50 {:>10}  p99 {:>10}",
        us(floor50),
        us(floor99)
    );
    let (py50, py99) = python_baseline(2, steps.min(20_000))?;
    println!(
        "  floor  Python broadcast+barrier, 2 ranks    p50 {:>10}  p99 {:>10}",
        us(py50),
        us(py99)
    );
    for &n in ranks {
        let (p50, p99) = run_ranks(n, steps, work_us, None)?;
        let mut line = format!(
            "  wm     NORMAL, {n} ranks                     p50 {:>10}  p99 {:>10}  {:>6.1}x faster than Python, {:.1}x the shm read",
            us(p50),
            us(p99),
            py50 as f64 / p50.max(1) as f64,
            p50 as f64 / floor50.max(1) as f64
        );
        if n == 2 {
            let ok = p50 <= 2_000 && py50 >= 50 * p50;
            line.push_str(&format!(
                "  (target p50 <= 2 us and >= 50x: {})",
                verdict(ok)
            ));
        }
        println!("{line}");
    }
    barrier_row(*ranks.iter().max().unwrap_or(&8), steps, work_us)
}

/// The largest rank count with the signal not NORMAL: every step a barrier.
fn barrier_row(n: u32, steps: usize, work_us: u64) -> Result<(), String> {
    let cell = format!("wmbench_cell_{}", std::process::id());
    let c = weight_manager_core::internals::signal::ControlCell::open_or_create(&cell)
        .map_err(|e| e.to_string())?;
    c.store(weight_manager_core::State::Cleared as i32)
        .map_err(|e| e.to_string())?;
    let barrier = run_ranks(n, (steps / 4).max(1000), work_us, Some(&cell));
    let _ = shm::unlink(&cell);
    let _ = shm::unlink(&format!("{cell}.wm_report"));
    let (b50, b99) = barrier?;
    println!(
        "  wm     non-NORMAL (barrier), {n} ranks       p50 {:>10}  p99 {:>10}  (target within 1 ms: {})",
        us(b50),
        us(b99),
        if b99 <= 1_000_000 { "PASS at p99" } else if b50 <= 1_000_000 { "PASS at p50, MISS at p99" } else { "MISS" }
    );
    Ok(())
}
