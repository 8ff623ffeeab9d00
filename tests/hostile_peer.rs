//! A hostile IPC publisher: a peer of the same uid, trusted with the bytes
//! but not with the engine's memory. The publisher here is a thread of the
//! test that binds a real Unix socket and speaks the wire protocol itself
//! (real frames, real sealed memfds passed with SCM_RIGHTS); the engine is
//! a real Manager in this process, whose RSS the tests watch.

mod common;

use common::*;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::{BucketEntry, Frame};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::SourceKind;
use weight_manager_core::TensorMeta;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{Mode, TensorView};

/// Tests here measure the process's RSS: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const TIB: u64 = 1 << 40;
const MIB: u64 = 1 << 20;

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

fn ipc_request<'h>(socket: &Path, mode: Mode) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(socket);
    r.source = SourceKind::Ipc;
    r.mode = mode;
    r.timeout = Duration::from_secs(30);
    r
}

fn meta(name: &str, nbytes: u64) -> TensorMeta {
    TensorMeta {
        name: name.into(),
        dtype: DType::U8,
        shape: vec![nbytes],
        nbytes,
        checksum: None,
        placement: None,
    }
}

/// A sealed memfd of `len` bytes (sparse: nothing written), with `data` at
/// its start.
fn sealed_memfd(len: u64, data: &[u8]) -> OwnedFd {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    let raw = unsafe { libc::memfd_create(c"hostile".as_ptr(), flags) };
    assert!(raw >= 0);
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    assert_eq!(unsafe { libc::ftruncate(raw, len as libc::off_t) }, 0);
    let n = unsafe { libc::pwrite(raw, data.as_ptr().cast(), data.len(), 0) };
    assert_eq!(n, data.len() as isize);
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    assert_eq!(unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) }, 0);
    fd
}

/// What the hostile publisher does after its MANIFEST, if the engine sends
/// WANT: hand over `buffer` (announced as `announced` bytes), send one
/// bucket of `entries`, then END once the bucket is acknowledged.
struct Script {
    manifest: Vec<TensorMeta>,
    buffer: OwnedFd,
    announced: u64,
    entries: Vec<BucketEntry>,
}

/// Serve one engine session on `sock` following `script`, on a thread.
/// Returns the frames the engine answered with (its last one an error, ACK
/// or WANT), for the test's curiosity; never fails the test itself.
fn hostile_publisher(sock: &Path, script: Script) -> std::thread::JoinHandle<Vec<String>> {
    numbered_publisher(sock, script, (0, 1))
}

/// [`hostile_publisher`] numbering its bucket `seq` and saying END after
/// `end` buckets.
fn numbered_publisher(
    sock: &Path,
    script: Script,
    (seq, end): (u64, u64),
) -> std::thread::JoinHandle<Vec<String>> {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        let mut step = |conn: &mut Conn| match conn.recv(deadline) {
            Ok(f) => {
                seen.push(f.name().to_string());
                Some(f)
            }
            Err(e) => {
                seen.push(format!("error: {e}"));
                None
            }
        };
        if step(&mut conn).is_none() {
            return seen; // no HELLO
        }
        let manifest = Frame::Manifest {
            version: "hostile".into(),
            tensors: script.manifest,
            base_kept: false,
        };
        conn.send(&manifest).unwrap();
        let want = step(&mut conn);
        if !matches!(want, Some(Frame::Want { .. })) {
            return seen;
        }
        if decline_base(&mut conn, want.as_ref().expect("a WANT")).is_err() {
            return seen;
        }
        let buffers = Frame::Buffers {
            sizes: vec![script.announced],
        };
        if conn
            .send_with_fds(&buffers, &[script.buffer.as_raw_fd()])
            .is_err()
        {
            return seen;
        }
        let bucket = Frame::Bucket {
            seq,
            buffer: 0,
            entries: script.entries,
        };
        if conn.send(&bucket).is_err() || step(&mut conn).is_none() {
            return seen;
        }
        let _ = conn.send(&Frame::End { buckets: end });
        seen
    })
}

/// Weights of version "v1" from a real snapshot: one host param "w".
fn engine_with_weights(dir: &Path) -> (Manager, Vec<(*mut u8, usize)>, Vec<T>) {
    let model_dir = dir.join("model");
    std::fs::create_dir(&model_dir).unwrap();
    let ts = vec![tensor("w", DType::U8, &[4096], 7)];
    write_safetensors(&model_dir.join("model.safetensors"), &ts);
    write_version(&model_dir, "v1");
    let m = manager();
    let ptrs = register(&m, &ts);
    m.update(UpdateRequest::snapshot(&model_dir)).unwrap();
    assert_params(&ptrs, &ts);
    (m, ptrs, ts)
}

/// An engine holding "v1" (`engine_with_weights`) updates from a
/// hostile publisher following `script`, its request as `ask` makes it from
/// the IPC request: the update must fail, leaving every param and the
/// version as they were. Returns the error.
fn refused_keeping_v1(
    script: Script,
    ask: impl FnOnce(&Path) -> UpdateRequest<'static>,
) -> weight_manager_core::Error {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("hostile.sock");
    let (m, ptrs, ts) = engine_with_weights(dir.path());
    let publisher = hostile_publisher(&sock, script);
    let e = m.update(ask(&sock)).unwrap_err();
    assert_params(&ptrs, &ts);
    assert_eq!(m.status().version.as_deref(), Some("v1"));
    publisher.join().unwrap();
    e
}

/// One bucket entry: the first 4096 bytes of request 0 at the buffer's start.
fn first_4096() -> Vec<BucketEntry> {
    vec![BucketEntry {
        request: 0,
        offset: 0,
        len: 4096,
        buffer_offset: 0,
    }]
}

/// A manifest announcing a 1 TiB tensor for the per-tensor callback, then a
/// 256-byte chunk of it: the engine must refuse it against its
/// callback_staging_limit before allocating or faulting in anything (it
/// used to abort allocating 1 TiB in place, and to fault in a whole staging
/// arena atomically), keep its weights and version, and stay small.
#[test]
fn a_tebibyte_callback_tensor_is_refused_in_place_and_atomic() {
    let _serial = serial();
    for mode in [Mode::InPlace, Mode::Atomic] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("hostile.sock");
        let (m, ptrs, ts) = engine_with_weights(dir.path());
        let publisher = hostile_publisher(
            &sock,
            Script {
                manifest: vec![meta("huge", TIB)],
                buffer: sealed_memfd(4096, &[0x5a; 256]),
                announced: 4096,
                entries: vec![BucketEntry {
                    request: 0,
                    offset: 0,
                    len: 256,
                    buffer_offset: 0,
                }],
            },
        );
        let before = rss();
        let mut delivered = 0usize;
        let mut hook = |_: &TensorView| -> Result<(), String> {
            delivered += 1;
            Ok(())
        };
        let mut req = ipc_request(&sock, mode);
        req.hooks.tensor = Some(&mut hook);
        let e = m.update(req).unwrap_err();
        let grown = rss().saturating_sub(before);
        assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{mode:?}: {e}");
        for part in [
            "tensor 'huge'",
            "callback_staging_limit of 4294967296 bytes",
        ] {
            assert!(e.message.contains(part), "{mode:?}: {e}");
        }
        assert!(grown < 16 * MIB, "{mode:?}: RSS grew by {grown} bytes");
        assert_eq!(delivered, 0);
        // Nothing committed is lost: the weights and their version stay.
        assert_params(&ptrs, &ts);
        assert_eq!(m.status().version.as_deref(), Some("v1"), "{mode:?}");
        let seen = publisher.join().unwrap();
        assert!(
            seen.last().is_some_and(|f| f.starts_with("error")),
            "{mode:?}: the publisher saw {seen:?}"
        );
    }
}

/// A limit the engine set is the bound, and an update within it works: two
/// callback tensors of 3 KiB pass a 4 KiB limit in place (one at a time)
/// but not atomically (staged together).
#[test]
fn the_callback_staging_limit_is_the_engines_setting() {
    let _serial = serial();
    for (mode, ok) in [(Mode::InPlace, true), (Mode::Atomic, false)] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("hostile.sock");
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i * 13) as u8).collect();
        let entries = (0..2u32)
            .map(|t| BucketEntry {
                request: t,
                offset: 0,
                len: 3072,
                buffer_offset: u64::from(t) * 4096,
            })
            .collect();
        let publisher = hostile_publisher(
            &sock,
            Script {
                manifest: vec![meta("a", 3072), meta("b", 3072)],
                buffer: sealed_memfd(8192, &bytes),
                announced: 8192,
                entries,
            },
        );
        let m = Manager::new(ManagerConfig {
            fallback_dir: None,
            callback_staging_limit: 4096,
            ..Default::default()
        })
        .unwrap();
        let mut got = Vec::new();
        let mut hook = |v: &TensorView| -> Result<(), String> {
            got.push((v.name.to_string(), v.data.to_vec()));
            Ok(())
        };
        let mut req = ipc_request(&sock, mode);
        req.hooks.tensor = Some(&mut hook);
        let r = m.update(req);
        publisher.join().unwrap();
        if ok {
            r.unwrap();
            assert_eq!(got.len(), 2);
            assert!(got[0].1 == bytes[..3072] && got[1].1 == bytes[4096..7168]);
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
            assert!(e.message.contains("6144 bytes"), "{e}");
            assert!(e.message.contains("limit of 4096 bytes"), "{e}");
            assert!(got.is_empty());
        }
    }
}

/// A sealed but sparse memfd announced at 1 GiB for a 4 KiB update: the
/// engine maps it and faults in only the window the bucket reads (it used
/// to fault in the whole announced length: 1 GiB of RSS).
#[test]
fn a_sparse_shared_buffer_is_not_faulted_in_whole() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("hostile.sock");
    let (m, ptrs, mut ts) = engine_with_weights(dir.path());
    let fresh: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 1) as u8).collect();
    let publisher = hostile_publisher(
        &sock,
        Script {
            manifest: vec![meta("w", 4096)],
            buffer: sealed_memfd(1 << 30, &fresh),
            announced: 1 << 30,
            entries: vec![BucketEntry {
                request: 0,
                offset: 0,
                len: 4096,
                buffer_offset: 0,
            }],
        },
    );
    let before = rss();
    let stats = m.update(ipc_request(&sock, Mode::InPlace)).unwrap();
    assert_eq!(stats.version, "hostile");
    let grown = rss().saturating_sub(before);
    assert!(grown < 64 * MIB, "RSS grew by {grown} bytes");
    ts[0].data = fresh;
    assert_params(&ptrs, &ts);
    publisher.join().unwrap();
}

/// A buffer smaller than it is announced, or than a bucket reads from it,
/// is refused naming it, and the weights stay.
#[test]
fn a_shared_buffer_too_small_for_the_plan_is_refused_naming_it() {
    let _serial = serial();
    let cases = [
        // (memfd size, announced size, what the error says)
        (
            4096u64,
            8192u64,
            "holds 4096 bytes, the peer announced 8192",
        ),
        (2048, 2048, "run past the 2048-byte buffer"),
    ];
    for (size, announced, says) in cases {
        let script = Script {
            manifest: vec![meta("w", 4096)],
            buffer: sealed_memfd(size, &[1; 256]),
            announced,
            entries: first_4096(),
        };
        let e = refused_keeping_v1(script, |sock| ipc_request(sock, Mode::Atomic));
        assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
        assert!(e.message.contains("shared buffer 0"), "{e}");
        assert!(e.message.contains(says), "{e}");
    }
}

/// Buckets out of sequence, and an END whose count is not the buckets
/// that came: refused naming the publisher, the old weights kept (the END
/// count was not checked over IPC).
#[test]
fn buckets_out_of_sequence_or_miscounted_are_refused() {
    let _serial = serial();
    for ((seq, end), says) in [
        ((3, 1), "bucket 3 came where bucket 0 was next"),
        ((0, 2), "END after 2 buckets, 1 received"),
        ((0, 0), "END after 0 buckets, 1 received"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("hostile.sock");
        let (m, ptrs, ts) = engine_with_weights(dir.path());
        let script = Script {
            manifest: vec![meta("w", 4096)],
            buffer: sealed_memfd(4096, &[9; 4096]),
            announced: 4096,
            entries: first_4096(),
        };
        let publisher = numbered_publisher(&sock, script, (seq, end));
        let e = m.update(ipc_request(&sock, Mode::Atomic)).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
        assert!(
            e.message.contains(says) && e.message.contains("hostile.sock"),
            "{e}"
        );
        assert_params(&ptrs, &ts);
        assert_eq!(m.status().version.as_deref(), Some("v1"));
        publisher.join().unwrap();
    }
}

/// A sparse buffer announced larger than the machine's memory (a real
/// publisher reserves every page, so it cannot be) is refused before it is
/// mapped: it would only eat the engine's address space.
#[test]
fn a_shared_buffer_larger_than_the_machine_is_refused() {
    let _serial = serial();
    let petabyte = 1u64 << 50;
    let script = Script {
        manifest: vec![meta("w", 4096)],
        buffer: sealed_memfd(petabyte, &[1; 4096]),
        announced: petabyte,
        entries: first_4096(),
    };
    let e = refused_keeping_v1(script, |sock| ipc_request(sock, Mode::InPlace));
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    assert!(e.message.contains("memory and swap"), "{e}");
}

/// Over rdma, the same manifest from a real network publisher (UCX over
/// TCP): a 1 TiB live tensor (address space only, never read) served without
/// checksums, to an engine with a tensor callback. The engine refuses it
/// against its callback_staging_limit before asking for any byte (it used
/// to abort allocating 1 TiB in place).
#[test]
fn a_tebibyte_callback_tensor_over_rdma_is_refused() {
    let _serial = serial();
    std::env::set_var("UCX_TLS", "tcp"); // UCX reads it once, at first use
    let secret = b"hostile-peer-secret-0123456789".to_vec();
    let huge = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TIB as usize,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(huge, libc::MAP_FAILED);
    let cfg = weight_manager_core::PublisherConfig {
        secret: Some(secret.clone()),
        checksums: false,
        bucket_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let p = weight_manager_core::Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
    // SAFETY: the mapping stays (unmapped only after serving ends); its
    // pages read as zeros.
    unsafe {
        p.add(weight_manager_core::TensorDesc::host(
            "huge",
            DType::U8,
            &[TIB],
            huge.cast(),
            TIB as usize,
        ))
    }
    .unwrap();
    p.set_version(Some("hostile".into()));
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        net: weight_manager_core::NetSettings {
            secret: Some(secret),
            bucket_size: 4096,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let addr = p.address();
    for mode in [Mode::InPlace, Mode::Atomic] {
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
            let before = rss();
            let mut hook = |_: &TensorView| -> Result<(), String> { Ok(()) };
            let mut req = UpdateRequest::snapshot(&addr);
            req.source = SourceKind::Rdma;
            req.skip_network_checksums = true;
            req.mode = mode;
            req.timeout = Duration::from_secs(30);
            req.hooks.tensor = Some(&mut hook);
            let e = m.update(req).unwrap_err();
            let grown = rss().saturating_sub(before);
            assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{mode:?}: {e}");
            assert!(e.message.contains("tensor 'huge'"), "{mode:?}: {e}");
            assert!(
                e.message.contains("callback_staging_limit"),
                "{mode:?}: {e}"
            );
            assert!(grown < 64 * MIB, "{mode:?}: RSS grew by {grown} bytes");
            // The publisher's session ends with the engine's refusal.
            let _ = serving.join().unwrap();
        });
    }
    unsafe { libc::munmap(huge, TIB as usize) };
}

/// A publisher serving another version than the one asked for (a real one
/// answers NOT_FOUND): refused before any byte moves, naming both, where
/// the update used to commit its bytes.
#[test]
fn a_publisher_serving_another_version_than_asked_is_refused() {
    let _serial = serial();
    let script = Script {
        manifest: vec![meta("w", 4096)],
        buffer: sealed_memfd(4096, &[1; 256]),
        announced: 4096,
        entries: first_4096(),
    };
    let e = refused_keeping_v1(script, |sock| {
        let mut req = ipc_request(sock, Mode::Atomic);
        req.version = Some("v2".into());
        req
    });
    assert_eq!(e.code, wm_result::WM_ERR_MISMATCH, "{e}");
    let says = "asked for version 'v2', it serves 'hostile'";
    assert!(e.message.contains(says), "{e}");
}

/// A MANIFEST announcing more tensors than the engine's bound (65,536 plus
/// one per 4 KiB of its params) is refused from its count, before any
/// tensor is decoded (decoded, one costs several times its wire bytes).
#[test]
fn a_manifest_of_more_tensors_than_the_engine_takes_is_refused_from_its_count() {
    let _serial = serial();
    let script = Script {
        manifest: (0..70_000).map(|i| meta(&format!("t{i}"), 0)).collect(),
        buffer: sealed_memfd(4096, &[1; 256]),
        announced: 4096,
        entries: Vec::new(),
    };
    let e = refused_keeping_v1(script, |sock| ipc_request(sock, Mode::Atomic));
    assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
    let says = "MANIFEST announces 70000 tensors, more than the 655";
    assert!(e.message.contains(says), "{e}");
}

/// A network "publisher" without the secret that answers HELLO with a
/// frame announcing 64 MiB: before the publisher's proof checks, the
/// engine reads no frame over 64 KiB (it read this one whole, 64 MiB of
/// memory per connection, until its deadline), so it is refused at once
/// from its length, naming the peer.
#[test]
fn an_unauthenticated_publisher_cannot_send_a_large_frame() {
    let _serial = serial();
    std::env::set_var("UCX_TLS", "tcp");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 256];
        let _ = s.read(&mut hello);
        let _ = s.write_all(&(64u32 << 20).to_le_bytes());
        let _ = s.write_all(&vec![0u8; 1 << 20]);
        // Hold the connection until the engine lets go of it.
        let _ = s.read(&mut hello);
    });
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        net: weight_manager_core::NetSettings {
            secret: Some(b"hostile-peer-secret-0123456789".to_vec()),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let mut req = UpdateRequest::snapshot(&addr);
    req.source = SourceKind::Rdma;
    req.timeout = Duration::from_secs(20);
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    assert!(
        e.message.contains(&addr) && e.message.contains("frame of 67108864 bytes (1 to 65536"),
        "{e}"
    );
    drop(m);
    fake.join().unwrap();
}
