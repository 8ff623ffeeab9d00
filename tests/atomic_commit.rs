//! Atomic commits through the Rust API with real files, a real publisher
//! process and real memory: library-owned params take the update by a page
//! swap (address kept, old pages freed, readers see one version at a time),
//! failures before the commit leave the old bytes and free the new pages,
//! and engine-owned params' staging is kept between updates until a clear.
//!
//! Memory is measured as this process's resident set, so the tests of this
//! file run one at a time (`serial`).

mod common;

use common::*;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use weight_manager_core::checkpoint::checksums;
use weight_manager_core::wm_result;
use weight_manager_core::ParamSpec;
use weight_manager_core::SourceKind;
use weight_manager_core::State;
use weight_manager_core::{Hooks, Mode, Progress};
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

use common::WM;
const MIB: usize = 1 << 20;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's resident memory in bytes (after the allocator gave back
/// what it can, so the test's own freed buffers do not count).
fn rss() -> usize {
    // SAFETY: no preconditions.
    unsafe { libc::malloc_trim(0) };
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Params of these sizes in bytes (f32 vectors): large ones (several
/// huge pages, and not a multiple of one), and small ones.
/// Large enough that a model's worth stands out of the process's noise.
const SIZES: [usize; 5] = [24 * MIB, 13 * MIB + 4096, 64 * 1024, 4096, 8];

/// Version `v` of the model (`common::word_tagged`: each word says its
/// version and place).
fn version(v: u64) -> Vec<T> {
    word_tagged(v, &SIZES)
}

/// Write version `v` as a snapshot with checksums in `dir`; returns it.
fn snapshot(dir: &Path, v: u64) -> Vec<T> {
    std::fs::create_dir_all(dir).unwrap();
    let ts = version(v);
    write_safetensors(&dir.join("model_state.tp0.0.safetensors"), &ts);
    write_version(dir, &v.to_string());
    checksums::write(dir, 2).unwrap();
    ts
}

/// Version `v` in two part files (the first with two tensors), with
/// checksums, so an update of it reports progress before it reads the
/// second file; returns the second file.
fn snapshot_in_parts(dir: &Path, v: u64) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let ts = version(v);
    write_safetensors(&dir.join("model_state.tp0.0.part1.safetensors"), &ts[..2]);
    let second = dir.join("model_state.tp0.0.part2.safetensors");
    write_safetensors(&second, &ts[2..]);
    write_version(dir, &v.to_string());
    checksums::write(dir, 2).unwrap();
    second
}

fn manager(keep_atomic_staging: bool) -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        keep_atomic_staging,
        ..Default::default()
    })
    .unwrap()
}

fn atomic<'h>(dir: &Path) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(dir);
    r.mode = Mode::Atomic;
    r.verify = true;
    r.timeout = Duration::from_secs(30);
    r
}

/// A manager with library-owned params holding version 1; `keep`: it
/// keeps atomic staging (faults in the next update's shadows ahead).
fn updated_once(root: &Path, keep: bool) -> (Manager, Vec<(*mut u8, usize)>, Vec<T>) {
    let m = manager(keep);
    let v1 = snapshot(&root.join("v1"), 1);
    let ptrs = register(&m, &v1);
    m.update(atomic(&root.join("v1"))).unwrap();
    assert_params(&ptrs, &v1);
    (m, ptrs, v1)
}

#[test]
fn a_swap_keeps_every_address_and_frees_the_old_pages() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    // Without kept staging, so that every update makes fresh shadows.
    let (m, ptrs, _) = updated_once(root.path(), false);
    let total: usize = SIZES.iter().sum();
    let before = rss();
    for v in 2..6 {
        let ts = snapshot(&root.path().join(format!("v{v}")), v);
        m.update(atomic(&root.path().join(format!("v{v}"))))
            .unwrap();
        // The same pointers the engine got at registration see the new bytes.
        assert_params(&ptrs, &ts);
    }
    let s = m.status();
    assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("5")));
    assert_eq!(s.resident_bytes, total as u64);
    // Four updates of the whole model later, one model's worth is resident:
    // every swap freed the pages it replaced.
    let grown = rss().saturating_sub(before);
    assert!(grown < total / 2, "resident memory grew by {grown} bytes");
}

/// Run `fail` (an update of version 2, in two part files in the directory
/// it gets, that must fail before its commit) against a manager holding
/// version 1 in library-owned params; the old bytes, version and state
/// stay, and the shadows it faulted in are freed.
fn fails_before_commit(fail: impl FnOnce(&Manager, &Path, &mut usize) -> wm_result) -> wm_result {
    let root = tempfile::tempdir().unwrap();
    let (m, ptrs, v1) = updated_once(root.path(), false);
    snapshot_in_parts(&root.path().join("v2"), 2);
    let before = rss();
    let mut peak = 0;
    let code = fail(&m, &root.path().join("v2"), &mut peak);
    let total: usize = SIZES.iter().sum();
    // The shadows were resident during the update (so the measure sees
    // them), and are not any more.
    assert!(
        peak >= before + total * 9 / 10,
        "peak {peak}, before {before}"
    );
    let after = rss();
    assert!(after < before + total / 4, "after {after}, before {before}");
    let s = m.status();
    assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("1")));
    assert_params(&ptrs, &v1);
    code
}

/// A progress hook that records the peak resident memory and returns `go_on`.
fn measuring(peak: &mut usize, go_on: bool) -> impl FnMut(&Progress) -> bool + '_ {
    move |_| {
        *peak = (*peak).max(rss());
        go_on
    }
}

#[test]
fn a_truncated_file_leaves_the_old_bytes_and_frees_the_new_pages() {
    let _s = serial();
    let code = fails_before_commit(|m, dir, peak| {
        // The second part file is cut once the first is applied.
        let p2 = dir.join("model_state.tp0.0.part2.safetensors");
        let mut measure = measuring(peak, true);
        let mut cut = |p: &Progress| {
            if p.tensors_done == 2 {
                let f = std::fs::OpenOptions::new().write(true).open(&p2).unwrap();
                f.set_len(100).unwrap();
            }
            measure(p)
        };
        let mut req = atomic(dir);
        req.version = Some("2".into());
        req.hooks = Hooks {
            progress: Some(&mut cut),
            tensor: None,
        };
        m.update(req).unwrap_err().code
    });
    assert_ne!(code, wm_result::WM_OK);
}

#[test]
fn a_checksum_error_leaves_the_old_bytes_and_frees_the_new_pages() {
    let _s = serial();
    let code = fails_before_commit(|m, dir, peak| {
        // Flip a bit of the last tensor: only its checksum can tell.
        let path = dir.join("model_state.tp0.0.part2.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let mut measure = measuring(peak, true);
        let mut req = atomic(dir);
        req.hooks.progress = Some(&mut measure);
        m.update(req).unwrap_err().code
    });
    assert_eq!(code, wm_result::WM_ERR_CHECKSUM);
}

#[test]
fn a_cancelled_update_leaves_the_old_bytes_and_frees_the_new_pages() {
    let _s = serial();
    let code = fails_before_commit(|m, dir, peak| {
        let mut stop = measuring(peak, false);
        let mut req = atomic(dir);
        req.hooks.progress = Some(&mut stop);
        m.update(req).unwrap_err().code
    });
    assert_eq!(code, wm_result::WM_ERR_CANCELLED);
}

#[test]
fn a_dead_publisher_leaves_the_old_bytes_and_frees_the_new_pages() {
    let _s = serial();
    fails_before_commit(|m, dir, peak| {
        let sock = dir.join("p.sock");
        let mut publisher = std::process::Command::new(&*WM)
            .args([
                "serve",
                "--ipc",
                sock.to_str().unwrap(),
                dir.to_str().unwrap(),
            ])
            .args(["--bucket-mib", "1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while !sock.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "publisher did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = publisher.id() as i32;
        let mut kill_first = |_: &Progress| {
            *peak = (*peak).max(rss());
            // SAFETY: our own child process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            true
        };
        let mut req = atomic(&sock);
        req.source = SourceKind::Ipc;
        req.hooks.progress = Some(&mut kill_first);
        let e = m.update(req).unwrap_err();
        let _ = publisher.wait();
        e.code
    });
}

/// A word of the param at `p`: (version, param, word index).
fn word_at(p: *const u8, w: usize) -> (u64, u64, u64) {
    // SAFETY: the caller reads inside a registered param.
    let x = unsafe { std::ptr::read_volatile(p.cast::<u64>().add(w)) };
    (x >> 48, (x >> 40) & 0xff, x & ((1 << 40) - 1))
}

/// One pass over param `i` at `p` (`n` bytes), first and last word of every
/// 4 KiB page in order: every word must be in its place, and the versions
/// seen must never go back (each swap is one instant; a copy that a reader
/// overtakes would show new bytes, then old ones).
fn check_pass(i: usize, p: *const u8, n: usize) -> Result<(), String> {
    let words = n / 8;
    let mut last = 0;
    for page in (0..words).step_by(512) {
        for w in [page, (page + 511).min(words - 1)] {
            let (v, at, index) = word_at(p, w);
            if at != i as u64 || index != w as u64 || v == 0 {
                return Err(format!(
                    "param {i} word {w}: {:#x}",
                    v << 48 | at << 40 | index
                ));
            }
            if v < last {
                return Err(format!("param {i}: version {v} after version {last}"));
            }
            last = v;
        }
    }
    Ok(())
}

#[test]
fn a_concurrent_reader_sees_one_version_at_a_time_in_every_param() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    let (m, ptrs, _) = updated_once(root.path(), true);
    let stop = Arc::new(AtomicBool::new(false));
    let params: Vec<(usize, usize)> = ptrs.iter().map(|(p, n)| (*p as usize, *n)).collect();
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || -> Result<u64, String> {
            let mut passes = 0;
            while !stop.load(Ordering::Relaxed) {
                for (i, &(p, n)) in params.iter().enumerate() {
                    check_pass(i, p as *const u8, n)?;
                }
                passes += 1;
            }
            Ok(passes)
        })
    };
    for v in 2..10 {
        let dir = root.path().join(format!("v{v}"));
        let ts = snapshot(&dir, v);
        m.update(atomic(&dir)).unwrap();
        assert_params(&ptrs, &ts);
    }
    stop.store(true, Ordering::Relaxed);
    let passes = reader.join().unwrap().unwrap();
    assert!(passes > 0);
}

/// Engine-owned params: `n` bytes each, zeroed, registered as version 1's.
fn engine_params(m: &Manager, ts: &[T]) -> Vec<(*mut u8, usize)> {
    ts.iter()
        .map(|t| {
            let buf = Box::leak(vec![0u8; t.data.len()].into_boxed_slice());
            let spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
            unsafe { m.register(&spec, buf.as_mut_ptr(), buf.len()) }.unwrap();
            (buf.as_mut_ptr(), buf.len())
        })
        .collect()
}

#[test]
fn engine_owned_staging_is_kept_until_a_clear_or_freed_when_asked() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    let total: usize = SIZES.iter().sum();
    for keep in [true, false] {
        let m = manager(keep);
        let v1 = snapshot(&root.path().join("v1"), 1);
        let v2 = snapshot(&root.path().join("v2"), 2);
        let ptrs = engine_params(&m, &v1);
        // The params resident before the first reading: the allocator may
        // hand back memory an earlier test faulted in, or fresh pages, and
        // only the staging is to be counted.
        for &(p, n) in &ptrs {
            for at in (0..n).step_by(4096) {
                // SAFETY: inside the param's buffer, which nothing else uses yet.
                unsafe { p.add(at).write_volatile(0) };
            }
        }
        let before = rss();
        m.update(atomic(&root.path().join("v1"))).unwrap();
        assert_params(&ptrs, &v1);
        let after_first = rss();
        m.update(atomic(&root.path().join("v2"))).unwrap();
        assert_params(&ptrs, &v2);
        let after_second = rss();
        let kept = after_first.saturating_sub(before);
        if keep {
            assert!(kept >= total * 9 / 10, "kept {kept} bytes of staging");
            // The second update reused it.
            assert!(after_second < after_first + total / 4);
            m.clear().unwrap();
            assert!(
                rss() + total * 9 / 10 <= after_second,
                "clear frees the staging"
            );
        } else {
            assert!(kept < total / 4, "kept {kept} bytes of staging");
            assert!(after_second < after_first + total / 4);
        }
    }
}

#[test]
fn shadows_faulted_in_ahead_are_used_and_freed_by_a_clear() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    let total: usize = SIZES.iter().sum();
    let versions: Vec<Vec<T>> = (1..4)
        .map(|v| snapshot(&root.path().join(format!("v{v}")), v))
        .collect();
    let base = rss();
    let m = manager(true);
    let ptrs = register(&m, &versions[0]);
    for (v, ts) in versions.iter().enumerate().take(2) {
        m.update(atomic(&root.path().join(format!("v{}", v + 1))))
            .unwrap();
        assert_params(&ptrs, ts);
    }
    // Between updates the next shadows are faulted in: one more model.
    let start = std::time::Instant::now();
    while rss() < base + total * 19 / 10 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no shadows faulted in ahead"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    m.clear().unwrap();
    let left = rss().saturating_sub(base);
    assert!(left < total / 4, "{left} bytes left after a clear");
    m.update(atomic(&root.path().join("v3"))).unwrap();
    assert_params(&ptrs, &versions[2]);
}

/// Versions `vs` written as snapshots under `root` (`v<N>` each); returns
/// (directory, tensors) per version.
fn snapshots(root: &Path, vs: std::ops::Range<u64>) -> Vec<(std::path::PathBuf, Vec<T>)> {
    vs.map(|v| {
        let dir = root.join(format!("v{v}"));
        let ts = snapshot(&dir, v);
        (dir, ts)
    })
    .collect()
}

#[test]
fn back_to_back_updates_keep_every_address_and_memory_flat() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    // Written first, so that the updates follow each other with no pause:
    // each comes while the shadows of the next are still being faulted in.
    let versions = snapshots(root.path(), 2..8);
    let base = rss();
    let (m, ptrs, _) = updated_once(root.path(), true);
    let total: usize = SIZES.iter().sum();
    for (dir, ts) in &versions {
        m.update(atomic(dir)).unwrap();
        assert_params(&ptrs, ts);
    }
    assert_eq!(m.status().version.as_deref(), Some("7"));
    // The params and at most one set of next shadows: every swap freed the
    // pages it replaced, and every set of shadows taken was used or freed.
    let grown = rss().saturating_sub(base);
    assert!(
        grown < 2 * total + total / 2,
        "resident memory grew by {grown} bytes for a model of {total}"
    );
    m.clear().unwrap();
    assert!(rss().saturating_sub(base) < total / 2);
}

#[test]
fn a_failure_among_back_to_back_updates_leaves_the_old_bytes() {
    let _s = serial();
    let root = tempfile::tempdir().unwrap();
    let versions = snapshots(root.path(), 2..5);
    let (m, ptrs, _) = updated_once(root.path(), true);
    assert_eq!(versions[1].1.len(), SIZES.len());
    m.update(atomic(&versions[0].0)).unwrap();
    // Version 3 (in two part files) is cancelled after its first file,
    // right after version 2.
    let v3 = root.path().join("v3-parts");
    snapshot_in_parts(&v3, 3);
    let mut stop = |_: &Progress| false;
    let mut req = atomic(&v3);
    req.hooks.progress = Some(&mut stop);
    assert_eq!(m.update(req).unwrap_err().code, wm_result::WM_ERR_CANCELLED);
    let s = m.status();
    assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("2")));
    assert_params(&ptrs, &versions[0].1);
    // And the next one, right after, goes through at the same addresses.
    m.update(atomic(&versions[2].0)).unwrap();
    assert_params(&ptrs, &versions[2].1);
    assert_eq!(m.status().version.as_deref(), Some("4"));
}

/// `wm bench snapshot` on a small model: every atomic row is printed
/// beside the floor or the in-place figure it is measured against (PyTorch
/// is left out: `WM_PYTHON` names no Python).
#[test]
fn bench_snapshot_prints_every_atomic_row_beside_its_floor() {
    let _s = serial();
    let out = std::process::Command::new(&*WM)
        .args(["bench", "snapshot", "--gib", "0.125", "--small", "0"])
        .env("WM_PYTHON", "/nonexistent/python")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "floor  fault in fresh memory ",
        "floor  fault in fresh memory, read",
        "to in-place (page swap, 2 s apart",
        "to in-place, ",
        "to fault in + read (back to back",
        "to fault in + read (atomic, library-owned)",
        "to fault in + two passes (atomic, engine-owned)",
        "to two passes (kept staging",
        "torch  load_file + copy_()            skipped",
    ] {
        assert!(text.contains(row), "no '{row}' in:\n{text}");
    }
}
