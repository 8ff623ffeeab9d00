//! `wm <command> --help` works for every command and subcommand (exit 0,
//! the usage naming the command), and a bad option is refused by name.

mod common;

use common::WM;
use std::process::{Command, Output};

/// Every command and subcommand of `wm`, hidden ones (the benches' child
/// processes) included.
const COMMANDS: &[&str] = &[
    "demo",
    "inspect",
    "manifest",
    "shard",
    "plan",
    "bench",
    "bench snapshot",
    "bench signal",
    "bench ipc",
    "bench net",
    "bench gpu",
    "bench quant",
    "bench delta",
    "bench shard",
    "bench signal-rank",
    "bench ipc-publisher",
    "bench net-publisher",
    "bench shard-snapshot-rank",
    "bench shard-ucx-publisher",
    "bench shard-ucx-rank",
    "bench shard-ipc-rank",
    "serve",
    "pull",
    "signal",
    "signal get",
    "signal set",
    "signal wait",
    "signal request",
    "worker",
    "devices",
];

fn wm(args: &[&str]) -> Output {
    Command::new(&*WM).args(args).output().unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn help_of_every_command_names_it() {
    let top = wm(&["--help"]);
    assert!(top.status.success(), "wm --help: {:?}", top.status);
    let listed = text(&top.stdout);
    for cmd in COMMANDS {
        let mut args: Vec<&str> = cmd.split(' ').collect();
        if args.len() == 1 {
            assert!(
                listed.contains(&format!("  {cmd} ")),
                "wm --help lists {cmd}: {listed}"
            );
        }
        args.push("--help");
        let out = wm(&args);
        let said = text(&out.stdout);
        assert!(
            out.status.success(),
            "wm {cmd} --help: {:?} {said} {}",
            out.status,
            text(&out.stderr)
        );
        assert!(
            said.contains(&format!("Usage: wm {cmd}")),
            "wm {cmd} --help: {said}"
        );
    }
}

#[test]
fn unknown_option_is_refused_by_name() {
    for args in [
        &[
            "plan",
            "--trainer",
            "t.json",
            "--engine",
            "e.json",
            "--no-such",
        ][..],
        &["bench", "snapshot", "--no-such", "1"],
        &["pull", "--ipc", "/nonexistent.sock", "--no-such"],
        &["signal", "get", "cell", "--no-such"],
        &["demo", "--no-such"],
    ] {
        let out = wm(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "wm {args:?} succeeded");
        assert!(err.contains("--no-such"), "wm {args:?}: {err}");
    }
}

/// Network settings on an IPC pull (they would not apply), an IPC one on
/// a network pull, and two bucket sizes at once: refused, naming them.
#[test]
fn settings_of_the_other_transport_are_refused_by_name() {
    let both_sizes = ["--bucket-mib", "4", "--bucket-bytes", "9"];
    for (args, want) in [
        (&["--ipc", "s", "--depth", "3"][..], "--depth"),
        (&["--ipc", "s", "--gdr", "true"], "--gdr"),
        (&["--ipc", "s", "--bucket-mib", "4"], "--bucket-mib"),
        (
            &["--net", "h:1", "--allow-other-uids", "true"],
            "--allow-other-uids",
        ),
        (
            &[&["--net", "h:1"][..], &both_sizes].concat(),
            "--bucket-bytes",
        ),
    ] {
        let args: Vec<&str> = std::iter::once("pull")
            .chain(args.iter().copied())
            .collect();
        let out = wm(&args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "wm {args:?} succeeded");
        assert!(err.contains(want), "wm {args:?}: {err}");
    }
}

#[test]
fn bad_values_and_unknown_commands_are_refused_by_name() {
    for (args, want) in [
        (&["pull", "--ipc", "s", "--verify", "maybe"][..], "--verify"),
        (&["bench", "quant", "--gib", "lots"], "--gib"),
        // More than the machine's memory (it ran until something filled).
        (&["bench", "snapshot", "--gib", "99999"], "--gib"),
        // Counts of nothing: verdicts of no measurement, or a hang (a
        // signal bench of 0 steps waited 300 s on a child that died).
        (&["bench", "signal", "--steps", "0"], "--steps"),
        (&["bench", "signal", "--ranks", "0"], "--ranks"),
        (&["bench", "quant", "--runs", "0"], "--runs"),
        (&["shard", "in", "--out", "o", "--ranks", "0"], "--ranks"),
        (&["serve", "dir"], "--ipc"),
        (&["no-such-command"], "no-such-command"),
        // Waits that are no number of seconds (they panicked converting).
        (
            &["serve", "--ipc", "s", "--accept-timeout", "nan", "d"],
            "--accept-timeout",
        ),
        (
            &["serve", "--ipc", "s", "--accept-timeout", "1e30", "d"],
            "--accept-timeout",
        ),
        (&["pull", "--ipc", "s", "--timeout=-5"], "--timeout"),
        (&["pull", "--ipc", "s", "--timeout", "inf"], "--timeout"),
        (
            &["signal", "--timeout=-1", "wait", "c", "CLEARED"],
            "--timeout",
        ),
        (
            &["serve", "--ipc", "s", "--bucket-mib", "99999999999", "d"],
            "--bucket-mib",
        ),
        // A group timeout of 584 million years (it waited on).
        (
            &[
                "worker",
                "--rank",
                "0",
                "--timeout-ms",
                "18446744073709551615",
            ],
            "--timeout-ms",
        ),
        // A log that is a device (a FIFO would wait for a reader).
        (
            &[
                "worker",
                "--rank",
                "0",
                "--model-dir",
                "tests",
                "--log",
                "/dev/null",
            ],
            "--log /dev/null: not a regular file",
        ),
        // Folders: several only over the network; a missing one named.
        (
            &["serve", "--ipc", "s", "tests", "src"],
            "only over the network (--net)",
        ),
        (
            &["serve", "--ipc", "s", "no/such/folder"],
            "no/such/folder: no such folder",
        ),
        // Over the network each folder is a version: every one stays
        // served (three with the default --keep 2 dropped the first), and
        // one --version cannot name several (the last replaced the rest).
        (
            &["serve", "--net", "127.0.0.1:0", "tests", "src", "docs"],
            "pass --keep 3",
        ),
        (
            &[
                "serve",
                "--net",
                "127.0.0.1:0",
                "--version",
                "v",
                "tests",
                "src",
            ],
            "--version names one version",
        ),
    ] {
        refused(args, want);
    }
}

fn refused(args: &[&str], want: &str) {
    let out = wm(args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "wm {args:?} succeeded");
    assert!(err.contains(want), "wm {args:?}: want '{want}' in {err}");
}

/// `wm shard --ranks` past the most trainer ranks one update reads
/// (`WM_MAX_SOURCES`) is refused before anything is read: a billion rank
/// files, each with a copy of every tensor too small to split, ran until
/// the disk filled.
#[test]
fn shard_ranks_are_bounded() {
    refused(&["shard", "in", "--out", "o", "--ranks", "4097"], "--ranks");
}

/// `wm inspect` of a file that is no safetensors fails with its error
/// alone: no half report on stdout (it printed the version, checksums and
/// column headers first).
#[test]
fn inspect_of_a_bad_file_prints_no_report() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("model.safetensors");
    std::fs::write(&bad, b"version: 100\n").unwrap();
    let out = wm(&["inspect", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("safetensors header"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn version_prints_the_version() {
    for args in [&["--version"][..], &["version"]] {
        let out = wm(args);
        assert!(out.status.success());
        let said = text(&out.stdout);
        // The tests' wm has the test hooks, and says so after the version.
        let want = format!("wm {} (test hooks)", env!("CARGO_PKG_VERSION"));
        assert_eq!(said.trim(), want);
    }
}

/// Audit item: `wm serve --net` of two folders naming one version printed
/// both as published, and the second replaced the first. Refused, naming
/// both folders and the version, before any engine is served.
#[test]
fn two_folders_of_one_version_are_refused_over_the_network() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    common::write_version(a.path(), "same");
    common::write_version(b.path(), "same");
    let out = Command::new(&*WM)
        .env("WM_NET_SECRET", "cli-help-secret-0123456789")
        .args(["serve", "--net", "127.0.0.1:0", "--accept-timeout", "5"])
        .args([a.path(), b.path()])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("both name version same") && err.contains(&b.path().display().to_string()),
        "{err}"
    );
}
