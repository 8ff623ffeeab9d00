//! What `wm` leaves on disk: nothing of its own after a stopping signal
//! (SIGINT, SIGTERM: its temporary folders and socket files are removed,
//! and it still ends by that signal), and nothing of the user's is
//! overwritten by `wm demo --dir`. The real `wm` in real processes.

mod common;

use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Wait (at most 20 s) until `path` exists.
fn wait_for(path: &Path, child: &mut Child) {
    let until = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        let exited = child.try_wait().unwrap();
        assert!(
            exited.is_none(),
            "wm exited ({exited:?}) before {path:?} existed"
        );
        assert!(Instant::now() < until, "{path:?} never appeared");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Send `signal` and wait (at most 20 s) for `child` to end; its status.
fn stop(child: &mut Child, signal: i32) -> std::process::ExitStatus {
    // SAFETY: a signal to our own child, which has not been waited for.
    unsafe { libc::kill(child.id() as i32, signal) };
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("wm did not end within 20 s of signal {signal}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_stopping_signal_removes_the_demos_temporary_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new(&*WM)
        .arg("demo")
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let folder = tmp.path().join(format!("wm-demo-{}", child.id()));
    wait_for(&folder, &mut child);
    let status = stop(&mut child, libc::SIGINT);
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    assert!(!folder.exists(), "{folder:?} left behind");
}

#[test]
fn a_stopping_signal_removes_the_served_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_folder(tmp.path());
    let socket = tmp.path().join("p.sock");
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut child = serving(&socket, &model, false);
        let status = stop(&mut child, signal);
        assert_eq!(status.signal(), Some(signal), "{status:?}");
        assert!(!socket.exists(), "signal {signal}: {socket:?} left behind");
    }
}

/// A snapshot folder to serve, in `dir`.
fn model_folder(dir: &Path) -> std::path::PathBuf {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    write_safetensors(&model.join("model.safetensors"), &common::model(3));
    write_version(&model, "7");
    model
}

/// `wm serve --ipc SOCKET DIR` (under `nohup`: SIGHUP ignored), once it
/// said it listens.
fn serving(socket: &Path, model: &Path, nohup: bool) -> Child {
    let mut c = match nohup {
        true => Command::new("nohup"),
        false => Command::new(&*WM),
    };
    if nohup {
        c.arg(&*WM);
    }
    let mut child = c
        .arg("serve")
        .arg("--ipc")
        .arg(socket)
        .arg(model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on") {
        line.clear();
        let read = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(read > 0, "wm serve exited before it listened");
    }
    child
}

/// A signal wm was started ignoring stays ignored (`nohup`: SIGHUP); the
/// others still end it, cleaning up.
#[test]
fn a_signal_ignored_at_start_stays_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_folder(tmp.path());
    let socket = tmp.path().join("p.sock");
    let mut child = serving(&socket, &model, true);
    // SAFETY: a signal to our own child, which has not been waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP under nohup ended wm"
    );
    assert!(socket.exists());
    let status = stop(&mut child, libc::SIGTERM);
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(!socket.exists(), "{socket:?} left behind");
}

#[test]
fn demo_refuses_a_folder_that_holds_files() {
    let tmp = tempfile::tempdir().unwrap();
    let mine = tmp.path().join("model.safetensors");
    std::fs::write(&mine, b"the user's model").unwrap();
    let out = Command::new(&*WM)
        .args(["demo", "--dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not empty") && err.contains("model.safetensors"),
        "{err}"
    );
    assert_eq!(std::fs::read(&mine).unwrap(), b"the user's model");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "wrote files"
    );
    // A new folder (and an empty one) is the demo's.
    let new = tmp.path().join("new");
    let out = Command::new(&*WM)
        .args(["demo", "--dir"])
        .arg(&new)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
