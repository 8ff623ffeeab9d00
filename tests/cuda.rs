//! The CUDA backend without a GPU: every way CUDA can be missing gives a
//! clear error, never a panic or a crash.
//!
//! - No driver library at all (this CI machine): device params are refused
//!   naming libcuda.so.1; host params and updates are untouched.
//! - A driver library that is present but sees no device: a tiny stub
//!   `libcuda.so` built here with the system C compiler (cuDriverGetVersion
//!   says 12.8, cuInit says CUDA_ERROR_NO_DEVICE), found first through
//!   LD_LIBRARY_PATH by a `wm devices` process. A machine with a real driver
//!   runs this test too: the stub shadows it for that one process.
//!
//! The GPU suite proper (device params on every path) needs a GPU; see
//! scripts/gpu.sh.

#[path = "common/wm_bin.rs"]
mod wm_bin;
use std::path::Path;
use std::process::Command;
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::{Manager, ManagerConfig};
use weight_manager_core::{MemoryKind, ParamSpec};
use wm_bin::WM;

/// The `wm` program: this build's, or `WM_BIN` (scripts/gpu.sh runs these
/// tests as a prebuilt kit, away from the build tree).
fn wm() -> String {
    WM.to_string_lossy().into_owned()
}

const STUB: &str = r#"
/* A CUDA driver that is installed but finds no GPU. */
int cuDriverGetVersion(int *v) { *v = 12080; return 0; }
int cuInit(unsigned flags) { (void)flags; return 100; /* CUDA_ERROR_NO_DEVICE */ }
"#;

fn build_stub(dir: &Path) -> Result<(), String> {
    let src = dir.join("stub.c");
    std::fs::write(&src, STUB).map_err(|e| e.to_string())?;
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .output()
        .map_err(|e| format!("running cc: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    std::fs::copy(dir.join("libcuda.so"), dir.join("libcuda.so.1")).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn driver_present_without_a_device_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    build_stub(dir.path()).expect("building the stub driver");
    let out = Command::new(wm())
        .arg("devices")
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "wm devices succeeded with the stub: {err}"
    );
    assert!(
        err.contains("CUDA 12.8")
            && err.contains("no device")
            && err.contains("CUDA_ERROR_NO_DEVICE")
            && err.contains("WM_ERR_UNSUPPORTED"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn without_a_driver_device_params_are_refused_by_name() {
    // SAFETY: only tries to dlopen.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: this machine has a CUDA driver (the GPU suite covers it)");
        return;
    }
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let mut spec = ParamSpec::host("w", DType::F32, &[4]);
    spec.memory = MemoryKind::Device;
    spec.device_ordinal = 0;
    let mut fake = [0u8; 16];
    // SAFETY: the pointer is never written: registration is refused first.
    let e = unsafe { m.register(&spec, fake.as_mut_ptr(), 16) }.unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED);
    assert!(
        e.message.contains("param 'w'") && e.message.contains("libcuda.so.1"),
        "{e}"
    );
    // Library-owned device memory is refused the same way.
    let mut owned = spec.clone();
    owned.name = "owned".into();
    let e = m.allocate(&owned).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED);
    assert!(
        e.message.contains("param 'owned'") && e.message.contains("libcuda.so.1"),
        "{e}"
    );
    // The same process still registers host params.
    let mut host = [0u8; 16];
    unsafe {
        m.register(
            &ParamSpec::host("w", DType::F32, &[4]),
            host.as_mut_ptr(),
            16,
        )
    }
    .unwrap();
    let out = Command::new(wm()).arg("devices").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("libcuda.so.1"));
}
