//! `wm bench delta`'s update section: a model whose next version changed a
//! share of its bf16 elements, updated as deltas against the version the
//! engine holds and whole (`WM_UPDATE_WHOLE`), over IPC and over UCX
//! (`UCX_TLS=tcp`), alternating in one process against one publisher that
//! keeps both versions. Before each timed update the publisher publishes
//! both versions afresh, so no delta encoded for an earlier update is
//! reused (the encoding is part of what one engine waits for), and the
//! engine goes back to the base (untimed), so every timed update starts
//! from the same state.
//! Target at 2% changed: deltas >= 10x faster than whole over UCX.
//!
//! Each path in place (the deltas patch the params where they are) and
//! atomic (the base copied into the staging and patched there, the commit
//! as for any update). With a GPU, the params are library-owned device
//! params: in place the deltas' changes are written and the results
//! hashed on the GPU; atomic, the base is read back into the host staging.

use super::harness::{alternate, verdict, Scratch};
use super::model::{add_layers, layer_count, net_manager, register_layers, LAYER, LAYER_SHAPE};
use crate::fmt::gbps;
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::cuda_ipc;
use weight_manager_core::UpdateStats;
use weight_manager_core::{DType, DeltaFallback, DeltaMode, Manager, MemoryKind, Mode, ParamSpec};
use weight_manager_core::{Publisher, PublisherConfig, SourceKind, UpdateRequest};

const SECRET: &str = "wm-bench-delta-secret-0123456789";

/// Both ways of updating to the next version, per path, at each share;
/// into device params on GPU `gpu` when given.
pub fn run(gib: f64, shares: &[f64], pairs: usize, gpu: Option<i32>) -> Result<(), String> {
    let count = layer_count(gib);
    let into = gpu.map_or("host params".into(), |g| {
        format!("device params on GPU {g}")
    });
    println!(
        "  update time, {count} bf16 layers of 64 MiB into {into}, deltas against the \
         engine's version vs whole, alternating ({pairs} pairs):"
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
            for mode in [Mode::InPlace, Mode::Atomic] {
                one_path((source, mode, gpu), share, (&base, &next), pairs)?;
            }
        }
    }
    Ok(())
}

/// The engine's params: host buffers it owns, or library-owned device
/// params (address, bytes).
enum Params {
    Host(Vec<Vec<u8>>),
    Device(i32, Vec<(u64, usize)>),
}

impl Params {
    fn new(m: &Manager, base: &[Vec<u8>], gpu: Option<i32>) -> Result<Params, String> {
        let Some(g) = gpu else {
            let mut params: Vec<Vec<u8>> = base.iter().map(|l| vec![1u8; l.len()]).collect();
            register_layers(m, &mut params)?;
            return Ok(Params::Host(params));
        };
        let mut out = Vec::with_capacity(base.len());
        for i in 0..base.len() {
            let mut spec = ParamSpec::host(&format!("layers.{i}.w"), DType::Bf16, &LAYER_SHAPE);
            (spec.memory, spec.device_ordinal) = (MemoryKind::Device, g);
            let (p, n) = m.allocate(&spec).map_err(|e| e.to_string())?;
            out.push((p as u64, n));
        }
        Ok(Params::Device(g, out))
    }

    /// Whether every param holds `want`'s bytes.
    fn hold(&self, want: &[Vec<u8>]) -> Result<bool, String> {
        match self {
            Params::Host(params) => Ok(params.iter().zip(want).all(|(a, b)| a == b)),
            Params::Device(g, params) => {
                let mut buf = vec![0u8; LAYER];
                for (&(p, n), w) in params.iter().zip(want) {
                    // SAFETY: the param's device memory, into a buffer of
                    // its size (one layer).
                    unsafe { cuda_ipc::download(*g, buf.as_mut_ptr(), p, n) }
                        .map_err(|e| e.to_string())?;
                    if buf[..n] != w[..] {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }
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

/// One path's engine and publisher.
struct Path<'a> {
    p: &'a Publisher,
    m: &'a Manager,
    versions: [(&'static str, &'a [Vec<u8>]); 2],
    source: SourceKind,
    mode: Mode,
    location: String,
}

impl Path<'_> {
    /// Publish both versions afresh: no delta of an earlier publish is
    /// kept (a delta is encoded once per version and shared by the
    /// engines that take the same runs; one engine pays for encoding it).
    fn publish(&self) -> Result<(), String> {
        for (name, data) in self.versions {
            self.p.clear_tensors();
            add_layers(self.p, data, None)?;
            self.p.set_version(Some(name.into()));
            self.p.publish().map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Update the engine to `version`, whole or as deltas, served by a
    /// session of its own; the time the update call took.
    fn update(&self, version: &str, whole: bool) -> Result<(UpdateStats, Duration), String> {
        let mut r = UpdateRequest::snapshot(self.location.as_str());
        r.deltas = if whole { DeltaMode::Off } else { DeltaMode::On };
        (r.source, r.version, r.mode) = (self.source, Some(version.into()), self.mode);
        std::thread::scope(|s| {
            let serving = s.spawn(|| self.p.serve(1, Duration::from_secs(600)));
            let t = Instant::now();
            let stats = self.m.update(r).map_err(|e| e.to_string());
            let took = t.elapsed();
            let served = serving.join().map_err(|_| "the publisher panicked")?;
            served.map_err(|e| e.to_string())?;
            Ok((stats?, took))
        })
    }
}

/// Serve both versions from one publisher; time each way of updating.
fn one_path(
    (source, mode, gpu): (SourceKind, Mode, Option<i32>),
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
    let location = match source {
        SourceKind::Ipc => sock.display().to_string(),
        _ => p.address(),
    };
    let m = net_manager(SECRET)?;
    let params = Params::new(&m, base, gpu)?;
    let path = Path {
        p: &p,
        m: &m,
        versions: [("base", base), ("next", next)],
        source,
        mode,
        location,
    };
    timed_pairs(&path, share, pairs)?;
    // Each timed update ended with a delta update back to the base.
    if !params.hold(base)? {
        return Err("the engine's params are not the base version".into());
    }
    Ok(())
}

/// Go to the base (untimed), then time an update to the next version as
/// deltas (ours) or whole (theirs), alternating, each from freshly
/// published versions; print the figures.
fn timed_pairs(path: &Path, share: f64, pairs: usize) -> Result<(), String> {
    let (source, mode) = (path.source, path.mode);
    path.publish()?;
    path.update("base", true)?;
    let to_next = |whole: bool, wire: &mut (u64, u64)| -> Result<Duration, String> {
        path.publish()?;
        let (stats, took) = path.update("next", whole)?;
        let d = &stats.deltas;
        if !whole && (d.fallback != DeltaFallback::None || d.runs_delta == 0) {
            return Err(format!("the delta update moved no deltas: {d:?}"));
        }
        *wire = (d.wire_bytes, stats.bytes);
        path.update("base", false)?;
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
    let name = match (source, mode) {
        (SourceKind::Ipc, Mode::Atomic) => "ipc ",
        (SourceKind::Ipc, _) => "ipc, in place, ",
        (_, Mode::Atomic) => "rdma",
        _ => "rdma, in place,",
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
