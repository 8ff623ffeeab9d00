//! `wm`: the weight_manager command line.
//!
//! Every command (each in its own file, its options a `clap` struct there;
//! `wm <command> --help` lists them):
//! - `wm demo`: one engine rank with host params through init, update from a
//!   snapshot, clear, update again; prints a table and a verdict.
//! - `wm inspect <file|dir>`: tensors, dtypes, shapes, bytes, version.
//! - `wm manifest <dir>`: write `wm_checksums.json` for the snapshot in `dir`.
//! - `wm shard <file|dir> --out DIR --ranks N`: per-rank shard files, each
//!   tensor's placement in its file's metadata.
//! - `wm plan --trainer T.json --engine E.json`: plan every engine rank of
//!   two layouts (no weights, no memory): runs, bytes per rank, busiest
//!   link, predicted transfer time (`docs/layouts.md`).
//! - `wm bench <kind>` (folder `bench/`, one harness shared by every bench):
//!   - `wm bench snapshot`: snapshot update throughput beside its floors.
//!   - `wm bench signal`: per-step latency of the signal across real ranks.
//!   - `wm bench ipc`: same-node IPC update throughput beside its floor.
//!   - `wm bench net`: rdma over UCX beside the raw UCX floor.
//!   - `wm bench gpu`: device params on a real GPU beside their floors.
//!   - `wm bench quant`: FP8 block quantization beside memcpy and PyTorch.
//!   - `wm bench delta`: deltas between training steps beside memcpy and
//!     PyTorch.
//!   - `wm bench shard`: sharded updates (planning; snapshot, UCX and IPC
//!     ranks) beside their targets and floors.
//! - `wm serve --ipc | --net`: the trainer side, publishing a snapshot.
//! - `wm pull --ipc | --net`: an engine rank that checks what it received.
//! - `wm signal get|set|wait|request`: the controller's side of the cell.
//! - `wm worker`: the engine's worker loop as a real rank.
//! - `wm devices`: what the CUDA backend sees, or why it cannot work.
//! - `wm --version`: the library's version.
//!
//! Options that take `true` or `false` (`wm pull --verify true`) also take
//! 1/0, yes/no and on/off ([`truth`]). An option given twice takes the last
//! value.

#![cfg_attr(not(test), warn(clippy::undocumented_unsafe_blocks))]

mod bench;
mod demo;
mod fixtures;
mod fmt;
mod inspect;
mod ipc;
mod leftovers;
mod plan;
mod shard;
mod signal;
mod worker;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

/// The version `wm --version` prints; "(test hooks)" after it in a build
/// with the core's test hooks, which the integration tests check for.
const VERSION: &str = if weight_manager_core::TEST_HOOKS {
    concat!(env!("CARGO_PKG_VERSION"), " (test hooks)")
} else {
    env!("CARGO_PKG_VERSION")
};

/// The weight_manager command line.
#[derive(Parser, Debug)]
#[command(name = "wm", version = VERSION, about, propagate_version = false)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// One engine rank through init, update, clear and update again
    Demo(demo::Args),
    /// Tensors, dtypes, shapes, bytes and version of a snapshot
    Inspect(inspect::InspectArgs),
    /// Write wm_checksums.json for the snapshot in a folder
    Manifest(inspect::ManifestArgs),
    /// Per-rank shard files, each tensor's placement in their metadata
    Shard(shard::Args),
    /// Plan every engine rank of two layouts, no weights moved (docs/layouts.md)
    Plan(plan::Args),
    /// Benchmarks, each figure beside its floor or target
    #[command(subcommand)]
    Bench(bench::Bench),
    /// The trainer side: publish a snapshot over IPC or the network
    Serve(ipc::ServeArgs),
    /// An engine rank that pulls an update and checks what it received
    Pull(ipc::PullArgs),
    /// The controller's side of the control cell
    Signal(signal::Args),
    /// The engine's worker loop as a real rank
    Worker(worker::Args),
    /// What the CUDA backend sees, or why it cannot work
    Devices,
    /// The library's version (as --version)
    #[command(hide = true)]
    Version,
}

/// A true/false option's value: true/false, 1/0, yes/no, on/off.
pub fn truth(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("true or false".into()),
    }
}

/// The longest wait an option may ask for: 7 days.
const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// A wait in seconds: a number from 0 to 7 days (NaN, infinities and
/// negative values are refused, naming the value).
pub fn seconds(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(s) if (0.0..=MAX_SECONDS).contains(&s) => Ok(s),
        _ => Err(format!(
            "seconds from 0 to {MAX_SECONDS} (7 days), not '{v}'"
        )),
    }
}

/// A wait in milliseconds: a whole number from 0 to 7 days.
pub fn millis(v: &str) -> Result<u64, String> {
    match v.trim().parse::<u64>() {
        Ok(ms) if ms as f64 <= MAX_SECONDS * 1000.0 => Ok(ms),
        _ => Err(format!(
            "milliseconds from 0 to {} (7 days), not '{v}'",
            MAX_SECONDS as u64 * 1000
        )),
    }
}

/// A bucket size in MiB: 1 to 4096.
pub fn bucket_mib(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(m) if (1..=4096).contains(&m) => Ok(m),
        _ => Err(format!("MiB from 1 to 4096, not '{v}'")),
    }
}

/// A count of runs, pairs, steps or ranks: at least 1 (0 printed
/// verdicts of no measurement, or waited on a child that had nothing to
/// report).
pub fn count(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("a whole number of at least 1, not '{v}'")),
    }
}

/// A model size in GiB for a benchmark: from 0 up to this machine's
/// memory (every benchmark holds its model in memory at least once; more
/// ran until the disk or memory filled). 0 means what each flag's help
/// says (a section skipped, or the smallest model: one tensor).
pub fn gib(v: &str) -> Result<f64, String> {
    let total = memory_gib();
    match v.trim().parse::<f64>() {
        Ok(g) if g >= 0.0 && g <= total => Ok(g),
        Ok(g) if g > total && g.is_finite() => Err(format!(
            "{g} GiB is more than this machine's {total:.1} GiB of memory (the benchmark holds \
             its model in memory)"
        )),
        _ => Err(format!(
            "GiB from 0 to {total:.1} (this machine's memory), not '{v}'"
        )),
    }
}

/// This machine's memory in GiB (`MemTotal`; unbounded where unknown).
fn memory_gib() -> f64 {
    let total = weight_manager_core::internals::memory::host::meminfo("MemTotal");
    total.map_or(f64::INFINITY, |b| b as f64 / (1u64 << 30) as f64)
}

/// A number of ranks to run: 1 to 1024.
pub fn rank_count(v: &str) -> Result<u32, String> {
    match v.trim().parse::<u32>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(format!("ranks from 1 to 1024, not '{v}'")),
    }
}

/// `c` and every subcommand under it: an option given twice takes the
/// last value.
fn last_wins(c: clap::Command) -> clap::Command {
    let names: Vec<String> = c
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    names.iter().fold(c.args_override_self(true), |c, n| {
        c.mut_subcommand(n, last_wins)
    })
}

fn run(command: &Command) -> Result<(), String> {
    match command {
        Command::Demo(a) => demo::run(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Manifest(a) => inspect::manifest(a),
        Command::Shard(a) => shard::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Serve(a) => ipc::serve(a),
        Command::Pull(a) => ipc::pull(a),
        Command::Signal(a) => signal::run(a),
        Command::Worker(a) => worker::run(a),
        Command::Devices => devices(),
        Command::Version => {
            println!("wm {VERSION}");
            Ok(())
        }
    }
}

/// `wm devices`: what the CUDA backend sees; fails with the reason when
/// device params cannot work here.
fn devices() -> Result<(), String> {
    let cuda = weight_manager_core::internals::memory::cuda::cuda().map_err(|e| e.to_string())?;
    println!("{}", cuda.describe());
    for d in 0..cuda.device_count() {
        let (name, total) = cuda.device_info(d).map_err(|e| e.to_string())?;
        println!("  GPU {d}: {name}, {}", fmt::bytes(total as u64));
    }
    Ok(())
}

fn main() -> ExitCode {
    // A closed stdout (`wm inspect DIR | head -1`) ends wm quietly, as it
    // does any command line tool, instead of a panic in println!.
    // SAFETY: setting a signal's disposition to the default, at start-up.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    leftovers::watch();
    let matches = last_wins(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match run(&cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wm: {e}");
            ExitCode::FAILURE
        }
    }
}
