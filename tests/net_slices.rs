//! Strided slices over the network: two publishers (trainer ranks, each
//! holding the row half of every global tensor) serve one engine rank its
//! TP pieces over real TCP and UCX (`UCX_TLS=tcp`): column splits of small
//! and large rows, a fused gate_up param (two column slices side by side),
//! a column slice of stacked experts, and a QKV param of whole tensors.
//! Small blocks travel packed, several to a UCX message (direct: 4 KiB
//! blocks scattered by UCX straight into the param, smaller ones through a
//! bounce buffer); every byte of
//! every param is checked against the global tensors, staged and direct,
//! atomic and in place, verified. A hand-written publisher that lies about
//! a packed message's length is named.

mod common;

use common::sharded::{piece, Global, F32};
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weight_manager_core::internals::transport::auth::{self, Secret};
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::transport::seal::Role;
use weight_manager_core::internals::transport::ucx::Pump;
use weight_manager_core::internals::wire::{message_tag, split_entries, BucketEntry, Frame};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::SourceKind;
use weight_manager_core::TensorBox;
use weight_manager_core::TensorMeta;
use weight_manager_core::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig, ServeStats};

const SECRET: &str = "net-slices-secret-0123456789";

/// Tests here share UCX (one environment per process): one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    std::env::set_var("UCX_TLS", "tcp");
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn model(seed: u8) -> Vec<Global> {
    vec![
        // 256-byte blocks: packed.
        Global::new("a", &[256, 256], seed),
        // 80 KiB blocks: each its own message, straight into the param.
        Global::new("b", &[16, 40960], seed),
        // 4 KiB blocks: packed, and (direct) scattered by UCX into the
        // param's rows.
        Global::new("c", &[64, 2048], seed),
        Global::new("gate", &[128, 128], seed),
        Global::new("up", &[128, 128], seed),
        Global::new("experts", &[8, 32, 64], seed),
        Global::new("q", &[64, 64], seed),
        Global::new("k", &[32, 64], seed),
        Global::new("v", &[32, 64], seed),
    ]
}

/// The engine rank's params: the TP half of each.
fn specs() -> Vec<ParamSpec> {
    let spec = |name: &str, shape: &[u64], pieces: Vec<Piece>| ParamSpec {
        pieces,
        ..ParamSpec::host(name, DType::F32, shape)
    };
    vec![
        spec(
            "a",
            &[256, 64],
            vec![Piece::narrow("a", &[256, 256], 1, 64, 64)],
        ),
        spec(
            "b",
            &[16, 20480],
            vec![Piece::narrow("b", &[16, 40960], 1, 0, 20480)],
        ),
        // Gate and up columns 64..128 side by side.
        spec(
            "c",
            &[64, 1024],
            vec![Piece::narrow("c", &[64, 2048], 1, 1024, 1024)],
        ),
        spec(
            "gate_up",
            &[128, 128],
            vec![
                piece("gate", &[0, 64], &[128, 64], &[0, 0]),
                piece("up", &[0, 64], &[128, 64], &[0, 64]),
            ],
        ),
        // Experts 2..6, the second half of their last dimension.
        spec(
            "experts",
            &[4, 32, 32],
            vec![piece("experts", &[2, 0, 32], &[4, 32, 32], &[0, 0, 0])],
        ),
        spec(
            "qkv",
            &[128, 64],
            vec![
                piece("q", &[0, 0], &[64, 64], &[0, 0]),
                piece("k", &[0, 0], &[32, 64], &[64, 0]),
                piece("v", &[0, 0], &[32, 64], &[96, 0]),
            ],
        ),
    ]
}

/// Row-major strides (in elements) of `shape`.
fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Call `f(global element, param element, elements)` for each innermost
/// row of `b` (a box of `global`'s tensor), placed at `at` + (its offset -
/// `origin`) in a param of `param`'s shape.
fn rows_of(
    b: &TensorBox,
    global: &[u64],
    origin: &[u64],
    at: &[u64],
    param: &[u64],
    mut f: impl FnMut(u64, u64, u64),
) {
    let (gs, ps) = (strides(global), strides(param));
    let outer: u64 = b.len[..b.len.len() - 1].iter().product();
    for i in 0..outer {
        let (mut rest, mut g, mut p) = (i, 0, 0);
        for d in (0..b.len.len()).rev() {
            let idx = if d + 1 == b.len.len() {
                0
            } else {
                let x = rest % b.len[d];
                rest /= b.len[d];
                x
            };
            g += (b.offset[d] + idx) * gs[d];
            p += (at[d] + b.offset[d] - origin[d] + idx) * ps[d];
        }
        f(g, p, *b.len.last().unwrap());
    }
}

/// What each param must hold of `globals`.
fn expected(globals: &[Global], specs: &[ParamSpec]) -> Vec<Vec<u8>> {
    specs
        .iter()
        .map(|s| {
            let mut out = vec![0u8; (s.shape.iter().product::<u64>() * F32) as usize];
            for pc in &s.pieces {
                let g = globals.iter().find(|g| g.name == pc.tensor).unwrap();
                rows_of(
                    &pc.global,
                    &g.shape,
                    &pc.global.offset,
                    &pc.at,
                    &s.shape,
                    |gi, pi, n| {
                        let (gi, pi, n) =
                            ((gi * F32) as usize, (pi * F32) as usize, (n * F32) as usize);
                        out[pi..pi + n].copy_from_slice(&g.bytes[gi..gi + n]);
                    },
                );
            }
            out
        })
        .collect()
}

/// Contiguous blocks of its tensor that publisher `r` holds of the
/// engine's pieces: what one message per block would have sent.
fn blocks(globals: &[Global], specs: &[ParamSpec], r: u64) -> u64 {
    let mut n = 0;
    for pc in specs.iter().flat_map(|s| &s.pieces) {
        let g = globals.iter().find(|g| g.name == pc.tensor).unwrap();
        let Some(b) = pc.global.intersect(&g.half(r)) else {
            continue;
        };
        let half = g.half(r);
        // Dimensions after `k` are whole in the shard: a block spans them.
        let k = (0..b.len.len())
            .rev()
            .find(|&d| b.len[d] != half.len[d])
            .unwrap_or(0);
        n += b.len[..k].iter().product::<u64>();
    }
    n
}

/// Two network publishers: publisher `r` holds the row half `r` of every
/// global tensor (publisher 1 as a published copy, 0 live).
fn publishers(globals: &[Global], version: &str) -> Vec<Publisher> {
    (0..2u64)
        .map(|r| {
            let cfg = PublisherConfig {
                secret: Some(SECRET.as_bytes().to_vec()),
                bucket_timeout: Duration::from_secs(10),
                ..Default::default()
            };
            let p = Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
            for g in globals {
                // SAFETY: `globals` outlives the serving.
                unsafe { g.add_half_to(&p, r) };
            }
            p.set_version(Some(version.into()));
            if r == 1 {
                p.publish().unwrap();
            }
            p
        })
        .collect()
}

/// `keyed`: each message checked against a keyed digest too.
fn engine(staged: bool, keyed: bool) -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        net: NetSettings {
            secret: Some(SECRET.as_bytes().to_vec()),
            // Requests cross bucket edges: packed messages start and end
            // inside blocks.
            bucket_size: 192 << 10,
            staged,
            keyed_digests: keyed,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

fn request<'h>(addresses: &[String], mode: Mode) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(PathBuf::new());
    r.locations = addresses.iter().map(PathBuf::from).collect();
    r.source = SourceKind::Rdma;
    r.verify = true;
    r.mode = mode;
    r.timeout = Duration::from_secs(60);
    r
}

/// Update `m` from `ps`, each serving one engine.
fn update(
    m: &Manager,
    ps: &[Publisher],
    mode: Mode,
) -> (weight_manager_core::Result<String>, Vec<ServeStats>) {
    let addresses: Vec<String> = ps.iter().map(Publisher::address).collect();
    std::thread::scope(|s| {
        let serves: Vec<_> = ps
            .iter()
            .map(|p| s.spawn(move || p.serve(1, Duration::from_secs(30))))
            .collect();
        let r = m.update(request(&addresses, mode)).map(|u| u.version);
        let served = serves
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        (r, served)
    })
}

fn holds(ptrs: &[(*mut u8, usize)], want: &[Vec<u8>], specs: &[ParamSpec], what: &str) {
    for (((p, n), w), s) in ptrs.iter().zip(want).zip(specs) {
        // SAFETY: library-owned params, nothing writes them now.
        let got = unsafe { std::slice::from_raw_parts(*p, *n) };
        let bad = got.iter().zip(w).position(|(a, b)| a != b);
        assert!(
            bad.is_none(),
            "{what}: param '{}' differs from byte {bad:?}",
            s.name
        );
    }
}

/// Staged and direct (with keyed digests too), atomic and in place, a new
/// version each time, verified with slice sums: every byte of every param
/// right, and each publisher sent its blocks in fewer
/// messages than blocks (the small ones packed).
#[test]
fn column_splits_and_fused_params_from_two_publishers_staged_and_direct() {
    let _serial = serial();
    let specs = specs();
    let mut seed = 1;
    for (staged, keyed) in [(false, false), (true, false), (false, true)] {
        let m = engine(staged, keyed);
        let ptrs: Vec<_> = specs.iter().map(|s| m.allocate(s).unwrap()).collect();
        for mode in [Mode::Atomic, Mode::InPlace] {
            let what = format!("staged {staged}, keyed {keyed}, {mode:?}");
            let globals = model(seed);
            seed += 1;
            let ps = publishers(&globals, &format!("v{seed}"));
            let (r, served) = update(&m, &ps, mode);
            assert_eq!(
                r.unwrap_or_else(|e| panic!("{what}: {e}")),
                format!("v{seed}")
            );
            holds(&ptrs, &expected(&globals, &specs), &specs, &what);
            for (r, s) in served.iter().enumerate() {
                let (sent, blocks) = (s.sessions[0].messages, blocks(&globals, &specs, r as u64));
                // "a": 128 blocks of 256 bytes (32 KiB), "gate_up" 2 x 64 of
                // 256, "experts" 64 of 128, "c" 32 of 4 KiB: a few messages
                // each; "b": 8 blocks of 80 KiB, one message each.
                assert!(blocks > 300, "{what}: publisher {r}: {blocks} blocks");
                assert!(
                    sent <= 30,
                    "{what}: publisher {r} sent {sent} messages for {blocks} blocks"
                );
            }
            drop(ps);
        }
    }
}

/// What a lying publisher sends once its message is out.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// Nothing: it waits for the engine's ERROR or hang-up.
    Wait,
    /// END, without the SUMS its bucket owes.
    End,
    /// SUMS of bucket 3, which it never sent.
    StraySums,
}

/// A hostile network publisher of global tensor `g`: real handshake and
/// sealed frames, then one bucket of one packed entry (every block the
/// engine asks of `g`, 64 KiB in all), whose UCX message is `sent` bytes
/// (64 KiB: the truth), then `then`.
fn lying_publisher(
    listener: TcpListener,
    g: Global,
    sent: usize,
    then: Then,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        let hello = conn.recv(deadline).unwrap();
        let secret = Secret::resolve(Some(SECRET.as_bytes())).unwrap();
        let mine = auth::nonce().unwrap();
        conn.send(&Frame::Challenge { nonce: mine }).unwrap();
        let Frame::Proof { nonce: theirs, .. } = conn.recv(deadline).unwrap() else {
            panic!("no PROOF")
        };
        conn.send(&Frame::Proof {
            mac: secret.publisher_proof(&theirs, &mine),
            nonce: [0; 32],
        })
        .unwrap();
        conn.secure(
            &secret.session_keys(&mine, &theirs, &hello.encode()),
            Role::Publisher,
        );
        // The engine's READY comes right after the challenge.
        let Frame::Ready { address, .. } = conn.recv(deadline).unwrap() else {
            panic!("no READY")
        };
        let tensors = vec![TensorMeta {
            name: g.name.into(),
            dtype: DType::F32,
            shape: g.shape.clone(),
            nbytes: g.bytes.len() as u64,
            checksum: None,
            placement: None,
        }];
        conn.send(&Frame::Manifest {
            version: "lie".into(),
            tensors,
            base_kept: false,
        })
        .unwrap();
        let want = conn.recv(deadline).unwrap();
        common::decline_base(&mut conn, &want).unwrap();
        let Frame::Want { requests, .. } = want else {
            panic!("no WANT")
        };
        let whole = BucketEntry {
            request: 0,
            offset: 0,
            len: requests[0].bytes(),
            buffer_offset: 0,
        };
        let entries = split_entries(&[whole], &requests);
        assert_eq!(entries.len(), 1, "one packed message");
        conn.send(&Frame::Bucket {
            seq: 0,
            buffer: 0,
            entries,
        })
        .unwrap();
        let pump = Pump::start("liar").unwrap();
        pump.connect(&address).unwrap();
        // SAFETY: `g` outlives the pump (dropped first, below).
        unsafe {
            pump.send(message_tag(0, 0), g.bytes.as_ptr(), sent)
                .unwrap()
        };
        let _ = pump.next(deadline);
        let _ = match then {
            Then::Wait => Ok(()),
            Then::End => conn.send(&Frame::End { buckets: 1 }),
            Then::StraySums => conn.send(&Frame::Sums {
                seq: 3,
                sums: vec![(0, 1)],
            }),
        };
        let _ = conn.recv(deadline); // the engine's ERROR, or its hang-up
        drop(pump);
    })
}

/// A packed message shorter or longer than its entry announces fails the
/// update naming the publisher, the bucket and the entry; the old weights
/// stay. Staged and direct; direct, 256-byte blocks land in a bounce
/// buffer and 4 KiB ones are scattered by UCX straight into the param's
/// rows (atomic: its shadow).
#[test]
fn a_publisher_lying_about_a_packed_messages_length_is_named() {
    let _serial = serial();
    // Columns 64..128 of "a" (256-byte blocks); 1024..2048 of "c" (4 KiB).
    let small = || (Global::new("a", &[256, 256], 1), specs()[0].clone());
    let large = || {
        let spec = ParamSpec {
            pieces: vec![Piece::narrow("c", &[16, 2048], 1, 1024, 1024)],
            ..ParamSpec::host("c", DType::F32, &[16, 1024])
        };
        (Global::new("c", &[16, 2048], 1), spec)
    };
    let cases = [(false, -256i64), (true, -256), (false, 256), (true, 256)];
    for ((staged, delta), tensor) in cases
        .into_iter()
        .flat_map(|c| [(c, small as fn() -> (Global, ParamSpec)), (c, large)])
    {
        let (g, spec) = tensor();
        let m = engine(staged, false);
        let (p, n) = m.allocate(&spec).unwrap();
        // SAFETY: library-owned, nothing else writes it.
        unsafe { std::ptr::write_bytes(p, 0x5a, n) };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let liar = lying_publisher(listener, g, (65536 + delta) as usize, Then::Wait);
        let mut req = request(std::slice::from_ref(&addr), Mode::Atomic);
        // The liar sends no slice sums.
        (req.verify, req.skip_network_checksums) = (false, true);
        req.timeout = Duration::from_secs(20);
        let e = m.update(req).unwrap_err();
        let what = format!("'{}', staged {staged}, {delta:+} bytes", spec.name);
        assert_eq!(e.code, wm_result::WM_ERR_PEER, "{what}: {e}");
        assert!(
            e.message.contains(&format!("the publisher at {addr}"))
                && e.message.contains("bucket 0 entry 0"),
            "{what}: {e}"
        );
        liar.join().unwrap();
        // SAFETY: as above.
        assert!(
            unsafe { std::slice::from_raw_parts(p, n) }
                .iter()
                .all(|&b| b == 0x5a),
            "{what}"
        );
    }
}

/// Over the network a bucket's SUMS follows its messages, and the entry
/// completing a part waits for it: a publisher that ends without the SUMS
/// it owes or sends SUMS of a bucket not in flight fails the update
/// naming it; one that never sends it, at the update's timeout. The old
/// weights stay.
#[test]
fn a_publisher_withholding_or_misplacing_slice_sums_is_named() {
    let _serial = serial();
    let cases = [
        (
            Then::End,
            wm_result::WM_ERR_PEER,
            "END before the SUMS of bucket 0",
        ),
        (
            Then::StraySums,
            wm_result::WM_ERR_PEER,
            "SUMS of bucket 3, which is not in flight",
        ),
        (
            Then::Wait,
            wm_result::WM_ERR_TIMEOUT,
            "did not finish within 3s",
        ),
    ];
    for (then, code, want) in cases {
        let g = Global::new("a", &[256, 256], 1);
        let spec = specs()[0].clone();
        let m = engine(false, false);
        let (p, n) = m.allocate(&spec).unwrap();
        // SAFETY: library-owned, nothing else writes it.
        unsafe { std::ptr::write_bytes(p, 0x5a, n) };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let liar = lying_publisher(listener, g, 65536, then);
        let mut req = request(std::slice::from_ref(&addr), Mode::Atomic);
        req.timeout = Duration::from_secs(3);
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, code, "{then:?}: {e}");
        // Every case names the publisher (the update's timeout too: it
        // said "update did not finish within 3s" alone).
        let named = e.message.contains(&addr);
        assert!(named && e.message.contains(want), "{then:?}: {e}");
        liar.join().unwrap();
        // SAFETY: as above.
        let param = unsafe { std::slice::from_raw_parts(p, n) };
        assert!(param.iter().all(|&b| b == 0x5a), "{then:?}");
    }
}

/// `wm bench shard --section ucx`, small: two trainer and two engine-rank
/// processes over UCX, each pattern's figures beside its raw UCX floor
/// (column halves: the same 4 KiB blocks, and contiguous ranges), and the
/// column halves' 4 KiB blocks packed into 1 MiB messages.
#[test]
fn bench_shard_ucx_prints_each_pattern_beside_its_floor() {
    let out = std::process::Command::new(&*common::WM)
        .args(["bench", "shard", "--section", "ucx", "--quick"])
        .args(["--gib", "0.0625", "--runs", "1", "--bucket-mib", "16"])
        .env("UCX_TLS", "tcp")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "row halves: raw UCX floor, 2 pairs at once",
        "row halves, verified, aggregate of 2 ranks",
        "column halves: raw UCX floor, 4 pairs at once",
        "in flight, 4 KiB blocks gathered or packed",
        "in flight, contiguous ranges",
        "column halves, unverified, aggregate of 2 ranks",
        "column halves, verified, beside contiguous ranges",
        // 64 MiB: a quarter to each session, 4 KiB blocks, 1 MiB messages.
        "a column-halves session sent 16 UCX messages for 4096 blocks of 4 KiB",
    ] {
        assert!(text.contains(want), "want '{want}' in: {text}");
    }
}
