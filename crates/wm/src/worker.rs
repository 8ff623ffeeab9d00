//! `wm worker`: the engine's worker loop (README "The worker loop") as a
//! real engine rank. Each step it
//! asks for the signal; UPDATING: update from the snapshot; CLEARING: clear;
//! otherwise serve (sleep `--step-us`). Used by the multi-process tests and
//! as a reference for engine authors.
//!
//! The rank holds one library-owned param `w` (f32 [16]); the snapshot in
//! `--model-dir` must hold it (any HuggingFace-style `*.safetensors`).
//! With `--device N`, `w` is GPU memory of device N and each successful
//! update logs `updated <version> w=<xxh3-128 of w's bytes, read back>`;
//! `--fanout G` (and `--nccl PATH`) puts the rank in NCCL fan-out group G.

use crate::Args;
use std::io::Write;
use std::time::Duration;
use weight_manager_core::checksum;
use weight_manager_core::fanout::FanoutSettings;
use weight_manager_core::manager::{GroupSettings, Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::memory::cuda_ipc::download;
use weight_manager_core::registry::{MemoryKind, ParamSpec};
use weight_manager_core::state::State;
use weight_manager_core::tensor::DType;

pub const OPTIONS: &[&str] = &[
    "group",
    "rank",
    "world",
    "local-rank",
    "local-world",
    "node",
    "addr",
    "cell",
    "model-dir",
    "steps",
    "step-us",
    "timeout-ms",
    "log",
    "device",
    "fanout",
    "nccl",
];

pub fn run(a: &Args) -> Result<(), String> {
    let rank: u32 = a.number("rank", 0)?;
    let world: u32 = a.number("world", 1)?;
    let steps: u64 = a.number("steps", 1000)?;
    let step_us: u64 = a.number("step-us", 100)?;
    let timeout = Duration::from_millis(a.number("timeout-ms", 10_000)?);
    let model_dir = a.value("model-dir").ok_or("wm worker needs --model-dir")?;
    let group = a.value("group").map(|name| GroupSettings {
        name: name.to_string(),
        local_rank: a.value("local-rank").map(|v| v.parse().unwrap_or(0)),
        local_world_size: a.value("local-world").map(|v| v.parse().unwrap_or(1)),
        node_rank: a.value("node").map_or(0, |v| v.parse().unwrap_or(0)),
        addr: a.value("addr").map(str::to_string),
        timeout,
    });
    let device: i32 = a.number("device", -1)?;
    let fanout = match a.value("fanout") {
        Some(g) => Some(FanoutSettings {
            group: g
                .parse()
                .map_err(|_| format!("--fanout {g} is not a group number"))?,
            nccl_library: a.value("nccl").map(Into::into),
        }),
        None => None,
    };
    let m = Manager::new(ManagerConfig {
        rank,
        world_size: world,
        device,
        fallback_dir: None,
        control_cell: a.value("cell").map(str::to_string),
        group,
        model_dir: Some(model_dir.into()),
        fanout,
        ..Default::default()
    })
    .map_err(|e| format!("rank {rank}: init: {e}"))?;
    let mut spec = ParamSpec::host("w", DType::F32, &[16]);
    if device >= 0 {
        spec.memory = MemoryKind::Device;
        spec.device_ordinal = device;
    }
    let (w, w_len) = m.allocate(&spec).map_err(|e| format!("rank {rank}: {e}"))?;
    let mut log = match a.value("log") {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| format!("creating {p}: {e}"))?,
        )),
        None => None,
    };
    let (mut updates, mut clears, mut failed) = (0, 0, 0);
    for step in 0..steps {
        let signal = m
            .broadcast_signal()
            .map_err(|e| format!("rank {rank}: step {step}: {e}"))?;
        if let Some(l) = log.as_mut() {
            writeln!(l, "{step} {}", signal.name()).map_err(|e| e.to_string())?;
        }
        let outcome = match signal {
            State::Updating => {
                updates += 1;
                m.update(UpdateRequest::snapshot(model_dir))
                    .and_then(|stats| {
                        if let (Some(l), true) = (log.as_mut(), device >= 0) {
                            let mut bytes = vec![0u8; w_len];
                            // SAFETY: `w` is this manager's device param of `w_len` bytes.
                            unsafe { download(device, bytes.as_mut_ptr(), w as u64, w_len)? };
                            let _ = writeln!(
                                l,
                                "updated {} w={:032x}",
                                stats.version,
                                checksum::of(&bytes)
                            );
                        }
                        Ok(())
                    })
            }
            State::Clearing => {
                clears += 1;
                m.clear().map(|_| ())
            }
            _ => {
                std::thread::sleep(Duration::from_micros(step_us));
                Ok(())
            }
        };
        if let Err(e) = outcome {
            // A failed local update is reported to the controller by rank 0;
            // the loop goes on serving. A dead peer ends it.
            if matches!(
                e.code,
                weight_manager_core::wm_result::WM_ERR_PEER
                    | weight_manager_core::wm_result::WM_ERR_TIMEOUT
            ) {
                return Err(format!("rank {rank}: step {step}: {e}"));
            }
            failed += 1;
            eprintln!("wm worker: rank {rank}: step {step}: {signal} failed: {e}");
        }
    }
    if let Some(mut l) = log {
        l.flush().map_err(|e| e.to_string())?;
    }
    println!("rank {rank}: {steps} steps, {updates} updates, {clears} clears, {failed} failed");
    Ok(())
}
