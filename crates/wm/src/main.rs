//! `wm`: the weight_manager command line.
//!
//! Every command (options: `USAGE` below; each in its own file):
//! - `wm demo`: one engine rank with host params through init, update from a
//!   snapshot, clear, update again; prints a table and a verdict.
//! - `wm inspect <file|dir>`: tensors, dtypes, shapes, bytes, version.
//! - `wm manifest <dir>`: write `wm_checksums.json` for the snapshot in `dir`.
//! - `wm shard <file|dir> --out DIR --ranks N`: per-rank shard files, each
//!   tensor's placement in its file's metadata.
//! - `wm plan --trainer T.json --engine E.json`: plan every engine rank of
//!   two layouts (no weights, no memory): runs, bytes per rank, busiest
//!   link, predicted transfer time (`docs/layouts.md`).
//! - `wm bench snapshot`: snapshot update throughput beside its floors.
//! - `wm bench signal`: per-step latency of the signal across real ranks.
//! - `wm bench ipc`: same-node IPC update throughput beside its floor.
//! - `wm bench net`: rdma over UCX beside the raw UCX floor.
//! - `wm bench gpu`: device params on a real GPU beside their floors.
//! - `wm bench quant`: FP8 block quantization beside memcpy and PyTorch.
//! - `wm bench delta`: deltas between training steps beside memcpy and PyTorch.
//! - `wm bench shard`: sharded updates (planning; snapshot ranks slicing
//!   one checkpoint) beside their targets and floors.
//! - `wm serve --ipc | --net`: the trainer side, publishing a snapshot.
//! - `wm pull --ipc | --net`: an engine rank that checks what it received.
//! - `wm signal get|set|wait|request`: the controller's side of the cell.
//! - `wm worker`: the engine's worker loop as a real rank.
//! - `wm devices`: what the CUDA backend sees, or why it cannot work.
//! - `wm --version`: the library's version.

mod bench;
mod bench_atomic;
mod bench_delta;
mod bench_floors;
mod bench_gpu;
mod bench_ipc;
mod bench_net;
mod bench_quant;
mod bench_shard;
mod bench_signal;
mod bench_torch;
mod bench_ucx_floor;
mod demo;
mod fixtures;
mod fmt;
mod inspect;
mod ipc;
mod plan;
mod shard;
mod signal;
mod worker;

use std::process::ExitCode;

const USAGE: &str = "usage:
  wm demo [--dir DIR]
  wm inspect <file|dir> [--rank R] [--gpu G] [--all]
  wm manifest <dir>
  wm shard <file|dir> --out DIR --ranks N [--dim D]     (per-rank shard files, placement in their metadata)
  wm plan --trainer TRAINER.json --engine ENGINE.json [--link-gbps 400] [--json]   (docs/layouts.md)
  wm bench snapshot [--gib N] [--small N] [--threads N] [--dir DIR]
  wm bench signal [--steps N] [--ranks 2,4,8] [--work-us US]
  wm bench ipc [--gib N] [--bucket-mib M]
  wm bench net [--gib N] [--bucket-mib M] [--runs N]   (UCX_TLS=tcp without RDMA hardware)
  wm bench gpu [--gib N]                               (needs an NVIDIA GPU)
  wm bench quant [--gib N] [--runs N]                  FP8 block quantization beside memcpy and PyTorch
  wm bench delta [--data DIR] [--gib N] [--runs N]     deltas between training steps, beside memcpy and PyTorch
  wm bench shard [--section planning|snapshot|ipc] [--pieces 10000] [--sources 8] [--runs 20] [--gib N | --quick] [--dir DIR]
  wm serve --ipc SOCKET DIR [--engines N] [--bucket-mib M] [--version V] [--accept-timeout S]
  wm serve --net HOST:PORT DIR... [--keep K] [--engines N] [--bucket-mib M]   (secret: WM_NET_SECRET)
  wm pull --ipc SOCKET [--rank R --world W --gpu G] [--check DIR] [--verify true] [--version V]
  wm pull --net HOST:PORT [--gdr true] [--staged true] [--bucket-mib M --depth D] [--keyed-digests true] [--rank R ...] [--check DIR]
  wm signal get|set|wait|request <cell> [STATE|update|clear] [--timeout SECONDS]
  wm worker --model-dir DIR [--rank R --world W --group NAME] [--local-rank L --local-world N --node K --addr HOST:PORT]
            [--cell NAME] [--steps N] [--step-us US] [--timeout-ms MS] [--log FILE]
  wm devices                      (what the CUDA backend sees, or why it cannot work)
  wm --version";

/// Parsed `--name value` options and positional arguments.
pub struct Args {
    pub positional: Vec<String>,
    options: Vec<(String, Option<String>)>,
}

impl Args {
    fn parse(raw: &[String], flags: &[&str]) -> Result<Args, String> {
        let mut positional = Vec::new();
        let mut options = Vec::new();
        let mut it = raw.iter();
        while let Some(a) = it.next() {
            if let Some(name) = a.strip_prefix("--") {
                if flags.contains(&name) {
                    options.push((name.to_string(), None));
                } else {
                    let v = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
                    options.push((name.to_string(), Some(v.clone())));
                }
            } else {
                positional.push(a.clone());
            }
        }
        Ok(Args {
            positional,
            options,
        })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.options.iter().any(|(n, _)| n == name)
    }

    pub fn value(&self, name: &str) -> Option<&str> {
        self.options
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    pub fn number<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.value(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("--{name} {v}: not a number")),
        }
    }

    fn check_known(&self, known: &[&str]) -> Result<(), String> {
        for (n, _) in &self.options {
            if !known.contains(&n.as_str()) {
                return Err(format!("unknown option --{n}"));
            }
        }
        Ok(())
    }
}

fn run(argv: &[String]) -> Result<(), String> {
    let Some(cmd) = argv.first() else {
        return Err(USAGE.into());
    };
    let rest = &argv[1..];
    match cmd.as_str() {
        "demo" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(&["dir"])?;
            demo::run(&a)
        }
        "inspect" => {
            let a = Args::parse(rest, &["all"])?;
            a.check_known(&["rank", "gpu", "all"])?;
            inspect::inspect(&a)
        }
        "manifest" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(&[])?;
            inspect::manifest(&a)
        }
        "shard" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(shard::OPTIONS)?;
            shard::run(&a)
        }
        "plan" => {
            let a = Args::parse(rest, plan::FLAGS)?;
            a.check_known(plan::OPTIONS)?;
            plan::run(&a)
        }
        "bench" => {
            let a = Args::parse(rest, &["quick"])?;
            a.check_known(&[
                "gib",
                "small",
                "threads",
                "dir",
                "steps",
                "ranks",
                "work-us",
                "rank",
                "world",
                "group",
                "cell",
                "socket",
                "bucket-mib",
                "engines",
                "runs",
                "mode",
                "quick",
                "split",
                "verify",
                "section",
                "pieces",
                "sources",
                "addresses",
                "data",
            ])?;
            match a.positional.first().map(String::as_str) {
                Some("snapshot") => bench::snapshot(&a),
                Some("signal") => bench_signal::run(&a),
                Some("signal-rank") => bench_signal::rank(&a),
                Some("ipc") => bench_ipc::run(&a),
                Some("ipc-publisher") => bench_ipc::publisher(&a),
                Some("net") => bench_net::run(&a),
                Some("net-publisher") => bench_net::publisher(&a),
                Some("gpu") => bench_gpu::run(&a),
                Some("quant") => bench_quant::run(&a),
                Some("delta") => bench_delta::run(&a),
                Some("shard") => bench_shard::run(&a),
                Some("shard-snapshot-rank") => bench_shard::snapshot::rank(&a),
                Some("shard-ucx-publisher") => bench_shard::ucx::publisher(&a),
                Some("shard-ucx-rank") => bench_shard::ucx::rank(&a),
                Some("shard-ipc-rank") => bench_shard::ipc::rank(&a),
                _ => Err(
                    "usage: wm bench snapshot|signal|ipc|net|gpu|shard|quant|delta [options]"
                        .into(),
                ),
            }
        }
        "signal" => {
            let mut all = vec!["signal".to_string()];
            all.extend_from_slice(rest);
            let a = Args::parse(&all, &[])?;
            a.check_known(&["timeout"])?;
            signal::run(&a)
        }
        "serve" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(ipc::SERVE_OPTIONS)?;
            ipc::serve(&a)
        }
        "pull" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(ipc::PULL_OPTIONS)?;
            ipc::pull(&a)
        }
        "devices" => {
            Args::parse(rest, &[])?.check_known(&[])?;
            devices()
        }
        "worker" => {
            let a = Args::parse(rest, &[])?;
            a.check_known(worker::OPTIONS)?;
            worker::run(&a)
        }
        "--version" | "version" => {
            println!("wm {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command '{other}'\n{USAGE}")),
    }
}

/// `wm devices`: what the CUDA backend sees; fails with the reason when
/// device params cannot work here.
fn devices() -> Result<(), String> {
    let cuda = weight_manager_core::memory::cuda::cuda().map_err(|e| e.to_string())?;
    println!("{}", cuda.describe());
    for d in 0..cuda.device_count() {
        let (name, total) = cuda.device_info(d).map_err(|e| e.to_string())?;
        println!("  GPU {d}: {name}, {}", fmt::bytes(total as u64));
    }
    Ok(())
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match run(&argv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wm: {e}");
            ExitCode::FAILURE
        }
    }
}
