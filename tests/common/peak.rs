//! Memory measured in a child process: the `#[ignore]`d test that does the
//! work runs alone in this test binary again, so its peak RSS (VmHWM) is
//! its own, not the harness's or another test's.

use std::process::Command;

/// A line of /proc/self/status, in bytes (`VmRSS`, `VmHWM`).
pub fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// Run the `#[ignore]`d test `name` alone in a child process; it prints
/// "child passed" when its checks hold.
pub fn in_child(name: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {:?}\n{text}", out.status);
    assert!(text.contains("child passed"), "{name}:\n{text}");
}
