//! `wm bench gpu`'s PyTorch rows: what an engine written in PyTorch does
//! for the same two jobs, timed alternating with ours in the same run
//! (the order flipping each pair; median of the per-pair ratios, above 1:
//! ours is faster):
//!
//! - snapshot into CUDA params: `safetensors.torch.load_file` of the
//!   snapshot (from the page cache, as ours reads it), then
//!   `param.copy_()` of each tensor into a CUDA param made once;
//! - IPC from a trainer process: `torch.multiprocessing` sharing the
//!   trainer's CUDA tensors through a queue, then `copy_()` into the CUDA
//!   params. The peer keeps the tensors it received last until the next
//!   arrive, so PyTorch's cache of opened IPC handles is warm (ours opens
//!   the trainer's buffer once too). The trainer is forked before the
//!   peer touches CUDA, so it initializes CUDA itself, as a spawned one
//!   would.

use super::{engine, ipc_request, serve_from_gpu, timed};
use crate::bench::harness::alternate;
use crate::bench::harness::torch::TorchPeer;
use crate::fmt::gbps;
use std::path::Path;
use weight_manager_core::{Mode, UpdateRequest};

/// Pairs of runs per comparison.
const PAIRS: usize = 5;

const TORCH_PEER: &str = r#"
import glob, multiprocessing, sys, time
from safetensors.torch import load_file
files = sorted(glob.glob(sys.argv[1] + "/*.safetensors"))

def trainer(req, resp):
    import os, queue, torch
    parent = os.getppid()
    sd = {}
    for f in files:
        sd.update({k: v.cuda() for k, v in load_file(f).items()})
    torch.cuda.synchronize()
    resp.put("loaded")
    while True:
        try:
            if req.get(timeout=1) is None:
                return
            resp.put(sd)
        except queue.Empty:
            if os.getppid() != parent:  # the peer was killed: no orphan
                return

ctx = multiprocessing.get_context("fork")
req, resp = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=trainer, args=(req, resp), daemon=True)
proc.start()
import torch
import torch.multiprocessing  # registers the CUDA tensor reductions
assert resp.get(timeout=600) == "loaded"
params = {}
for f in files:
    params.update({k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in load_file(f).items()})
last = None
print("ready", flush=True)
for line in sys.stdin:
    torch.cuda.synchronize()
    t = time.perf_counter()
    if line.strip() == "snapshot":
        for f in files:
            for k, v in load_file(f).items():
                params[k].copy_(v)
    else:
        req.put(1)
        got = resp.get(timeout=600)
        for k, v in got.items():
            params[k].copy_(v)
        last = got
    torch.cuda.synchronize()
    print(time.perf_counter() - t, flush=True)
del last
req.put(None)
proc.join(timeout=60)
"#;

/// Ours beside PyTorch: snapshot into CUDA params, and IPC from a trainer
/// process; skipped, saying why, without a Python with torch,
/// safetensors and CUDA.
pub(super) fn torch_rows(dir: &Path, count: usize, total: u64) -> Result<(), String> {
    let mut torch = match TorchPeer::start(TORCH_PEER, &[dir.display().to_string()]) {
        Ok(t) => t,
        Err(e) => {
            println!("  torch  skipped: {e} (needs torch with CUDA and safetensors)");
            return Ok(());
        }
    };
    let (m, _params) = engine(count)?;
    let snapshot = || {
        let mut req = UpdateRequest::snapshot(dir);
        req.mode = Mode::InPlace;
        timed(&m, req)
    };
    snapshot()?;
    let (ratio, ours, theirs) = alternate(PAIRS, snapshot, || torch.run("snapshot"))?;
    row(
        "snapshot -> GPU params",
        "load_file + copy_()",
        ratio,
        (gbps(total, ours), gbps(total, theirs)),
    );

    let sock = dir.join("torch-peers.sock");
    let trainer = serve_from_gpu(dir, &sock, PAIRS + 1)?;
    let ipc = || timed(&m, ipc_request(&sock));
    super::first_session(&m, &sock)?;
    torch.run("ipc")?;
    let (ratio, ours, theirs) = alternate(PAIRS, ipc, || torch.run("ipc"))?;
    row(
        "IPC GPU -> GPU params",
        "torch.multiprocessing + copy_()",
        ratio,
        (gbps(total, ours), gbps(total, theirs)),
    );
    trainer.finish()?;
    torch.finish()?;
    Ok(())
}

fn row(what: &str, theirs: &str, ratio: f64, (ours_gbps, theirs_gbps): (f64, f64)) {
    println!(
        "  wm/torch {what:<24} {ratio:>5.2}x  (median of {PAIRS} pairs; best wm {ours_gbps:.2} GB/s, torch {theirs} {theirs_gbps:.2} GB/s) {}",
        crate::bench::harness::verdict(ratio > 1.0)
    );
}
