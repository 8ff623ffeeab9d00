//! Handle lifetimes through the C ABI (issue 15): handle values are never
//! reused, destroy waits for calls in flight and cancels them, the
//! publisher's argument checks, and why a create call failed.

mod common;

use common::{tensor, write_safetensors, write_version};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use weight_manager::controller::*;
use weight_manager::manager::*;
use weight_manager::params::*;
use weight_manager::publisher::*;
use weight_manager::result::wm_result;
use weight_manager::status::*;
use weight_manager::update::*;
use weight_manager_core::DType;

fn new_manager() -> *mut wm_manager {
    let mut cfg = std::mem::MaybeUninit::<wm_config>::uninit();
    let mut m = std::ptr::null_mut();
    unsafe {
        assert_eq!(wm_config_init(cfg.as_mut_ptr()), wm_result::WM_OK);
        let cfg = cfg.assume_init();
        assert_eq!(wm_init(&cfg, &mut m), wm_result::WM_OK);
    }
    m
}

fn status_of(m: *const wm_manager) -> wm_result {
    let mut s: wm_status_info = unsafe { std::mem::zeroed() };
    s.struct_size = std::mem::size_of::<wm_status_info>() as u32;
    unsafe { wm_status(m, &mut s) }
}

fn create_error() -> String {
    let mut buf = [0 as c_char; 512];
    let mut n = 0usize;
    unsafe {
        assert_eq!(
            wm_last_create_error(buf.as_mut_ptr(), buf.len(), &mut n),
            wm_result::WM_OK
        );
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    }
}

/// Item 12: the allocator hands a freed manager's address to the next one;
/// a handle must not come back to life with it.
#[test]
fn destroyed_handles_stay_invalid_when_new_ones_are_made() {
    let mut old = Vec::new();
    for _ in 0..8 {
        let m = new_manager();
        unsafe { wm_destroy(m) };
        old.push(m as usize);
        let fresh = new_manager();
        for &o in &old {
            assert_eq!(
                status_of(o as *const wm_manager),
                wm_result::WM_ERR_INVALID_HANDLE,
                "a destroyed handle answered for a new manager"
            );
        }
        assert_ne!(fresh as usize, m as usize);
        unsafe { wm_destroy(fresh) };
    }
    let dir = tempfile::tempdir().unwrap();
    let path = CString::new(dir.path().join("p.sock").to_str().unwrap()).unwrap();
    let cell = CString::new(format!("wm-handles-test-{}", std::process::id())).unwrap();
    let (mut p, mut c) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        assert_eq!(
            wm_publisher_create(path.as_ptr(), std::ptr::null(), &mut p),
            wm_result::WM_OK
        );
        wm_publisher_destroy(p);
        let mut p2 = std::ptr::null_mut();
        assert_eq!(
            wm_publisher_create(path.as_ptr(), std::ptr::null(), &mut p2),
            wm_result::WM_OK
        );
        assert_eq!(wm_publisher_publish(p), wm_result::WM_ERR_INVALID_HANDLE);
        wm_publisher_destroy(p2);
        assert_eq!(wm_controller_open(cell.as_ptr(), &mut c), wm_result::WM_OK);
        wm_controller_destroy(c);
        let mut c2 = std::ptr::null_mut();
        assert_eq!(wm_controller_open(cell.as_ptr(), &mut c2), wm_result::WM_OK);
        let mut state = 0i32;
        assert_eq!(
            wm_controller_get(c, &mut state),
            wm_result::WM_ERR_INVALID_HANDLE
        );
        // A handle of one kind is no handle of another.
        assert_eq!(
            status_of(c2 as *const wm_manager),
            wm_result::WM_ERR_INVALID_HANDLE
        );
        wm_controller_destroy(c2);
    }
    let _ = std::fs::remove_file(format!("/dev/shm/{}", cell.to_str().unwrap()));
}

/// What the blocking progress callback shares with the test.
struct Gate {
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
    /// Destroy this manager from inside the callback (same thread) instead.
    destroy_inside: Option<usize>,
}

unsafe extern "C" fn blocking_progress(user: *mut c_void, _p: *const wm_progress) -> i32 {
    let gate = &*(user as *const std::sync::Mutex<Gate>);
    let gate = gate.lock().unwrap();
    let _ = gate.entered.send(());
    match gate.destroy_inside {
        Some(m) => wm_destroy(m as *mut wm_manager),
        None => {
            let _ = gate.release.recv_timeout(Duration::from_secs(120));
        }
    }
    0
}

/// A manager with one engine-owned param (in `buf`) and a snapshot in `dir`
/// whose bytes differ from the buffer's.
fn engine_with_param(dir: &std::path::Path, buf: &mut [u8]) -> *mut wm_manager {
    let t = tensor("w", DType::U8, &[buf.len() as u64], 3);
    assert!(t.data.iter().any(|b| *b != 0xee));
    write_safetensors(&dir.join("model_state.tp0.0.safetensors"), &[t]);
    write_version(dir, "1");
    let m = new_manager();
    let name = CString::new("w").unwrap();
    let shape = [buf.len() as u64];
    unsafe {
        let mut d = std::mem::zeroed::<wm_param_desc>();
        wm_param_desc_init(&mut d);
        d.dtype = DType::U8 as u32;
        d.name = name.as_ptr();
        d.shape = shape.as_ptr();
        d.ndim = 1;
        let rc = wm_register_param(m, &d, buf.as_mut_ptr().cast(), buf.len());
        assert_eq!(rc, wm_result::WM_OK);
    }
    m
}

/// Run `wm_update` from `dir` with the blocking progress callback.
fn update_with_gate(m: usize, dir: &std::path::Path, gate: &std::sync::Mutex<Gate>) -> wm_result {
    let loc = CString::new(dir.to_str().unwrap()).unwrap();
    unsafe {
        let mut r = std::mem::zeroed::<wm_update_request>();
        wm_update_request_init(&mut r);
        r.location = loc.as_ptr();
        r.progress_callback = Some(blocking_progress);
        r.progress_user_data = gate as *const _ as *mut c_void;
        wm_update(m as *mut wm_manager, &r, std::ptr::null_mut())
    }
}

/// Item 13: `wm_destroy` on another thread while an update is paused in its
/// progress callback. It must wait for the update, which must then write
/// nothing: after `wm_destroy` returns the engine poisons (frees) its
/// memory, and the bytes must stay poisoned.
#[test]
fn destroy_waits_for_the_update_in_flight_which_writes_nothing_after() {
    let dir = tempfile::tempdir().unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let m = engine_with_param(dir.path(), &mut buf) as usize;
    let addr = buf.as_mut_ptr() as usize;
    let len = buf.len();
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let gate = Arc::new(std::sync::Mutex::new(Gate {
        entered: entered_tx,
        release: release_rx,
        destroy_inside: None,
    }));
    let dir_path = dir.path().to_path_buf();
    let g = gate.clone();
    let updater = std::thread::spawn(move || update_with_gate(m, &dir_path, &g));
    entered.recv_timeout(Duration::from_secs(60)).unwrap();
    let destroyed = Arc::new(AtomicBool::new(false));
    let d = destroyed.clone();
    let destroyer = std::thread::spawn(move || {
        unsafe { wm_destroy(m as *mut wm_manager) };
        // The engine frees its memory once destroy returned: poison it.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0xee, len) };
        d.store(true, Ordering::SeqCst);
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !destroyed.load(Ordering::SeqCst),
        "wm_destroy returned while an update was still running"
    );
    release.send(()).unwrap();
    destroyer.join().unwrap();
    assert_eq!(updater.join().unwrap(), wm_result::WM_ERR_CANCELLED);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        buf.iter().all(|b| *b == 0xee),
        "the update wrote engine memory after wm_destroy returned"
    );
    assert_eq!(status_of(m as *const _), wm_result::WM_ERR_INVALID_HANDLE);
}

/// Item 13: destroy from inside the manager's own callback, on the
/// updating thread, neither deadlocks nor lets the update commit.
#[test]
fn destroy_inside_a_callback_cancels_without_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    let mut buf = vec![0x11u8; 4096];
    let m = engine_with_param(dir.path(), &mut buf) as usize;
    let (entered_tx, _entered) = mpsc::channel();
    let (_release, release_rx) = mpsc::channel();
    let gate = std::sync::Mutex::new(Gate {
        entered: entered_tx,
        release: release_rx,
        destroy_inside: Some(m),
    });
    assert_eq!(
        update_with_gate(m, dir.path(), &gate),
        wm_result::WM_ERR_CANCELLED
    );
    assert!(buf.iter().all(|b| *b == 0x11), "atomic: nothing committed");
    assert_eq!(status_of(m as *const _), wm_result::WM_ERR_INVALID_HANDLE);
}

/// Item 13, publisher: destroy while `wm_publisher_serve` runs a session
/// (an engine connected and went silent) stops the serve and waits for it,
/// so the trainer may free its tensors when destroy returns.
#[test]
fn publisher_destroy_stops_a_serve_in_flight_and_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.sock");
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let data = vec![7u8; 1 << 12];
    let name = CString::new("w").unwrap();
    let shape = [data.len() as u64];
    let mut p = std::ptr::null_mut();
    unsafe {
        assert_eq!(
            wm_publisher_create(cpath.as_ptr(), std::ptr::null(), &mut p),
            wm_result::WM_OK
        );
        let rc = wm_publisher_add_tensor(
            p,
            name.as_ptr(),
            DType::U8 as u32,
            shape.as_ptr(),
            1,
            data.as_ptr().cast(),
            data.len(),
            -1,
        );
        assert_eq!(rc, wm_result::WM_OK);
    }
    let p = p as usize;
    let served = Arc::new(AtomicBool::new(false));
    let s = served.clone();
    let server = std::thread::spawn(move || {
        let rc =
            unsafe { wm_publisher_serve(p as *mut wm_publisher, 1, 120_000, std::ptr::null_mut()) };
        s.store(true, Ordering::SeqCst);
        rc
    });
    // A silent engine: the session waits for its HELLO (60 s by default).
    let _engine = std::os::unix::net::UnixStream::connect(&path).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!served.load(Ordering::SeqCst));
    unsafe { wm_publisher_destroy(p as *mut wm_publisher) };
    assert!(
        set_within(&served, 10),
        "wm_publisher_destroy returned while wm_publisher_serve still ran"
    );
    assert_ne!(server.join().unwrap(), wm_result::WM_OK);
}

/// Whether `flag` is set within `secs` seconds. The serve thread sets it
/// right after `wm_publisher_serve` returned, a moment after destroy could
/// see the call end; without the fix serve runs on for its 60 s timeouts.
fn set_within(flag: &AtomicBool, secs: u64) -> bool {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        if flag.load(Ordering::SeqCst) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn publisher_at(dir: &std::path::Path) -> *mut wm_publisher {
    let cpath = CString::new(dir.join("p.sock").to_str().unwrap()).unwrap();
    let mut p = std::ptr::null_mut();
    let rc = unsafe { wm_publisher_create(cpath.as_ptr(), std::ptr::null(), &mut p) };
    assert_eq!(rc, wm_result::WM_OK);
    p
}

/// Item 17: a rank below -1 is not "every rank".
#[test]
fn publisher_refuses_ranks_below_minus_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = publisher_at(dir.path());
    let data = [1u8; 4];
    let shape = [4u64];
    let add = |name: &str, rank: i32| {
        let name = CString::new(name).unwrap();
        unsafe {
            wm_publisher_add_tensor(
                p,
                name.as_ptr(),
                DType::U8 as u32,
                shape.as_ptr(),
                1,
                data.as_ptr().cast(),
                4,
                rank,
            )
        }
    };
    assert_eq!(add("a", -5), wm_result::WM_ERR_INVALID_ARGUMENT);
    assert_eq!(add("a", i32::MIN), wm_result::WM_ERR_INVALID_ARGUMENT);
    let mut buf = [0 as c_char; 256];
    let mut n = 0;
    unsafe { wm_publisher_last_error(p, buf.as_mut_ptr(), buf.len(), &mut n) };
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    assert!(text.contains("rank -2147483648"), "{text}");
    assert_eq!(add("a", -1), wm_result::WM_OK);
    assert_eq!(add("b", 3), wm_result::WM_OK);
    unsafe { wm_publisher_destroy(p) };
}

/// Item 16: a version engines refuse (over 255 bytes) is refused by the
/// publisher, whether set or read from a directory's version.yaml.
#[test]
fn publisher_refuses_versions_engines_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let p = publisher_at(dir.path());
    let long = CString::new("v".repeat(256)).unwrap();
    let max = CString::new("v".repeat(255)).unwrap();
    let empty = CString::new("").unwrap();
    unsafe {
        assert_eq!(
            wm_publisher_set_version(p, long.as_ptr()),
            wm_result::WM_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            wm_publisher_set_version(p, empty.as_ptr()),
            wm_result::WM_ERR_INVALID_ARGUMENT
        );
        assert_eq!(wm_publisher_set_version(p, max.as_ptr()), wm_result::WM_OK);
        assert_eq!(wm_publisher_publish(p), wm_result::WM_OK);
        // From a version.yaml: refused at publish and at serve.
        let snap = dir.path().join("snap");
        std::fs::create_dir(&snap).unwrap();
        write_version(&snap, &"9".repeat(300));
        let csnap = CString::new(snap.to_str().unwrap()).unwrap();
        assert_eq!(wm_publisher_set_dir(p, csnap.as_ptr()), wm_result::WM_OK);
        assert_eq!(
            wm_publisher_set_version(p, std::ptr::null()),
            wm_result::WM_OK
        );
        assert_eq!(wm_publisher_publish(p), wm_result::WM_ERR_INVALID_ARGUMENT);
        wm_publisher_destroy(p);
        let p = publisher_at(dir.path());
        assert_eq!(wm_publisher_set_dir(p, csnap.as_ptr()), wm_result::WM_OK);
        let rc = wm_publisher_serve(p, 1, 1, std::ptr::null_mut());
        assert_eq!(rc, wm_result::WM_ERR_INVALID_ARGUMENT);
        wm_publisher_destroy(p);
    }
}

/// Item 18: a failed create call's reason is reachable without a handle.
#[test]
fn failed_creates_leave_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"x").unwrap();
    let cfile = CString::new(file.to_str().unwrap()).unwrap();
    let mut p = std::ptr::null_mut();
    unsafe {
        let rc = wm_publisher_create(cfile.as_ptr(), std::ptr::null(), &mut p);
        assert_eq!(rc, wm_result::WM_ERR_INVALID_ARGUMENT);
    }
    assert!(p.is_null());
    let text = create_error();
    assert!(text.contains("not a socket"), "{text}");

    let mut cfg = std::mem::MaybeUninit::<wm_config>::uninit();
    let mut m = std::ptr::null_mut();
    unsafe {
        wm_config_init(cfg.as_mut_ptr());
        let mut cfg = cfg.assume_init();
        cfg.rank = 3;
        assert_eq!(wm_init(&cfg, &mut m), wm_result::WM_ERR_INVALID_ARGUMENT);
    }
    let text = create_error();
    assert!(text.contains("rank 3"), "{text}");

    let bad = CString::new("no/slashes/allowed").unwrap();
    let mut c = std::ptr::null_mut();
    let rc = unsafe { wm_controller_open(bad.as_ptr(), &mut c) };
    assert_ne!(rc, wm_result::WM_OK);
    assert!(!create_error().is_empty());

    // A successful create clears it.
    let m = new_manager();
    assert_eq!(create_error(), "");
    unsafe { wm_destroy(m) };
}

/// Item 13, publisher mid-transfer: an engine's IPC update pauses in its
/// progress callback after the first bucket, with the publisher's session
/// waiting for its acknowledgement. `wm_publisher_destroy` must end that
/// serve before it returns (after which the trainer frees its tensor).
#[test]
fn publisher_destroy_mid_transfer_ends_the_serve_first() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let csock = CString::new(sock.to_str().unwrap()).unwrap();
    let mut trainer = vec![5u8; 1 << 16];
    let (name, shape) = (CString::new("w").unwrap(), [trainer.len() as u64]);
    let mut p = std::ptr::null_mut();
    unsafe {
        let mut cfg = std::mem::zeroed::<wm_publisher_config>();
        wm_publisher_config_init(&mut cfg);
        cfg.bucket_size = 4096; // 16 buckets
        assert_eq!(
            wm_publisher_create(csock.as_ptr(), &cfg, &mut p),
            wm_result::WM_OK
        );
        let rc = wm_publisher_add_tensor(
            p,
            name.as_ptr(),
            DType::U8 as u32,
            shape.as_ptr(),
            1,
            trainer.as_ptr().cast(),
            trainer.len(),
            -1,
        );
        assert_eq!(rc, wm_result::WM_OK);
        let v = CString::new("1").unwrap();
        assert_eq!(wm_publisher_set_version(p, v.as_ptr()), wm_result::WM_OK);
    }
    let p = p as usize;
    let served = Arc::new(AtomicBool::new(false));
    let s = served.clone();
    let server = std::thread::spawn(move || {
        let rc =
            unsafe { wm_publisher_serve(p as *mut wm_publisher, 1, 120_000, std::ptr::null_mut()) };
        s.store(true, Ordering::SeqCst);
        rc
    });
    let mut engine_mem = vec![0u8; trainer.len()];
    let m = engine_with_param(dir.path(), &mut engine_mem) as usize;
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let gate = Arc::new(std::sync::Mutex::new(Gate {
        entered: entered_tx,
        release: release_rx,
        destroy_inside: None,
    }));
    let g = gate.clone();
    let engine = std::thread::spawn(move || {
        let loc = CString::new(sock.to_str().unwrap()).unwrap();
        unsafe {
            let mut r = std::mem::zeroed::<wm_update_request>();
            wm_update_request_init(&mut r);
            r.source = 1; // WM_SOURCE_IPC
            r.location = loc.as_ptr();
            r.progress_callback = Some(blocking_progress);
            r.progress_user_data = &*g as *const _ as *mut c_void;
            let rc = wm_update(m as *mut wm_manager, &r, std::ptr::null_mut());
            wm_destroy(m as *mut wm_manager);
            rc
        }
    });
    entered.recv_timeout(Duration::from_secs(60)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !served.load(Ordering::SeqCst),
        "the session waits for the paused engine"
    );
    unsafe { wm_publisher_destroy(p as *mut wm_publisher) };
    assert!(
        set_within(&served, 10),
        "wm_publisher_destroy returned while a session still read the trainer's tensor"
    );
    trainer.iter_mut().for_each(|b| *b = 0xee); // freed, as far as the library knows
    release.send(()).unwrap();
    assert_ne!(server.join().unwrap(), wm_result::WM_OK);
    assert_ne!(engine.join().unwrap(), wm_result::WM_OK);
}
