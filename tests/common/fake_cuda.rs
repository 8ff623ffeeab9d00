//! A test-only CUDA driver (`tests/fake_cuda.c`) whose device memory is
//! host memory: built with the system C compiler, found first through
//! LD_LIBRARY_PATH by a child process that runs the test again (and by
//! the processes it starts, which inherit the path), and its control
//! functions. The library's own code runs unchanged on it.

use std::ffi::{c_char, CString};
use std::path::Path;
use std::process::Command;

const FAKE: &str = include_str!("../fake_cuda.c");
/// The FP8 kernels the fake runs on the host (`#include`d by it).
const KERNELS: &str = include_str!("../../crates/core/src/quant/fp8.cu");
/// The GPU deltas' kernels, likewise.
const DELTA_KERNELS: &str = include_str!("../../crates/core/src/delta/device.cu");

/// True in the child that runs test `name` under the fake driver; in the
/// parent, runs that child and checks it passed.
pub fn under_fake_driver(name: &str, no_device: bool) -> bool {
    if std::env::var_os("WM_UNDER_FAKE_CUDA").is_some() {
        return true;
    }
    let dir = tempfile::tempdir().unwrap();
    build_fake(dir.path());
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", dir.path())
        .env("WM_UNDER_FAKE_CUDA", "1")
        // The fake answers as NVRTC too: a real one named here (on a GPU
        // machine) would make PTX the fake cannot load.
        .env_remove("WM_NVRTC_LIB")
        .env("FAKE_CUDA_NO_DEVICE", if no_device { "1" } else { "0" })
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name} under the fake driver:\n{text}"
    );
    assert!(text.contains("1 passed"), "{name} did not run:\n{text}");
    false
}

fn build_fake(dir: &Path) {
    let src = dir.join("fake_cuda.c");
    std::fs::write(&src, FAKE).unwrap();
    std::fs::write(dir.join("fp8.cu"), KERNELS).unwrap();
    std::fs::write(dir.join("delta.cu"), DELTA_KERNELS).unwrap();
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .output()
        .expect("running cc");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One file under both names, so the loader maps it once.
    std::os::unix::fs::symlink(dir.join("libcuda.so"), dir.join("libcuda.so.1")).unwrap();
    // The fake answers as NVRTC too.
    std::os::unix::fs::symlink(dir.join("libcuda.so"), dir.join("libnvrtc.so")).unwrap();
}

/// The fake driver's control functions.
pub struct Fake {
    lib: *mut std::ffi::c_void,
}

impl Fake {
    pub fn open() -> Fake {
        weight_manager_core::internals::memory::cuda::cuda().expect("the fake driver loads");
        // SAFETY: the file the driver was loaded from (same inode).
        let lib = unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW) };
        assert!(!lib.is_null());
        Fake { lib }
    }

    fn sym(&self, name: &str) -> *mut std::ffi::c_void {
        let n = CString::new(name).unwrap();
        // SAFETY: a valid handle and name.
        let f = unsafe { libc::dlsym(self.lib, n.as_ptr()) };
        assert!(!f.is_null(), "{name} not in the fake driver");
        f
    }

    /// The call `name` after `skip` more calls of it fails.
    pub fn fail(&self, name: &str, skip: i32) {
        let n = CString::new(name).unwrap();
        // SAFETY: the fake's signature.
        let f: extern "C" fn(*const c_char, i32) =
            unsafe { std::mem::transmute(self.sym("fake_cuda_fail")) };
        f(n.as_ptr(), skip)
    }

    fn get(&self, name: &str) -> u64 {
        // SAFETY: the fake's signature.
        let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(self.sym(name)) };
        f()
    }

    /// The most page-locked host bytes alive at once so far.
    pub fn pinned_peak(&self) -> u64 {
        self.get("fake_cuda_pinned_peak")
    }

    /// Every event recorded from now on answers NOT_READY to its next `n`
    /// queries: copies stay in flight for a while.
    pub fn event_delay(&self, n: u64) {
        // SAFETY: the fake's signature.
        let f: extern "C" fn(u64) =
            unsafe { std::mem::transmute(self.sym("fake_cuda_event_delay")) };
        f(n)
    }

    /// While `on`, the library's deferred-release thread waits before
    /// unmapping or freeing device memory (at most 20 s: `hold_expired`).
    pub fn hold_freeing(&self, on: bool) {
        // SAFETY: the fake's signature.
        let f: extern "C" fn(i32) =
            unsafe { std::mem::transmute(self.sym("fake_cuda_hold_freeing")) };
        f(on as i32)
    }

    /// Whether a hold ran out before it was lifted.
    pub fn hold_expired(&self) -> bool {
        self.get("fake_cuda_hold_expired") != 0
    }

    /// Bytes of device memory alive.
    pub fn used(&self) -> u64 {
        self.get("fake_cuda_used")
    }

    /// The most alive since the last `reset_peak`.
    pub fn peak(&self) -> u64 {
        self.get("fake_cuda_peak")
    }

    pub fn reset_peak(&self) {
        // SAFETY: the fake's signature.
        let f: extern "C" fn() = unsafe { std::mem::transmute(self.sym("fake_cuda_reset_peak")) };
        f()
    }

    pub fn set_total(&self, bytes: u64) {
        // SAFETY: the fake's signature.
        let f: extern "C" fn(u64) = unsafe { std::mem::transmute(self.sym("fake_cuda_set_total")) };
        f(bytes)
    }

    /// The allocation mapped at each of `ptrs` (0: none).
    pub fn handles(&self, ptrs: &[u64]) -> Vec<u64> {
        // SAFETY: the fake's signature.
        let f: extern "C" fn(u64) -> u64 =
            unsafe { std::mem::transmute(self.sym("fake_cuda_handle_at")) };
        ptrs.iter().map(|&p| f(p)).collect()
    }

    /// How many times the copy or launch `name` was called in this
    /// process (cuMemcpy2D, cuMemcpy2DAsync, cuMemcpyAsync, cuMemcpyDtoH,
    /// cuLaunchKernel).
    pub fn calls(&self, name: &str) -> u64 {
        let n = CString::new(name).unwrap();
        // SAFETY: the fake's signature.
        let f: extern "C" fn(*const c_char) -> u64 =
            unsafe { std::mem::transmute(self.sym("fake_cuda_calls")) };
        f(n.as_ptr())
    }
}
