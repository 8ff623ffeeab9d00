//! Hostile snapshot files (issue 15): FIFOs where files should be, YAML alias
//! bombs, oversized and NUL-named safetensors headers, odd part numbers.
//! Real files, real FIFOs, real `wm` processes.

use crate::common::*;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::layout;
use weight_manager_core::{wm_result, Error, UpdateStats};
use weight_manager_core::{LogLevel, Logger};
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

const TIMEOUT: Duration = Duration::from_secs(3);
/// When a run that should have ended is declared hung (and unblocked).
const HUNG: Duration = Duration::from_secs(10);

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap()
}

fn mkfifo(path: &Path) {
    assert_eq!(unsafe { libc::mkfifo(c_path(path).as_ptr(), 0o600) }, 0);
}

/// Open `fifo` for writing and close it: a reader stuck in `open()` goes on
/// (and reads EOF), so a test of the old, blocking code ends.
fn unblock(fifo: &Path) {
    let fd = unsafe { libc::open(c_path(fifo).as_ptr(), libc::O_WRONLY | libc::O_NONBLOCK) };
    if fd >= 0 {
        unsafe { libc::close(fd) };
    }
}

/// Run `f` on a thread; past `HUNG`, keep unblocking `fifo` until it ends.
/// Returns its result and how long it took.
fn bounded<R: Send>(fifo: &Path, f: impl FnOnce() -> R + Send) -> (R, Duration) {
    std::thread::scope(|s| {
        let start = Instant::now();
        let h = s.spawn(move || {
            let r = f();
            (r, start.elapsed())
        });
        while !h.is_finished() {
            std::thread::sleep(Duration::from_millis(20));
            if start.elapsed() > HUNG {
                unblock(fifo);
            }
        }
        h.join().unwrap()
    })
}

fn update(
    dir: &Path,
    version: Option<&str>,
    fifo: &Path,
) -> (Result<UpdateStats, Error>, Duration) {
    let m = manager();
    register(&m, &model(1));
    bounded(fifo, || {
        let mut req = UpdateRequest::snapshot(dir);
        req.timeout = TIMEOUT;
        req.version = version.map(str::to_string);
        m.update(req)
    })
}

fn inspect(dir: &Path, fifo: &Path) -> (Output, Duration) {
    bounded(fifo, || {
        Command::new(&*WM)
            .arg("inspect")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A FIFO named like a part file, `version.yaml` or `wm_checksums.json`
/// fails the update promptly (well within twice its timeout) with an error
/// naming it, and `wm inspect` does not block on it either.
#[test]
fn fifos_in_a_snapshot_fail_promptly_naming_the_file() {
    let cases = [
        (
            "model_state.tp0.0.part2.safetensors",
            wm_result::WM_ERR_FORMAT,
        ),
        ("version.yaml", wm_result::WM_ERR_NO_VERSION),
        ("wm_checksums.json", wm_result::WM_ERR_FORMAT),
    ];
    for (name, code) in cases {
        let d = tempfile::tempdir().unwrap();
        let first = if name.contains("part") {
            "model_state.tp0.0.part1.safetensors"
        } else {
            "model_state.tp0.0.safetensors"
        };
        write_safetensors(&d.path().join(first), &model(1));
        if name != "version.yaml" {
            write_version(d.path(), "5");
        }
        let fifo = d.path().join(name);
        mkfifo(&fifo);
        let (r, took) = update(d.path(), None, &fifo);
        assert!(took < 2 * TIMEOUT, "{name}: the update took {took:?}");
        let e = r.expect_err(name);
        assert_eq!(e.code, code, "{name}: {e}");
        assert!(
            e.message.contains(name) && e.message.contains("FIFO"),
            "{e}"
        );

        let (out, took) = inspect(d.path(), &fifo);
        assert!(took < 2 * TIMEOUT, "{name}: wm inspect took {took:?}");
        let said = text(&out);
        assert!(said.contains(name) && said.contains("FIFO"), "{said}");
        assert_eq!(out.status.success(), name == "version.yaml", "{said}");
    }
    // The only snapshot file a FIFO (per-rank or Hugging Face name), or the
    // location itself one: refused naming it, not "no snapshot here".
    for name in ["model_state.tp0.0.safetensors", "model.safetensors"] {
        let d = tempfile::tempdir().unwrap();
        write_version(d.path(), "5");
        let fifo = d.path().join(name);
        mkfifo(&fifo);
        for at in [d.path(), fifo.as_path()] {
            let (r, took) = update(at, None, &fifo);
            assert!(took < 2 * TIMEOUT, "{name}: the update took {took:?}");
            let e = r.expect_err(name);
            assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{name}: {e}");
            assert!(
                e.message.contains(name) && e.message.contains("FIFO"),
                "{e}"
            );
        }
    }
    // A request that names its version never opens version.yaml.
    let d = tempfile::tempdir().unwrap();
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &model(1));
    let fifo = d.path().join("version.yaml");
    mkfifo(&fifo);
    let (r, took) = update(d.path(), Some("v9"), &fifo);
    assert!(took < 2 * TIMEOUT, "took {took:?}");
    assert_eq!(r.unwrap().version, "v9");
}

/// Nine levels of nine aliases: a few hundred bytes that expand into about
/// 387 million nodes.
fn alias_bomb() -> String {
    let mut s = "a0: &a0 [\"lol\"]\n".to_string();
    for i in 1..10 {
        let refs: Vec<String> = (0..9).map(|_| format!("*a{}", i - 1)).collect();
        s.push_str(&format!("a{i}: &a{i} [{}]\n", refs.join(",")));
    }
    s + "step: 3\n"
}

/// version.yaml is untrusted: aliases and oversized files are refused and
/// named in the no-version error, and the file is not read at all when the
/// request names its version.
#[test]
fn version_yaml_aliases_and_size_are_refused() {
    let d = tempfile::tempdir().unwrap();
    write_safetensors(&d.path().join("model_state.tp0.0.safetensors"), &model(1));
    let none = d.path().join("none");
    let big = format!("step: 4\n{}", "# pad\n".repeat(20_000));
    for (yaml, why) in [("a: &x 7\nstep: *x\n", "alias"), (big.as_str(), "limit")] {
        std::fs::write(d.path().join("version.yaml"), yaml).unwrap();
        let e = update(d.path(), None, &none).0.unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_NO_VERSION, "{e}");
        assert!(
            e.message.contains("version.yaml") && e.message.contains(why),
            "{e}"
        );
    }
    std::fs::write(d.path().join("version.yaml"), alias_bomb()).unwrap();
    assert_eq!(update(d.path(), Some("v2"), &none).0.unwrap().version, "v2");
    let e = update(d.path(), None, &none).0.unwrap_err();
    assert!(e.message.contains("alias"), "{e}");
    // In a process with 1 GiB of address space, so that expanding it would
    // fail the process rather than the machine.
    let out = Command::new("sh")
        .args(["-c", "ulimit -v 1048576 && exec \"$0\" inspect \"$1\""])
        .arg(&*WM)
        .arg(d.path())
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("version: none") && said.contains("alias"),
        "{said}"
    );
}

/// Writes a safetensors file whose header is `json` (padded to 8 bytes),
/// followed by `data` zero bytes.
fn write_raw(path: &Path, json: &str, data: usize) {
    let mut h = json.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.resize(bytes.len() + data, 0);
    std::fs::write(path, bytes).unwrap();
}

/// A header over the limit is refused by name before it is read.
#[test]
fn oversized_safetensors_header_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("model_state.tp0.0.safetensors");
    write_raw(&path, &format!("{{{}}}", " ".repeat(40 << 20)), 8);
    let e = update(d.path(), Some("1"), &d.path().join("none"))
        .0
        .unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
    assert!(
        e.message.contains("model_state.tp0.0.safetensors") && e.message.contains("limit"),
        "{e}"
    );
}

/// Peak RSS of `wm inspect dir`, in bytes, and whether it succeeded.
#[expect(
    clippy::zombie_processes,
    reason = "the child is reaped by wait4, which std cannot do but which reports its RSS"
)]
fn inspect_peak_rss(dir: &Path) -> (u64, bool) {
    let child = Command::new(&*WM)
        .arg("inspect")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    assert_eq!(unsafe { libc::wait4(pid, &mut status, 0, &mut usage) }, pid);
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    (usage.ru_maxrss as u64 * 1024, ok)
}

/// A large, valid header costs a small multiple of its size, not the 16x a
/// generic JSON tree costs.
#[test]
fn safetensors_header_memory_is_bounded() {
    let d = tempfile::tempdir().unwrap();
    let count = 400_000usize;
    let mut json = String::from("{");
    for i in 0..count {
        let sep = if i + 1 == count { "" } else { "," };
        json.push_str(&format!(
            r#""t{i:07}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}{sep}"#,
            i + 1
        ));
    }
    json.push('}');
    let header = json.len() as u64;
    write_raw(&d.path().join("model.safetensors"), &json, count);
    let (rss, ok) = inspect_peak_rss(d.path());
    assert!(ok, "wm inspect failed");
    let bound = (64 << 20) + 8 * header;
    assert!(
        rss < bound,
        "a {header}-byte header took {rss} bytes of RSS (bound {bound})"
    );
}

/// A tensor name holding NUL is a format error naming the file, not a
/// callback failure blamed on the engine.
#[test]
fn nul_in_a_tensor_name_is_refused_at_parse() {
    let d = tempfile::tempdir().unwrap();
    write_raw(
        &d.path().join("model_state.tp0.0.safetensors"),
        r#"{"a\u0000b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
        8,
    );
    let m = manager();
    let mut on_tensor = |_: &weight_manager_core::TensorView| Ok(());
    let mut req = UpdateRequest::snapshot(d.path());
    req.version = Some("1".into());
    req.hooks.tensor = Some(&mut on_tensor);
    let e = m.update(req).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{e}");
    assert!(
        e.message.contains("model_state.tp0.0.safetensors") && e.message.contains("NUL"),
        "{e}"
    );
}

/// Part numbers are digits only; `part+2` is not part 2, and a number that
/// does not fit 64 bits is warned about by name, not called "not a number".
#[test]
fn part_numbers_are_digits_that_fit() {
    let d = tempfile::tempdir().unwrap();
    let names = [
        "model_state.tp0.0.part1.safetensors",
        "model_state.tp0.0.part+2.safetensors",
        "model_state.tp0.0.part 3.safetensors",
        "model_state.tp0.0.part99999999999999999999.safetensors",
        "model_state.tp0.0.part10.safetensors",
    ];
    for n in names {
        std::fs::write(d.path().join(n), b"x").unwrap();
    }
    let logged = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let sink = logged.clone();
    let logger = Logger::closure(LogLevel::Debug, move |_, m| sink.lock().push(m.into()));
    let loc = layout::SnapshotLocation {
        model_dir: d.path().to_path_buf(),
        fallback_dir: None,
        rank: 0,
        gpu_id: "0".into(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let found = layout::resolve(&loc, &logger, deadline).unwrap();
    let got: Vec<_> = found.files.iter().map(|p| p.file_name().unwrap()).collect();
    assert_eq!(got, [names[0], names[4]]);
    let logged = logged.lock().join("\n");
    for (n, why) in [
        ("part+2", "is not a number"),
        ("part 3", "is not a number"),
        ("part99999999999999999999", "does not fit"),
    ] {
        assert!(
            logged.lines().any(|l| l.contains(n) && l.contains(why)),
            "{n}: {logged}"
        );
    }
}
