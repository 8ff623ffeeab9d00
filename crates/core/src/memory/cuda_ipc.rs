//! GPU memory shared between processes with CUDA IPC handles.
//!
//! The trainer's publisher copies a published version's device tensors
//! into one [`ExportedDeviceBuffer`] (`cuMemAlloc`, then
//! `cuIpcGetMemHandle`); an IPC session hands its 64-byte handle to the
//! engine, which opens it once per session as an [`ImportedDeviceBuffer`]
//! (`cuIpcOpenMemHandle`, closed when the session ends) and copies device
//! to device into its params.
//!
//! Ordering: the publisher synchronizes the device before copying a
//! version (every kernel that wrote the trainer's tensors has finished)
//! and its copies are synchronous, so a version's bytes are complete
//! before any session announces them. The engine waits for its copies out
//! of a bucket before acknowledging it, so the trainer never frees or
//! refills memory an engine still reads.

use super::cuda::{check, cuda};
pub use super::device::{DeviceAllocation, DeviceSpan};
use crate::result::{Error, Result};
use cudarc::driver::sys;

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub(crate) const HANDLE_BYTES: usize = 64;

/// Wait for all work on GPU `ordinal` (in its primary context).
pub fn synchronize(ordinal: i32) -> Result<()> {
    cuda()?.make_current(ordinal)?;
    // SAFETY: a plain driver call on the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Wait, until `deadline`, for the work queued so far on GPU `ordinal`'s
/// legacy default stream (which follows every blocking stream's earlier
/// work): an event recorded there, polled. A wedged GPU is a timeout
/// error naming `what`, never a hang.
pub fn wait_default_stream(ordinal: i32, deadline: std::time::Instant, what: &str) -> Result<()> {
    cuda()?.make_current(ordinal)?;
    let mut event: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    check(
        // SAFETY: a valid out-pointer; the event is destroyed below.
        unsafe { sys::cuEventCreate(&mut event, flags) },
        "cuEventCreate",
    )?;
    let r = check(
        // SAFETY: our event, on the current context's legacy stream.
        unsafe { sys::cuEventRecord(event, std::ptr::null_mut()) },
        "cuEventRecord",
    )
    .and_then(|()| loop {
        // SAFETY: an event recorded above.
        match unsafe { sys::cuEventQuery(event) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(20))
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                return Err(Error::timeout(format!(
                    "GPU {ordinal}: {what} did not finish in time"
                )))
            }
            other => return check(other, "cuEventQuery"),
        }
    });
    // SAFETY: our event; destroying it while pending is allowed.
    unsafe { sys::cuEventDestroy_v2(event) };
    r
}

/// Device memory this process allocated and shares by handle.
#[derive(Debug)]
pub struct ExportedDeviceBuffer {
    memory: DeviceAllocation,
    handle: [u8; HANDLE_BYTES],
}

impl std::ops::Deref for ExportedDeviceBuffer {
    type Target = DeviceSpan;
    fn deref(&self) -> &DeviceSpan {
        &self.memory
    }
}

impl ExportedDeviceBuffer {
    /// `len` bytes (at least one) on GPU `ordinal`; `what` names the owner
    /// in errors.
    pub fn new(what: &str, ordinal: i32, len: usize) -> Result<ExportedDeviceBuffer> {
        let memory = DeviceAllocation::new(what, ordinal, len)?;
        let mut raw = sys::CUipcMemHandle_st {
            reserved: [0; HANDLE_BYTES],
        };
        check(
            // SAFETY: a valid out-pointer and our own allocation (current context).
            unsafe { sys::cuIpcGetMemHandle(&mut raw, memory.ptr()) },
            "cuIpcGetMemHandle",
        )
        .map_err(|e| e.context(what))?;
        let handle = raw.reserved.map(|b| b as u8);
        Ok(ExportedDeviceBuffer { memory, handle })
    }

    /// The handle another process opens.
    pub fn handle(&self) -> [u8; HANDLE_BYTES] {
        self.handle
    }

    /// Copy `len` bytes from `src` (a device address of any GPU of this
    /// process, or host memory) to byte `offset` of this buffer; returns
    /// once copied.
    ///
    /// # Safety
    /// `src..src+len` is readable memory that nothing writes meanwhile, and
    /// `offset + len` is within this buffer (checked).
    pub unsafe fn copy_in(&self, offset: usize, src: u64, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::invalid_argument(format!(
                "{len} bytes at offset {offset} do not fit a device buffer of {} bytes",
                self.len
            )));
        }
        cuda()?.make_current(self.ordinal)?;
        let dst = self.ptr + offset as u64;
        // Ordinary host memory is unknown to the driver: copy it as host
        // memory; device (or registered) memory by unified addressing.
        let mut kind: u32 = 0;
        let known = sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            src,
        ) == sys::CUresult::CUDA_SUCCESS;
        if known {
            check(sys::cuMemcpy(dst, src, len), "cuMemcpy (to the GPU buffer)")
        } else {
            check(
                sys::cuMemcpyHtoD_v2(dst, src as *const std::ffi::c_void, len),
                "cuMemcpyHtoD (to the GPU buffer)",
            )
        }
    }
}

/// Another process's device memory, opened from its handle in this
/// process's context of GPU `ordinal` (peer access is enabled when the
/// memory lives on another GPU). Closed on drop.
#[derive(Debug)]
pub struct ImportedDeviceBuffer {
    span: DeviceSpan,
}

impl std::ops::Deref for ImportedDeviceBuffer {
    type Target = DeviceSpan;
    fn deref(&self) -> &DeviceSpan {
        &self.span
    }
}

impl ImportedDeviceBuffer {
    /// Open `handle`, announced as `len` bytes, on GPU `ordinal`.
    pub fn open(
        what: &str,
        ordinal: i32,
        handle: &[u8; HANDLE_BYTES],
        len: usize,
    ) -> Result<ImportedDeviceBuffer> {
        let c = cuda().map_err(|e| e.context(format!("{what} is GPU memory (CUDA IPC)")))?;
        c.check_ordinal(ordinal, what)?;
        c.make_current(ordinal)?;
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0u64;
        check(
            // SAFETY: a valid out-pointer; the handle is only bytes to the driver,
            // which refuses one it did not issue.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    raw,
                    sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )
        .map_err(|e| e.context(format!("{what} on GPU {ordinal}")))?;
        let opened = ImportedDeviceBuffer {
            span: DeviceSpan { ordinal, ptr, len },
        };
        // The announced length must lie inside the real allocation.
        let mut size = 0usize;
        // SAFETY: out-pointer of the attribute's type.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut size as *mut usize).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                ptr,
            )
        };
        check(r, "cuPointerGetAttribute(RANGE_SIZE)")?;
        if len > size {
            return Err(Error::peer(format!(
                "{what}: announced as {len} bytes but the GPU allocation holds {size}"
            )));
        }
        Ok(opened)
    }
}

impl Drop for ImportedDeviceBuffer {
    fn drop(&mut self) {
        if cuda().and_then(|c| c.make_current(self.ordinal)).is_ok() {
            // SAFETY: opened by us; copies out of it were waited for.
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Copy `len` bytes from device address `src` (valid in GPU `ordinal`'s
/// context) to host memory at `dst`; returns once copied.
///
/// # Safety
/// `dst..dst+len` is writable host memory and `src..src+len` device memory.
pub unsafe fn download(ordinal: i32, dst: *mut u8, src: u64, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    cuda()?.make_current(ordinal)?;
    check(sys::cuMemcpyDtoH_v2(dst.cast(), src, len), "cuMemcpyDtoH")
}

/// Copy `len` bytes of host memory at `src` to device address `dst`
/// (valid in GPU `ordinal`'s context); returns once copied.
///
/// # Safety
/// `src..src+len` is readable host memory and `dst..dst+len` device memory.
pub unsafe fn upload(ordinal: i32, dst: u64, src: *const u8, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    cuda()?.make_current(ordinal)?;
    check(sys::cuMemcpyHtoD_v2(dst, src.cast(), len), "cuMemcpyHtoD")
}

/// Copy the rows of `run` (equally spaced blocks of device memory valid in
/// GPU `ordinal`'s context: `memory::strided`) to host memory with one 2D
/// copy; returns once copied.
///
/// # Safety
/// Every destination row is writable host memory, rows not overlapping;
/// every source row device memory.
pub unsafe fn download_2d(ordinal: i32, run: &super::strided::Strided) -> Result<()> {
    if run.bytes() == 0 {
        return Ok(());
    }
    cuda()?.make_current(ordinal)?;
    super::cuda::copy_2d(run, super::cuda::CopyTo::Host, None)
}
