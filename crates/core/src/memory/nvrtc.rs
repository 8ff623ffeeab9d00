//! CUDA C compiled at run time: NVRTC turns a kernel source into PTX for
//! the GPU at hand, the driver loads it as a module (once per GPU and
//! source, kept for the process's life), and [`launch`] runs its kernels.
//! Users: the FP8 quantizer (`quant::device`) and deltas of GPU params
//! (`delta::device`).
//!
//! NVRTC is loaded with `dlopen` like UCX and NCCL (`dynlib`), not with
//! cudarc's `nvrtc` feature: cudarc looks only for the file names of the
//! CUDA version it was built for (12 here) and panics when none loads,
//! while an engine's image may carry NVRTC 13, or only the copy a PyTorch
//! wheel ships (`nvidia/cuda_nvrtc/lib`). Looked for: `$WM_NVRTC_LIB`,
//! then `libnvrtc.so`, `.so.13`, `.so.12`. Nothing is needed at build
//! time; without NVRTC the GPU quantizer is unavailable, with an error
//! saying so, and GPU params take no deltas (their runs come whole).

use super::cuda::{check, cuda};
use crate::dynlib::{dynamic_api, open_first};
use crate::result::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CString};

dynamic_api! { "libnvrtc", Api {
    nvrtcVersion: fn(*mut c_int, *mut c_int) -> c_int;
    nvrtcCreateProgram: fn(*mut *mut c_void, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
    nvrtcCompileProgram: fn(*mut c_void, c_int, *const *const c_char) -> c_int;
    nvrtcGetPTXSize: fn(*mut c_void, *mut usize) -> c_int;
    nvrtcGetPTX: fn(*mut c_void, *mut c_char) -> c_int;
    nvrtcGetProgramLogSize: fn(*mut c_void, *mut usize) -> c_int;
    nvrtcGetProgramLog: fn(*mut c_void, *mut c_char) -> c_int;
    nvrtcDestroyProgram: fn(*mut *mut c_void) -> c_int;
}}

/// Where NVRTC is looked for (module docs).
fn candidates() -> Vec<String> {
    match std::env::var("WM_NVRTC_LIB") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
            .map(String::from)
            .to_vec(),
    }
}

/// NVRTC, loaded once per process (a failure is retried by the next call).
fn nvrtc() -> Result<&'static Api> {
    static LOADED: Mutex<Option<&'static Api>> = Mutex::new(None);
    let mut loaded = LOADED.lock();
    if let Some(api) = *loaded {
        return Ok(api);
    }
    let (handle, path) = open_first(&candidates()).map_err(|tried| {
        Error::unsupported(format!(
            "NVRTC is not available ({}): the GPU kernels (FP8 quantization, deltas of GPU \
             params) are compiled at run time; install the CUDA runtime compiler (e.g. `pip install nvidia-cuda-nvrtc-cu12`) \
             and set WM_NVRTC_LIB to its libnvrtc.so",
            tried.join("; ")
        ))
    })?;
    // SAFETY: a live handle; each symbol is looked up by name.
    let api = unsafe { Api::resolve(handle) }
        .map_err(|why| Error::unsupported(format!("{path} is not a usable NVRTC: {why}")))?;
    let api: &'static Api = Box::leak(Box::new(api));
    *loaded = Some(api);
    Ok(api)
}

/// A loaded module's kernel (a `CUfunction`; modules are never unloaded).
#[derive(Clone, Copy, Debug)]
pub struct Kernel(usize);

/// Kernel `name` of `source` (named `program` in NVRTC's messages),
/// compiled for GPU `ordinal` on first use. Leaves that GPU's context
/// current.
pub fn kernel(ordinal: i32, program: &'static str, source: &str, name: &str) -> Result<Kernel> {
    static MODULES: Mutex<Vec<((i32, &'static str), usize)>> = Mutex::new(Vec::new());
    cuda()?.make_current(ordinal)?;
    let module = {
        let mut modules = MODULES.lock();
        match modules.iter().find(|(k, _)| *k == (ordinal, program)) {
            Some(&(_, m)) => m,
            None => {
                let m = load(ordinal, program, source)?;
                modules.push(((ordinal, program), m));
                m
            }
        }
    };
    let c_name =
        CString::new(name).map_err(|_| Error::invalid_argument("a kernel name with NUL"))?;
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    let r = unsafe { sys::cuModuleGetFunction(&mut f, module as sys::CUmodule, c_name.as_ptr()) };
    check(r, &format!("cuModuleGetFunction({name})"))?;
    Ok(Kernel(f as usize))
}

/// Compile `source` for GPU `ordinal`'s architecture and load it there.
fn load(ordinal: i32, program: &str, source: &str) -> Result<usize> {
    let ptx = compile(program, source, compute_capability(ordinal)?)?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: a NUL-terminated PTX image; the GPU's context is current.
    let r = unsafe { sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) };
    check(r, &format!("cuModuleLoadData({program}: PTX from NVRTC)"))
        .map_err(|e| e.context("a newer NVRTC than the driver makes PTX it cannot load"))?;
    Ok(module as usize)
}

fn compute_capability(ordinal: i32) -> Result<(i32, i32)> {
    let (mut major, mut minor, mut dev) = (0, 0, 0);
    use sys::CUdevice_attribute::*;
    // SAFETY: valid out-pointers; the ordinal was checked by make_current.
    unsafe {
        check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        check(
            sys::cuDeviceGetAttribute(
                &mut major,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)",
        )?;
        check(
            sys::cuDeviceGetAttribute(
                &mut minor,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                dev,
            ),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)",
        )?;
    }
    Ok((major, minor))
}

/// `source` compiled to PTX (NUL-terminated) for compute capability
/// `(major, minor)`. No fast-math: the quantizer's arithmetic is IEEE's.
/// What every kernel source starts with under NVRTC: the integer types
/// and the kernel macros it is written with (the test driver, which
/// compiles the same sources as C, defines them its own way).
const PRELUDE: &str = "typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define WM_KERNEL extern \"C\" __global__
#define WM_DEVICE static __device__ __forceinline__
#define WM_FIRST_THREAD ((u64)blockIdx.x * blockDim.x + threadIdx.x)
#define WM_THREADS ((u64)gridDim.x * blockDim.x)
";

/// The PTX of `source` for compute capability `arch`, as the library
/// compiles it (no GPU needed: the tests compile every kernel source with
/// a real NVRTC where no GPU is).
#[doc(hidden)]
pub fn compile_to_ptx(program: &str, source: &str, arch: (i32, i32)) -> Result<Vec<u8>> {
    compile(program, source, arch)
}

fn compile(program: &str, source: &str, (major, minor): (i32, i32)) -> Result<Vec<u8>> {
    let api = nvrtc()?;
    let src = CString::new(format!("{PRELUDE}{source}"))
        .map_err(|_| Error::invalid_argument("a kernel source with NUL"))?;
    let name =
        CString::new(program).map_err(|_| Error::invalid_argument("a program name with NUL"))?;
    let arch = CString::new(format!("--gpu-architecture=compute_{major}{minor}")).expect("no NUL");
    let failed = |call: &str, r: c_int| {
        Error::unsupported(format!("NVRTC {call} for {program}: result {r}"))
    };
    let mut prog: *mut c_void = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings, no headers.
    let r = unsafe {
        (api.nvrtcCreateProgram)(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(failed("nvrtcCreateProgram", r));
    }
    let options = [arch.as_ptr()];
    // SAFETY: a live program and one NUL-terminated option.
    let compiled = unsafe { (api.nvrtcCompileProgram)(prog, 1, options.as_ptr()) };
    let out = match compiled {
        0 => ptx(api, prog).ok_or_else(|| failed("nvrtcGetPTX", -1)),
        r => Err(Error::unsupported(format!(
            "NVRTC {} could not compile {program} for compute_{major}{minor} (result {r}): {}",
            version(api),
            log(api, prog)
        ))),
    };
    // SAFETY: the program created above, destroyed once.
    unsafe { (api.nvrtcDestroyProgram)(&mut prog) };
    out
}

fn version(api: &Api) -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers.
    match unsafe { (api.nvrtcVersion)(&mut major, &mut minor) } {
        0 => format!("{major}.{minor}"),
        _ => "(version unknown)".into(),
    }
}

fn ptx(api: &Api, prog: *mut c_void) -> Option<Vec<u8>> {
    let mut n = 0usize;
    // SAFETY: a compiled program; the buffer has the size NVRTC gave.
    unsafe {
        ((api.nvrtcGetPTXSize)(prog, &mut n) == 0).then_some(())?;
        let mut buf = vec![0u8; n.max(1)];
        ((api.nvrtcGetPTX)(prog, buf.as_mut_ptr().cast()) == 0).then_some(())?;
        // NVRTC counts the NUL; a missing one is added.
        if buf.last() != Some(&0) {
            buf.push(0);
        }
        Some(buf)
    }
}

fn log(api: &Api, prog: *mut c_void) -> String {
    let mut n = 0usize;
    // SAFETY: a live program; the buffer has the size NVRTC gave.
    unsafe {
        if (api.nvrtcGetProgramLogSize)(prog, &mut n) != 0 || n == 0 {
            return "no log".into();
        }
        let mut buf = vec![0u8; n];
        (api.nvrtcGetProgramLog)(prog, buf.as_mut_ptr().cast());
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}

/// Launch `kernel` on `blocks` x `threads` threads on `stream` (its GPU's
/// context current) with `params` (a pointer to each argument).
///
/// # Safety
/// `params` match the kernel's parameters, and what they point at (device
/// memory included) stays valid until the stream is synchronized.
pub unsafe fn launch(
    kernel: Kernel,
    (blocks, threads): (u32, u32),
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    check(
        sys::cuLaunchKernel(
            kernel.0 as sys::CUfunction,
            blocks,
            1,
            1,
            threads,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
        "cuLaunchKernel",
    )
}
