//! `wm bench quant`'s update section: a bf16 model into FP8 params
//! (128x128 block scales) against the same model into bf16 params, in one
//! process, alternating, the median of the per-pair ratios:
//!
//! - over UCX (`UCX_TLS=tcp` here) from one publisher serving both
//!   engines, whole (no deltas): the FP8 engine's publisher quantizes, so
//!   the wire carries one byte per element. Targets: wire bytes <= 0.52 of
//!   bf16's, update >= 1.7x faster.
//! - from a bf16 snapshot in the page cache, in place: the FP8 engine
//!   quantizes after reading. Target: >= 0.8 of the bf16 update's speed.
//!
//! The FP8 params are checked once against `quant::quantize` (itself
//! checked bit for bit against PyTorch).

use super::harness::{alternate, verdict, Scratch};
use super::model::net_manager;
use crate::fixtures;
use crate::fmt::gbps;
use std::cell::RefCell;
use std::time::{Duration, Instant};
use weight_manager_core::quant::{self, Scheme, Source};
use weight_manager_core::{DType, DeltaMode, Manager, Mode, ParamSpec};
use weight_manager_core::{Publisher, PublisherConfig, SessionStats, SourceKind, TensorDesc};
use weight_manager_core::{UpdateRequest, UpdateStats};

const SECRET: &str = "wm-bench-quant-secret-0123456789";

/// The layers' shape: bf16 [4096, 8192], 64 MiB each.
const SHAPE: [u64; 2] = [4096, 8192];
const SCALES: [u64; 2] = [SHAPE[0] / 128, SHAPE[1] / 128];

/// Both sections over `layers` (bf16 bytes of `SHAPE` each).
pub fn run(layers: &[Vec<u8>], pairs: usize) -> Result<(), String> {
    let total: u64 = layers.iter().map(|l| l.len() as u64).sum();
    println!(
        "  bf16 model of {} layers ({:.2} GiB) into FP8 params vs into bf16 params, alternating ({pairs} pairs):",
        layers.len(),
        total as f64 / (1u64 << 30) as f64
    );
    match weight_manager_core::internals::transport::ucx::ucx() {
        Ok(_) => over_ucx(layers, pairs)?,
        Err(e) => println!("    rdma: skipped ({e})"),
    }
    from_snapshot(layers, pairs)
}

/// A param's memory: address and length.
type Memory = (*mut u8, usize);

/// An engine with a param per layer: bf16, or FP8 with its scales
/// (declared quantized). Library-owned; returns the FP8 params' memory.
fn engine(layers: usize, fp8: bool) -> Result<(Manager, Vec<Memory>), String> {
    let m = net_manager(SECRET)?;
    let mut fp8_params = Vec::new();
    for i in 0..layers {
        let name = format!("layers.{i}.w");
        let dtype = if fp8 { DType::F8E4m3 } else { DType::Bf16 };
        let p = m
            .allocate(&ParamSpec::host(&name, dtype, &SHAPE))
            .map_err(|e| e.to_string())?;
        if fp8 {
            let scales = format!("{name}.scale_inv");
            m.allocate(&ParamSpec::host(&scales, DType::F32, &SCALES))
                .map_err(|e| e.to_string())?;
            m.quantize(&name, &scales, Scheme::Fp8Block128)
                .map_err(|e| e.to_string())?;
            fp8_params.push(p);
        }
    }
    Ok((m, fp8_params))
}

/// The FP8 bytes of layer 0 are `quant::quantize`'s.
fn check(layer: &[u8], fp8: Memory) -> Result<(), String> {
    let mut q = vec![0u8; layer.len() / 2];
    let mut s = vec![0f32; (SCALES[0] * SCALES[1]) as usize];
    let src = Source {
        dtype: DType::Bf16,
        bytes: layer,
        rows: SHAPE[0] as usize,
        cols: SHAPE[1] as usize,
    };
    quant::quantize(Scheme::Fp8Block128, src, &mut q, &mut s).map_err(|e| format!("{e:?}"))?;
    // SAFETY: a library-owned param of the engine, not being updated.
    let got = unsafe { std::slice::from_raw_parts(fp8.0, fp8.1) };
    match got == &q[..] {
        true => Ok(()),
        false => Err("the FP8 params are not the reference's bytes".into()),
    }
}

/// One whole update of `m` from `location` over `source`: its time and
/// the bytes the sources sent.
fn update(
    m: &Manager,
    source: SourceKind,
    location: &str,
    mode: Mode,
) -> Result<(Duration, u64), String> {
    update_stats(m, source, location, mode).map(|(t, s)| (t, s.bytes))
}

/// [`update`], with the update's statistics.
fn update_stats(
    m: &Manager,
    source: SourceKind,
    location: &str,
    mode: Mode,
) -> Result<(Duration, UpdateStats), String> {
    let mut r = UpdateRequest::snapshot(location);
    r.source = source;
    r.mode = mode;
    r.deltas = DeltaMode::Off;
    let t = Instant::now();
    let stats = m.update(r).map_err(|e| e.to_string())?;
    Ok((t.elapsed(), stats))
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Where the FP8 and bf16 updates' time went: the publisher's sessions
/// (those that quantized, and the others) and the engines' updates.
fn where_it_went(sessions: &[SessionStats], fp8: &[UpdateStats], bf16: &[UpdateStats]) {
    let of = |quantized: bool| -> Vec<&SessionStats> {
        sessions
            .iter()
            .filter(|s| (s.quantized > 0) == quantized)
            .collect()
    };
    println!(
        "      publisher sessions (mean): FP8 {}",
        session_parts(&of(true))
    );
    println!(
        "                                 bf16 {}",
        session_parts(&of(false))
    );
    println!(
        "      engine (mean of the timed updates): FP8 {}; bf16 {}",
        engine_parts(fp8),
        engine_parts(bf16)
    );
}

/// Where a kind of publisher session spent its time, on average.
fn session_parts(sessions: &[&SessionStats]) -> String {
    let n = sessions.len().max(1) as u32;
    let mean =
        |f: fn(&SessionStats) -> Duration| ms(sessions.iter().map(|s| f(s)).sum::<Duration>() / n);
    format!(
        "total {}: hashing {}, reading, agreeing (AMAX/SCALES) and waiting for images {}, packing {}, waiting for the engine {}",
        mean(|s| s.total),
        mean(|s| s.hash),
        mean(|s| s.quantize),
        mean(|s| s.pack),
        mean(|s| s.wait)
    )
}

/// The engine's receive and commit times, on average.
fn engine_parts(stats: &[UpdateStats]) -> String {
    let n = stats.len().max(1) as u32;
    let receive: Duration = stats.iter().map(|s| s.sync).sum::<Duration>() / n;
    let commit: Duration = stats.iter().map(|s| s.update).sum::<Duration>() / n;
    format!("receiving {}, committing {}", ms(receive), ms(commit))
}

fn over_ucx(layers: &[Vec<u8>], pairs: usize) -> Result<(), String> {
    let p = Publisher::bind_net(
        "127.0.0.1:0",
        PublisherConfig {
            secret: Some(SECRET.into()),
            keep_versions: 1,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    for (i, l) in layers.iter().enumerate() {
        let name = format!("layers.{i}.w");
        let desc = TensorDesc::host(&name, DType::Bf16, &SHAPE, l.as_ptr(), l.len());
        // SAFETY: `layers` outlives the serving below.
        unsafe { p.add(desc) }.map_err(|e| e.to_string())?;
    }
    p.set_version(Some("1".into()));
    let address = p.address();
    let (fp8, fp8_params) = engine(layers.len(), true)?;
    let (bf16, _) = engine(layers.len(), false)?;
    let mut wire = (0, 0);
    let (fp8_stats, bf16_stats) = (RefCell::new(Vec::new()), RefCell::new(Vec::new()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(2 + 2 * pairs.max(1), Duration::from_secs(600)));
        let r = (|| {
            update(&fp8, SourceKind::Rdma, &address, Mode::Atomic)?;
            update(&bf16, SourceKind::Rdma, &address, Mode::Atomic)?;
            check(&layers[0], fp8_params[0])?;
            let timed = |m: &Manager, bytes: &mut u64, all: &RefCell<Vec<UpdateStats>>| {
                let (t, stats) = update_stats(m, SourceKind::Rdma, &address, Mode::Atomic)?;
                // What crossed the wire (the params' bytes count the
                // scales, which the engine makes from the agreed amax).
                *bytes = stats.deltas.wire_bytes;
                all.borrow_mut().push(stats);
                Ok(t)
            };
            let (mut on_fp8, mut on_bf16) = (0, 0);
            let r = alternate(
                pairs,
                || timed(&fp8, &mut on_fp8, &fp8_stats),
                || timed(&bf16, &mut on_bf16, &bf16_stats),
            )?;
            wire = (on_fp8, on_bf16);
            Ok::<_, String>(r)
        })();
        let served = serving
            .join()
            .map_err(|_| "the publisher panicked".to_string())?;
        let served = served.map_err(|e| e.to_string())?;
        let (ratio, o, t) = r?;
        let share = wire.0 as f64 / wire.1.max(1) as f64;
        let total: u64 = layers.iter().map(|l| l.len() as u64).sum();
        println!(
            "    rdma (UCX, whole): into FP8 {:.1} ms, into bf16 {:.1} ms ({:.2} GB/s of bf16): FP8 {ratio:.2}x faster [target >= 1.7: {}]; wire bytes {share:.3} of bf16's [target <= 0.52: {}]",
            o.as_secs_f64() * 1e3,
            t.as_secs_f64() * 1e3,
            gbps(total, t),
            verdict(ratio >= 1.7),
            verdict(share <= 0.52)
        );
        where_it_went(&served.sessions, &fp8_stats.borrow(), &bf16_stats.borrow());
        Ok(())
    })
}

fn from_snapshot(layers: &[Vec<u8>], pairs: usize) -> Result<(), String> {
    let scratch = Scratch::temp("wm-bench-quant-update")?;
    let path = scratch.0.join("model_state.tp0.0.safetensors");
    let ts: Vec<fixtures::FakeTensor> = (layers.iter().enumerate())
        .map(|(i, l)| fixtures::FakeTensor {
            name: format!("layers.{i}.w"),
            dtype: DType::Bf16,
            shape: SHAPE.to_vec(),
            data: l.clone(),
        })
        .collect();
    fixtures::write(&path, &ts)?;
    drop(ts);
    fixtures::write_version(&scratch.0, 1)?;
    super::model::warm(&path)?;
    let dir = scratch.0.display().to_string();
    let (fp8, fp8_params) = engine(layers.len(), true)?;
    let (bf16, _) = engine(layers.len(), false)?;
    update(&fp8, SourceKind::Snapshot, &dir, Mode::InPlace)?;
    update(&bf16, SourceKind::Snapshot, &dir, Mode::InPlace)?;
    check(&layers[0], fp8_params[0])?;
    let (ratio, o, t) = alternate(
        pairs,
        || update(&fp8, SourceKind::Snapshot, &dir, Mode::InPlace).map(|r| r.0),
        || update(&bf16, SourceKind::Snapshot, &dir, Mode::InPlace).map(|r| r.0),
    )?;
    let total: u64 = layers.iter().map(|l| l.len() as u64).sum();
    println!(
        "    snapshot in place: into FP8 {:.1} ms ({:.2} GB/s of bf16), into bf16 {:.1} ms ({:.2} GB/s): FP8 at {ratio:.2} of bf16's speed [target >= 0.8: {}]",
        o.as_secs_f64() * 1e3,
        gbps(total, o),
        t.as_secs_f64() * 1e3,
        gbps(total, t),
        verdict(ratio >= 0.8)
    );
    Ok(())
}
