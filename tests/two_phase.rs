//! Two-phase updates through the Rust API (`Manager::stage`, then
//! `Staged::commit` or `abort`), with real files, publishers and memory:
//! while a version stages, reader threads checksum every param and see
//! only the old version's bytes; after the commit, only the new one's.
//! Library-owned and engine-owned host params, over snapshot, IPC (one
//! publisher, and two serving one version together) and rdma. Misuse: stage twice, update while staged, in-place and hooked
//! requests, clear while staged, abort, dropping a `Staged`.

mod common;

use common::*;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use weight_manager_core::wm_result;
use weight_manager_core::{DeltaFallback, DeltaMode, Manager, ManagerConfig, Mode, UpdateRequest};
use weight_manager_core::{ParamSpec, SourceKind, State};
use weight_manager_core::{Publisher, PublisherConfig};

/// Version `v`: a few params of 1 MiB and less, each 8-byte word saying
/// its version (`common::word_tagged`).
fn version(v: u64) -> Vec<T> {
    word_tagged(v, &[1 << 20, 256 << 10, 4096, 8])
}

fn snapshot(dir: &Path, v: u64) -> Vec<T> {
    std::fs::create_dir_all(dir).unwrap();
    let ts = version(v);
    write_safetensors(&dir.join("model_state.tp0.0.safetensors"), &ts);
    write_version(dir, &v.to_string());
    ts
}

/// Params for `ts`: library-owned (allocated) or engine-owned (registered
/// buffers, leaked for the test's life), as (address, length).
fn params(m: &Manager, ts: &[T], library: bool) -> Vec<(usize, usize)> {
    if library {
        return register(m, ts)
            .into_iter()
            .map(|(p, n)| (p as usize, n))
            .collect();
    }
    ts.iter()
        .map(|t| {
            let buf: &'static mut [u8] = Box::leak(vec![0u8; t.data.len()].into_boxed_slice());
            let spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
            unsafe { m.register(&spec, buf.as_mut_ptr(), buf.len()) }.unwrap();
            (buf.as_ptr() as usize, buf.len())
        })
        .collect()
}

/// The versions every param's words say, read word by word (a torn param
/// would show two).
fn versions_seen(ps: &[(usize, usize)]) -> Vec<u64> {
    let mut seen = Vec::new();
    for &(p, n) in ps {
        let words = unsafe { std::slice::from_raw_parts(p as *const u64, n / 8) };
        for w in words {
            let v = w >> 48;
            if !seen.contains(&v) {
                seen.push(v);
            }
        }
    }
    seen
}

/// Readers that checksum the params over and over until stopped: every
/// version they saw.
struct Readers {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<u64>>>,
}

impl Readers {
    fn start(ps: &[(usize, usize)], n: usize) -> Readers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let (ps, stop) = (ps.to_vec(), stop.clone());
                std::thread::spawn(move || {
                    let mut all = Vec::new();
                    while !stop.load(Ordering::Acquire) {
                        for v in versions_seen(&ps) {
                            if !all.contains(&v) {
                                all.push(v);
                            }
                        }
                    }
                    all
                })
            })
            .collect();
        Readers { stop, threads }
    }

    fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Release);
        let mut all: Vec<u64> = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort();
        all.dedup();
        all
    }
}

/// Stage version 2 from `request` with readers running, check they saw
/// only version 1, commit, and check every param is version 2.
fn stage_then_commit(
    m: &Arc<Manager>,
    ps: &[(usize, usize)],
    request: impl Fn() -> UpdateRequest<'static>,
) {
    assert_eq!(versions_seen(ps), vec![1]);
    let readers = Readers::start(ps, 2);
    let staged = m.stage(request()).unwrap();
    assert_eq!(staged.version(), "2");
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(
        readers.stop(),
        vec![1],
        "a reader saw the staged version before the commit"
    );
    assert_eq!(m.status().version.as_deref(), Some("1"));
    let stats = staged.commit().unwrap();
    assert_eq!(stats.version, "2");
    assert_eq!(versions_seen(ps), vec![2]);
    let st = m.status();
    assert_eq!(
        (st.state, st.version.as_deref()),
        (State::Normal, Some("2"))
    );
}

#[test]
fn snapshot_stages_while_readers_see_the_old_version_then_commits() {
    for library in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (d1, d2) = (dir.path().join("v1"), dir.path().join("v2"));
        let v1 = snapshot(&d1, 1);
        snapshot(&d2, 2);
        let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
        let ps = params(&m, &v1, library);
        m.update(UpdateRequest::snapshot(&d1)).unwrap();
        stage_then_commit(&m, &ps, || UpdateRequest::snapshot(&d2));
    }
}

/// An engine at version 1 (from a snapshot in `dir`), its params
/// library-owned or engine-owned.
fn engine_at_v1(
    dir: &Path,
    library: bool,
    cfg: ManagerConfig,
) -> (Arc<Manager>, Vec<(usize, usize)>) {
    let d1 = dir.join("v1");
    let v1 = snapshot(&d1, 1);
    let m = Arc::new(Manager::new(cfg).unwrap());
    let ps = params(&m, &v1, library);
    m.update(UpdateRequest::snapshot(&d1)).unwrap();
    (m, ps)
}

/// A publisher at `sock` serving `ts` as version 2.
fn publisher(sock: &Path, ts: &[T]) -> Publisher {
    let p = Publisher::bind(sock, PublisherConfig::default()).unwrap();
    add_all(&p, ts);
    p.set_version(Some("2".into()));
    p
}

#[test]
fn ipc_stages_then_commits() {
    let v2 = version(2);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let p = publisher(&sock, &v2);
    let (m, ps) = engine_at_v1(dir.path(), false, ManagerConfig::default());
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, std::time::Duration::from_secs(30)));
        stage_then_commit(&m, &ps, || {
            let mut r = UpdateRequest::snapshot(&sock);
            r.source = SourceKind::Ipc;
            r
        });
        serving.join().unwrap().unwrap();
    });
}

/// Two publishers serving one version together (each half the tensors),
/// pulled at once.
#[test]
fn two_publishers_stage_one_version() {
    let v2 = version(2);
    let dir = tempfile::tempdir().unwrap();
    let socks = [dir.path().join("a.sock"), dir.path().join("b.sock")];
    let pubs = [
        publisher(&socks[0], &v2[..2]),
        publisher(&socks[1], &v2[2..]),
    ];
    let (m, ps) = engine_at_v1(dir.path(), true, ManagerConfig::default());
    std::thread::scope(|s| {
        let serving: Vec<_> = (pubs.iter())
            .map(|p| s.spawn(|| p.serve(1, std::time::Duration::from_secs(30))))
            .collect();
        stage_then_commit(&m, &ps, || {
            let mut r = UpdateRequest::snapshot(&socks[0]);
            r.locations.push(socks[1].clone());
            r.source = SourceKind::Ipc;
            r
        });
        for t in serving {
            t.join().unwrap().unwrap();
        }
    });
}

#[test]
fn rdma_stages_then_commits() {
    if weight_manager_core::internals::transport::ucx::ucx().is_err() {
        println!("skipped: no UCX");
        return;
    }
    let v2 = version(2);
    let dir = tempfile::tempdir().unwrap();
    let secret = b"two-phase-secret-0123".to_vec();
    let cfg = PublisherConfig {
        secret: Some(secret.clone()),
        ..Default::default()
    };
    let net = Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
    add_all(&net, &v2);
    net.set_version(Some("2".into()));
    net.publish().unwrap();
    let cfg = ManagerConfig {
        net: weight_manager_core::NetSettings {
            secret: Some(secret),
            ..Default::default()
        },
        ..Default::default()
    };
    let (m, ps) = engine_at_v1(dir.path(), true, cfg);
    let addr = net.address();
    std::thread::scope(|s| {
        let serving = s.spawn(|| net.serve(1, std::time::Duration::from_secs(30)));
        stage_then_commit(&m, &ps, || {
            let mut r = UpdateRequest::snapshot(&addr);
            r.source = SourceKind::Rdma;
            r
        });
        serving.join().unwrap().unwrap();
    });
}

#[test]
fn abort_clear_and_drop_keep_what_was_committed() {
    let dir = tempfile::tempdir().unwrap();
    let (d1, d2) = (dir.path().join("v1"), dir.path().join("v2"));
    let v1 = snapshot(&d1, 1);
    snapshot(&d2, 2);
    let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
    let ps = params(&m, &v1, true);
    m.update(UpdateRequest::snapshot(&d1)).unwrap();

    // Abort: old weights and version; the next stage works.
    m.stage(UpdateRequest::snapshot(&d2))
        .unwrap()
        .abort()
        .unwrap();
    assert_eq!(versions_seen(&ps), vec![1]);
    assert_eq!(m.status().version.as_deref(), Some("1"));
    assert!(!m.is_staged());
    // An abort that succeeded records no error (it once left the stage's
    // cancel as the last error).
    assert!(
        m.status().last_error.is_none(),
        "{:?}",
        m.status().last_error
    );

    // Dropping a Staged aborts it.
    drop(m.stage(UpdateRequest::snapshot(&d2)).unwrap());
    assert!(!m.is_staged());
    assert_eq!(versions_seen(&ps), vec![1]);

    // Staged: a second stage and a one-call update are refused, saying so.
    let staged = m.stage(UpdateRequest::snapshot(&d2)).unwrap();
    let e = m.stage(UpdateRequest::snapshot(&d2)).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_STATE, "{e}");
    let e = m.update(UpdateRequest::snapshot(&d2)).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_BUSY, "{e}");
    assert!(e.message.contains("staged"), "{e}");
    assert_eq!(versions_seen(&ps), vec![1]);

    // A clear drops the staged version; its commit then says why.
    m.clear().unwrap();
    assert_eq!(m.status().state, State::Cleared);
    let e = staged.commit().unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_CANCELLED, "{e}");
    assert!(e.message.contains("clear"), "{e}");
    // And the manager updates again.
    m.update(UpdateRequest::snapshot(&d2)).unwrap();
    assert_eq!(versions_seen(&ps), vec![2]);
}

/// An aborted stage that took deltas leaves the state and the base as they
/// were (it once left FAILED: an atomic update counted its deltas as param
/// writes), so the next update takes deltas against the same version.
#[test]
fn an_aborted_delta_stage_keeps_the_state_and_the_base() {
    let v1 = version(1);
    let mut v2 = version(1);
    for t in &mut v2 {
        t.data[..8].copy_from_slice(&(2u64 << 48).to_le_bytes());
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let cfg = PublisherConfig {
        keep_versions: 2,
        ..Default::default()
    };
    let p = Publisher::bind(&sock, cfg).unwrap();
    let publish = |ts: &[T], v: &str| {
        p.clear_tensors();
        add_all(&p, ts);
        p.set_version(Some(v.into()));
        p.publish().unwrap();
    };
    let request = |v: &str| {
        let mut r = UpdateRequest::snapshot(&sock);
        (r.source, r.version, r.deltas) = (SourceKind::Ipc, Some(v.into()), DeltaMode::On);
        r
    };
    let served = |f: &dyn Fn()| {
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(1, std::time::Duration::from_secs(30)));
            f();
            serving.join().unwrap().unwrap();
        })
    };
    let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
    let ps = params(&m, &v1, true);
    publish(&v1, "1");
    served(&|| drop(m.update(request("1")).unwrap()));
    publish(&v2, "2");
    served(&|| m.stage(request("2")).unwrap().abort().unwrap());
    assert_eq!(m.status().state, State::Normal);
    assert_eq!(m.status().version.as_deref(), Some("1"));
    assert_eq!(versions_seen(&ps), vec![1]);
    served(&|| {
        let d = m.update(request("2")).unwrap().deltas;
        assert_eq!(
            (d.fallback, d.base_version.as_str()),
            (DeltaFallback::None, "1")
        );
        assert!(d.runs_delta > 0, "{d:?}");
    });
    // Each param's first word is version 2's now, the rest version 1's.
    let mut seen = versions_seen(&ps);
    seen.sort_unstable();
    assert_eq!(seen, vec![1, 2]);
}

#[test]
fn requests_that_cannot_stage_are_refused_before_anything_moves() {
    let dir = tempfile::tempdir().unwrap();
    let d1 = dir.path().join("v1");
    let v1 = snapshot(&d1, 1);
    let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
    let ps = params(&m, &v1, false);
    let mut r = UpdateRequest::snapshot(&d1);
    r.mode = Mode::InPlace;
    let e = m.stage(r).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT, "{e}");
    let mut cb = |_: &weight_manager_core::TensorView| Ok(());
    let mut r = UpdateRequest::snapshot(&d1);
    r.hooks.tensor = Some(&mut cb);
    let e = m.stage(r).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT, "{e}");
    // A stage that fails (no such snapshot) reports it and stages nothing.
    let e = m
        .stage(UpdateRequest::snapshot(dir.path().join("missing")))
        .unwrap_err();
    assert_ne!(e.code, wm_result::WM_OK);
    assert!(!m.is_staged());
    assert_eq!(versions_seen(&ps), vec![0]);
    // A cancel (the handle's destruction) aborts a staged version.
    let staged = m.stage(UpdateRequest::snapshot(&d1)).unwrap();
    m.cancel();
    assert!(!m.is_staged());
    assert_eq!(
        staged.commit().unwrap_err().code,
        wm_result::WM_ERR_CANCELLED
    );
    assert_eq!(versions_seen(&ps), vec![0]);
}

/// At `WM_LOG_LEVEL_DEBUG` an update says where its time went, and a
/// staged one when its commit began (README "Two-phase updates").
#[test]
fn debug_lines_name_the_update_phases_and_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let keep = Arc::clone(&lines);
    let logger =
        weight_manager_core::Logger::closure(weight_manager_core::LogLevel::Debug, move |_, l| {
            keep.lock().unwrap().push(l.to_string())
        });
    let cfg = ManagerConfig {
        logger,
        ..Default::default()
    };
    let (m, _) = engine_at_v1(dir.path(), true, cfg);
    snapshot(&dir.path().join("v2"), 2);
    lines.lock().unwrap().clear();
    let staged = m
        .stage(UpdateRequest::snapshot(dir.path().join("v2")))
        .unwrap();
    staged.commit().unwrap();
    let lines = lines.lock().unwrap();
    let at = |needle: &str| lines.iter().position(|l| l.contains(needle));
    let committing = at("rank 0: staged version 2: committing").expect("the commit's start");
    let phases = at("rank 0: version 2: planned in ").expect("the phases");
    assert!(committing < phases, "{lines:?}");
    for part in ["received in", "committed in", "(device page swap"] {
        assert!(lines[phases].contains(part), "{}", lines[phases]);
    }
}

/// A stage waiting for a publisher that never serves (bound, not serving)
/// is stopped by a clear within moments, not after its wait for the
/// publisher (up to the bucket timeout, 60 s): the clear returns OK and
/// the stage says the clear dropped it. A one-call update waiting the same
/// way stops as promptly when the manager is cancelled (a destroy).
#[test]
fn a_clear_or_destroy_stops_a_wait_for_a_silent_publisher() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let _silent = publisher(&sock, &version(2));
    let (m, ps) = engine_at_v1(dir.path(), true, ManagerConfig::default());
    let ipc = move |sock: &Path| {
        let mut r = UpdateRequest::snapshot(sock);
        r.source = SourceKind::Ipc;
        r
    };
    let stopped_within = |stop: &dyn Fn(), waiting: std::thread::JoinHandle<wm_result>| {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let t = std::time::Instant::now();
        stop();
        let code = waiting.join().unwrap();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
        code
    };
    let stage = {
        let (m, sock) = (m.clone(), sock.clone());
        std::thread::spawn(move || {
            m.stage(ipc(&sock))
                .err()
                .map_or(wm_result::WM_OK, |e| e.code)
        })
    };
    let code = stopped_within(&|| m.clear().map(|_| ()).unwrap(), stage);
    assert_eq!(code, wm_result::WM_ERR_CANCELLED);
    assert_eq!(m.status().state, State::Cleared);
    m.update(UpdateRequest::snapshot(dir.path().join("v1")))
        .unwrap();
    assert_eq!(versions_seen(&ps), vec![1]);
    let update = {
        let (m, sock) = (m.clone(), sock.clone());
        std::thread::spawn(move || {
            m.update(ipc(&sock))
                .err()
                .map_or(wm_result::WM_OK, |e| e.code)
        })
    };
    let code = stopped_within(&|| m.cancel(), update);
    assert_eq!(code, wm_result::WM_ERR_CANCELLED);
    assert_eq!(versions_seen(&ps), vec![1]);
}

/// Staged commits back to back into library-owned params: each commit
/// moves the old pages out and the manager keeps them as the next update's
/// shadows (nothing is zeroed or freed between), so the shadows hold an
/// older version's bytes until written over: every version must still read
/// exactly, whole (snapshots) and as deltas over IPC, with one-call updates
/// between.
#[test]
fn staged_commits_back_to_back_read_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = |k: u64| dir.path().join(format!("v{k}"));
    for k in 1..=3 {
        snapshot(&d(k), k);
    }
    let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
    let ps = params(&m, &version(1), true);
    m.update(UpdateRequest::snapshot(d(1))).unwrap();
    for k in [2, 3, 1, 2] {
        m.stage(UpdateRequest::snapshot(d(k)))
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(versions_seen(&ps), vec![k]);
    }
    m.update(UpdateRequest::snapshot(d(3))).unwrap();
    assert_eq!(versions_seen(&ps), vec![3]);
    m.stage(UpdateRequest::snapshot(d(1)))
        .unwrap()
        .commit()
        .unwrap();
    assert_eq!(versions_seen(&ps), vec![1]);

    // Deltas over IPC: version k changes each param's first word only.
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
    let first_word = |k: u64| {
        let mut ts = version(1);
        for t in &mut ts {
            t.data[..8].copy_from_slice(&(k << 48).to_le_bytes());
        }
        ts
    };
    for k in [4u64, 5, 6] {
        let ts = first_word(k);
        p.clear_tensors();
        add_all(&p, &ts);
        p.set_version(Some(k.to_string()));
        p.publish().unwrap();
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(1, std::time::Duration::from_secs(30)));
            let mut r = UpdateRequest::snapshot(&sock);
            (r.source, r.version, r.deltas) = (SourceKind::Ipc, Some(k.to_string()), DeltaMode::On);
            let done = m.stage(r).unwrap().commit().unwrap();
            if k > 4 {
                assert!(done.deltas.runs_delta > 0, "{:?}", done.deltas);
            }
            serving.join().unwrap().unwrap();
        });
        let mut seen = versions_seen(&ps);
        seen.sort_unstable();
        assert_eq!(seen, vec![1, k]);
    }
}

/// A stage whose publisher went silent mid-session (manifest sent, the
/// engine's WANT taken, then nothing: a stopped trainer) is stopped by a
/// clear within moments (the source waits between frames, where only the
/// bucket timeout, 60 s, ended it), the old weights kept.
#[test]
fn a_clear_stops_a_stage_whose_publisher_went_silent_mid_session() {
    use weight_manager_core::internals::transport::conn::Conn;
    let dir = tempfile::tempdir().unwrap();
    let (model, v1) = hostile_windows::first_version(dir.path());
    let sock = dir.path().join("stalls.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let stalls = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        conn.recv(deadline).unwrap();
        conn.send(&hostile_windows::manifest_of_w("v2", false))
            .unwrap();
        conn.recv(deadline).unwrap(); // WANT
        let _ = released.recv_timeout(std::time::Duration::from_secs(30));
    });
    let m = Arc::new(Manager::new(ManagerConfig::default()).unwrap());
    let ps = register(&m, std::slice::from_ref(&v1));
    m.update(UpdateRequest::snapshot(&model)).unwrap();
    let stage = {
        let (m, sock) = (m.clone(), sock.clone());
        std::thread::spawn(move || {
            let mut r = UpdateRequest::snapshot(&sock);
            (r.source, r.deltas) = (SourceKind::Ipc, DeltaMode::Off);
            m.stage(r).err().map(|e| e.code)
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t = std::time::Instant::now();
    m.clear().unwrap();
    assert_eq!(stage.join().unwrap(), Some(wm_result::WM_ERR_CANCELLED));
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    release.send(()).unwrap();
    stalls.join().unwrap();
    m.update(UpdateRequest::snapshot(&model)).unwrap();
    let held = unsafe { std::slice::from_raw_parts(ps[0].0, ps[0].1) };
    assert!(held == &v1.data[..]);
}
