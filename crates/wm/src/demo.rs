//! `wm demo`: one engine rank with host params through init, update from a
//! snapshot, clear, and update again, checking every byte.

use crate::fixtures::{self, FakeTensor};
use crate::fmt;
use crate::leftovers::Listed;
use std::path::{Path, PathBuf};
use std::time::Instant;
use weight_manager_core::checkpoint::checksums;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::{LogLevel, Logger};
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

/// `wm demo` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Folder for the demo's snapshot, created; a folder that exists must
    /// be empty (the demo writes a snapshot there, twice, and would
    /// overwrite a model's files) (default: a temporary one, removed)
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Removes the demo's own temporary directory on exit (and on a stopping
/// signal, while listed).
struct TempDir(
    PathBuf,
    #[expect(
        dead_code,
        reason = "held for its drop: listed while the folder exists"
    )]
    Listed,
);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_snapshot(dir: &Path, model: &[FakeTensor], step: u64) -> Result<(), String> {
    fixtures::write(&dir.join("model_state.tp0.0.safetensors"), model)?;
    fixtures::write_version(dir, step)?;
    checksums::write(dir, 2).map_err(|e| e.to_string())?;
    Ok(())
}

fn row(step: usize, action: &str, m: &Manager, tensors: &str, bytes: &str, time: &str, rate: &str) {
    let s = m.status();
    println!(
        "{step:<5} {action:<24} {:<9} {:<8} {tensors:>7} {bytes:>10} {time:>9} {rate:>7}",
        s.state.name(),
        s.version.as_deref().unwrap_or("-"),
    );
}

/// Compare every param with the model's bytes; returns the bytes checked.
fn check(params: &[(*mut u8, usize)], model: &[FakeTensor]) -> Result<u64, String> {
    let mut n = 0;
    for ((p, len), t) in params.iter().zip(model) {
        // SAFETY: each pointer addresses len bytes of a registered param, and no update runs now.
        let got = unsafe { std::slice::from_raw_parts(*p, *len) };
        if got != &t.data[..] {
            return Err(format!(
                "param '{}' does not hold the snapshot's bytes",
                t.name
            ));
        }
        n += *len as u64;
    }
    Ok(n)
}

/// The demo's folder: `--dir` (created, or empty), or a temporary one
/// removed when the second value is dropped.
fn demo_dir(a: &Args) -> Result<(PathBuf, Option<TempDir>), String> {
    match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
            let first = std::fs::read_dir(d)
                .map_err(|e| format!("reading {}: {e}", d.display()))?
                .next();
            if let Some(entry) = first {
                let name = entry.map(|e| e.file_name().to_string_lossy().into_owned());
                return Err(format!(
                    "--dir {} is not empty (it holds '{}'): the demo writes its snapshot \
                     there and would overwrite a model's files; give a new or empty folder",
                    d.display(),
                    name.unwrap_or_else(|e| e.to_string())
                ));
            }
            Ok((d.clone(), None))
        }
        None => {
            let d = std::env::temp_dir().join(format!("wm-demo-{}", std::process::id()));
            let listed = Listed::new(&d);
            std::fs::create_dir_all(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
            Ok((d.clone(), Some(TempDir(d, listed))))
        }
    }
}

fn print_header(model: &[FakeTensor], total: u64, dir: &Path) {
    println!(
        "weight_manager {} demo: one engine rank, host params, snapshot updates",
        env!("CARGO_PKG_VERSION")
    );
    println!(
        "model: {} tensors, {} (bf16 + f32) in {}",
        model.len(),
        fmt::bytes(total),
        dir.display()
    );
    println!(
        "params: even-numbered engine-owned (the engine's buffers), odd-numbered library-owned (released on clear)\n"
    );
    println!(
        "{:<5} {:<24} {:<9} {:<8} {:>7} {:>10} {:>9} {:>7}",
        "step", "action", "state", "version", "tensors", "bytes", "time", "GB/s"
    );
}

/// Register every tensor of `model` with `m`: even-numbered ones
/// engine-owned (in `engine_buffers`), odd-numbered library-owned; every
/// param's (address, length).
fn register(
    m: &Manager,
    model: &[FakeTensor],
    engine_buffers: &mut Vec<Vec<u8>>,
) -> Result<Vec<(*mut u8, usize)>, String> {
    let mut params = Vec::new();
    for (i, t) in model.iter().enumerate() {
        let spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
        if i % 2 == 0 {
            let mut buf = vec![0u8; t.data.len()];
            // SAFETY: the caller keeps engine_buffers as long as the manager.
            unsafe { m.register(&spec, buf.as_mut_ptr(), buf.len()) }.map_err(|e| e.to_string())?;
            params.push((buf.as_mut_ptr(), buf.len()));
            engine_buffers.push(buf);
        } else {
            params.push(m.allocate(&spec).map_err(|e| e.to_string())?);
        }
    }
    Ok(params)
}

/// One update from the snapshot in `dir`, verified, printed as row `step`.
fn update(
    m: &Manager,
    dir: &Path,
    (step, action): (usize, &str),
    mode: Mode,
) -> Result<(), String> {
    let mut progress = fmt::progress_line(action);
    let mut req = UpdateRequest::snapshot(dir);
    req.verify = true;
    req.mode = mode;
    req.hooks.progress = Some(&mut progress);
    let stats = m.update(req).map_err(|e| format!("{action}: {e}"))?;
    row(
        step,
        action,
        m,
        &stats.tensors.to_string(),
        &fmt::bytes(stats.bytes),
        &fmt::ms(stats.total),
        &format!("{:.2}", fmt::gbps(stats.bytes, stats.total)),
    );
    Ok(())
}

/// Clear `m` (row 3); every library-owned byte must be released.
fn clear(m: &Manager) -> Result<(), String> {
    let t = Instant::now();
    let cleared = m.clear().map_err(|e| e.to_string())?;
    row(
        3,
        "clear",
        m,
        &cleared.params.to_string(),
        &format!("-{}", fmt::bytes(cleared.bytes_released)),
        &fmt::ms(t.elapsed()),
        "-",
    );
    let s = m.status();
    if s.resident_bytes != 0 {
        return Err(format!(
            "after clear {} bytes are still resident",
            s.resident_bytes
        ));
    }
    Ok(())
}

pub fn run(a: &Args) -> Result<(), String> {
    let (dir, _cleanup) = demo_dir(a)?;
    let v1 = fixtures::demo_model(100);
    let total: u64 = v1.iter().map(|t| t.data.len() as u64).sum();
    write_snapshot(&dir, &v1, 100)?;
    print_header(&v1, total, &dir);
    let m = Manager::new(ManagerConfig {
        model_dir: Some(dir.clone()),
        fallback_dir: None,
        logger: Logger::stderr(LogLevel::Warn),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut engine_buffers: Vec<Vec<u8>> = Vec::new();
    let params = register(&m, &v1, &mut engine_buffers)?;
    let n = v1.len().to_string();
    row(1, "init + register", &m, &n, &fmt::bytes(total), "-", "-");
    update(&m, &dir, (2, "update (atomic, xxh3)"), Mode::Atomic)?;
    check(&params, &v1)?;
    clear(&m)?;
    let v2 = fixtures::demo_model(200);
    write_snapshot(&dir, &v2, 200)?;
    update(&m, &dir, (4, "update (in-place, xxh3)"), Mode::InPlace)?;
    let checked = check(&params, &v2)?;
    // `check` read every param through the pointers taken at registration, so
    // the new bytes are at the old addresses.
    let s = m.status();
    println!();
    let all_resident = s.resident_bytes == s.param_bytes;
    if s.state.name() == "NORMAL" && s.version.as_deref() == Some("200") && all_resident {
        println!(
            "verdict: OK - every param holds version 200's bytes ({} checked), library-owned memory was released and came back at the same addresses",
            fmt::bytes(checked)
        );
        Ok(())
    } else {
        Err(format!(
            "verdict: FAILED - final state {} version {:?}",
            s.state, s.version
        ))
    }
}
