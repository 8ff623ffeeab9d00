//! The network paths (rdma, gdr) over a real UCX on loopback (`UCX_TLS=tcp`):
//! publishers are `wm serve --net` processes or an in-process Publisher;
//! engines are `wm pull --net` processes or this test process (a Manager).

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Logger;
use weight_manager_core::Mode;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, NetSettings, UpdateRequest};
use weight_manager_core::{Publisher, PublisherConfig};

use common::WM;
const SECRET: &str = "test-secret-0123456789";

/// UCX reads its environment once per process: pin TCP before first use.
fn tcp_only() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("UCX_TLS", "tcp"));
}

/// A logger that keeps every line, for checking what was logged.
fn capture() -> (Logger, std::sync::Arc<parking_lot::Mutex<Vec<String>>>) {
    let lines = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let sink = lines.clone();
    let log = Logger::closure(weight_manager_core::LogLevel::Warn, move |_, m| {
        sink.lock().push(m.to_string())
    });
    (log, lines)
}

fn manager(secret: &str, bucket_size: usize, logger: Logger) -> Manager {
    receiving_manager(secret, bucket_size, logger, false)
}

/// `staged`: through staging slots rather than straight into the params.
fn receiving_manager(secret: &str, bucket_size: usize, logger: Logger, staged: bool) -> Manager {
    tcp_only();
    Manager::new(ManagerConfig {
        fallback_dir: None,
        logger,
        net: NetSettings {
            secret: Some(secret.as_bytes().to_vec()),
            bucket_size,
            staged,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

fn rdma<'h>(addr: &str) -> UpdateRequest<'h> {
    let mut r = UpdateRequest::snapshot(addr);
    r.source = SourceKind::Rdma;
    r.timeout = Duration::from_secs(30);
    r
}

fn publisher(secret: &str, logger: Logger) -> Publisher {
    tcp_only();
    Publisher::bind_net(
        "127.0.0.1:0",
        PublisherConfig {
            secret: Some(secret.as_bytes().to_vec()),
            bucket_timeout: Duration::from_secs(10),
            logger,
            ..Default::default()
        },
    )
    .unwrap()
}

fn wm(args: &[&str]) -> Command {
    let mut c = Command::new(&*WM);
    c.args(args)
        .env("UCX_TLS", "tcp")
        .env("WM_NET_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Start `wm serve --net` and read the address it bound from its stdout.
/// The caller waits for the child it gets back.
#[expect(
    clippy::zombie_processes,
    reason = "the child is handed to the caller, which waits for it"
)]
fn serve(args: &[&str]) -> (Child, String, BufReader<ChildStdout>) {
    let mut c = wm(&[&["serve", "--net", "127.0.0.1:0"], args].concat())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let _ = c.kill();
            let _ = c.wait();
            panic!("wm serve exited before listening");
        }
        if let Some(rest) = line.trim().strip_prefix("wm serve: listening on ") {
            let addr = rest.split(',').next().unwrap().to_string();
            return (c, addr, out);
        }
    }
}

fn four_rank_snapshot(dir: &Path, seed: u8, step: &str) {
    std::fs::create_dir_all(dir).unwrap();
    for r in 0..4u32 {
        let mut shard: Vec<T> = model(seed + r as u8);
        shard.push(tensor("big", DType::F32, &[5000], seed)); // split over 4 KiB buckets
        write_safetensors(
            &dir.join(format!("model_state.tp{r}.0.safetensors")),
            &shard,
        );
    }
    write_version(dir, step);
}

#[test]
fn one_publisher_four_ranks_two_versions_back_to_back() {
    let dir = tempfile::tempdir().unwrap();
    let (d1, d2) = (dir.path().join("v1"), dir.path().join("v2"));
    four_rank_snapshot(&d1, 10, "100");
    four_rank_snapshot(&d2, 20, "200");
    let (publisher, addr, _out) =
        serve(&[d1.to_str().unwrap(), d2.to_str().unwrap(), "--engines", "8"]);
    for (d, version) in [(&d1, "100"), (&d2, "latest")] {
        // Odd ranks receive through staging slots, even ones directly.
        let engines: Vec<Child> = (0..4)
            .map(|r| {
                let staged = if r % 2 == 1 { "true" } else { "false" };
                wm(&[
                    "pull",
                    "--net",
                    &addr,
                    "--rank",
                    &r.to_string(),
                    "--world",
                    "4",
                    "--check",
                    d.to_str().unwrap(),
                    "--version",
                    version,
                    "--bucket-bytes",
                    "4096",
                    "--depth",
                    "3",
                    "--staged",
                    staged,
                ])
                .spawn()
                .unwrap()
            })
            .collect();
        for (r, e) in engines.into_iter().enumerate() {
            let (ok, text) = output(e);
            assert!(
                ok && text.contains("equal to the snapshot"),
                "rank {r}, version {version}: {text}"
            );
            let want = if version == "latest" { "200" } else { version };
            assert!(text.contains(&format!("version {want},")), "{text}");
        }
    }
    let (ok, text) = output(publisher);
    assert!(ok, "{text}");
}

#[test]
fn a_missing_version_is_not_found_and_names_what_is_served() {
    let p = publisher(SECRET, Logger::default());
    let ts = model(3);
    add_all(&p, &ts);
    p.set_version(Some("7".into()));
    assert_eq!(p.publish().unwrap(), "7");
    let addr = p.address();
    let m = manager(SECRET, 1 << 20, Logger::default());
    let ptrs = register(&m, &ts);
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(2, Duration::from_secs(20)));
        let mut req = rdma(&addr);
        req.version = Some("9".into());
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_NOT_FOUND, "{e}");
        assert!(
            e.message.contains("asked for version '9'") && e.message.contains("'7'"),
            "{e}"
        );
        // The same publisher still serves the version it has.
        m.update(rdma(&addr)).unwrap();
        assert!(serving.join().unwrap().is_err());
    });
    assert_params(&ptrs, &ts);
    assert_eq!(m.status().version.as_deref(), Some("7"));
}

/// Live tensors are hashed once per serve call: the sessions of one call
/// share the sums (the tensors are unchanged while it runs), the next call
/// hashes again, and every engine still verifies what it got.
#[test]
fn live_tensors_are_hashed_once_per_serve_call() {
    let p = publisher(SECRET, Logger::default());
    let mut ts = model(6);
    add_all(&p, &ts);
    p.set_version(Some("6".into()));
    let total: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    let m = manager(SECRET, 4096, Logger::default());
    let ptrs = register(&m, &ts);
    let addr = p.address();
    let hashed = |engines: usize| {
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(engines, Duration::from_secs(20)));
            for _ in 0..engines {
                m.update(rdma(&addr)).unwrap();
            }
            let mut h: Vec<u64> = serving
                .join()
                .unwrap()
                .unwrap()
                .sessions
                .iter()
                .map(|s| s.hashed)
                .collect();
            h.sort();
            h
        })
    };
    assert_eq!(hashed(2), vec![0, total]);
    assert_params(&ptrs, &ts);
    // Changed between calls: the next call hashes the new bytes.
    for t in &mut ts {
        t.data.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    }
    assert_eq!(hashed(1), vec![total]);
    assert_params(&ptrs, &ts);
}

#[test]
fn published_versions_are_copies_and_only_the_last_k_are_kept() {
    let p = publisher(SECRET, Logger::default());
    let mut ts = model(4);
    add_all(&p, &ts);
    for v in ["1", "2", "3"] {
        p.set_version(Some(v.into()));
        p.publish().unwrap();
    }
    assert_eq!(p.versions(), vec!["2", "3"], "keep_versions defaults to 2");
    // The trainer overwrites its tensors: the published copy is what is served.
    let want = ts.clone();
    for t in &mut ts {
        t.data.iter_mut().for_each(|b| *b = !*b);
    }
    let m = manager(SECRET, 1 << 20, Logger::default());
    let ptrs = register(&m, &want);
    let addr = p.address();
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        let mut req = rdma(&addr);
        req.version = Some("2".into());
        assert_eq!(m.update(req).unwrap().version, "2");
        serving.join().unwrap().unwrap();
    });
    assert_params(&ptrs, &want);
}

#[test]
fn a_wrong_secret_is_refused_and_logged_on_both_sides() {
    let (pub_log, pub_lines) = capture();
    let (eng_log, eng_lines) = capture();
    let p = publisher(SECRET, pub_log);
    let ts = model(5);
    add_all(&p, &ts);
    p.set_version(Some("5".into()));
    let m = manager("another-secret-0123456789", 1 << 20, eng_log);
    let ptrs = register(&m, &ts);
    let before: Vec<Vec<u8>> = ptrs
        .iter()
        .map(|(p, n)| unsafe { std::slice::from_raw_parts(*p, *n) }.to_vec())
        .collect();
    let addr = p.address();
    std::thread::scope(|s| {
        // The refused engine does not count as the one served: the
        // publisher times out waiting for a real one, and says why.
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(5)));
        let e = m.update(rdma(&addr)).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_AUTH, "{e}");
        let pe = serving.join().unwrap().unwrap_err();
        assert_eq!(pe.code, wm_result::WM_ERR_TIMEOUT, "{pe}");
        assert!(
            pe.message.contains("0 of 1 engine(s)") && pe.message.contains("authentication failed"),
            "{pe}"
        );
    });
    let logged = |lines: &std::sync::Arc<parking_lot::Mutex<Vec<String>>>| {
        lines
            .lock()
            .iter()
            .any(|l| l.contains("authentication failed"))
    };
    assert!(logged(&pub_lines), "publisher log: {:?}", pub_lines.lock());
    assert!(logged(&eng_lines), "engine log: {:?}", eng_lines.lock());
    for ((p, n), b) in ptrs.iter().zip(&before) {
        assert_eq!(unsafe { std::slice::from_raw_parts(*p, *n) }, &b[..]);
    }
    // No secret at all: refused before connecting, naming what to set.
    let e = Manager::new(ManagerConfig::default())
        .unwrap()
        .update(rdma(&addr))
        .unwrap_err();
    if std::env::var_os("WM_NET_SECRET").is_none() {
        assert_eq!(e.code, wm_result::WM_ERR_AUTH, "{e}");
        assert!(e.message.contains("WM_NET_SECRET"), "{e}");
    }
}

#[test]
fn corrupted_bytes_are_caught_and_old_weights_kept() {
    corrupted_bytes_caught(false);
}

#[test]
fn corrupted_bytes_are_caught_when_staged_too() {
    corrupted_bytes_caught(true);
}

fn corrupted_bytes_caught(staged: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (d1, d2) = (dir.path().join("v1"), dir.path().join("v2"));
    for (d, seed, step) in [(&d1, 1u8, "1"), (&d2, 2u8, "2")] {
        std::fs::create_dir(d).unwrap();
        write_safetensors(&d.join("model.safetensors"), &model(seed));
        write_version(d, step);
    }
    let v1 = model(1);
    let m = receiving_manager(SECRET, 4096, Logger::default(), staged);
    let ptrs = register(&m, &v1);
    let (first, addr, _o) = serve(&[d1.to_str().unwrap()]);
    m.update(rdma(&addr)).unwrap();
    assert!(output(first).0);
    let (second, addr, _o) = serve(&[d2.to_str().unwrap(), "--corrupt", "layer0.norm"]);
    let e = m.update(rdma(&addr)).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "{e}");
    assert!(e.message.contains("'layer0.norm'"), "{e}");
    let (ok, text) = output(second);
    assert!(
        !ok && text.contains("checksum"),
        "the publisher hears why: {text}"
    );
    assert_params(&ptrs, &v1);
    assert_eq!(m.status().version.as_deref(), Some("1"));
}

/// Big enough for many 1 MiB buckets.
fn big_model(seed: u8) -> Vec<T> {
    (0..16)
        .map(|i| tensor(&format!("layers.{i}"), DType::F32, &[1 << 18], seed))
        .collect()
}

/// `big_model(2)` as version 2 in `dir/v2`, for a `wm serve` to publish.
fn big_version_2(dir: &Path) -> std::path::PathBuf {
    let d2 = dir.join("v2");
    std::fs::create_dir(&d2).unwrap();
    write_safetensors(&d2.join("model.safetensors"), &big_model(2));
    write_version(&d2, "2");
    d2
}

#[test]
fn publisher_killed_mid_stream_is_noticed_at_once_and_old_weights_kept() {
    let dir = tempfile::tempdir().unwrap();
    let d2 = big_version_2(dir.path());
    let v1 = big_model(1);
    let p = publisher(SECRET, Logger::default());
    add_all(&p, &v1);
    p.set_version(Some("1".into()));
    let m = manager(SECRET, 1 << 20, Logger::default());
    let ptrs = register(&m, &v1);
    let addr = p.address();
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        m.update(rdma(&addr)).unwrap();
        serving.join().unwrap().unwrap();
    });
    let (mut second, addr, _o) = serve(&[d2.to_str().unwrap()]);
    let pid = second.id();
    let e = update_killing_publisher(&m, SourceKind::Rdma, &addr, pid);
    assert_eq!(e.code, wm_result::WM_ERR_PEER, "{e}");
    second.wait().unwrap();
    assert_params(&ptrs, &v1);
    assert_eq!(m.status().version.as_deref(), Some("1"));
}

/// A publisher that stops mid-transfer (SIGSTOP: alive, its sockets open,
/// nothing more sent) fails the update at its `timeout`, with at most the
/// 2 s the header allows for cancelling the posted receives, atomic and in
/// place, and the params untouched (atomic).
#[test]
fn a_publisher_stopped_mid_transfer_fails_the_update_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let d2 = big_version_2(dir.path());
    let v1 = big_model(1);
    let m = manager(SECRET, 1 << 20, Logger::default());
    let ptrs = register(&m, &v1);
    for mode in [Mode::Atomic, Mode::InPlace] {
        let (mut stopped, addr, _o) = serve(&[d2.to_str().unwrap()]);
        let pid = stopped.id() as i32;
        let mut req = rdma(&addr);
        (req.mode, req.timeout) = (mode, Duration::from_millis(1500));
        let mut stop_after_first = |_: &weight_manager_core::Progress| {
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            true
        };
        req.hooks.progress = Some(&mut stop_after_first);
        let start = std::time::Instant::now();
        let e = m.update(req).unwrap_err();
        let took = start.elapsed();
        unsafe { libc::kill(pid, libc::SIGKILL) };
        stopped.wait().unwrap();
        assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT, "{mode:?}: {e}");
        assert!(
            took < Duration::from_millis(1500 + 2000 + 500),
            "{mode:?}: the update returned {took:?} after it began (timeout 1.5 s)"
        );
        if mode == Mode::Atomic {
            // Never updated: every param still reads as zeros.
            for &(p, n) in &ptrs {
                assert!(unsafe { std::slice::from_raw_parts(p, n) }
                    .iter()
                    .all(|&b| b == 0));
            }
        }
    }
}

#[test]
fn zero_copy_callback_and_in_place_over_the_network() {
    let p = publisher(SECRET, Logger::default());
    let ts = model(6);
    add_all(&p, &ts);
    p.set_version(Some("6".into()));
    let addr = p.address();
    let m = manager(SECRET, 4096, Logger::default());
    let mut got = Vec::new();
    let mut cb = |t: &weight_manager_core::TensorView| {
        got.push((t.name.to_string(), t.data.to_vec()));
        Ok(())
    };
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        let mut req = rdma(&addr);
        req.mode = Mode::InPlace;
        req.hooks.tensor = Some(&mut cb);
        m.update(req).unwrap();
        serving.join().unwrap().unwrap();
    });
    got.sort();
    let mut want: Vec<_> = ts
        .iter()
        .map(|t| (t.name.clone(), t.data.clone()))
        .collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn gdr_without_device_params_is_refused_unless_falling_back() {
    let p = publisher(SECRET, Logger::default());
    let ts = model(7);
    add_all(&p, &ts);
    p.set_version(Some("7".into()));
    let addr = p.address();
    let m = manager(SECRET, 1 << 20, Logger::default());
    let ptrs = register(&m, &ts);
    let mut req = rdma(&addr);
    req.source = SourceKind::Gdr;
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED, "{e}");
    assert!(
        e.message.contains("gdr") && e.message.contains("rdma"),
        "{e}"
    );
    // With the fallback allowed, the same request runs as rdma.
    let (log, lines) = capture();
    let m = Manager::new(ManagerConfig {
        logger: log,
        net: NetSettings {
            secret: Some(SECRET.as_bytes().to_vec()),
            gdr_fallback: true,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let ptrs2 = register(&m, &ts);
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        let mut req = rdma(&addr);
        req.source = SourceKind::Gdr;
        m.update(req).unwrap();
        serving.join().unwrap().unwrap();
    });
    assert_params(&ptrs2, &ts);
    assert!(lines
        .lock()
        .iter()
        .any(|l| l.contains("falling back to rdma")));
    drop(ptrs);
}

#[test]
fn without_ucx_the_network_paths_say_what_to_install() {
    let (ok, text) = output(
        wm(&["pull", "--net", "127.0.0.1:9"])
            .env("WM_UCX_LIB", "/nonexistent/libucp.so.0")
            .spawn()
            .unwrap(),
    );
    assert!(!ok);
    assert!(
        text.contains("UCX is not available") && text.contains("libucx-cu12"),
        "{text}"
    );
}

/// A UCX older than 1.14 (Debian 12's libucx0 is 1.13.1, which
/// scripts/setup.sh installs for this test) can abort the engine when a
/// publisher dies mid-update: it is refused, saying what to install and
/// how to override, and with the override it runs after a loud warning.
#[test]
fn a_ucx_older_than_1_14_is_refused_unless_allowed() {
    let system = [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ]
    .map(|d| format!("{d}/libucp.so.0"))
    .into_iter()
    .find(|p| Path::new(p).exists());
    let Some(system) = system else {
        eprintln!("SKIP a_ucx_older_than_1_14_is_refused_unless_allowed: no system libucp.so.0");
        return;
    };
    let pull = |allow: &str| {
        output(
            wm(&["pull", "--net", "127.0.0.1:9"])
                .env("WM_UCX_LIB", &system)
                .env("WM_UCX_ALLOW_OLD", allow)
                .spawn()
                .unwrap(),
        )
    };
    let (ok, text) = pull("");
    assert!(!ok);
    if !text.contains("older than 1.14.0") {
        eprintln!(
            "SKIP a_ucx_older_than_1_14_is_refused_unless_allowed: {system} is 1.14 or newer"
        );
        return;
    }
    for needed in [
        system.as_str(),
        "libucx-cu12",
        "WM_UCX_LIB",
        "WM_UCX_ALLOW_OLD=1",
    ] {
        assert!(text.contains(needed), "no {needed:?} in: {text}");
    }
    // Allowed, it gets as far as the (closed) port, after the warning.
    let (ok, text) = pull("1");
    assert!(!ok);
    assert!(
        text.contains("WARNING") && !text.contains("WM_ERR_UNSUPPORTED"),
        "{text}"
    );
}

/// `ip args`, which must succeed.
fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Network namespaces, deleted on drop.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Add namespace `b` and join it to `a` (added already) by a veth pair:
/// `a` is 10.231.0.1 and `b` 10.231.0.2, their links up.
fn join_by_veth(a: &str, b: &str, tag: u32) {
    ip(&["netns", "add", b]);
    let (va, vb) = (format!("va{tag}"), format!("vb{tag}"));
    ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
    ip(&["link", "set", &va, "netns", a]);
    ip(&["link", "set", &vb, "netns", b]);
    ip(&["-n", a, "addr", "add", "10.231.0.1/24", "dev", &va]);
    ip(&["-n", b, "addr", "add", "10.231.0.2/24", "dev", &vb]);
    for (ns, dev) in [(a, &va), (b, &vb)] {
        ip(&["-n", ns, "link", "set", dev, "up"]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
    }
}

/// Two network namespaces joined by a veth pair: the publisher and the
/// engine see each other only through a real (virtual) network link.
#[test]
fn across_two_network_namespaces() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP across_two_network_namespaces: needs root for ip netns");
        return;
    }
    let ip_ok = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ip_ok {
        eprintln!("SKIP across_two_network_namespaces: `ip netns` is not available (iproute2)");
        return;
    }
    let tag = std::process::id() % 10000;
    let (a, b) = (format!("wmA{tag}"), format!("wmB{tag}"));
    let probe = Command::new("ip")
        .args(["netns", "add", &a])
        .output()
        .unwrap();
    if !probe.status.success() {
        eprintln!(
            "SKIP across_two_network_namespaces: ip netns add failed ({})",
            String::from_utf8_lossy(&probe.stderr).trim()
        );
        return;
    }
    let _cleanup = Netns(vec![a.clone(), b.clone()]);
    join_by_veth(&a, &b, tag);
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &model(8));
    write_version(dir.path(), "8");
    let d = dir.path().to_str().unwrap();
    let in_ns = |ns: &str, args: &[&str]| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns])
            .arg(&*WM)
            .args(args)
            .env("UCX_TLS", "tcp")
            .env("WM_NET_SECRET", SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let publisher = in_ns(&a, &["serve", "--net", "10.231.0.1:47311", d])
        .spawn()
        .unwrap();
    // The engine retries until the publisher listens.
    let start = Instant::now();
    loop {
        let (ok, text) = output(
            in_ns(&b, &["pull", "--net", "10.231.0.1:47311", "--check", d])
                .spawn()
                .unwrap(),
        );
        if ok {
            assert!(text.contains("equal to the snapshot"), "{text}");
            break;
        }
        assert!(
            text.contains("no publisher answers") && start.elapsed() < Duration::from_secs(20),
            "{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, text) = output(publisher);
    assert!(ok, "{text}");
}

/// Staged receive (`staged`, not the default): every bucket lands in a
/// staging slot and is copied from there to the staging arena (atomic) or
/// the params (in place); checksums still verified.
#[test]
fn staged_receive_lands_in_params_atomic_and_in_place() {
    let p = publisher(SECRET, Logger::default());
    let mut ts = model(9);
    ts.push(tensor("big", DType::F32, &[5000], 9)); // split over 4 KiB buckets
    add_all(&p, &ts);
    p.set_version(Some("9".into()));
    let addr = p.address();
    let m = receiving_manager(SECRET, 4096, Logger::default(), true);
    let ptrs = register(&m, &ts);
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(2, Duration::from_secs(20)));
        m.update(rdma(&addr)).unwrap();
        assert_params(&ptrs, &ts);
        for (p, n) in &ptrs {
            unsafe { std::ptr::write_bytes(*p, 0, *n) };
        }
        let mut req = rdma(&addr);
        req.mode = Mode::InPlace;
        m.update(req).unwrap();
        let st = serving.join().unwrap().unwrap();
        assert!(st.sessions.iter().all(|s| s.buckets > 3));
    });
    assert_params(&ptrs, &ts);
}

/// A staged receive takes the memory its buckets need, not `depth`
/// buckets of the configured size: a fresh `wm pull --staged true` of a
/// small snapshot, with the default 512 MiB buckets and 2 in flight (1 GiB
/// of slots, each page faulted in, before 2026-11-28), peaks far below
/// one bucket.
#[test]
#[expect(
    clippy::zombie_processes,
    reason = "the engine is reaped by wait4, which gives its peak memory"
)]
fn a_staged_receive_takes_the_memory_its_buckets_need() {
    tcp_only();
    let dir = tempfile::tempdir().unwrap();
    four_rank_snapshot(dir.path(), 3, "5");
    let (mut publisher, addr, _out) = serve(&[dir.path().to_str().unwrap()]);
    let d = dir.path().to_str().unwrap();
    let args = ["pull", "--net", &addr, "--check", d, "--world", "4"];
    let engine = wm(&[&args[..], &["--staged", "true"]].concat())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: an rusage filled by wait4 for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for that child, which nothing else waits for.
    let waited = unsafe { libc::wait4(engine.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(waited, engine.id() as i32);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{status}"
    );
    let peak_mib = usage.ru_maxrss / 1024;
    assert!(
        peak_mib < 256,
        "a staged pull of a few KiB peaked at {peak_mib} MiB"
    );
    let _ = publisher.wait();
}

#[path = "net/proxy.rs"]
mod proxy;

/// Port probes and silent connections to `wm serve --net --engines 2`
/// neither count as engines nor hold the real ones up: both real engines
/// are served, the probes are dropped after the handshake bound, and the
/// publisher exits cleanly.
#[test]
fn probe_connections_neither_count_nor_block_real_engines() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("v1");
    four_rank_snapshot(&d, 30, "300");
    let (publisher, addr, _out) = serve(&[d.to_str().unwrap(), "--engines", "2"]);
    // Three connections that never speak, and one that closes at once.
    let probes: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    drop(std::net::TcpStream::connect(&addr).unwrap());
    let started = Instant::now();
    let engines: Vec<Child> = (0..2)
        .map(|r| {
            wm(&[
                "pull",
                "--net",
                &addr,
                "--rank",
                &r.to_string(),
                "--world",
                "4",
                "--check",
                d.to_str().unwrap(),
            ])
            .spawn()
            .unwrap()
        })
        .collect();
    expect_equal_to_snapshot(engines);
    // Served long before a probe's old 60 s hold (generous for a busy machine).
    assert!(
        started.elapsed() < Duration::from_secs(45),
        "{:?}",
        started.elapsed()
    );
    // Each probe was dropped by the publisher (after an ERROR saying why).
    for mut p in probes {
        p.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        p.read_to_end(&mut rest)
            .expect("the publisher closed the probe");
    }
    let (ok, text) = output(publisher);
    assert!(ok, "{text}");
}

/// Flip the lowest bit of byte `at` of a frame.
fn flipped(mut frame: Vec<u8>, at: usize) -> Vec<u8> {
    frame[at] ^= 1;
    frame
}

/// The tamperings of the control frames test: what each does, and
/// whether the publisher sees it too. A dropped or reordered frame shows
/// when the frame after it comes: the ACKs of a session of several
/// buckets (the others each wait for the publisher's answer).
fn control_frame_tamperings() -> [(&'static str, Box<proxy::Tamper>, bool); 4] {
    use proxy::{Dir, Tamper};
    // Frames each way: engine HELLO 0, PROOF 1, READY 2, WANT 3, ACK 0 is
    // 4, ACK 1 is 5; publisher CHALLENGE 0, PROOF 1, MANIFEST 2.
    let manifest_version_rewritten: Box<Tamper> = Box::new(|dir, i, f| match (dir, i) {
        // MANIFEST: [len][type][version len u32][version...]: "5" becomes "4".
        (Dir::ToEngine, 2) => vec![flipped(f, 9)],
        _ => vec![f],
    });
    let ready_replayed: Box<Tamper> = Box::new(|dir, i, f| match (dir, i) {
        (Dir::ToPublisher, 2) => vec![f.clone(), f],
        _ => vec![f],
    });
    let ack_dropped: Box<Tamper> = Box::new(|dir, i, f| match (dir, i) {
        (Dir::ToPublisher, 4) => vec![],
        _ => vec![f],
    });
    let mut held = None;
    let acks_reordered: Box<Tamper> = Box::new(move |dir, i, f| match (dir, i) {
        (Dir::ToPublisher, 4) => {
            held = Some(f);
            vec![]
        }
        (Dir::ToPublisher, 5) => vec![f, held.take().unwrap()],
        _ => vec![f],
    });
    [
        (
            "manifest version rewritten",
            manifest_version_rewritten,
            false,
        ),
        ("READY replayed", ready_replayed, true),
        ("ACK 0 dropped", ack_dropped, true),
        ("ACK 0 and ACK 1 reordered", acks_reordered, true),
    ]
}

/// An on-path proxy forwards the challenge untouched, then alters,
/// replays, drops or reorders one control frame: the side that receives it
/// fails with an authentication error, and the engine keeps its weights.
#[test]
fn control_frames_altered_replayed_dropped_or_reordered_on_the_way_fail() {
    use proxy::Proxy;
    let cases = control_frame_tamperings();
    let (pub_log, pub_lines) = capture();
    let p = publisher(SECRET, pub_log);
    let ts = model(5);
    add_all(&p, &ts);
    p.set_version(Some("5".into()));
    // Buckets of 4 KiB: a session of several, so that ACKs follow ACKs.
    let m = manager(SECRET, 4096, Logger::default());
    let ptrs = register(&m, &ts);
    let before: Vec<Vec<u8>> = ptrs
        .iter()
        .map(|(p, n)| unsafe { std::slice::from_raw_parts(*p, *n) }.to_vec())
        .collect();
    for (what, tamper, publisher_sees_it) in cases {
        let proxy = Proxy::start(&p.address(), tamper);
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
            let r = m.update(rdma(&proxy.address));
            let e = r.expect_err(what);
            assert_eq!(e.code, wm_result::WM_ERR_AUTH, "{what}: {e}");
            assert!(e.message.contains("authentication failed"), "{what}: {e}");
            let pe = serving.join().unwrap().unwrap_err();
            if publisher_sees_it {
                assert_eq!(pe.code, wm_result::WM_ERR_AUTH, "{what}: {pe}");
                assert!(
                    pe.message.contains("does not carry this session's MAC"),
                    "{what}: {pe}"
                );
            }
        });
        drop(proxy);
        for ((ptr, n), b) in ptrs.iter().zip(&before) {
            let params = unsafe { std::slice::from_raw_parts(*ptr, *n) };
            assert_eq!(params, &b[..], "{what}: params written");
        }
        assert!(m.status().version.is_none(), "{what}");
    }
    assert!(
        pub_lines
            .lock()
            .iter()
            .any(|l| l.contains("authentication failed")),
        "{:?}",
        pub_lines.lock()
    );
    // Untouched, the same proxy path serves the update.
    let proxy = Proxy::start(&p.address(), Box::new(|_, _, f| vec![f]));
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        assert_eq!(m.update(rdma(&proxy.address)).unwrap().version, "5");
        serving.join().unwrap().unwrap();
    });
    assert_params(&ptrs, &ts);
}

/// With `keyed_digests`, each bucket entry's bytes are checked against a
/// keyed BLAKE3 digest taken before they left the publisher: bytes altered
/// after that (the test-only corruption) are caught even with the XXH3
/// checksums skipped, naming the tensor; untouched bytes pass, staged or
/// direct.
#[test]
fn keyed_digests_catch_altered_bytes_without_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("v2");
    std::fs::create_dir(&d).unwrap();
    write_safetensors(&d.join("model.safetensors"), &model(2));
    write_version(&d, "2");
    for staged in [false, true] {
        tcp_only();
        let m = Manager::new(ManagerConfig {
            fallback_dir: None,
            net: NetSettings {
                secret: Some(SECRET.as_bytes().to_vec()),
                bucket_size: 4096,
                staged,
                keyed_digests: true,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        let v1 = model(1);
        let ptrs = register(&m, &v1);
        let before: Vec<Vec<u8>> = ptrs
            .iter()
            .map(|(p, n)| unsafe { std::slice::from_raw_parts(*p, *n) }.to_vec())
            .collect();
        let (bad, addr, _o) = serve(&[d.to_str().unwrap(), "--corrupt", "layer0.norm"]);
        let mut req = rdma(&addr);
        req.skip_network_checksums = true;
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "staged {staged}: {e}");
        assert!(
            e.message.contains("'layer0.norm'") && e.message.contains("keyed BLAKE3"),
            "staged {staged}: {e}"
        );
        assert!(!output(bad).0);
        for ((p, n), b) in ptrs.iter().zip(&before) {
            assert_eq!(unsafe { std::slice::from_raw_parts(*p, *n) }, &b[..]);
        }
        let (good, addr, _o) = serve(&[d.to_str().unwrap()]);
        let mut req = rdma(&addr);
        req.skip_network_checksums = true;
        assert_eq!(m.update(req).unwrap().version, "2");
        assert_params(&ptrs, &model(2));
        assert!(output(good).0);
    }
}

/// A first network update of a process whose deadline passes while UCX is
/// loaded and initialized (0.4 s on this machine) says so, naming UCX,
/// before connecting (found by an audit: it blamed the publisher's
/// silence). `wm pull` is a fresh process, so UCX's first use is its.
#[test]
fn a_deadline_spent_making_ucx_ready_is_named() {
    tcp_only();
    let out = wm(&["pull", "--net", "127.0.0.1:9", "--timeout", "0.001"])
        .env("WM_NET_SECRET", SECRET)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("deadline passed while UCX was made ready")
            && text.contains("before connecting to 127.0.0.1:9")
            && text.contains("WM_ERR_TIMEOUT"),
        "{text}"
    );
}
