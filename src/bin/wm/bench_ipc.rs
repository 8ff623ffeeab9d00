//! `wm bench ipc`: a model over host shared memory from a trainer process
//! (the publisher, its own process) into this engine process, in copy mode
//! (into registered params) and zero-copy mode (per-tensor callback on the
//! shared buffer), beside a memcpy floor measured in the same run.
//!
//! The trainer packs bucket i+1 while the engine applies bucket i, so the two
//! run at once: each side gets half of the cores (as on a real node, where
//! both have their own). Floors: one memcpy with the engine's threads (the
//! issue's), and two memcpys at once, which is what the two-copy pipeline can
//! reach where memory bandwidth is the limit.

use crate::fmt::{self, gbps};
use crate::Args;
use std::time::Duration;
use weight_manager::apply::Mode;
use weight_manager::manager::{Manager, ManagerConfig, UpdateRequest};
use weight_manager::publisher::{Publisher, PublisherConfig};
use weight_manager::source::SourceKind;

/// The trainer process: builds the model in memory, publishes, serves.
pub fn publisher(a: &Args) -> Result<(), String> {
    let socket = a.value("socket").ok_or("--socket")?;
    let count = crate::bench::layer_count(a.number("gib", 4.0)?);
    let threads: usize = a.number("threads", 1)?;
    let bucket_mib: usize = a.number("bucket-mib", 512)?;
    let data = crate::bench::trainer_layers(count);
    let p = Publisher::bind(
        std::path::Path::new(socket),
        PublisherConfig {
            bucket_size: bucket_mib << 20,
            threads,
            checksums: false,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    crate::bench::add_layers(&p, &data, None)?;
    p.set_version(Some("bench".into()));
    println!("ready");
    let stats = p
        .serve(a.number("engines", 3)?, Duration::from_secs(600))
        .map_err(|e| e.to_string())?;
    for s in stats.sessions {
        println!(
            "session {} {} {}",
            s.bytes,
            s.pack.as_nanos(),
            s.wait.as_nanos()
        );
    }
    Ok(())
}

/// The snapshot benchmark's memcpy floor on `bytes` of fresh buffers.
fn memcpy_floor(bytes: usize, threads: usize) -> Result<Duration, String> {
    let src = crate::bench::buffer(bytes);
    let mut dst = crate::bench::buffer(bytes);
    crate::bench::best(|| crate::bench::memcpy_floor(&src, &mut dst, threads))
}

pub fn run(a: &Args) -> Result<(), String> {
    let gib: f64 = a.number("gib", 4.0)?;
    let bucket_mib: usize = a.number("bucket-mib", 512)?;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let side: usize = a.number("threads", (cores / 2).max(1))?;
    let count = crate::bench::layer_count(gib);
    let total = (count * crate::bench::LAYER) as u64;
    let dir = std::env::temp_dir().join(format!("wm-bench-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("trainer.sock");
    let args: Vec<String> = [
        "bench",
        "ipc-publisher",
        "--socket",
        socket.to_str().unwrap_or_default(),
        "--gib",
        &gib.to_string(),
        "--threads",
        &side.to_string(),
        "--bucket-mib",
        &bucket_mib.to_string(),
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let (trainer, _) = crate::bench::TrainerProcess::start(&args, "ready")?;
    println!(
        "wm bench ipc: {} of bf16 in {count} tensors, buckets of {bucket_mib} MiB x 2, {side} thread(s) each for trainer and engine",
        fmt::bytes(total)
    );
    let floor_bytes = (1usize << 30).min(total as usize);
    let floor = gbps(floor_bytes as u64, memcpy_floor(floor_bytes, side)?);
    println!("  floor  memcpy, {side} thread(s)                {floor:>7.2} GB/s");
    // Copy mode moves every byte twice at once (the trainer packs bucket
    // i+1 while the engine applies bucket i), so the two copies share the
    // memory bandwidth: this floor is two memcpys running together.
    let two = std::thread::scope(|s| {
        let a = s.spawn(|| memcpy_floor(floor_bytes, side));
        let b = s.spawn(|| memcpy_floor(floor_bytes, side));
        Ok::<_, String>(a.join().expect("floor")?.max(b.join().expect("floor")?))
    })?;
    let pipe_floor = gbps(floor_bytes as u64, two);
    println!("  floor  two memcpys at once            {pipe_floor:>7.2} GB/s each");

    let m = Manager::new(ManagerConfig {
        threads: side,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut params = crate::bench::layer_params(count);
    crate::bench::register_layers(&m, &mut params)?;
    // Warm-up: the first session creates the trainer's shared buffers (page
    // faults, slow on a VM); steady RL updates reuse them, as timed below.
    let warm = Manager::new(ManagerConfig::default()).map_err(|e| e.to_string())?;
    let mut ignore = |_: &weight_manager::apply::TensorView| Ok(());
    let mut r = UpdateRequest::snapshot(&socket);
    r.source = SourceKind::Ipc;
    r.mode = Mode::InPlace;
    r.hooks.tensor = Some(&mut ignore);
    let first = warm.update(r).map_err(|e| e.to_string())?;
    println!(
        "  wm     first update (creates buffers)  {:>7.2} GB/s   (later updates reuse the trainer's buffers)",
        gbps(first.bytes, first.sync)
    );
    let request = |mode| {
        let mut r = UpdateRequest::snapshot(&socket);
        r.source = SourceKind::Ipc;
        r.mode = mode;
        r
    };
    let copy = m
        .update(request(Mode::InPlace))
        .map_err(|e| e.to_string())?;
    let copy_rate = gbps(copy.bytes, copy.sync);
    println!(
        "  wm     copy mode (into params)         {copy_rate:>7.2} GB/s   ratio {:.2} to memcpy (target >= 0.80) {}; {:.2} to two memcpys at once",
        copy_rate / floor,
        if copy_rate / floor >= 0.8 { "PASS" } else { "MISS" },
        copy_rate / pipe_floor
    );
    let zero = Manager::new(ManagerConfig::default()).map_err(|e| e.to_string())?;
    let mut touched = 0u64;
    let mut cb = |t: &weight_manager::apply::TensorView| {
        touched += t.data[t.data.len() / 2] as u64;
        Ok(())
    };
    let mut r = request(Mode::InPlace);
    r.hooks.tensor = Some(&mut cb);
    let zc = zero.update(r).map_err(|e| e.to_string())?;
    let zc_rate = gbps(zc.bytes, zc.sync);
    println!(
        "  wm     zero-copy (callback on buffer)  {zc_rate:>7.2} GB/s   ratio {:.2} (bounded by the trainer's packing)",
        zc_rate / floor
    );
    let sessions = trainer.finish();
    let _ = std::fs::remove_dir_all(&dir);
    let sessions = sessions?;
    for (name, s, engine) in [
        ("copy mode", sessions.get(1), &copy),
        ("zero-copy", sessions.get(2), &zc),
    ] {
        if let Some(s) = s.filter(|s| s.len() == 3) {
            let pack = Duration::from_nanos(s[1]);
            println!(
                "  {name:<10} trainer packing {} ({:.2} GB/s), waiting for acks {}; engine receive+apply {}",
                fmt::ms(pack),
                gbps(s[0], pack),
                fmt::ms(Duration::from_nanos(s[2])),
                fmt::ms(engine.sync)
            );
        }
    }
    std::hint::black_box(touched);
    Ok(())
}
