//! Every GPU kernel source compiles with a real NVRTC, no GPU needed: the
//! library compiles them at run time on the engine's GPU (`memory::nvrtc`),
//! so a source NVRTC refuses would otherwise show only on a GPU machine
//! (the test driver runs the same sources compiled as C). NVRTC is
//! `WM_NVRTC_LIB`, else the `.venv`'s nvidia-cuda-nvrtc-cu12 (which
//! `scripts/setup.sh` installs); in CI one must be found.

use std::path::PathBuf;
use weight_manager_core::internals::kernel_sources;
use weight_manager_core::internals::memory::nvrtc;

/// A libnvrtc to compile with.
fn find_nvrtc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WM_NVRTC_LIB").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let lib = std::fs::read_dir(".venv/lib").ok()?;
    lib.flatten()
        .map(|py| {
            py.path()
                .join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
        })
        .find(|p| p.exists())
}

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    let Some(lib) = find_nvrtc() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "no NVRTC: scripts/setup.sh installs nvidia-cuda-nvrtc-cu12 into .venv"
        );
        println!("skipped: no NVRTC (WM_NVRTC_LIB, or .venv: scripts/setup.sh)");
        return;
    };
    // Read once, by the loader's first use: this test binary has one test.
    std::env::set_var("WM_NVRTC_LIB", &lib);
    for (program, source) in kernel_sources() {
        let kernels: Vec<&str> = source
            .split("WM_KERNEL void ")
            .skip(1)
            .map(|rest| rest.split('(').next().unwrap())
            .collect();
        assert!(!kernels.is_empty(), "{program}: no kernels found");
        // Ampere and Hopper: the oldest the library targets, and the newest
        // it was run on.
        for arch in [(8, 0), (9, 0)] {
            let ptx = nvrtc::compile_to_ptx(program, source, arch)
                .unwrap_or_else(|e| panic!("{program} for compute_{}{}: {e}", arch.0, arch.1));
            let ptx = String::from_utf8_lossy(&ptx);
            for k in &kernels {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "{program}: kernel {k} not in its PTX"
                );
            }
        }
    }
}
