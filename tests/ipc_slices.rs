//! Slices of published versions over IPC, served as windows: two trainer
//! ranks (in-process `Publisher`s on threads, real Unix sockets and shared
//! memory), each publishing the row half of every tensor, and one engine
//! (this process's `Manager`) whose params cut across both: a column split,
//! a row range that starts off the 256-byte grid, a fused QKV of unequal
//! parts (its column half), and an expert range cut by columns. Every byte
//! is checked, atomic and in place, verified (slice sums) and not. On the
//! wire, a published version answers any request with WINDOWS into its one
//! buffer (nothing packed); a hostile publisher's window that points past
//! the buffer or past its request is refused naming it, weights intact.

mod common;

use common::sharded::{expected, piece, serving, Global};

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::shared::SharedBuffer;
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::{check_windows, BucketEntry, Frame, Request};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{Mode, TensorView};
use weight_manager_core::{Publisher, PublisherConfig};

/// Small buckets: requests are split across buckets too.
const SMALL: usize = 4096;

/// Tests here bind sockets and share the machine's memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn model(seed: u8) -> Vec<Global> {
    vec![
        Global::new("w", &[64, 48], seed),
        Global::new("q", &[32, 48], seed),
        Global::new("k", &[16, 48], seed),
        Global::new("v", &[16, 48], seed),
        Global::new("experts", &[8, 16, 48], seed),
    ]
}

/// Trainer rank `r` of 2: the rows `r` half of every tensor, published as
/// `version` (one shared buffer, 256-byte aligned tensors), serving
/// buckets of at most `bucket` bytes.
fn publisher(sock: &Path, r: u64, globals: &[Global], version: &str, bucket: usize) -> Publisher {
    let cfg = PublisherConfig {
        bucket_size: bucket,
        bucket_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let p = Publisher::bind(sock, cfg).unwrap();
    for g in globals {
        // SAFETY: publish copies the bytes before `globals` goes.
        unsafe { g.add_half_to(&p, r) };
    }
    p.set_version(Some(version.into()));
    p.publish().unwrap();
    p.clear_tensors();
    p
}

/// The engine's params, each cutting across both trainer ranks' halves.
fn specs() -> Vec<ParamSpec> {
    let spec = |name: &str, shape: &[u64], pieces: Vec<Piece>| ParamSpec {
        pieces,
        ..ParamSpec::host(name, DType::F32, shape)
    };
    let qkv = |t: &str, rows: u64, at: u64| piece(t, &[0, 24], &[rows, 24], &[at, 0]);
    vec![
        // Columns 8..32 of "w": a strided run of 96 of every 192 bytes.
        spec(
            "w_cols",
            &[64, 24],
            vec![piece("w", &[0, 8], &[64, 24], &[0, 0])],
        ),
        // Rows 21..45 of "w": from rank 0 it starts at byte 4032 of its
        // shard, off the 256-byte grid.
        spec(
            "w_rows",
            &[24, 48],
            vec![piece("w", &[21, 0], &[24, 48], &[0, 0])],
        ),
        // The column half of q, k and v (32, 16 and 16 rows) stacked.
        spec(
            "qkv",
            &[64, 24],
            vec![qkv("q", 32, 0), qkv("k", 16, 32), qkv("v", 16, 48)],
        ),
        // Experts 3..6 (one on rank 0, two on rank 1), columns 16..40.
        spec(
            "experts",
            &[3, 16, 24],
            vec![piece("experts", &[3, 0, 16], &[3, 16, 24], &[0, 0, 0])],
        ),
    ]
}

fn request<'h>(socks: &[PathBuf], mode: Mode, verify: bool) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(PathBuf::new());
    r.locations = socks.to_vec();
    r.source = SourceKind::Ipc;
    r.verify = verify;
    r.mode = mode;
    r.timeout = Duration::from_secs(60);
    r
}

/// The engine's pieces from both ranks' published versions at once, every
/// byte right, atomic and in place, verified and not; each rank sent
/// exactly what it holds of them.
#[test]
fn slices_of_published_versions_from_two_publishers() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let specs = specs();
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap();
    let ptrs: Vec<(*mut u8, usize)> = specs.iter().map(|s| m.allocate(s).unwrap()).collect();
    let cases = [
        (Mode::Atomic, true),
        (Mode::Atomic, false),
        (Mode::InPlace, true),
        (Mode::InPlace, false),
    ];
    for (k, (mode, verify)) in cases.into_iter().enumerate() {
        let what = format!("{mode:?}, verify {verify}");
        let globals = model(k as u8 + 1);
        let version = format!("v{k}");
        let socks: Vec<PathBuf> = (0..2)
            .map(|r| dir.path().join(format!("p{k}-{r}.sock")))
            .collect();
        let ps: Vec<Publisher> = (0..2)
            .map(|r| publisher(&socks[r], r as u64, &globals, &version, SMALL))
            .collect();
        let (r, served) = serving(&ps, || m.update(request(&socks, mode, verify)));
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        for ((p, n), spec) in ptrs.iter().zip(&specs) {
            // SAFETY: library-owned params; nothing writes them now.
            let got = unsafe { std::slice::from_raw_parts(*p, *n) };
            assert!(
                got == expected(spec, &globals),
                "{what}: param '{}' differs",
                spec.name
            );
        }
        assert_eq!(m.status().version.as_deref(), Some(version.as_str()));
        let param_bytes: u64 = ptrs.iter().map(|p| p.1 as u64).sum();
        let sent: u64 = served
            .into_iter()
            .map(|s| s.unwrap().sessions[0].bytes)
            .sum();
        assert_eq!(
            sent, param_bytes,
            "{what}: the ranks sent exactly the params' bytes"
        );
    }
}

/// Zero-copy: each rank's shards handed to the callback where they lie in
/// its published buffer (each lies whole in a bucket), 256-byte aligned,
/// every byte right.
#[test]
fn zero_copy_hands_out_published_shards_whole_and_aligned() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let globals = model(9);
    let socks: Vec<PathBuf> = (0..2)
        .map(|r| dir.path().join(format!("z{r}.sock")))
        .collect();
    let ps: Vec<Publisher> = (0..2)
        .map(|r| publisher(&socks[r], r as u64, &globals, "z", 1 << 20))
        .collect();
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let mut seen = Vec::new();
    let mut cb = |t: &TensorView| {
        let g = globals.iter().find(|g| g.name == t.name).unwrap();
        let half = g.shape[0] / 2;
        let r = t.offset[0] / half;
        let aligned = (t.data.as_ptr() as usize).is_multiple_of(256);
        seen.push((
            t.name.to_string(),
            r,
            aligned,
            t.data == g.rows(r * half, (r + 1) * half),
        ));
        Ok(())
    };
    let mut req = request(&socks, Mode::InPlace, true);
    req.hooks.tensor = Some(&mut cb);
    let (r, _) = serving(&ps, || m.update(req));
    r.unwrap();
    seen.sort();
    assert_eq!(seen.len(), 2 * globals.len(), "{seen:?}");
    assert!(seen.iter().all(|s| s.2 && s.3), "{seen:?}");
}

/// On the wire: a published version answers a strided request and an
/// unaligned range with BUFFERS (its one buffer) and WINDOWS frames,
/// whose blocks hold exactly the bytes asked for.
#[test]
fn a_published_version_serves_strided_requests_as_windows() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let globals = model(5);
    let sock = dir.path().join("wire.sock");
    let p = publisher(&sock, 0, &globals, "w1", SMALL);
    std::thread::scope(|s| {
        let serve = s.spawn(|| p.serve(1, Duration::from_secs(30)));
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut conn = Conn::new(UnixStream::connect(&sock).unwrap(), "the publisher");
        conn.send(&Frame::Hello {
            rank: 0,
            world_size: 1,
            gpu_id: "0".into(),
            version: String::new(),
            base: String::new(),
        })
        .unwrap();
        let Frame::Manifest { tensors, .. } = conn.recv(deadline).unwrap() else {
            panic!("no manifest")
        };
        let w = tensors.iter().position(|t| t.name == "w").unwrap() as u32;
        // Columns 8..32 of the shard's 32 rows of 192 bytes, then rows 21..32.
        let cols = Request::of_blocks(w, (0..32).map(|r| (r * 192 + 32, 96)), true);
        let rows = Request::of_blocks(w, [(21 * 192, 11 * 192)], false);
        let requests = vec![cols, rows];
        conn.send(&Frame::Want {
            requests: requests.clone(),
            base: None,
            quant: vec![],
        })
        .unwrap();
        let Frame::Buffers { sizes } = conn.recv(deadline).unwrap() else {
            panic!("no BUFFERS")
        };
        assert_eq!(
            sizes.len(),
            1,
            "a published version hands over its one buffer"
        );
        let fd = conn.take_fds(1).unwrap().pop().unwrap();
        let buffer = SharedBuffer::receive(fd, sizes[0] as usize, "version").unwrap();
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); 2];
        loop {
            match conn.recv(deadline).unwrap() {
                Frame::Windows { seq, entries, .. } => {
                    let blocks = check_windows(seq, &entries, sizes[0], &requests).unwrap();
                    for b in blocks.blocks {
                        assert_eq!(b.offset, got[b.request as usize].len() as u64);
                        // SAFETY: checked to lie in the mapped buffer.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(
                                buffer.ptr().add(b.buffer_offset as usize),
                                b.len as usize,
                            )
                        };
                        got[b.request as usize].extend_from_slice(bytes);
                    }
                    conn.send(&Frame::Ack { seq }).unwrap();
                }
                Frame::Sums { .. } => {}
                Frame::End { .. } => break,
                other => panic!("expected WINDOWS, got {}", other.name()),
            }
        }
        let g = &globals[0];
        let want_cols: Vec<u8> = (0..32)
            .flat_map(|r| g.rows(r, r + 1)[32..128].to_vec())
            .collect();
        assert!(got[0] == want_cols, "the column blocks");
        assert!(got[1] == g.rows(21, 32), "the unaligned row range");
        drop(conn);
        serve.join().unwrap().unwrap();
    });
}

/// A hostile publisher whose one buffer is shared memory of 4096 bytes,
/// then a WINDOWS bucket of `entries`.
fn hostile(sock: &Path, entries: Vec<BucketEntry>) -> std::thread::JoinHandle<()> {
    common::hostile_windows::serve(sock, entries, |conn| {
        let fd = sealed_memfd(4096);
        let buffers = Frame::Buffers { sizes: vec![4096] };
        let _ = conn.send_with_fds(&buffers, &[fd.as_raw_fd()]);
        Some(fd)
    })
}

/// A sealed memfd of `len` bytes of 0xee.
fn sealed_memfd(len: usize) -> OwnedFd {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    let raw = unsafe { libc::memfd_create(c"hostile".as_ptr(), flags) };
    assert!(raw >= 0);
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let data = vec![0xeeu8; len];
    assert_eq!(
        unsafe { libc::pwrite(raw, data.as_ptr().cast(), len, 0) },
        len as isize
    );
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    assert_eq!(unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) }, 0);
    fd
}

/// `m`'s update (in `mode`) from a hostile publisher at `sock` sending a
/// WINDOWS bucket of `entries`: its error, once the publisher is done.
fn refused_by_hostile(
    m: &Manager,
    sock: &Path,
    entries: Vec<BucketEntry>,
    mode: Mode,
) -> weight_manager_core::Error {
    let publisher = hostile(sock, entries);
    let mut req = UpdateRequest::snapshot(sock);
    req.source = SourceKind::Ipc;
    req.mode = mode;
    req.timeout = Duration::from_secs(30);
    let e = m.update(req).unwrap_err();
    publisher.join().unwrap();
    e
}

/// An engine whose param "w" [64, 32] u8 is columns 0..32 of the global
/// "w" [64, 64], updated from the snapshot at `model_dir`: the manager and
/// the param's memory.
fn columns_engine(model_dir: &Path) -> (Manager, (*mut u8, usize)) {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap();
    let spec = ParamSpec {
        pieces: vec![piece("w", &[0, 0], &[64, 32], &[0, 0])],
        ..ParamSpec::host("w", DType::U8, &[64, 32])
    };
    let param = m.allocate(&spec).unwrap();
    m.update(UpdateRequest::snapshot(model_dir)).unwrap();
    (m, param)
}

/// The engine takes columns 0..32 of "w" [64, 64] (a strided request of 64
/// blocks of 32 bytes). A window whose blocks run past the 4096-byte buffer,
/// or which covers more than its request, is refused naming the entry and
/// the buffer, before any byte is read: the weights and version stay.
#[test]
fn hostile_windows_are_refused_naming_them() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, full) = common::hostile_windows::first_version(dir.path());
    let (m, (p, n)) = columns_engine(&model_dir);
    let before: Vec<u8> = (0..64)
        .flat_map(|r| full.data[r * 64..r * 64 + 32].to_vec())
        .collect();
    for (k, (entry, want)) in common::hostile_windows::cases().into_iter().enumerate() {
        for mode in [Mode::Atomic, Mode::InPlace] {
            let sock = dir.path().join(format!("h{k}-{mode:?}.sock"));
            let e = refused_by_hostile(&m, &sock, vec![entry], mode);
            assert_eq!(e.code, wm_result::WM_ERR_PEER, "{mode:?}: {e}");
            for part in ["shared buffer 0", "bucket 0: entry 0: ", want] {
                assert!(e.message.contains(part), "{mode:?}: {part}: {e}");
            }
            // SAFETY: a library-owned param; nothing writes it now.
            let held = unsafe { std::slice::from_raw_parts(p, n) };
            assert!(held == before, "{mode:?}: the weights were touched");
            assert_eq!(m.status().version.as_deref(), Some("v1"), "{mode:?}");
        }
    }
}

/// A publisher serving a snapshot directory (no published copy), asked
/// for columns 0..32 of "w" [64, 64]: 64 blocks of 32 bytes of one file in
/// one batch, copied from a mapping of the file (a `pread` each before:
/// 2^22 blocks took 2.7 s of system calls). The engine gets exactly the
/// columns, atomic and in place.
#[test]
fn a_served_directory_sends_many_small_blocks_of_its_files() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, full) = common::hostile_windows::first_version(dir.path());
    let (m, (p, n)) = columns_engine(&model_dir);
    let want: Vec<u8> = (0..64)
        .flat_map(|r| full.data[r * 64..r * 64 + 32].to_vec())
        .collect();
    for mode in [Mode::Atomic, Mode::InPlace] {
        // SAFETY: a library-owned param; nothing reads it meanwhile.
        unsafe { std::ptr::write_bytes(p, 0, n) };
        let sock = dir.path().join(format!("dir-{mode:?}.sock"));
        let publisher = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
        publisher.set_dir(&model_dir);
        std::thread::scope(|s| {
            let serving = s.spawn(|| publisher.serve(1, Duration::from_secs(20)));
            let mut req = UpdateRequest::snapshot(&sock);
            req.source = SourceKind::Ipc;
            req.mode = mode;
            req.timeout = Duration::from_secs(20);
            m.update(req).unwrap();
            serving.join().unwrap().unwrap();
        });
        // SAFETY: as above.
        let held = unsafe { std::slice::from_raw_parts(p, n) };
        assert!(held == want, "{mode:?}: the columns");
    }
}

/// A publisher whose END comes before every byte it was asked for (one
/// window of half the request) is named in the error (found by an audit:
/// "the source ended before ..." named no publisher), atomic and in place.
#[test]
fn a_publisher_ending_before_its_bytes_is_named() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = common::hostile_windows::first_version(dir.path());
    let (m, _) = columns_engine(&model_dir);
    let half = BucketEntry {
        request: 0,
        offset: 0,
        len: 1024,
        buffer_offset: 0,
    };
    for mode in [Mode::Atomic, Mode::InPlace] {
        let sock = dir.path().join(format!("short-{mode:?}.sock"));
        let e = refused_by_hostile(&m, &sock, vec![half], mode);
        assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{mode:?}: {e}");
        let named = format!("{} ended before 1 tensor(s) were complete", sock.display());
        assert!(e.message.contains(&named), "{mode:?}: {e}");
        assert!(
            e.message.contains("'w' (1024 of 2048 bytes)"),
            "{mode:?}: {e}"
        );
    }
}

/// `wm bench shard --section ipc`, small: 2 trainer and 2 engine processes
/// run both patterns, and every figure is printed beside its floor.
#[test]
fn bench_shard_ipc_prints_each_pattern_beside_its_floor() {
    let _serial = serial();
    let out = std::process::Command::new(&*common::WM)
        .args(["bench", "shard", "--section", "ipc", "--gib", "0.0625"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for pattern in ["row halves", "column halves"] {
        for what in [
            "first update (maps the buffers)",
            "steady update, 4 processes at once",
        ] {
            let line = text
                .lines()
                .find(|l| l.contains(&format!("{pattern}: {what}")))
                .unwrap_or_else(|| panic!("no '{pattern}: {what}' in: {text}"));
            assert!(
                line.contains("GB/s   memcpy") && line.contains("ratio"),
                "{line}"
            );
        }
    }
}
