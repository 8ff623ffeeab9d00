//! `wm bench shard`: sharded updates, each figure printed beside its target
//! or a floor measured in the same run, with their ratio.
//!
//! A section is a file of this folder with a `run(&Args) -> Result<Vec<Row>,
//! String>`; adding one is one line in `SECTIONS` (and its `mod` line).
//! `--section NAME` runs only that one.

pub mod ipc;
mod planning;
pub mod snapshot;
pub mod ucx;
mod ucx_floors;

/// `wm bench shard` options (each section reads those it uses).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Run only this section: planning, snapshot, ucx or ipc
    #[arg(long)]
    section: Option<String>,
    /// planning: the engine rank's pieces
    #[arg(long, default_value_t = 10_000)]
    pieces: u64,
    /// planning: trainer ranks (a divisor of 64)
    #[arg(long, default_value_t = 8)]
    sources: u64,
    /// Timed runs (default: planning 20, ucx 3, or 2 with --quick)
    #[arg(long)]
    runs: Option<usize>,
    /// Model size in GiB (default: snapshot 2, ucx and ipc 1, or 0.25 with --quick)
    #[arg(long)]
    gib: Option<f64>,
    /// Small models and few runs
    #[arg(long)]
    quick: bool,
    /// snapshot: folder for the checkpoint (default: the temporary folder)
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// ucx: bucket size in MiB
    #[arg(long, default_value_t = 64)]
    bucket_mib: usize,
    /// ipc: copier threads of each engine (default: half of the cores)
    #[arg(long)]
    threads: Option<usize>,
}

impl Args {
    /// `--gib`, else `full`, or 0.25 with `--quick`.
    fn gib(&self, full: f64) -> f64 {
        self.gib.unwrap_or(if self.quick { 0.25 } else { full })
    }
}

use super::harness::verdict;

/// One figure: what was measured, its value, what it is compared with, and
/// the ratio (measured / target for times: at most 1 meets the target).
/// `ok` is None for a figure with no target (a floor).
pub struct Row {
    pub what: String,
    pub value: String,
    pub beside: String,
    pub ratio: f64,
    pub ok: Option<bool>,
}

type Section = fn(&Args) -> Result<Vec<Row>, String>;

const SECTIONS: &[(&str, Section)] = &[
    ("planning", planning::run),
    ("snapshot", snapshot::run),
    ("ucx", ucx::run),
    ("ipc", ipc::run),
];

pub fn run(a: &Args) -> Result<(), String> {
    let only = a.section.as_deref();
    if let Some(name) = only {
        if !SECTIONS.iter().any(|(n, _)| *n == name) {
            let known: Vec<&str> = SECTIONS.iter().map(|(n, _)| *n).collect();
            return Err(format!("--section {name}: not one of {}", known.join(", ")));
        }
    }
    println!("wm bench shard");
    let mut all_ok = true;
    for (name, section) in SECTIONS
        .iter()
        .filter(|(n, _)| only.is_none_or(|o| o == *n))
    {
        println!("  {name}");
        for r in section(a)? {
            println!(
                "    {:<62} {:>10}   {:<22} ratio {:>6.3} {}",
                r.what,
                r.value,
                r.beside,
                r.ratio,
                r.ok.map_or("", verdict)
            );
            all_ok &= r.ok.unwrap_or(true);
        }
    }
    println!(
        "  {}",
        if all_ok {
            "every figure meets its target"
        } else {
            "some figures miss their target"
        }
    );
    Ok(())
}
