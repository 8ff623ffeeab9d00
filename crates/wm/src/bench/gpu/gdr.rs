//! `wm bench gpu`'s gdr rows: a `wm serve --net --gpu` trainer process
//! publishing the model from GPU 0, this engine's device params written by
//! UCX straight from the network (gdr, in place), beside raw UCX moving the
//! same bytes, from a host source as big as the model, in the session's
//! messages into GPU memory (no protocol, plan or checksums).

use super::{engine_with, timed};
use crate::bench::harness::process::Proc;
use crate::bench::harness::{best, buffer, RUNS};
use crate::bench::ucx_floor::{raw_floor, FloorPair, Take};
use crate::fmt::gbps;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use weight_manager_core::defaults::{BUCKET_SIZE, BUFFERS_IN_FLIGHT};
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::internals::memory::SendPtr;
use weight_manager_core::internals::wire::net_message_bytes;
use weight_manager_core::{Mode, NetSettings, SourceKind, UpdateRequest};

const SECRET: &str = "wm-bench-gpu-secret-0123456789";

/// gdr from a GPU trainer process beside raw UCX into GPU memory; skipped,
/// saying why, when this UCX cannot reach CUDA memory.
pub(super) fn gdr_rows(dir: &Path, count: usize, total: usize) -> Result<(), String> {
    match weight_manager_core::internals::transport::ucx::ucx() {
        Ok(u) if u.supports_cuda() => {}
        Ok(u) => {
            println!("  (gdr rows skipped: {})", u.no_cuda_reason());
            return Ok(());
        }
        Err(e) => {
            println!("  (gdr rows skipped: no UCX: {e})");
            return Ok(());
        }
    }
    let floor = gbps(total as u64, ucx_floor_into_gpu(total)?);
    println!("  floor  raw UCX host -> GPU memory   {floor:>8.2} GB/s");
    // Two runs of each kind (verified, checksums skipped) after a warm-up.
    let sessions = 1 + 2 * RUNS;
    let mut trainer = gpu_trainer(dir, sessions)?;
    let addr = trainer.line_after("wm serve: listening on ")?;
    let addr = addr.split(',').next().unwrap_or_default().to_string();
    let (m, _params) = engine_with(
        count,
        NetSettings {
            secret: Some(SECRET.into()),
            ..Default::default()
        },
    )?;
    let gdr = |skip: bool| {
        let mut req = UpdateRequest::snapshot(&addr);
        req.source = SourceKind::Gdr;
        req.mode = Mode::InPlace;
        req.skip_network_checksums = skip;
        // Every byte moves, as the floor moves them: device params take
        // deltas too, and the same version again would come as nothing.
        req.deltas = weight_manager_core::DeltaMode::Off;
        timed(&m, req)
    };
    gdr(false)?;
    for (skip, label) in [(false, "verified"), (true, "no checksums")] {
        let r = gbps(total as u64, best(|| gdr(skip))?);
        println!(
            "  wm     gdr -> GPU, {label:<12}   {r:>8.2} GB/s   ratio {:.2} to raw UCX into GPU memory",
            r / floor
        );
    }
    trainer.finish()?;
    Ok(())
}

/// `wm serve --net` of `dir` from GPU 0 for `sessions` engine sessions.
fn gpu_trainer(dir: &Path, sessions: usize) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = Command::new(exe);
    c.args(["serve", "--net", "127.0.0.1:0"])
        .arg(dir)
        .args(["--gpu", "0", "--accept-timeout", "300"])
        .args(["--engines", &sessions.to_string()])
        .env("WM_NET_SECRET", SECRET);
    Proc::spawn(c)
}

/// Raw UCX: `total` bytes of host memory in messages of the session's
/// size, into a ring of GPU-memory slots as many as the session has
/// messages in flight; best of [`RUNS`].
fn ucx_floor_into_gpu(total: usize) -> Result<Duration, String> {
    let message = net_message_bytes().min(BUCKET_SIZE);
    let in_flight = BUFFERS_IN_FLIGHT * BUCKET_SIZE.div_ceil(message);
    let ring =
        ExportedDeviceBuffer::new("floor", 0, in_flight * message).map_err(|e| e.to_string())?;
    let slots: Vec<SendPtr> = (0..in_flight)
        .map(|i| SendPtr((ring.ptr() + (i * message) as u64) as *mut u8))
        .collect();
    let src = buffer(total);
    best(|| {
        raw_floor(&mut [FloorPair {
            src: &src,
            message,
            slots: &slots,
            take: Take::Contiguous,
            packs: &mut [],
        }])
    })
}
