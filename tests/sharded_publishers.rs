//! Several publishers, one per trainer rank, each holding row shards of
//! the global tensors, update one engine whose params are pieces of them:
//! a column TP piece, a fused QKV param, an expert range, and a whole
//! tensor. Publishers are in-process `Publisher`s on threads, over real
//! Unix sockets and shared memory (IPC) or real TCP and UCX (`UCX_TLS=tcp`,
//! rdma); the engine is this process's `Manager`, reading all publishers
//! at once. Every byte is checked against the global tensors, and what
//! each publisher sent against what it holds of the engine's pieces.

mod common;

use common::sharded::{serial, serving, Global};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::{Frame, Request, WantRun};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, UpdateRequest};
use weight_manager_core::{Mode, Progress};
use weight_manager_core::{Publisher, PublisherConfig, TensorDesc};

const SECRET: &str = "sharded-secret-0123456789";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Via {
    Ipc,
    Net,
}

/// The model: "w" [64, 48] (the engine takes columns 8..32), "q" [32, 48],
/// "k" and "v" [16, 48] (fused into one [64, 48] param), "experts"
/// [8, 16, 48] (the engine takes experts 3..6) and "b" [48] (whole, served
/// by the second publisher only).
fn model(seed: u8) -> Vec<Global> {
    vec![
        Global::new("w", &[64, 48], seed),
        Global::new("q", &[32, 48], seed),
        Global::new("k", &[16, 48], seed),
        Global::new("v", &[16, 48], seed),
        Global::new("experts", &[8, 16, 48], seed),
        Global::new("b", &[48], seed),
    ]
}

/// Publisher `r` of 2 serves the rows `r` half of every tensor but "b",
/// which only publisher 1 holds.
fn add_shards(p: &Publisher, r: u64, globals: &[Global]) {
    for g in globals {
        if g.name == "b" {
            if r == 1 {
                // SAFETY: `globals` outlives the serving.
                unsafe {
                    p.add(TensorDesc::host(
                        "b",
                        DType::F32,
                        &g.shape,
                        g.bytes.as_ptr(),
                        192,
                    ))
                }
                .unwrap();
            }
            continue;
        }
        // SAFETY: as above.
        unsafe { g.add_half_to(p, r) };
    }
}

/// The engine's params: their spec, and the bytes they must hold of
/// `globals`, each with the bytes that come from publisher 0 and 1.
fn engine_params(globals: &[Global]) -> Vec<(ParamSpec, Vec<u8>, [u64; 2])> {
    let g = |name: &str| globals.iter().find(|g| g.name == name).unwrap();
    let spec = |name: &str, shape: &[u64], pieces: Vec<Piece>| ParamSpec {
        pieces,
        ..ParamSpec::host(name, DType::F32, shape)
    };
    // (a) Columns 8..32 of "w": 96 bytes of each of 64 rows.
    let w = g("w");
    let cols: Vec<u8> = (0..64)
        .flat_map(|i| w.rows(i, i + 1)[32..128].to_vec())
        .collect();
    let a = spec(
        "w",
        &[64, 24],
        vec![Piece::narrow("w", &[64, 48], 1, 8, 24)],
    );
    // (b) q, k, v stacked by rows into "qkv".
    let at = |t: &str, shape: &[u64], row: u64| Piece {
        at: vec![row, 0],
        ..Piece::whole(t, shape)
    };
    let qkv: Vec<u8> = ["q", "k", "v"]
        .iter()
        .flat_map(|n| g(n).bytes.clone())
        .collect();
    let b = spec(
        "qkv",
        &[64, 48],
        vec![
            at("q", &[32, 48], 0),
            at("k", &[16, 48], 32),
            at("v", &[16, 48], 48),
        ],
    );
    // (c) Experts 3..6 of "experts": one from publisher 0, two from 1.
    let e = g("experts");
    let c = spec(
        "experts",
        &[3, 16, 48],
        vec![Piece::narrow("experts", &[8, 16, 48], 0, 3, 3)],
    );
    let halves = |n: u64| [n / 2, n / 2];
    vec![
        (a, cols, halves(64 * 96)),
        (b, qkv, halves(64 * 48 * 4)),
        (c, e.rows(3, 6).to_vec(), [e.row(), 2 * e.row()]),
        (spec("b", &[48], Vec::new()), g("b").bytes.clone(), [0, 192]),
    ]
}

fn engine() -> Manager {
    common::sharded::net_engine(SECRET)
}

/// Two publishers, serving `versions[r]` with `cfg(r)`.
fn publishers(
    dir: &Path,
    via: Via,
    versions: [&str; 2],
    globals: &[Global],
    cfg: impl Fn(u64) -> PublisherConfig,
) -> Vec<Publisher> {
    (0..2u64)
        .map(|r| {
            let p = match via {
                Via::Ipc => Publisher::bind(&dir.join(format!("p{r}.sock")), cfg(r)).unwrap(),
                Via::Net => {
                    std::env::set_var("UCX_TLS", "tcp");
                    let c = PublisherConfig {
                        secret: Some(SECRET.as_bytes().to_vec()),
                        ..cfg(r)
                    };
                    Publisher::bind_net("127.0.0.1:0", c).unwrap()
                }
            };
            add_shards(&p, r, globals);
            p.set_version(Some(versions[r as usize].to_string()));
            p
        })
        .collect()
}

fn small_buckets(_: u64) -> PublisherConfig {
    PublisherConfig {
        bucket_size: 4096,
        bucket_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

fn request<'h>(via: Via, ps: &[Publisher], mode: Mode) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(PathBuf::new());
    r.locations = ps.iter().map(|p| PathBuf::from(p.address())).collect();
    r.source = match via {
        Via::Ipc => SourceKind::Ipc,
        Via::Net => SourceKind::Rdma,
    };
    r.verify = true;
    r.mode = mode;
    r.timeout = Duration::from_secs(60);
    r
}

/// Register the params, library-owned; returns (address, length) of each.
fn register(m: &Manager, params: &[(ParamSpec, Vec<u8>, [u64; 2])]) -> Vec<(*mut u8, usize)> {
    params
        .iter()
        .map(|(s, ..)| m.allocate(s).unwrap())
        .collect()
}

fn assert_holds(ptrs: &[(*mut u8, usize)], params: &[(ParamSpec, Vec<u8>, [u64; 2])], what: &str) {
    for ((p, n), (spec, want, _)) in ptrs.iter().zip(params) {
        // SAFETY: library-owned params, nothing writes them now.
        let got = unsafe { std::slice::from_raw_parts(*p, *n) };
        assert!(got == &want[..], "{what}: param '{}' differs", spec.name);
    }
}

/// The engine's pieces, from both publishers at once: every byte right,
/// each publisher sent exactly what it holds of them (bytes moved / param
/// bytes = 1.00), in both modes, verified with slice checksums.
fn pieces_from_two_publishers(via: Via) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for (k, mode) in [Mode::Atomic, Mode::InPlace].into_iter().enumerate() {
        let globals = model(k as u8 + 1);
        let params = engine_params(&globals);
        let m = engine();
        let ptrs = register(&m, &params);
        let ps = publishers(dir.path(), via, ["v1", "v1"], &globals, small_buckets);
        let (r, served) = serving(&ps, || m.update(request(via, &ps, mode)));
        r.unwrap_or_else(|e| panic!("{via:?} {mode:?}: {e}"));
        assert_holds(&ptrs, &params, &format!("{via:?} {mode:?}"));
        let want: Vec<u64> = (0..2)
            .map(|r| params.iter().map(|p| p.2[r]).sum())
            .collect();
        let stats = m.status().last_update.unwrap();
        assert_eq!(stats.source_bytes, want, "{via:?} {mode:?}");
        let param_bytes: u64 = params.iter().map(|p| p.1.len() as u64).sum();
        assert_eq!(stats.bytes, param_bytes, "moved / param bytes = 1.00");
        for (r, s) in served.into_iter().enumerate() {
            let s = s.unwrap();
            assert_eq!(s.sessions[0].bytes, want[r], "{via:?}: publisher {r} sent");
        }
        drop(ps);
    }
}

#[test]
fn pieces_from_two_ipc_publishers_at_once() {
    pieces_from_two_publishers(Via::Ipc);
}

#[test]
fn pieces_from_two_network_publishers_at_once() {
    pieces_from_two_publishers(Via::Net);
}

/// Deltas from two publishers at once: both publish "v1" and then "v2"
/// (a few elements of every tensor changed); the engine, at "v1", pulls
/// "v2" as each run's changes from the publisher holding it: every byte
/// right, every run a delta, far fewer bytes on the wire. Then "v3" with
/// the publishers' shards swapped: whole, the base not kept.
fn deltas_from_two_publishers(via: Via) {
    if via == Via::Net && weight_manager_core::internals::transport::ucx::ucx().is_err() {
        println!("skipped: no UCX");
        return;
    }
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for mode in [Mode::Atomic, Mode::InPlace] {
        let v1 = model(7);
        let mut v2 = model(7);
        for g in &mut v2 {
            g.bytes.iter_mut().step_by(97).for_each(|b| *b ^= 0x40);
        }
        let m = engine();
        let ptrs = register(&m, &engine_params(&v1));
        let ps = publishers(dir.path(), via, ["v1", "v1"], &v1, small_buckets);
        for (r, p) in ps.iter().enumerate() {
            p.publish().unwrap();
            p.clear_tensors();
            add_shards(p, r as u64, &v2);
            p.set_version(Some("v2".into()));
            p.publish().unwrap();
        }
        let to = |version: &str| {
            let mut r = request(via, &ps, mode);
            r.version = Some(version.into());
            r.deltas = weight_manager_core::DeltaMode::On;
            r
        };
        serving(&ps, || m.update(to("v1"))).0.unwrap();
        assert_holds(&ptrs, &engine_params(&v1), "v1");
        let (r, _) = serving(&ps, || m.update(to("v2")));
        let stats = r.unwrap_or_else(|e| panic!("{via:?} {mode:?}: {e}"));
        assert_holds(&ptrs, &engine_params(&v2), &format!("{via:?} {mode:?}: v2"));
        let d = &stats.deltas;
        assert_eq!(
            d.fallback,
            weight_manager_core::DeltaFallback::None,
            "{d:?}"
        );
        assert_eq!((d.runs_delta, d.runs_whole), (stats.tensors, 0), "{d:?}");
        assert!(d.wire_bytes * 4 < stats.bytes, "{d:?} of {}", stats.bytes);
        // "v3": the publishers swap what they hold. Each keeps "v2", laid
        // out as it was: nothing there to diff the new layout's runs
        // against. Whole, the base not kept (not DIFFERS: the engine's
        // bytes are v2's).
        let v3 = model(9);
        for (r, p) in ps.iter().enumerate() {
            p.clear_tensors();
            add_shards(p, 1 - r as u64, &v3);
            p.set_version(Some("v3".into()));
            p.publish().unwrap();
        }
        let (r, _) = serving(&ps, || m.update(to("v3")));
        let stats = r.unwrap_or_else(|e| panic!("{via:?} {mode:?}: {e}"));
        assert_holds(&ptrs, &engine_params(&v3), &format!("{via:?} {mode:?}: v3"));
        let d = &stats.deltas;
        let not_kept = weight_manager_core::DeltaFallback::NotKept;
        assert_eq!((d.fallback, d.runs_delta), (not_kept, 0), "{d:?}");
        drop(ps);
    }
}

#[test]
fn deltas_from_two_ipc_publishers_at_once() {
    deltas_from_two_publishers(Via::Ipc);
}

#[test]
fn deltas_from_two_network_publishers_at_once() {
    deltas_from_two_publishers(Via::Net);
}

/// An engine updated to "v1" from two publishers (then gone): the manager,
/// its params' memory and their bytes.
type Held = (
    Manager,
    Vec<(*mut u8, usize)>,
    Vec<(ParamSpec, Vec<u8>, [u64; 2])>,
);

fn engine_at_v1(dir: &std::path::Path, via: Via) -> Held {
    let old = model(1);
    let params_old = engine_params(&old);
    let m = engine();
    let ptrs = register(&m, &params_old);
    let ps = publishers(dir, via, ["v1", "v1"], &old, small_buckets);
    serving(&ps, || m.update(request(via, &ps, Mode::Atomic)))
        .0
        .unwrap();
    drop(ps);
    (m, ptrs, params_old)
}

/// A publisher whose bytes are corrupted after it hashed them (the
/// test-only hook flips a bit of the tensor once packed) fails the update
/// with a checksum error naming the tensor; atomic, the old weights stay.
/// "w" is a column slice (the publisher's SUMS catch it); "k" lands whole
/// inside the fused "qkv" (the manifest's checksum does).
fn corrupted_slice_is_caught(via: Via) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (m, ptrs, params_old) = engine_at_v1(dir.path(), via);
    let new = model(2);
    for victim in ["w", "k"] {
        let corrupt = |r: u64| PublisherConfig {
            corrupt_tensor: (r == 1).then(|| victim.to_string()),
            ..small_buckets(r)
        };
        let ps = publishers(dir.path(), via, ["v2", "v2"], &new, corrupt);
        let (r, _) = serving(&ps, || m.update(request(via, &ps, Mode::Atomic)));
        let e = r.unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "{via:?}: {e}");
        // "w" moves in part (checked against the publisher's slice sum),
        // "k" whole into the fused param (against the manifest's).
        let named = match victim {
            "w" => "tensor 'w' (the part this rank takes)".to_string(),
            _ => format!("tensor '{victim}' from"),
        };
        assert!(
            e.message.contains(&named) && e.message.contains("source 1"),
            "{via:?}: {e}"
        );
        assert_holds(&ptrs, &params_old, "old weights kept");
        assert_eq!(m.status().version.as_deref(), Some("v1"));
        drop(ps);
    }
}

#[test]
fn a_corrupted_slice_over_ipc_fails_the_update_naming_the_tensor() {
    corrupted_slice_is_caught(Via::Ipc);
}

#[test]
fn a_corrupted_slice_over_the_network_fails_the_update_naming_the_tensor() {
    corrupted_slice_is_caught(Via::Net);
}

/// Publisher 1 stops (its connections shut) once bytes flow: the update
/// fails naming it, the old weights stay, and publisher 0 is told why.
fn a_publisher_dying_mid_update(via: Via) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (m, ptrs, params_old) = engine_at_v1(dir.path(), via);
    let new = model(2);
    let ps = publishers(dir.path(), via, ["v2", "v2"], &new, small_buckets);
    let victim = ps[1].address();
    let (r, served) = serving(&ps, || {
        let mut stopped = false;
        let mut hook = |_: &Progress| {
            if !stopped {
                ps[1].stop();
                stopped = true;
            }
            true
        };
        let mut req = request(via, &ps, Mode::Atomic);
        req.hooks.progress = Some(&mut hook);
        m.update(req)
    });
    let e = r.unwrap_err();
    assert!(
        e.message
            .contains(&format!("source 1 (the publisher at {victim})")),
        "{via:?}: {e}"
    );
    assert_holds(&ptrs, &params_old, "old weights kept");
    assert_eq!(m.status().version.as_deref(), Some("v1"));
    let told = served[0].as_ref().unwrap_err();
    assert!(
        told.message.contains("source 1"),
        "{via:?}: publisher 0 got {told}"
    );
    // The stopped publisher's serve names its stop, not the engine.
    let own = served[1].as_ref().unwrap_err();
    assert_eq!(own.code, wm_result::WM_ERR_CANCELLED, "{via:?}: {own}");
    assert!(own.message.contains("stopped"), "{via:?}: {own}");
}

#[test]
fn an_ipc_publisher_dying_mid_update_is_named_and_old_weights_kept() {
    a_publisher_dying_mid_update(Via::Ipc);
}

#[test]
fn a_network_publisher_dying_mid_update_is_named_and_old_weights_kept() {
    a_publisher_dying_mid_update(Via::Net);
}

/// Publishers serving different versions are refused before any byte
/// moves: neither sent a bucket.
#[test]
fn publishers_of_different_versions_are_refused_before_bytes_move() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for via in [Via::Ipc, Via::Net] {
        let globals = model(3);
        let params = engine_params(&globals);
        let m = engine();
        register(&m, &params);
        let ps = publishers(dir.path(), via, ["v1", "v2"], &globals, small_buckets);
        let (r, served) = serving(&ps, || m.update(request(via, &ps, Mode::Atomic)));
        let e = r.unwrap_err();
        assert!(
            e.message.contains("different versions") && e.message.contains("'v2'"),
            "{via:?}: {e}"
        );
        for s in served {
            // The engine hung up after the manifests: no session got a WANT.
            assert!(
                s.is_err_and(|e| !e.message.contains("WANT request")),
                "{via:?}"
            );
        }
        drop(ps);
    }
}

/// A hand-written engine sends WANTs no real engine would: each is
/// answered with an ERROR frame naming the problem, and nothing is packed.
#[test]
fn a_bad_want_gets_an_error_naming_the_problem() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let globals = model(4);
    let run = |offset, len, rows, stride| WantRun {
        offset,
        len,
        rows,
        stride,
    };
    // Tensor 0 of publisher 0 is its half of "w": 32 rows of 192 bytes.
    let cases: Vec<(Vec<Request>, &str)> = vec![
        (vec![Request::whole(99, 8, false)], "request #0: names tensor #99"),
        (
            vec![
                Request::whole(0, 6144, false),
                Request {
                    tensor: 0,
                    runs: vec![run(100, 96, 32, 192)],
                    sums: true,
                },
            ],
            "request #1: run 0 (32 rows of 96 bytes from byte 100, stride 192) runs past the 6144 bytes",
        ),
        (
            vec![Request {
                tensor: 0,
                runs: vec![run(0, 8, 2, 4)],
                sums: false,
            }],
            "stride 4",
        ),
        (
            vec![Request {
                tensor: 0,
                runs: vec![run(u64::MAX - 4, 8, 1, 8)],
                sums: false,
            }],
            "runs past",
        ),
        (
            vec![Request {
                tensor: 0,
                runs: vec![run(0, 6144, 1, 6144), run(0, 6144, 1, 6144)],
                sums: false,
            }],
            "12288 bytes asked of the 6144 bytes",
        ),
    ];
    for (requests, want) in cases {
        let ps = publishers(dir.path(), Via::Ipc, ["v1", "v1"], &globals, small_buckets);
        let sock = ps[0].address();
        let ((), served) = serving(&ps[..1], || {
            let stream = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            let mut conn = Conn::new(stream, "the publisher");
            let deadline = Instant::now() + Duration::from_secs(10);
            conn.send(&Frame::Hello {
                rank: 0,
                world_size: 1,
                gpu_id: "0".into(),
                version: String::new(),
                base: String::new(),
            })
            .unwrap();
            assert!(matches!(
                conn.recv(deadline).unwrap(),
                Frame::Manifest { .. }
            ));
            conn.send(&Frame::Want {
                requests,
                base: None,
                quant: vec![],
            })
            .unwrap();
            let e = conn.recv(deadline).unwrap_err();
            assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
            assert!(e.message.contains(want), "{want}: {e}");
        });
        let e = served[0].as_ref().unwrap_err();
        assert!(e.message.contains(want), "the publisher's own error: {e}");
        drop(ps);
    }
}
