//! Where the `wm` command of this build is. `wm` is its own crate, so
//! cargo gives these tests no `CARGO_BIN_EXE_wm`: `cargo test` at the
//! workspace root builds it beside the test programs (`target/<profile>/wm`,
//! with the test hooks, since the features of one cargo run are unified).
//! `WM_BIN` names another one (the GPU kit carries its own).

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
    assert!(
        wm.exists(),
        "{} is missing: run the tests from the workspace root (cargo test), which builds wm",
        wm.display()
    );
    wm
});
