//! CUDA device memory through the driver API, loaded at run time.
//!
//! cudarc's `dynamic-loading` finds `libcuda.so` (or `.so.1`) on the first
//! call, so this library builds and loads on machines without CUDA. cudarc
//! panics when the library or a symbol is missing; [`cuda`] checks for the
//! library first and runs initialization under `catch_unwind`, so a broken or
//! partial driver becomes an error naming what is missing, never a panic.
//!
//! What is here: finding the driver and its devices (with the error an
//! engine author needs for each way that fails), checking that a device
//! pointer the engine registers really is device memory of the GPU it
//! names and holds the param's bytes, and making the device's primary
//! context current (the context PyTorch and most engines use). Copies to
//! the GPU live in `memory::staging` (pinned, asynchronous) and
//! `memory::cuda_ipc` (between processes).

use crate::result::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;

/// The loaded driver and what it reports.
pub struct Cuda {
    version: i32,
    devices: i32,
    /// Retained primary contexts by ordinal (kept for the process's life).
    contexts: Mutex<HashMap<i32, usize>>,
}

static CUDA: OnceLock<std::result::Result<Cuda, Error>> = OnceLock::new();

/// The driver, loaded and initialized once per process; the same error
/// every time when it cannot be.
pub fn cuda() -> Result<&'static Cuda> {
    CUDA.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Cuda> {
    // SAFETY: only tries to dlopen the candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::unsupported(
            "the CUDA driver library (libcuda.so.1) was not found: device params need \
             an NVIDIA driver (check LD_LIBRARY_PATH inside containers)",
        ));
    }
    std::panic::catch_unwind(|| {
        let mut version = 0;
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check(sys::cuDriverGetVersion(&mut version), "cuDriverGetVersion")?;
            match sys::cuInit(0) {
                CUresult::CUDA_SUCCESS => {}
                CUresult::CUDA_ERROR_NO_DEVICE => {
                    return Err(Error::unsupported(format!(
                        "the CUDA driver ({}) is present but reports no device \
                         (cuInit: CUDA_ERROR_NO_DEVICE); check CUDA_VISIBLE_DEVICES and /dev/nvidia*",
                        version_text(version)
                    )))
                }
                other => {
                    return Err(Error::unsupported(format!(
                        "the CUDA driver ({}) failed to initialize: cuInit returned {other:?}",
                        version_text(version)
                    )))
                }
            }
            let mut devices = 0;
            check(sys::cuDeviceGetCount(&mut devices), "cuDeviceGetCount")?;
            if devices <= 0 {
                return Err(Error::unsupported(format!(
                    "the CUDA driver ({}) initialized but sees no device",
                    version_text(version)
                )));
            }
            Ok(Cuda {
                version,
                devices,
                contexts: Mutex::new(HashMap::new()),
            })
        }
    })
    .unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown failure".into());
        Err(Error::unsupported(format!(
            "the CUDA driver library is unusable: {why}"
        )))
    })
}

fn version_text(v: i32) -> String {
    format!("CUDA {}.{}", v / 1000, (v % 1000) / 10)
}

/// A driver result as an error naming the call.
pub(crate) fn check(r: CUresult, call: &str) -> Result<()> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::out_of_memory(format!(
            "{call}: CUDA_ERROR_OUT_OF_MEMORY"
        ))),
        other => Err(Error::new(
            crate::result::wm_result::WM_ERR_IO,
            format!("{call}: {other:?}"),
        )),
    }
}

/// A new non-blocking stream in the current context: the engine's work on
/// the legacy default stream does not serialize with ours. Used for
/// uploads (`memory::staging`) and fan-out (`fanout::nccl`).
pub(crate) fn new_stream() -> Result<sys::CUstream> {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    check(
        // SAFETY: a valid out-pointer.
        unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        },
        "cuStreamCreate",
    )?;
    Ok(stream)
}

impl Cuda {
    /// "CUDA 12.8, 2 device(s)".
    pub fn describe(&self) -> String {
        format!("{}, {} device(s)", version_text(self.version), self.devices)
    }

    pub fn device_count(&self) -> i32 {
        self.devices
    }

    /// Name and total memory of device `ordinal`.
    pub fn device_info(&self, ordinal: i32) -> Result<(String, usize)> {
        self.check_ordinal(ordinal, "device")?;
        let mut dev = 0;
        let mut name = [0 as std::ffi::c_char; 256];
        let mut total = 0usize;
        // SAFETY: valid out-pointers and buffer length.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            check(
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
                "cuDeviceGetName",
            )?;
            check(
                sys::cuDeviceTotalMem_v2(&mut total, dev),
                "cuDeviceTotalMem",
            )?;
        }
        // SAFETY: the driver wrote a NUL-terminated name into the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
        Ok((name.to_string_lossy().into_owned(), total))
    }

    /// `ordinal` names one of this process's devices.
    pub fn check_ordinal(&self, ordinal: i32, what: &str) -> Result<()> {
        if ordinal < 0 || ordinal >= self.devices {
            return Err(Error::invalid_argument(format!(
                "{what}: device ordinal {ordinal} is out of range (this process sees {} device(s), 0 to {})",
                self.devices,
                self.devices - 1
            )));
        }
        Ok(())
    }

    /// Make device `ordinal`'s primary context current on this thread (what
    /// the engine's own CUDA calls on that device use too).
    pub fn make_current(&self, ordinal: i32) -> Result<()> {
        self.check_ordinal(ordinal, "device")?;
        let mut contexts = self.contexts.lock();
        let ctx = match contexts.get(&ordinal) {
            Some(&c) => c as sys::CUcontext,
            None => {
                let mut dev = 0;
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: valid out-pointers; the ordinal was range-checked.
                unsafe {
                    check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
                    check(
                        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                        "cuDevicePrimaryCtxRetain",
                    )?;
                }
                contexts.insert(ordinal, ctx as usize);
                ctx
            }
        };
        // SAFETY: a retained context, never released.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
    }

    /// Check that `[ptr, ptr + len)` is device memory of GPU `ordinal`,
    /// inside one allocation. `what` names the param in errors.
    pub fn check_device_range(&self, ordinal: i32, ptr: u64, len: usize, what: &str) -> Result<()> {
        self.check_ordinal(ordinal, what)?;
        if ptr == 0 {
            return Err(Error::null_argument(format!(
                "{what}: device pointer is NULL"
            )));
        }
        self.make_current(ordinal)?;
        let attr = |a: sys::CUpointer_attribute, out: *mut std::ffi::c_void| {
            // SAFETY: `out` points at storage of the attribute's type.
            unsafe { sys::cuPointerGetAttribute(out, a, ptr) }
        };
        let mut kind: u32 = 0;
        let r = attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut kind as *mut u32).cast(),
        );
        if r != CUresult::CUDA_SUCCESS || kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::invalid_argument(format!(
                "{what}: {ptr:#x} is not CUDA device memory (cuPointerGetAttribute: {r:?}, memory type {kind})"
            )));
        }
        let mut on: i32 = -1;
        check(
            attr(
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                (&mut on as *mut i32).cast(),
            ),
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
        )?;
        if on != ordinal {
            return Err(Error::invalid_argument(format!(
                "{what}: {ptr:#x} is memory of GPU {on}, not of GPU {ordinal} as registered"
            )));
        }
        let (mut start, mut size): (u64, usize) = (0, 0);
        check(
            attr(
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                (&mut start as *mut u64).cast(),
            ),
            "cuPointerGetAttribute(RANGE_START_ADDR)",
        )?;
        check(
            attr(
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                (&mut size as *mut usize).cast(),
            ),
            "cuPointerGetAttribute(RANGE_SIZE)",
        )?;
        let end = ptr.checked_add(len as u64);
        if end.is_none_or(|e| e > start.saturating_add(size as u64)) {
            return Err(Error::invalid_argument(format!(
                "{what}: {len} bytes at {ptr:#x} run past the end of its allocation ({size} bytes at {start:#x})"
            )));
        }
        Ok(())
    }
}

/// Where a 2D copy's rows go: GPU memory (any GPU of this process, by
/// unified addressing) or host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyTo {
    Device,
    Host,
}

/// Copy the rows of `run` out of GPU memory (by unified addressing) with
/// one `cuMemcpy2DAsync` queued on `stream`, or, with None, one
/// synchronous `cuMemcpy2D` (a host destination that is not pinned).
/// In every driver since CUDA 4 (`memory::strided` says why it pays).
/// Device to device, pitches the driver refuses (it may, for pitches
/// `cuMemAllocPitch` did not choose) are copied row by row instead.
///
/// # Safety
/// The context of the GPU holding `run.src` is current; every source row
/// is readable device memory and every destination row writable memory of
/// kind `to`, rows not overlapping; queued, both stay so until `stream` is
/// synchronized.
pub(crate) unsafe fn copy_2d(
    run: &super::strided::Strided,
    to: CopyTo,
    stream: Option<sys::CUstream>,
) -> Result<()> {
    if run.bytes() == 0 {
        return Ok(());
    }
    let (dst_type, dst_host, dst_device) = match to {
        CopyTo::Device => (
            sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            std::ptr::null_mut(),
            run.dst,
        ),
        CopyTo::Host => (sys::CUmemorytype::CU_MEMORYTYPE_HOST, run.dst as *mut _, 0),
    };
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        srcHost: std::ptr::null(),
        srcDevice: run.src,
        srcArray: std::ptr::null_mut(),
        srcPitch: run.src_pitch as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: run.dst_pitch as usize,
        WidthInBytes: run.width,
        Height: run.height,
    };
    let Some(stream) = stream else {
        return check(sys::cuMemcpy2D_v2(&p), "cuMemcpy2D");
    };
    let r = sys::cuMemcpy2DAsync_v2(&p, stream);
    if to == CopyTo::Device && r == CUresult::CUDA_ERROR_INVALID_VALUE {
        // The driver may refuse device-to-device pitches cuMemAllocPitch
        // did not choose (its unaligned 2D copy has no asynchronous form):
        // then the rows go one by one.
        for k in 0..run.height as u64 {
            let (dst, src) = (run.dst + k * run.dst_pitch, run.src + k * run.src_pitch);
            check(
                sys::cuMemcpyAsync(dst, src, run.width, stream),
                "cuMemcpyAsync (a row, after cuMemcpy2DAsync refused the pitches)",
            )?;
        }
        return Ok(());
    }
    check(r, "cuMemcpy2DAsync")
}
