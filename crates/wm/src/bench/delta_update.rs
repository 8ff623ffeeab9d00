//! `wm bench delta`'s update section: a model whose next version changed a
//! share of its bf16 elements, updated as deltas against the version the
//! engine holds and whole (`WM_UPDATE_WHOLE`), over IPC and over UCX
//! (`UCX_TLS=tcp`), alternating in one process against one publisher that
//! keeps both versions. Between timed updates the engine goes back to the
//! base (untimed), so every timed update starts from the same state.
//! Target at 2% changed: deltas >= 10x faster than whole over UCX.

use super::harness::{alternate, verdict, Scratch};
use super::model::{add_layers, layer_count, net_manager, register_layers, LAYER};
use crate::fmt::gbps;
use std::time::{Duration, Instant};
use weight_manager_core::{DeltaFallback, DeltaMode, Manager};
use weight_manager_core::{Publisher, PublisherConfig, SourceKind, UpdateRequest};

const SECRET: &str = "wm-bench-delta-secret-0123456789";

/// Both ways of updating to the next version, per path, at each share.
pub fn run(gib: f64, shares: &[f64], pairs: usize) -> Result<(), String> {
    let count = layer_count(gib);
    println!(
        "  update time, {count} bf16 layers of 64 MiB, deltas against the engine's version \
         vs whole, alternating ({pairs} pairs):"
    );
    let base = layers(count, None);
    for &share in shares {
        let next = layers(count, Some(share));
        for source in [SourceKind::Ipc, SourceKind::Rdma] {
            if source == SourceKind::Rdma
                && weight_manager_core::internals::transport::ucx::ucx().is_err()
            {
                println!("    rdma: skipped (no UCX)");
                continue;
            }
            one_path(source, share, (&base, &next), pairs)?;
        }
    }
    Ok(())
}

/// `count` layers of bf16 bytes; `Some(share)`: the same with that share of
/// elements changed at random places.
fn layers(count: usize, share: Option<f64>) -> Vec<Vec<u8>> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out: Vec<Vec<u8>> = (0..count)
        .map(|_| (0..LAYER / 8).flat_map(|_| rand().to_le_bytes()).collect())
        .collect();
    if let Some(share) = share {
        let every = (1.0 / share.max(1e-9)) as u64;
        for l in &mut out {
            for e in l.chunks_exact_mut(2) {
                if rand() % every == 0 {
                    e[0] ^= 0x5a;
                }
            }
        }
    }
    out
}

/// Serve both versions from one publisher; time each way of updating.
fn one_path(
    source: SourceKind,
    share: f64,
    (base, next): (&[Vec<u8>], &[Vec<u8>]),
    pairs: usize,
) -> Result<(), String> {
    let scratch = Scratch::temp("wm-bench-delta-update")?;
    let sock = scratch.0.join("trainer.sock");
    let cfg = PublisherConfig {
        secret: Some(SECRET.into()),
        keep_versions: 2,
        ..Default::default()
    };
    let p = match source {
        SourceKind::Ipc => Publisher::bind(&sock, cfg),
        _ => Publisher::bind_net("127.0.0.1:0", cfg),
    }
    .map_err(|e| e.to_string())?;
    for (name, data) in [("base", base), ("next", next)] {
        p.clear_tensors();
        add_layers(&p, data, None)?;
        p.set_version(Some(name.into()));
        p.publish().map_err(|e| e.to_string())?;
    }
    let location = match source {
        SourceKind::Ipc => sock.display().to_string(),
        _ => p.address(),
    };
    let m = net_manager(SECRET)?;
    let mut params: Vec<Vec<u8>> = base.iter().map(|l| vec![1u8; l.len()]).collect();
    register_layers(&m, &mut params)?;
    let sessions = 1 + 4 * pairs.max(1);
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(sessions, Duration::from_secs(600)));
        let r = timed_pairs(&m, (source, &location), share, pairs);
        let served = serving
            .join()
            .map_err(|_| "the publisher panicked".to_string())?;
        served.map_err(|e| e.to_string())?;
        r
    })?;
    // Each timed update ended with a delta update back to the base.
    if params.iter().zip(base).any(|(a, b)| a != b) {
        return Err("the engine's params are not the base version".into());
    }
    Ok(())
}

/// Go to the base (untimed), then time an update to the next version as
/// deltas (ours) or whole (theirs), alternating; print the figures.
fn timed_pairs(
    m: &Manager,
    (source, location): (SourceKind, &str),
    share: f64,
    pairs: usize,
) -> Result<(), String> {
    let request = |version: &str, whole: bool| {
        let mut r = UpdateRequest::snapshot(location);
        r.deltas = if whole { DeltaMode::Off } else { DeltaMode::On };
        (r.source, r.version) = (source, Some(version.into()));
        r
    };
    m.update(request("base", true)).map_err(|e| e.to_string())?;
    let to_next = |whole: bool, wire: &mut (u64, u64)| -> Result<Duration, String> {
        let t = Instant::now();
        let stats = m
            .update(request("next", whole))
            .map_err(|e| e.to_string())?;
        let took = t.elapsed();
        let d = &stats.deltas;
        if !whole && (d.fallback != DeltaFallback::None || d.runs_delta == 0) {
            return Err(format!("the delta update moved no deltas: {d:?}"));
        }
        *wire = (d.wire_bytes, stats.bytes);
        m.update(request("base", false))
            .map_err(|e| e.to_string())?;
        Ok(took)
    };
    let mut delta_wire = (0, 0);
    let mut whole_wire = (0, 0);
    let (ratio, ours, theirs) = alternate(
        pairs,
        || to_next(false, &mut delta_wire),
        || to_next(true, &mut whole_wire),
    )?;
    let wire = (delta_wire.0, whole_wire.0.max(1));
    let bytes = delta_wire.1;
    let name = if source == SourceKind::Ipc {
        "ipc "
    } else {
        "rdma"
    };
    let target = source == SourceKind::Ipc || ratio >= 10.0;
    println!(
        "    {name} at {:>4.1}% changed: delta {:>7.1} ms ({:.2} GB/s), whole {:>7.1} ms ({:.2} GB/s): {ratio:.1}x faster \
         (median of per-pair ratios){}; wire bytes {:.4} of whole",
        share * 100.0,
        ours.as_secs_f64() * 1e3,
        gbps(bytes, ours),
        theirs.as_secs_f64() * 1e3,
        gbps(bytes, theirs),
        match source {
            SourceKind::Ipc => String::new(),
            _ => format!(" [target >= 10x: {}]", verdict(target)),
        },
        wire.0 as f64 / wire.1 as f64,
    );
    Ok(())
}
