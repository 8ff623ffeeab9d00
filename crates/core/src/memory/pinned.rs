//! Page-locked ("pinned") host memory: what the DMA engine copies to and
//! from a GPU without the driver's own bounce buffers. The device staging
//! (`staging.rs`) keeps these for uploads; a publisher reads GPU slices
//! back through one to hash them (`publisher/device_sums.rs`).

use super::cuda::{check, cuda};
use crate::result::Result;
use cudarc::driver::sys;

/// Page-locked host memory, freed with `cuMemFreeHost` on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: plain memory owned by this value; the driver does not tie it to a
// thread (allocated PORTABLE, so any context may copy from it).
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// `cap` bytes, page-locked for GPU `ordinal` (and portable to all).
    pub(crate) fn new(ordinal: i32, cap: usize) -> Result<PinnedBuffer> {
        let c = cuda()?;
        c.make_current(ordinal)?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        check(
            // SAFETY: a valid out-pointer; the flags ask for portable, cached memory.
            unsafe { sys::cuMemHostAlloc(&mut p, cap, sys::CU_MEMHOSTALLOC_PORTABLE) },
            "cuMemHostAlloc",
        )
        .map_err(|e| e.context(format!("pinned staging buffer of {cap} bytes")))?;
        Ok(PinnedBuffer { ptr: p.cast(), cap })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn cap(&self) -> usize {
        self.cap
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; no copy reads it any more
        // (the staging only drops buffers whose event completed).
        unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}
