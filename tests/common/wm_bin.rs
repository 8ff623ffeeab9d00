//! Where the `wm` command of this build is. `wm` is its own crate, so
//! cargo neither builds it for these tests nor gives them
//! `CARGO_BIN_EXE_wm`: `scripts/test.sh` builds it first, with the test
//! hooks some tests use (`cargo build --release -p wm --features
//! test-hooks`), beside the test programs (`target/<profile>/wm`). `WM_BIN`
//! names another one (the GPU kit carries its own).

use std::path::PathBuf;
use std::sync::LazyLock;

pub static WM: LazyLock<PathBuf> = LazyLock::new(|| {
    if let Some(p) = std::env::var_os("WM_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test> -> target/<profile>/wm
    let exe = std::env::current_exe().expect("the test program's path");
    let wm = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .join("wm");
    // A product build of wm (no test hooks) would fail the tests that use
    // them with a confusing error: say what to build instead.
    let version = std::process::Command::new(&wm).arg("--version").output();
    let hooked = version.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("(test hooks)"));
    assert!(
        hooked,
        "{} is missing or has no test hooks: build it first (cargo build --release -p wm --features test-hooks)",
        wm.display()
    );
    wm
});
