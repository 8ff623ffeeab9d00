//! Delta updates through the Rust API with real publishers, sockets and
//! UCX: a trainer publishes 5 consecutive versions (about 2% of bf16
//! elements changed per step) to 2 engine ranks over IPC and rdma, every
//! version's bytes checked, deltas from the second version on; the
//! fallbacks to whole (the publisher no longer keeps the base, a param
//! written since, a clear, the engine asking); and hostile publishers
//! (bad DELTAS, bad deltas, a delta that does not give the announced
//! checksum), refused with the old weights kept.

mod common;

use common::sharded::serial;
use common::steps::{bind_trainer, first, next, publish_step};
use common::*;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::{DeltaRun, Frame, RunVerdict};
use weight_manager_core::wm_result;
use weight_manager_core::{DeltaFallback, DeltaMode, Manager, ManagerConfig, Mode, NetSettings};
use weight_manager_core::{
    ParamSpec, Publisher, PublisherConfig, SourceKind, State, UpdateRequest,
};

const SECRET: &[u8] = b"delta-test-secret-0123";

enum Via {
    Ipc,
    Rdma,
}

struct Trainer {
    publisher: Publisher,
    location: String,
    via: Via,
    /// Versions still referenced by the publisher's live tensors.
    live: Vec<Vec<T>>,
}

impl Trainer {
    fn new(via: Via, dir: &Path, keep_versions: usize) -> Trainer {
        let cfg = PublisherConfig {
            keep_versions,
            secret: Some(SECRET.to_vec()),
            ..Default::default()
        };
        let kind = match via {
            Via::Ipc => SourceKind::Ipc,
            Via::Rdma => SourceKind::Rdma,
        };
        let (publisher, location) = bind_trainer(kind, dir, cfg);
        Trainer {
            publisher,
            location,
            via,
            live: Vec::new(),
        }
    }

    /// Publish `ts` as version `v` (a copy the publisher keeps).
    fn publish(&mut self, ts: &[T], v: u64) {
        publish_step(&self.publisher, ts, v);
        self.live = vec![ts.to_vec()];
    }

    fn request(&self) -> UpdateRequest<'static> {
        let mut r = UpdateRequest::snapshot(&self.location);
        r.source = match self.via {
            Via::Ipc => SourceKind::Ipc,
            Via::Rdma => SourceKind::Rdma,
        };
        // IPC takes deltas when asked; the network by default.
        if matches!(self.via, Via::Ipc) {
            r.deltas = DeltaMode::On;
        }
        r
    }

    /// Update every engine from this trainer at once (one session each).
    fn update_all(
        &self,
        engines: &[Manager],
        request: impl Fn() -> UpdateRequest<'static> + Sync,
    ) -> Vec<weight_manager_core::Result<weight_manager_core::UpdateStats>> {
        self.update_all_served(engines, request).0
    }

    /// [`Trainer::update_all`], with what the publisher's sessions did.
    fn update_all_served(
        &self,
        engines: &[Manager],
        request: impl Fn() -> UpdateRequest<'static> + Sync,
    ) -> (
        Vec<weight_manager_core::Result<weight_manager_core::UpdateStats>>,
        weight_manager_core::ServeStats,
    ) {
        std::thread::scope(|s| {
            let serving = s.spawn(|| self.publisher.serve(engines.len(), Duration::from_secs(60)));
            let updates: Vec<_> = engines
                .iter()
                .map(|m| s.spawn(|| m.update(request())))
                .collect();
            let out = updates.into_iter().map(|u| u.join().unwrap()).collect();
            (out, serving.join().unwrap().unwrap())
        })
    }
}

fn engine(rank: u32) -> Manager {
    Manager::new(ManagerConfig {
        rank,
        world_size: 2,
        fallback_dir: None,
        net: NetSettings {
            secret: Some(SECRET.to_vec()),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

/// Engine-owned params for `ts` (leaked for the test's life).
fn own_params(m: &Manager, ts: &[T]) -> Vec<(*mut u8, usize)> {
    ts.iter()
        .map(|t| {
            let buf: &'static mut [u8] = Box::leak(vec![0u8; t.data.len()].into_boxed_slice());
            let spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
            unsafe { m.register(&spec, buf.as_mut_ptr(), buf.len()) }.unwrap();
            (buf.as_mut_ptr(), buf.len())
        })
        .collect()
}

/// UCX over TCP for this test, one network test at a time (None, said:
/// no UCX here).
fn ucx_over_tcp() -> Option<std::sync::MutexGuard<'static, ()>> {
    if weight_manager_core::internals::transport::ucx::ucx().is_err() {
        println!("skipped: no UCX");
        return None;
    }
    let one = serial();
    std::env::set_var("UCX_TLS", "tcp");
    Some(one)
}

/// The hostile publisher's tensor with element 5 changed, its checksum, and
/// the delta (GAPS: one change, its value, at element 5) giving it.
fn one_change(v1: &T) -> (Vec<u8>, u128, [u8; 4]) {
    let mut changed = v1.data.clone();
    changed[5] ^= 1;
    let sum = weight_manager_core::checksum::of(&changed);
    let good = [3u8, 1, changed[5], 5];
    (changed, sum, good)
}

/// Five versions to two engine ranks (one with library-owned params, one
/// with its own), `mode`: every version's bytes exact, deltas from the
/// second version on, carrying a small share of the bytes.
fn five_versions(via: Via, mode: Mode) {
    let dir = tempfile::tempdir().unwrap();
    let mut trainer = Trainer::new(via, dir.path(), 2);
    let mut ts = first();
    let engines = [engine(0), engine(1)];
    let params = [register(&engines[0], &ts), own_params(&engines[1], &ts)];
    let whole: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    for v in 1..=5u64 {
        if v > 1 {
            ts = next(&ts, v);
        }
        trainer.publish(&ts, v);
        let (results, served) = trainer.update_all_served(&engines, || {
            let mut r = trainer.request();
            r.mode = mode;
            r
        });
        // The two ranks take the same runs: each delta encoded once.
        let (sent, cached) = served
            .sessions
            .iter()
            .fold((0, 0), |(a, b), s| (a + s.delta_runs, b + s.delta_cached));
        assert_eq!(
            (sent, cached),
            if v == 1 { (0, 0) } else { (8, 4) },
            "version {v}"
        );
        for (rank, (r, ps)) in results.into_iter().zip(&params).enumerate() {
            let stats = r.unwrap_or_else(|e| panic!("version {v}, rank {rank}: {e}"));
            assert_params(ps, &ts);
            let d = &stats.deltas;
            if v == 1 {
                assert_eq!(d.fallback, DeltaFallback::NoBase, "{d:?}");
                assert_eq!((d.runs_delta, d.wire_bytes), (0, whole), "{d:?}");
                continue;
            }
            assert_eq!(d.fallback, DeltaFallback::None, "version {v}: {d:?}");
            assert_eq!(d.base_version, format!("step-{}", v - 1));
            assert_eq!((d.runs_delta, d.runs_whole), (4, 0), "version {v}: {d:?}");
            assert!(d.wire_bytes * 10 < whole, "version {v}: {d:?} of {whole}");
            assert!(
                d.rewritten_bytes > 0 && d.rewritten_bytes < whole / 10,
                "{d:?}"
            );
        }
    }
}

#[test]
fn ipc_five_versions_atomic() {
    five_versions(Via::Ipc, Mode::Atomic);
}

#[test]
fn ipc_five_versions_in_place() {
    five_versions(Via::Ipc, Mode::InPlace);
}

#[test]
fn rdma_five_versions() {
    let Some(_one) = ucx_over_tcp() else {
        return;
    };
    five_versions(Via::Rdma, Mode::Atomic);
    five_versions(Via::Rdma, Mode::InPlace);
}

/// The fallbacks to whole, each with its reason and exact bytes after.
#[test]
fn fallbacks_to_whole() {
    let dir = tempfile::tempdir().unwrap();
    let m = [engine(0)];
    let mut ts = first();
    let ps = register(&m[0], &ts);
    // Publish step `k` (the last one's with 2% changed), update to it with
    // `mode`, check every byte; what the deltas did.
    let mut step = |trainer: &mut Trainer, k: u64, mode: DeltaMode| {
        if k > 1 {
            ts = next(&ts, k);
        }
        trainer.publish(&ts, k);
        let r = trainer.update_all(&m, || {
            let mut r = trainer.request();
            r.deltas = mode;
            r
        });
        assert_params(&ps, &ts);
        r.into_iter().next().unwrap().unwrap().deltas
    };
    let expect = |d: weight_manager_core::DeltaStats, fallback, runs_delta| {
        assert_eq!((d.fallback, d.runs_delta), (fallback, runs_delta), "{d:?}");
        d
    };
    // Keeping one version: the engine's base is gone once the next is out.
    let mut trainer = Trainer::new(Via::Ipc, dir.path(), 1);
    expect(
        step(&mut trainer, 1, DeltaMode::On),
        DeltaFallback::NoBase,
        0,
    );
    let d = expect(
        step(&mut trainer, 2, DeltaMode::On),
        DeltaFallback::NotKept,
        0,
    );
    assert_eq!(d.base_version, "step-1");
    // Keeping two from here on; the engine asks for whole.
    drop(trainer);
    let mut trainer = Trainer::new(Via::Ipc, dir.path(), 2);
    trainer.publish(&first(), 0);
    expect(
        step(&mut trainer, 3, DeltaMode::Off),
        DeltaFallback::Refused,
        0,
    );
    // Something else wrote into one param since: that run comes whole.
    let written = ps[1].0;
    unsafe { *written ^= 0xff };
    let d = expect(
        step(&mut trainer, 4, DeltaMode::On),
        DeltaFallback::Differs,
        3,
    );
    assert_eq!(d.runs_whole, 1, "{d:?}");
    // After a clear the params hold no version.
    m[0].clear().unwrap();
    expect(
        step(&mut trainer, 5, DeltaMode::On),
        DeltaFallback::NoBase,
        0,
    );
    // IPC without asking: whole, and said so.
    expect(
        step(&mut trainer, 6, DeltaMode::Auto),
        DeltaFallback::NotAsked,
        0,
    );
    // Snapshots always move whole.
    let snap = dir.path().join("snap");
    std::fs::create_dir(&snap).unwrap();
    write_safetensors(&snap.join("model.safetensors"), &first());
    write_version(&snap, "7");
    let d = m[0].update(UpdateRequest::snapshot(&snap)).unwrap().deltas;
    assert_eq!(d.fallback, DeltaFallback::NotApplicable, "{d:?}");
}

/// A hostile IPC publisher: the manifest of one u8 tensor "w" [64, 64]
/// then after WANT the frames `answer` makes, and BUFFERS and END if the
/// engine is still there. Returns the WANT.
fn hostile(sock: &Path, answer: Vec<Frame>) -> std::thread::JoinHandle<Option<Frame>> {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        conn.recv(deadline).ok()?;
        conn.send(&hostile_windows::manifest_of_w("v2", true))
            .ok()?;
        let want = conn.recv(deadline).ok()?;
        for f in answer {
            if conn.send(&f).is_err() {
                return Some(want);
            }
        }
        // No bucket: the buffers, then END.
        let buffer = sealed_memfd(4096);
        let buffers = Frame::Buffers { sizes: vec![4096] };
        if conn.send_with_fds(&buffers, &[buffer.as_raw_fd()]).is_ok() {
            let _ = conn.send(&Frame::End { buckets: 0 });
            let _ = conn.recv(deadline);
        }
        Some(want)
    })
}

/// A memfd of `len` zeros, sealed against resizing (as the engine demands).
fn sealed_memfd(len: i64) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    let raw = unsafe { libc::memfd_create(c"deltas".as_ptr(), flags) };
    assert!(raw >= 0);
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    assert_eq!(unsafe { libc::ftruncate(raw, len) }, 0);
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    assert_eq!(unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) }, 0);
    fd
}

fn deltas(len: u64, sum: u128) -> Frame {
    Frame::Deltas {
        kept: true,
        runs: vec![DeltaRun {
            request: 0,
            verdict: RunVerdict::Delta,
            len,
            sum,
        }],
    }
}

fn piece(bytes: &[u8]) -> Frame {
    Frame::Delta {
        request: 0,
        bytes: bytes.to_vec(),
    }
}

/// The hostile answers to an engine holding `v1` (one u8 tensor), each
/// with what its refusal names.
fn hostile_cases(v1: &T) -> Vec<(Vec<Frame>, &'static str)> {
    let (changed, _, good) = one_change(v1);
    let sum = |bytes: &[u8]| weight_manager_core::checksum::of(bytes);
    vec![
        (
            vec![deltas(4097, 0)],
            "a delta of 4097 bytes for request #0 of 4096",
        ),
        (
            vec![Frame::Deltas {
                kept: false,
                runs: vec![DeltaRun {
                    request: 0,
                    verdict: RunVerdict::Delta,
                    len: 4,
                    sum: 0,
                }],
            }],
            "verdicts for a base it does not keep",
        ),
        (
            vec![Frame::Deltas {
                kept: true,
                runs: vec![],
            }],
            "0 verdicts for 1 requests",
        ),
        // A position past the run (a gap of 5000 in 4096 elements).
        (
            vec![deltas(5, sum(&changed)), piece(&[3, 1, 7, 0x88, 0x27])],
            "chunk 0: a position past the chunk's 4096 elements",
        ),
        // Three changes announced, one position given.
        (
            vec![deltas(3, sum(&changed)), piece(&[3, 3, 5])],
            "chunk 0:",
        ),
        // An unknown form.
        (
            vec![deltas(1, sum(&changed)), piece(&[9])],
            "unknown form 9",
        ),
        // Bytes after the run's last chunk.
        (
            vec![
                deltas(5, sum(&changed)),
                piece(&[good.as_slice(), &[0]].concat()),
            ],
            "1 bytes after",
        ),
        // A valid delta that does not give the announced bytes.
        (
            vec![deltas(4, sum(&changed) ^ 1), piece(&good)],
            "its delta does not give the new version's bytes",
        ),
        // A piece longer than the delta announced.
        (
            vec![
                deltas(4, sum(&changed)),
                piece(&[good.as_slice(), &[0, 0]].concat()),
            ],
            "DELTA of 6 bytes for request #0 while request #0's has 4 left",
        ),
        // A bucket where a DELTA is due.
        (
            vec![deltas(4, sum(&changed)), Frame::End { buckets: 0 }],
            "expected DELTA, got END",
        ),
    ]
}

/// Every hostile answer is refused naming what is wrong, and the old
/// weights stay (atomic; in place too, but for a delta whose result fails
/// its checksum: FAILED).
#[test]
fn hostile_deltas_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (model, v1) = hostile_windows::first_version(dir.path());
    let sum = |bytes: &[u8]| weight_manager_core::checksum::of(bytes);
    let cases = hostile_cases(&v1);
    for (k, (answer, want)) in cases.into_iter().enumerate() {
        for mode in [Mode::Atomic, Mode::InPlace] {
            let m = Manager::new(ManagerConfig::default()).unwrap();
            let p = register(&m, std::slice::from_ref(&v1));
            m.update(UpdateRequest::snapshot(&model)).unwrap();
            let sock = dir.path().join(format!("h{k}{mode:?}.sock"));
            let publisher = hostile(&sock, answer.clone());
            let mut r = UpdateRequest::snapshot(&sock);
            (r.source, r.mode, r.deltas) = (SourceKind::Ipc, mode, DeltaMode::On);
            let e = m.update(r).unwrap_err();
            assert!(e.message.contains(want), "case {k} {mode:?}: {e}");
            assert!(
                matches!(e.code, wm_result::WM_ERR_PEER | wm_result::WM_ERR_CHECKSUM),
                "case {k}: {e}"
            );
            let Some(Frame::Want {
                base: Some(base), ..
            }) = publisher.join().unwrap()
            else {
                panic!("case {k}: WANT named no base");
            };
            assert_eq!(base.version, "v1");
            assert_eq!(base.fingerprints, vec![(0, sum(&v1.data))]);
            let s = m.status();
            // In place, a delta is patched into the param before its
            // result's checksum is known: that one leaves FAILED. Every
            // other refusal comes before a byte is written.
            if mode == Mode::InPlace && want.contains("does not give") {
                assert_eq!(s.state, State::Failed, "case {k}");
                continue;
            }
            assert_params(&p, std::slice::from_ref(&v1));
            assert_eq!((s.state, s.version.as_deref()), (State::Normal, Some("v1")));
        }
    }
}

/// The good delta of the hostile publisher's tensor applies: the frames
/// the hostile cases bend are the ones a real publisher sends.
#[test]
fn a_hand_made_delta_applies() {
    let dir = tempfile::tempdir().unwrap();
    let (model, v1) = hostile_windows::first_version(dir.path());
    let (changed, sum, good) = one_change(&v1);
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let p = register(&m, std::slice::from_ref(&v1));
    m.update(UpdateRequest::snapshot(&model)).unwrap();
    let sock = dir.path().join("good.sock");
    let publisher = hostile(&sock, vec![deltas(4, sum), piece(&good)]);
    let mut r = UpdateRequest::snapshot(&sock);
    (r.source, r.deltas) = (SourceKind::Ipc, DeltaMode::On);
    let stats = m.update(r).unwrap();
    publisher.join().unwrap();
    let mut want = v1.clone();
    want.data = changed;
    assert_params(&p, &[want]);
    assert_eq!((stats.deltas.runs_delta, stats.deltas.wire_bytes), (1, 4));
    assert_eq!(stats.deltas.rewritten_bytes, 1);
}

/// A staged update takes deltas too (over rdma, by default): the params
/// keep the old version while it stages, hold the new one exactly after
/// the commit, and the commit's stats say deltas came.
#[test]
fn a_staged_update_takes_deltas() {
    let Some(_one) = ucx_over_tcp() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut trainer = Trainer::new(Via::Rdma, dir.path(), 2);
    let v1 = first();
    let v2 = next(&v1, 2);
    let m = std::sync::Arc::new(engine(0));
    let ps = register(&m, &v1);
    trainer.publish(&v1, 1);
    trainer.update_all(std::slice::from_ref(&*m), || trainer.request());
    trainer.publish(&v2, 2);
    std::thread::scope(|s| {
        let serving = s.spawn(|| trainer.publisher.serve(1, Duration::from_secs(60)));
        let staged = m.stage(trainer.request()).unwrap();
        assert_params(&ps, &v1);
        let stats = staged.commit().unwrap();
        serving.join().unwrap().unwrap();
        assert_params(&ps, &v2);
        let d = &stats.deltas;
        assert_eq!(
            (d.fallback, d.runs_delta),
            (DeltaFallback::None, 4),
            "{d:?}"
        );
    });
}

/// A hostile network publisher: real handshake and sealed frames, MANIFEST
/// of "w" saying the base is kept, DELTAS announcing one delta of
/// `announced` bytes, then that delta's UCX message of `sent` bytes (None:
/// it hangs up instead, as a publisher that died).
fn lying_delta_publisher(
    listener: std::net::TcpListener,
    (announced, sent, sum): (u64, Option<Vec<u8>>, u128),
) -> std::thread::JoinHandle<()> {
    use weight_manager_core::internals::transport::auth::{self, Secret};
    use weight_manager_core::internals::transport::seal::Role;
    use weight_manager_core::internals::transport::ucx::Pump;
    use weight_manager_core::internals::wire::delta_tag;
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        let hello = conn.recv(deadline).unwrap();
        let secret = Secret::resolve(Some(SECRET)).unwrap();
        let mine = auth::nonce().unwrap();
        conn.send(&Frame::Challenge { nonce: mine }).unwrap();
        let Frame::Proof { nonce: theirs, .. } = conn.recv(deadline).unwrap() else {
            panic!("no PROOF")
        };
        let proof = secret.publisher_proof(&theirs, &mine);
        conn.send(&Frame::Proof {
            mac: proof,
            nonce: [0; 32],
        })
        .unwrap();
        let keys = secret.session_keys(&mine, &theirs, &hello.encode());
        conn.secure(&keys, Role::Publisher);
        // The engine's READY comes right after the challenge.
        let Frame::Ready { address, .. } = conn.recv(deadline).unwrap() else {
            panic!("no READY")
        };
        conn.send(&hostile_windows::manifest_of_w("v2", true))
            .unwrap();
        let Frame::Want { base: Some(_), .. } = conn.recv(deadline).unwrap() else {
            panic!("no WANT with a base")
        };
        conn.send(&deltas(announced, sum)).unwrap();
        let Some(sent) = sent else {
            return drop(conn);
        };
        let pump = Pump::start("liar").unwrap();
        pump.connect(&address).unwrap();
        // SAFETY: `sent` outlives the pump (dropped first, below).
        unsafe { pump.send(delta_tag(0), sent.as_ptr(), sent.len()) }.unwrap();
        let _ = pump.next(deadline);
        let _ = conn.recv(deadline); // the engine's ERROR, or its hang-up
        drop(pump);
    })
}

/// An engine holding `v1` (from `model`), and a listener for a hostile
/// publisher, with its address.
fn engine_at_v1_and_a_listener(
    model: &Path,
    v1: &T,
) -> (
    Manager,
    Vec<(*mut u8, usize)>,
    std::net::TcpListener,
    String,
) {
    let m = engine(0);
    let p = register(&m, std::slice::from_ref(v1));
    m.update(UpdateRequest::snapshot(model)).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (m, p, listener, addr)
}

/// Over the network a delta's message shorter or longer than DELTAS
/// announced is refused naming the publisher; the old weights stay.
#[test]
fn a_network_delta_of_another_length_is_refused() {
    let Some(_one) = ucx_over_tcp() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (model, v1) = hostile_windows::first_version(dir.path());
    let (_, sum, good) = one_change(&v1);
    for (sent, want) in [
        (
            good[..3].to_vec(),
            "a delta of 3 bytes for request #0 announced as 4",
        ),
        ([good.as_slice(), &[0]].concat(), "a delta"),
    ] {
        let (m, p, listener, addr) = engine_at_v1_and_a_listener(&model, &v1);
        let liar = lying_delta_publisher(listener, (4, Some(sent), sum));
        let mut r = UpdateRequest::snapshot(&addr);
        (r.source, r.timeout) = (SourceKind::Rdma, Duration::from_secs(20));
        // Its manifest carries no checksums (the delta's own sum is checked).
        r.skip_network_checksums = true;
        let e = m.update(r).unwrap_err();
        assert!(
            e.message.contains(&format!("the publisher at {addr}")) && e.message.contains(want),
            "{e}"
        );
        liar.join().unwrap();
        assert_params(&p, std::slice::from_ref(&v1));
        assert_eq!(m.status().state, State::Normal);
    }
}

/// A network publisher that dies after announcing its deltas (no UCX
/// message comes): the engine notices on the connection within moments and
/// names it (it waited on the UCX worker until the update's deadline, 600 s
/// by default, and said TIMEOUT); the old weights stay.
#[test]
fn a_network_publisher_dying_while_deltas_are_due_is_named_at_once() {
    let Some(_one) = ucx_over_tcp() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (model, v1) = hostile_windows::first_version(dir.path());
    let (_, sum, _) = one_change(&v1);
    let (m, p, listener, addr) = engine_at_v1_and_a_listener(&model, &v1);
    let dying = lying_delta_publisher(listener, (4, None, sum));
    let mut r = UpdateRequest::snapshot(&addr);
    (r.source, r.timeout) = (SourceKind::Rdma, Duration::from_secs(30));
    r.skip_network_checksums = true;
    let t = Instant::now();
    let e = m.update(r).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "{:?}: {e}",
        t.elapsed()
    );
    assert_eq!(e.code, weight_manager_core::wm_result::WM_ERR_PEER, "{e}");
    assert!(
        e.message.contains(&format!("the publisher at {addr}")),
        "{e}"
    );
    dying.join().unwrap();
    assert_params(&p, std::slice::from_ref(&v1));
    assert_eq!(m.status().state, State::Normal);
}

/// An engine asking for keyed digests takes every run whole over rdma:
/// keyed digests authenticate bucket bytes, not deltas (an audit found the
/// deltas crossing unauthenticated, checked by XXH3 alone); the fallback
/// says NOT_APPLICABLE and every byte is the new version's.
#[test]
fn keyed_digests_take_every_run_whole() {
    let Some(_one) = ucx_over_tcp() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut trainer = Trainer::new(Via::Rdma, dir.path(), 1);
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        net: NetSettings {
            secret: Some(SECRET.to_vec()),
            keyed_digests: true,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let engines = [m];
    let mut ts = first();
    let ps = register(&engines[0], &ts);
    let whole: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    for v in 1..=2u64 {
        if v > 1 {
            ts = next(&ts, v);
        }
        trainer.publish(&ts, v);
        let (results, _) = trainer.update_all_served(&engines, || trainer.request());
        let stats = results.into_iter().next().unwrap().unwrap();
        assert_params(&ps, &ts);
        let d = &stats.deltas;
        assert_eq!(
            d.fallback,
            DeltaFallback::NotApplicable,
            "version {v}: {d:?}"
        );
        assert_eq!(
            (d.runs_delta, d.wire_bytes),
            (0, whole),
            "version {v}: {d:?}"
        );
    }
}
