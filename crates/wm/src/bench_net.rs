//! `wm bench net`: a model over UCX from a trainer process (the publisher)
//! into this engine process's host params, beside a raw UCX transfer of the
//! same bytes in the same bucket-sized messages, measured in the same run.
//!
//! Also: time to first byte (a whole update of one small tensor: connect,
//! challenge, manifest, UCX endpoint, one bucket) and the cost of each bucket
//! beyond its bytes (the same model in 1 MiB buckets against big buckets).
//!
//! Run it with `UCX_TLS=tcp` on a machine without RDMA (what CI does); on a
//! cluster leave UCX_TLS unset and UCX picks RDMA.
//! `WM_BENCH_VERBOSE=1` prints every run (floors around it, wm, ratio) on stderr.

use crate::bench_ucx_floor::{raw_floor, FloorPair, Take};
use crate::fmt::{self, gbps};
use crate::Args;
use std::time::{Duration, Instant};
use weight_manager_core::manager::{
    Manager, ManagerConfig, NetSettings, UpdateRequest, UpdateStats,
};
use weight_manager_core::pieces::Piece;
use weight_manager_core::publisher::{Publisher, PublisherConfig};
use weight_manager_core::registry::ParamSpec;
use weight_manager_core::source::SourceKind;
use weight_manager_core::tensor::DType;

const SECRET: &str = "wm-bench-net-secret-0123456789";

/// The trainer process: rank 0 gets the model, rank 1 one small tensor.
pub fn publisher(a: &Args) -> Result<(), String> {
    let count = crate::bench::layer_count(a.number("gib", 4.0)?);
    let data = crate::bench::trainer_layers(count);
    let small = vec![7u8; 4096];
    let p = Publisher::bind_net(
        "127.0.0.1:0",
        PublisherConfig {
            secret: Some(SECRET.into()),
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    crate::bench::add_layers(&p, &data, Some(0))?;
    // SAFETY: as above.
    unsafe { p.add_tensor("probe", DType::U8, &[4096], small.as_ptr(), 4096, Some(1)) }
        .map_err(|e| e.to_string())?;
    p.set_version(Some("bench".into()));
    println!("listening {}", p.address());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let stats = p
        .serve(a.number("engines", 1)?, Duration::from_secs(600))
        .map_err(|e| e.to_string())?;
    for s in stats.sessions.iter().filter(|s| s.rank == 0) {
        println!(
            "session {} {} {} {} {}",
            s.bytes,
            s.pack.as_nanos(),
            s.buckets,
            s.hashed,
            s.hash.as_nanos()
        );
    }
    Ok(())
}

/// A TP rank's half of every layer, verified with slice checksums: the
/// rows (one range of each tensor; over the network sent from the
/// trainer's tensors in 1 MiB messages), and the columns (a strided run
/// of 4 KiB row halves, packed: over the network 256 to a message).
pub(crate) const HALVES: [(&str, usize); 2] = [
    ("row half (TP piece), verified", 0),
    ("column half (TP piece), verified", 1),
];

/// Library-owned params holding the second half of every layer along
/// dimension `dim` (a first half named like its tensor would read as the
/// whole tensor of the param's shape: `ParamSpec::is_whole_tensor`).
pub(crate) fn half_params(m: &Manager, count: usize, dim: usize) -> Result<(), String> {
    let full = crate::bench::LAYER_SHAPE;
    for i in 0..count {
        let name = format!("layers.{i}.w");
        let mut shape = full.to_vec();
        shape[dim] /= 2;
        let spec = ParamSpec {
            pieces: vec![Piece::narrow(&name, &full, dim, shape[dim], shape[dim])],
            ..ParamSpec::host(&name, DType::Bf16, &shape)
        };
        m.allocate(&spec).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The best run of one configuration, and the median over its runs of the
/// ratio to the floor run just before each.
struct Measured {
    best: UpdateStats,
    median_ratio: f64,
}

pub fn run(a: &Args) -> Result<(), String> {
    let gib: f64 = a.number("gib", 4.0)?;
    let bucket_mib: usize = a.number("bucket-mib", 512)?;
    let depth = 2usize;
    let count = crate::bench::layer_count(gib);
    let total = count * crate::bench::LAYER;
    let probes = 5usize;
    // Sessions: direct (the default) and staged, each a warm-up then RUNS verified and
    // RUNS unverified; small buckets; one with keyed digests; then the probes.
    let runs: usize = a.number("runs", 5)?;
    let engines = 2 * (1 + 2 * runs) + 1 + 1 + 3 * HALVES.len() + probes;
    let args = ["bench", "net-publisher", "--gib", &gib.to_string()]
        .into_iter()
        .map(String::from)
        .chain(["--engines".into(), engines.to_string()])
        .collect::<Vec<_>>();
    let (trainer, addr) = crate::bench::TrainerProcess::start(&args, "listening ")?;
    let ucx = weight_manager_core::transport::ucx::ucx().map_err(|e| e.to_string())?;
    println!(
        "wm bench net: {} of bf16 in {count} tensors from a trainer process at {addr}, buckets of {bucket_mib} MiB x {depth}, {}, UCX_TLS={}",
        fmt::bytes(total as u64),
        ucx.describe(),
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(all)".into())
    );
    let bucket = bucket_mib << 20;
    let engine_with = |bucket_size: usize, rank: u32, staged: bool, keyed_digests: bool| {
        Manager::new(ManagerConfig {
            rank,
            world_size: 2,
            net: NetSettings {
                secret: Some(SECRET.into()),
                bucket_size,
                depth,
                staged,
                keyed_digests,
                ..Default::default()
            },
            ..Default::default()
        })
        .map_err(|e| e.to_string())
    };
    let engine = |bucket_size: usize, rank: u32| engine_with(bucket_size, rank, false, false);
    let m = engine(bucket, 0)?;
    let mut params = crate::bench::layer_params(count);
    crate::bench::register_layers(&m, &mut params)?;
    let request = |skip: bool| {
        let mut r = UpdateRequest::snapshot(&addr);
        r.source = SourceKind::Rdma;
        r.mode = weight_manager_core::apply::Mode::InPlace;
        r.skip_network_checksums = skip;
        r
    };
    // Warm-up: the first session creates both sides' buffers.
    let first = m.update(request(false)).map_err(|e| e.to_string())?;
    // This machine's speed wanders from second to second (a 2-core VM; the
    // floor alone ranges over 2x): every wm run is compared with the floor
    // runs just before and after it. Figures are the best of their runs; the
    // verdict uses the median of those ratios, which drift and spikes do not
    // sway. The floor sends from a source as big as the model, as the
    // trainer does (one small buffer sent again and again stays in cache).
    let mut floor_t = Duration::MAX;
    let message = weight_manager_core::wire::net_message_bytes().min(bucket);
    let floor_src = crate::bench::buffer(total);
    let mut floor_slots: Vec<Vec<u8>> = (0..depth * bucket.div_ceil(message))
        .map(|_| crate::bench::buffer(message))
        .collect();
    let mut best_of = |m: &Manager, skip: bool| -> Result<Measured, String> {
        let mut best: Option<UpdateStats> = None;
        let mut ratios = Vec::with_capacity(runs);
        // Each wm run sits between two floor runs and is compared with
        // their mean: the machine's drift then moves both sides alike. The
        // floor after one run is the floor before the next.
        let mut floor = || {
            raw_floor(&mut [FloorPair {
                src: &floor_src,
                message,
                slots: &mut floor_slots,
                take: Take::Contiguous,
                packs: &mut [],
            }])
        };
        let mut before = floor()?;
        floor_t = floor_t.min(before);
        for _ in 0..runs {
            let s = m.update(request(skip)).map_err(|e| e.to_string())?;
            let after = floor()?;
            floor_t = floor_t.min(after);
            let around = (gbps(total as u64, before) + gbps(total as u64, after)) / 2.0;
            let ratio = gbps(s.bytes, s.total) / around;
            if std::env::var_os("WM_BENCH_VERBOSE").is_some() {
                eprintln!(
                    "    run: floor {:.2} GB/s before, {:.2} after; wm {:.2} GB/s, ratio {ratio:.2}",
                    gbps(total as u64, before),
                    gbps(total as u64, after),
                    gbps(s.bytes, s.total)
                );
            }
            ratios.push(ratio);
            if best.as_ref().is_none_or(|b| s.total < b.total) {
                best = Some(s);
            }
            before = after;
        }
        ratios.sort_by(f64::total_cmp);
        Ok(Measured {
            best: best.expect("at least one run"),
            median_ratio: ratios[ratios.len() / 2],
        })
    };
    // The default, direct receive: each bucket entry lands in its param, no
    // staging slot and no copy out of it; the trainer sends from its
    // tensors, no packing either.
    let verified = best_of(&m, false)?;
    let plain = best_of(&m, true)?;
    // Staged (`net_staged`): into a slot, then copied to the params.
    let st = engine_with(bucket, 0, true, false)?;
    crate::bench::register_layers(&st, &mut params)?;
    st.update(request(false)).map_err(|e| e.to_string())?;
    let staged = best_of(&st, false)?;
    let staged_plain = best_of(&st, true)?;
    drop(st);
    // Per-bucket overhead: the same bytes in 1 MiB buckets.
    let small = engine(1 << 20, 0)?;
    crate::bench::register_layers(&small, &mut params)?;
    let fine = small.update(request(true)).map_err(|e| e.to_string())?;
    drop(small);
    // Keyed BLAKE3 digests of every entry (for untrusted networks), the
    // XXH3 checksums skipped: what authenticating the bytes costs.
    let keyed = engine_with(bucket, 0, false, true)?;
    crate::bench::register_layers(&keyed, &mut params)?;
    let keyed_run = keyed.update(request(true)).map_err(|e| e.to_string())?;
    drop(keyed);
    let halves = HALVES
        .iter()
        .map(|&(what, dim)| {
            let m = engine(bucket, 0)?;
            half_params(&m, count, dim)?;
            m.update(request(false)).map_err(|e| e.to_string())?; // faults the params
            let v = m.update(request(false)).map_err(|e| e.to_string())?;
            let u = m.update(request(true)).map_err(|e| e.to_string())?;
            Ok((what, v, u))
        })
        .collect::<Result<Vec<_>, String>>()?;

    let floor = gbps(total as u64, floor_t);
    println!(
        "  floor  raw UCX, same bytes and messages   {floor:>7.2} GB/s   (best of {}; {} MiB messages, {} in flight)",
        4 * (runs + 1),
        message >> 20,
        floor_slots.len()
    );
    println!(
        "  wm     first update (creates buffers)     {:>7.2} GB/s",
        gbps(first.bytes, first.total)
    );
    let row = |what: &str, m: &Measured, target: bool| {
        let rate = gbps(m.best.bytes, m.best.total);
        let verdict = match (target, m.median_ratio >= 0.8) {
            (false, _) => "",
            (true, true) => " (target >= 0.80) PASS",
            (true, false) => " (target >= 0.80) MISS",
        };
        println!(
            "  wm     {what:<36}{rate:>7.2} GB/s   ratio {:.2} to the best floor; median of runs against the floors around each {:.2}{verdict}",
            rate / floor,
            m.median_ratio
        );
    };
    row("rdma direct, verified (default)", &verified, true);
    row("rdma direct, unverified", &plain, false);
    row("rdma staged (net_staged), verified", &staged, false);
    row("rdma staged, unverified", &staged_plain, false);
    let (n_big, n_small) = (
        total.div_ceil(bucket) as f64,
        total.div_ceil(1 << 20) as f64,
    );
    let per_bucket =
        (fine.total.as_secs_f64() - plain.best.total.as_secs_f64()) / (n_small - n_big);
    println!(
        "  wm     1 MiB buckets ({n_small:.0})               {:>7.2} GB/s   per-bucket overhead {:.1} us (one run, against the best unverified direct run)",
        gbps(fine.bytes, fine.total),
        per_bucket.max(0.0) * 1e6
    );
    println!(
        "  wm     {:<36}{:>7.2} GB/s   (one run, XXH3 skipped; publisher and engine each hash every byte)",
        "rdma direct, keyed BLAKE3 digests",
        gbps(keyed_run.bytes, keyed_run.total)
    );
    for (what, v, u) in &halves {
        println!(
            "  wm     {what:<36}{:>7.2} GB/s   ratio {:.2} to the best floor; unverified {:.2} GB/s ({:.2}); {} of {} (one run each)",
            gbps(v.bytes, v.total),
            gbps(v.bytes, v.total) / floor,
            gbps(u.bytes, u.total),
            gbps(u.bytes, u.total) / floor,
            fmt::bytes(v.bytes),
            fmt::bytes(total as u64)
        );
    }
    hash_rates(&floor_src);
    // Time to first byte: a whole update of one 4 KiB tensor.
    let mut best = Duration::MAX;
    for _ in 0..probes {
        let probe = engine(1 << 20, 1)?;
        probe
            .allocate(&ParamSpec::host("probe", DType::U8, &[4096]))
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        probe.update(request(false)).map_err(|e| e.to_string())?;
        best = best.min(t.elapsed());
    }
    println!(
        "  wm     time to first byte                 {}  (a whole update of one 4 KiB tensor: connect, challenge, manifest, UCX endpoint, one bucket; best of {probes})",
        fmt::ms(best)
    );
    let sessions = trainer.finish()?;
    // The warm-up session hashed the trainer's live tensors for the
    // manifest; the later sessions of the same serve call reuse the sums.
    if let Some(s) = sessions.first().filter(|s| s.len() == 5) {
        let hashed: u64 = sessions.iter().skip(1).map(|s| s[3]).sum();
        println!(
            "  trainer checksums: {} hashed in {} before the first manifest ({:.2} GB/s); {} for the {} sessions after it (same serve call)",
            fmt::bytes(s[3]),
            fmt::ms(Duration::from_nanos(s[4])),
            gbps(s[3], Duration::from_nanos(s[4]).max(Duration::from_nanos(1))),
            fmt::bytes(hashed),
            sessions.len() - 1
        );
    }
    if let Some(s) = sessions.get(1).filter(|s| s.len() == 5) {
        let pack = Duration::from_nanos(s[1]);
        let packing = if pack.is_zero() {
            "none (entries sent from the tensors)".to_string()
        } else {
            format!(
                "{} ({:.2} GB/s, overlapped with sending)",
                fmt::ms(pack),
                gbps(s[0], pack)
            )
        };
        println!(
            "  verified run: trainer packing {packing}; engine receive+apply {}",
            fmt::ms(verified.best.sync)
        );
    }
    Ok(())
}

/// One core's hashing speed over the same bytes: XXH3-128 (the manifest's
/// checksums) beside keyed BLAKE3 (the keyed digests).
fn hash_rates(bytes: &[u8]) {
    let bytes = &bytes[..bytes.len().min(256 << 20)];
    let rate = |f: &dyn Fn(&[u8])| {
        let t = Instant::now();
        for piece in bytes.chunks(1 << 20) {
            f(piece);
        }
        gbps(bytes.len() as u64, t.elapsed())
    };
    let xxh3 = rate(&|b| {
        std::hint::black_box(weight_manager_core::checksum::of(b));
    });
    let key = [7u8; 32];
    let blake3 = rate(&|b| {
        std::hint::black_box(weight_manager_core::checksum::keyed(&key, b));
    });
    println!(
        "  hash   one core, 1 MiB pieces: xxh3-128 {xxh3:.2} GB/s, keyed BLAKE3 {blake3:.2} GB/s (XXH3 catches corruption; BLAKE3 keyed authenticates)"
    );
}
