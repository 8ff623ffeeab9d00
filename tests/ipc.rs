//! The IPC path: a publisher serving buckets in shared memory, engines
//! applying them. Publisher processes are `wm serve`; engines are this test
//! process (a Manager) and `wm pull` processes.

mod common;

/// Tests here run on parallel threads of one process, and one of them counts
/// the process's shared bucket buffers (`bucket_fds`): each test holds this
/// lock, so no other test's buffers are open while it counts.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

use common::*;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig};

use common::WM;

fn manager(rank: u32, world: u32) -> Manager {
    Manager::new(ManagerConfig {
        rank,
        world_size: world,
        fallback_dir: None,
        group: None,
        ..Default::default()
    })
    .unwrap()
}

fn ipc_request<'h>(socket: &Path) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(socket);
    r.source = SourceKind::Ipc;
    r.timeout = Duration::from_secs(30);
    r
}

fn small_buckets() -> PublisherConfig {
    PublisherConfig {
        bucket_size: 4096,
        bucket_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

#[test]
fn tensors_from_memory_copy_and_zero_copy() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let mut ts = model(21);
    ts.push(tensor("big", DType::F32, &[3000], 21)); // 12000 bytes: split across buckets
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    add_all(&publisher, &ts);
    publisher.set_version(Some("v21".into()));
    let mode = std::fs::metadata(&sock).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(2, Duration::from_secs(20)));
        // Copy mode into params, checksums verified.
        let m = manager(0, 1);
        let ptrs = register(&m, &ts);
        let mut req = ipc_request(&sock);
        req.verify = true;
        let stats = m.update(req).unwrap();
        assert_eq!(stats.version, "v21");
        assert_params(&ptrs, &ts);
        // Zero-copy: the callback sees the bytes in the shared buffer.
        assert_eq!(zero_copy_update(&sock, None), contents(&ts));
        let st = serving.join().unwrap().unwrap();
        assert_eq!(st.sessions.len(), 2);
        assert!(st.sessions.iter().all(|s| s.buckets > 3));
    });
}

/// The RL loop: the trainer publishes version after version (keeping two),
/// one engine updates to each. Published tensors live in one shared buffer
/// per version, served as windows without packing; the third version on
/// reuses the buffer of the one it pushed out, which the engine still has
/// mapped, so its bytes must be the new ones.
#[test]
fn published_versions_are_served_from_their_shared_memory() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    let m = manager(0, 1);
    let first = versioned_model(1);
    let ptrs = register(&m, &first);
    for k in 1..=5u8 {
        // The trainer's own tensors change after each publish.
        let ts = versioned_model(k);
        publisher.clear_tensors();
        add_all(&publisher, &ts);
        publisher.set_version(Some(format!("v{k}")));
        assert_eq!(publisher.publish().unwrap(), format!("v{k}"));
        drop(ts);
        std::thread::scope(|s| {
            let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
            let mut req = ipc_request(&sock);
            req.verify = true;
            let stats = m.update(req).unwrap();
            assert_eq!(stats.version, format!("v{k}"));
            assert_params(&ptrs, &versioned_model(k));
            let st = serving.join().unwrap().unwrap();
            // Buckets still respect the bucket size; nothing was packed.
            assert!(st.sessions[0].buckets > 3);
            assert_eq!(st.sessions[0].bytes, stats.bytes);
        });
    }
    assert_eq!(publisher.versions(), ["v4", "v5"]);
    // An older kept version, and zero-copy: the callback reads the
    // version's shared memory.
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        assert_eq!(
            zero_copy_update(&sock, Some("v4")),
            contents(&versioned_model(4))
        );
        serving.join().unwrap().unwrap();
    });
}

/// A fresh engine's zero-copy update from `sock`: each tensor's name and
/// the bytes its callback saw, sorted by name.
fn zero_copy_update(sock: &Path, version: Option<&str>) -> Vec<(String, Vec<u8>)> {
    let m = manager(0, 1);
    let mut got = Vec::new();
    let mut cb = |t: &weight_manager_core::TensorView| {
        got.push((t.name.to_string(), t.data.to_vec()));
        Ok(())
    };
    let mut req = ipc_request(sock);
    req.mode = Mode::InPlace;
    req.version = version.map(String::from);
    req.hooks.tensor = Some(&mut cb);
    m.update(req).unwrap();
    got.sort();
    got
}

/// Each tensor's name and bytes, sorted by name.
fn contents(ts: &[T]) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<_> = ts
        .iter()
        .map(|t| (t.name.clone(), t.data.clone()))
        .collect();
    all.sort();
    all
}

/// `model(seed)` plus a tensor larger than a test bucket (split across buckets).
fn versioned_model(seed: u8) -> Vec<T> {
    let mut ts = model(seed);
    ts.push(tensor("big", DType::F32, &[3000], seed));
    ts
}

#[test]
fn corrupted_bucket_is_caught_and_old_weights_kept() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let v1 = model(1);
    let v2 = model(2);
    let m = manager(0, 1);
    let ptrs = register(&m, &v1);
    for (v, corrupt, version) in [
        (&v1, None, "1"),
        (&v2, Some("layer0.norm".to_string()), "2"),
    ] {
        let publisher = Publisher::bind(
            &sock,
            PublisherConfig {
                corrupt_tensor: corrupt.clone(),
                ..small_buckets()
            },
        )
        .unwrap();
        add_all(&publisher, v);
        publisher.set_version(Some(version.into()));
        std::thread::scope(|s| {
            let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
            let mut req = ipc_request(&sock);
            req.verify = true;
            let r = m.update(req);
            let served = serving.join().unwrap();
            if corrupt.is_some() {
                let e = r.unwrap_err();
                assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM);
                assert!(e.message.contains("'layer0.norm'"), "{e}");
                assert!(served.is_err(), "the publisher hears why");
            } else {
                r.unwrap();
                served.unwrap();
            }
        });
    }
    assert_params(&ptrs, &v1);
    assert_eq!(m.status().version.as_deref(), Some("1"));
}

#[test]
fn another_version_or_no_publisher_is_a_clear_error() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("pub.sock");
    let m = manager(0, 1);
    let ts = model(3);
    register(&m, &ts);
    let e = m.update(ipc_request(&sock)).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_NOT_FOUND);
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    add_all(&publisher, &ts);
    publisher.set_version(Some("7".into()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let mut req = ipc_request(&sock);
        req.version = Some("8".into());
        let e = m.update(req).unwrap_err();
        assert!(
            e.message.contains("asked for version '8'") && e.message.contains("serves '7'"),
            "{e}"
        );
        assert!(serving.join().unwrap().is_err());
    });
}

fn wm(args: &[&str]) -> Command {
    let mut c = Command::new(&*WM);
    c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

fn wait_for_socket(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "publisher did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn one_publisher_serves_four_ranks_their_own_shards() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for r in 0..4u32 {
        let shard: Vec<T> = model(40 + r as u8);
        write_safetensors(
            &dir.path().join(format!("model_state.tp{r}.0.safetensors")),
            &shard,
        );
    }
    write_version(dir.path(), "40");
    weight_manager_core::checkpoint::checksums::write(dir.path(), 2).unwrap();
    let sock = dir.path().join("serve.sock");
    let d = dir.path().to_str().unwrap();
    let publisher = wm(&[
        "serve",
        "--ipc",
        sock.to_str().unwrap(),
        d,
        "--engines",
        "4",
        "--bucket-mib",
        "1",
    ])
    .spawn()
    .unwrap();
    wait_for_socket(&sock);
    let engines: Vec<Child> = (0..4)
        .map(|r| {
            wm(&[
                "pull",
                "--ipc",
                sock.to_str().unwrap(),
                "--rank",
                &r.to_string(),
                "--world",
                "4",
                "--check",
                d,
                "--verify",
                "true",
            ])
            .spawn()
            .unwrap()
        })
        .collect();
    expect_equal_to_snapshot(engines);
    let (ok, text) = output(publisher);
    assert!(ok, "{text}");
    assert_eq!(text.matches("version 40").count(), 4, "{text}");
    assert!(!sock.exists(), "the publisher removes its socket");
}

/// A model big enough to take many buckets of 1 MiB.
fn big_model(seed: u8) -> Vec<T> {
    (0..16)
        .map(|i| tensor(&format!("layers.{i}"), DType::F32, &[1 << 20], seed))
        .collect()
}

#[test]
fn publisher_killed_mid_update_keeps_old_weights() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (d1, d2) = (dir.path().join("v1"), dir.path().join("v2"));
    for (d, seed, step) in [(&d1, 1u8, "1"), (&d2, 2u8, "2")] {
        std::fs::create_dir(d).unwrap();
        write_safetensors(&d.join("model.safetensors"), &big_model(seed));
        write_version(d, step);
    }
    let m = manager(0, 1);
    let v1 = big_model(1);
    let ptrs = register(&m, &v1);
    let sock = dir.path().join("p.sock");
    let s = sock.to_str().unwrap();
    let first = wm(&[
        "serve",
        "--ipc",
        s,
        d1.to_str().unwrap(),
        "--bucket-mib",
        "1",
    ])
    .spawn()
    .unwrap();
    wait_for_socket(&sock);
    m.update(ipc_request(&sock)).unwrap();
    assert!(output(first).0);
    assert_params(&ptrs, &v1);

    let mut second = wm(&[
        "serve",
        "--ipc",
        s,
        d2.to_str().unwrap(),
        "--bucket-mib",
        "1",
    ])
    .spawn()
    .unwrap();
    wait_for_socket(&sock);
    let pid = second.id();
    let e = update_killing_publisher(&m, SourceKind::Ipc, &sock, pid);
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    assert!(e.message.contains("closed the connection"), "{e}");
    second.wait().unwrap();
    assert_params(&ptrs, &v1);
    assert_eq!(m.status().version.as_deref(), Some("1"));
}

fn bucket_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().contains("wm-bucket"))
        .count()
}

#[test]
fn engine_killed_mid_update_fails_the_session_and_frees_buffers() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let ts = big_model(5);
    let sock = dir.path().join("e.sock");
    let publisher = Publisher::bind(
        &sock,
        PublisherConfig {
            bucket_size: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    add_all(&publisher, &ts);
    publisher.set_version(Some("5".into()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        // The engine stops after its first bucket (a progress hook cannot
        // be set from the command line, so it is killed once buffers exist).
        let mut engine = wm(&["pull", "--ipc", sock.to_str().unwrap()])
            .spawn()
            .unwrap();
        let start = Instant::now();
        while bucket_fds() == 0 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_micros(200));
        }
        engine.kill().unwrap();
        engine.wait().unwrap();
        let r = serving.join().unwrap();
        // Either the engine died mid-stream (error), or it finished first on a fast machine.
        if let Err(e) = r {
            assert!(matches!(e.code, wm_result::WM_ERR_PEER), "{e}");
            assert!(e.message.contains("engine rank 0"), "{e}");
        }
    });
    assert_eq!(bucket_fds(), 0, "bucket buffers still open");
}

#[test]
fn a_publisher_of_another_uid_is_refused() {
    let _serial = serial();
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a peer as another uid");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let sock = dir.path().join("u.sock");
    let ts = model(9);
    let publisher = Publisher::bind(
        &sock,
        PublisherConfig {
            socket_mode: 0o666,
            ..small_buckets()
        },
    )
    .unwrap();
    add_all(&publisher, &ts);
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let mut c = wm(&["pull", "--ipc", sock.to_str().unwrap()]);
        std::os::unix::process::CommandExt::uid(&mut c, 65534);
        let (ok, text) = output(c.spawn().unwrap());
        assert!(!ok);
        assert!(text.contains("uid 0") && text.contains("refused"), "{text}");
        let e = serving.join().unwrap().unwrap_err();
        assert!(e.message.contains("uid 65534"), "{e}");
    });
    // An engine that allows other uids, turned away by the publisher, is
    // told why (it read "closed the connection (did it exit or crash?)").
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let sock = sock.to_str().unwrap();
        let mut c = wm(&["pull", "--ipc", sock, "--allow-other-uids", "true"]);
        std::os::unix::process::CommandExt::uid(&mut c, 65534);
        let (ok, text) = output(c.spawn().unwrap());
        assert!(!ok);
        assert!(
            text.contains("reports: ") && text.contains("uid 65534"),
            "{text}"
        );
        let e = serving.join().unwrap().unwrap_err();
        assert!(e.message.contains("uid 65534"), "{e}");
    });
}

/// A trainer that hands over GPU buffers (CUDA_BUFFERS, CUDA IPC handles)
/// to an engine that has no usable CUDA driver: the update fails with
/// UNSUPPORTED naming the buffer and the driver, nothing is written, and
/// the manager is not left FAILED. The trainer here speaks the wire
/// protocol by hand, as a GPU trainer would up to that frame.
#[test]
fn gpu_buffers_without_a_driver_fail_cleanly() {
    let _serial = serial();
    use std::os::unix::net::UnixListener;
    use weight_manager_core::internals::transport::conn::Conn;
    use weight_manager_core::internals::wire::{CudaBuffer, Frame};
    use weight_manager_core::TensorMeta;
    if weight_manager_core::internals::memory::cuda::cuda().is_ok() {
        println!("skipped: this machine has a GPU (tests/gpu.rs runs CUDA IPC for real)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gpu-trainer.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let t = tensor("w", DType::F32, &[64], 3);
    let m = manager(0, 1);
    let params = register(&m, std::slice::from_ref(&t));
    std::thread::scope(|s| {
        let trainer = s.spawn(|| {
            let (stream, _) = listener.accept().unwrap();
            let mut conn = Conn::new(stream, "engine");
            let deadline = Instant::now() + Duration::from_secs(20);
            assert!(matches!(conn.recv(deadline).unwrap(), Frame::Hello { .. }));
            conn.send(&Frame::Manifest {
                version: "9".into(),
                tensors: vec![TensorMeta {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![64],
                    nbytes: 256,
                    checksum: None,
                    placement: None,
                }],
                base_kept: false,
            })
            .unwrap();
            let want = conn.recv(deadline).unwrap();
            assert!(matches!(want, Frame::Want { .. }));
            decline_base(&mut conn, &want).unwrap();
            conn.send(&Frame::CudaBuffers {
                buffers: vec![CudaBuffer {
                    handle: [7; 64],
                    size: 4096,
                }],
            })
            .unwrap();
            // The engine gives up: it closes the connection (or says why).
            let _ = conn.recv(deadline);
        });
        let e = m.update(ipc_request(&sock)).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED, "{e}");
        assert!(
            e.message.contains("GPU buffer 0") && e.message.contains("libcuda.so.1"),
            "{e}"
        );
        trainer.join().unwrap();
    });
    let zeros = vec![0u8; 256];
    assert!(unsafe { std::slice::from_raw_parts(params[0].0, params[0].1) } == &zeros[..]);
    assert_ne!(m.status().state, weight_manager_core::State::Failed);
}

/// Serve `ts` once from `publisher` to a Manager over `sock`, checking
/// the engine got them: the publisher is reachable and serving.
fn serves_one_update(publisher: &Publisher, sock: &Path, ts: &[T]) {
    publisher.set_version(Some("served".into()));
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let m = manager(0, 1);
        let ptrs = register(&m, ts);
        m.update(ipc_request(sock)).unwrap();
        assert_params(&ptrs, ts);
        serving.join().unwrap().unwrap();
    });
}

/// The device and inode of the socket file at `path`.
fn identity(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.dev(), m.ino())
}

/// Publisher B started on live publisher A's socket path (a `wm serve`
/// process) fails with a clear error, leaves A's socket in place, and A
/// keeps serving.
#[test]
fn a_second_publisher_leaves_a_live_publishers_socket_alone() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let ts = model(41);
    write_safetensors(&snap.join("model.safetensors"), &ts);
    write_version(&snap, "41");
    let sock = dir.path().join("a.sock");
    let mut a = Command::new(&*WM)
        .args([
            "serve",
            "--ipc",
            sock.to_str().unwrap(),
            snap.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(30), "A never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The probe connection above is turned away by A after its handshake
    // bound, without counting as A's one engine.
    let before = identity(&sock);
    let e = Publisher::bind(&sock, small_buckets())
        .err()
        .expect("refused");
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT, "{e}");
    assert!(e.message.contains("another publisher is listening"), "{e}");
    assert_eq!(identity(&sock), before, "A's socket was replaced");
    let m = manager(0, 1);
    let ptrs = register(&m, &ts);
    let stats = m.update(ipc_request(&sock)).unwrap();
    assert_eq!(stats.version, "41");
    assert_params(&ptrs, &ts);
    assert!(a.wait().unwrap().success());
}

/// A socket nobody accepts on (its publisher exited without removing it)
/// is stale: a new publisher replaces it and serves.
#[test]
fn a_stale_socket_is_replaced() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(
        std::fs::symlink_metadata(&sock).is_ok(),
        "the stale file stays"
    );
    let p = Publisher::bind(&sock, small_buckets()).unwrap();
    let ts = model(42);
    add_all(&p, &ts);
    serves_one_update(&p, &sock, &ts);
}

/// A publisher whose socket path now holds another publisher's socket
/// (its own file was removed and the path bound again) leaves that socket
/// in place when it exits.
#[test]
fn a_publisher_exiting_removes_only_its_own_socket() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("shared.sock");
    let b = Publisher::bind(&sock, small_buckets()).unwrap();
    std::fs::remove_file(&sock).unwrap();
    let a = Publisher::bind(&sock, small_buckets()).unwrap();
    let a_socket = identity(&sock);
    drop(b);
    assert_eq!(identity(&sock), a_socket, "B removed A's socket");
    let ts = model(43);
    add_all(&a, &ts);
    serves_one_update(&a, &sock, &ts);
    drop(a);
    assert!(
        std::fs::symlink_metadata(&sock).is_err(),
        "A removes its own socket"
    );
}

/// A publisher at `dir`/p.sock serving `model(seed)` as version "1".
fn version_1(dir: &Path, seed: u8) -> (std::path::PathBuf, Vec<T>, Publisher) {
    let sock = dir.join("p.sock");
    let ts = model(seed);
    let publisher = Publisher::bind(&sock, small_buckets()).unwrap();
    add_all(&publisher, &ts);
    publisher.set_version(Some("1".into()));
    (sock, ts, publisher)
}

/// Audit item (docs/wire.md): a first frame that is no HELLO was closed
/// without a word, where a bad magic or protocol gets an ERROR saying
/// why. It gets one too now, and the publisher serves the next engine.
#[test]
fn a_first_frame_that_is_no_hello_is_told_so() {
    use weight_manager_core::internals::transport::conn::Conn;
    use weight_manager_core::internals::wire::Frame;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (sock, ts, publisher) = version_1(dir.path(), 4);
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let stream = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let mut conn = Conn::new(stream, "the publisher");
        conn.send(&Frame::Ack { seq: 0 }).unwrap();
        let e = conn
            .recv(Instant::now() + Duration::from_secs(10))
            .unwrap_err();
        assert!(
            e.message.contains("reports: ") && e.message.contains("expected HELLO, got ACK"),
            "{e}"
        );
        let m = manager(0, 1);
        let ptrs = register(&m, &ts);
        m.update(ipc_request(&sock)).unwrap();
        assert_params(&ptrs, &ts);
        serving.join().unwrap().unwrap();
    });
}

/// Audit item (docs/wire.md): the publisher's serve error for an engine
/// breaking the protocol named nobody ("expected WANT, got HELLO"); it
/// names the engine now, while the engine is told the bare reason.
#[test]
fn a_serve_error_names_the_engine_that_broke_the_protocol() {
    use weight_manager_core::internals::transport::conn::Conn;
    use weight_manager_core::internals::wire::Frame;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (sock, _ts, publisher) = version_1(dir.path(), 5);
    std::thread::scope(|s| {
        let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
        let stream = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let mut conn = Conn::new(stream, "the publisher");
        let deadline = Instant::now() + Duration::from_secs(10);
        let hello = || Frame::Hello {
            rank: 0,
            world_size: 1,
            gpu_id: "0".into(),
            version: String::new(),
            base: String::new(),
        };
        conn.send(&hello()).unwrap();
        assert!(matches!(
            conn.recv(deadline).unwrap(),
            Frame::Manifest { .. }
        ));
        conn.send(&hello()).unwrap();
        let told = conn.recv(deadline).unwrap_err();
        assert!(
            told.message.contains("reports: expected WANT, got HELLO"),
            "{told}"
        );
        let e = serving.join().unwrap().unwrap_err();
        assert!(
            e.message.contains("engine rank 0") && e.message.contains("expected WANT, got HELLO"),
            "{e}"
        );
    });
}
