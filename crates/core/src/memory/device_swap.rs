//! Device page swap: the commit of an atomic update into a library-owned
//! device param ([`DeviceRegion`]) without writing the param's memory.
//!
//! The update lands in [`DevicePages`]: a fresh physical allocation of the
//! region's size, mapped at an address range of its own (the shadow), so
//! uploads go there while the engine's kernels still read the old weights.
//! At commit [`DeviceRegion::swap_in`] waits for the device, unmaps the old
//! allocation from the param's range, maps the new one at the same
//! addresses and sets its access: pointers the engine captured (CUDA graphs
//! among them) stay valid. The old allocation comes back as `DevicePages`
//! without a mapping, kept until every swap of the update went through, so
//! that a later failure can swap it back; dropping it frees it.
//!
//! What a commit takes out is freed off the engine's pause when the commit
//! is a staged one ([`super::deferred::DeferredRelease`]): each swap leaves the old
//! allocation to be released by a thread of its own once the commit
//! returned (on the H200 those driver calls were most of a staged commit's
//! pause); the next update, a clear or the manager's end waits for that
//! thread first. A staged update also unmaps each shadow's view before it
//! reports staged ([`DevicePages::drop_view`]), so the commit maps the new
//! memory at the param's addresses only; a one-call update leaves the
//! view to go with the old memory.
//!
//! Between the unmap and the map the range has no memory: a kernel reading
//! the param then faults. So the engine must not run kernels that read a
//! swapped param while `wm_update` commits (the device is synchronized
//! before the first unmap, so work queued before the commit is safe; a
//! commit of many params waits once, [`DeviceRegion::swap_in_synchronized`],
//! and the memory it takes out is freed without waiting again).
//!
//! Failure: a swap that cannot map the new allocation maps the old one
//! again; if even that fails, the region holds no memory
//! ([`DeviceRegion::is_mapped`] false) and the next update maps fresh
//! memory there, like after a clear. Never a range that looks mapped and
//! is not.

use super::cuda::{check, cuda};
use super::device::{create, map_rw, DeviceRegion};
use crate::result::{Error, Result};
use cudarc::driver::sys;

/// Physical device memory that is not a param's: a shadow an update lands
/// in (mapped at a range of its own), or the memory a swap took out of a
/// param. Released (after waiting for the device) on drop.
#[derive(Debug)]
pub struct DevicePages {
    ordinal: i32,
    handle: sys::CUmemGenericAllocationHandle,
    len: usize,
    /// The range reserved for a shadow and mapped to it (a staged update
    /// unmaps it before its commit: `drop_view`). After a one-call
    /// update's swap, the memory taken out carries the shadow's range
    /// instead (mapped to the memory that went in, which keeps the param's
    /// own mapping), so that unmapping it goes with freeing the old memory.
    view: Option<u64>,
    /// Taken out of a param after the device was synchronized: nothing
    /// can use it, so dropping it needs no wait.
    idle: bool,
}

impl DevicePages {
    /// The shadow's device address (None: mapped nowhere).
    pub fn ptr(&self) -> Option<u64> {
        self.view
    }

    /// Unmap the view (a shadow's, once every copy into it finished: the
    /// caller synchronized the device), so that the swap maps the memory
    /// at the param's addresses only.
    pub fn drop_view(&mut self) {
        self.unview();
    }

    /// Unmap the view and free its addresses; the allocation lives on (as
    /// the handle returned).
    fn into_handle(mut self) -> sys::CUmemGenericAllocationHandle {
        self.unview();
        self.into_parts().0
    }

    /// The allocation (as its handle) and the view, still mapped.
    fn into_parts(mut self) -> (sys::CUmemGenericAllocationHandle, Option<u64>) {
        let parts = (self.handle, self.view.take());
        std::mem::forget(self);
        parts
    }

    fn unview(&mut self) {
        if let Some(ptr) = self.view.take() {
            unmap_view(self.ordinal, ptr, self.len);
        }
    }
}

/// Unmap a view of `len` bytes at `ptr` on GPU `ordinal` and free its
/// addresses.
fn unmap_view(ordinal: i32, ptr: u64, len: usize) {
    if cuda().and_then(|c| c.make_current(ordinal)).is_ok() {
        // SAFETY: a view of ours, mapped once; copies into it are done
        // (the device was synchronized by the caller or by drop).
        unsafe {
            sys::cuMemUnmap(ptr, len);
            sys::cuMemAddressFree(ptr, len);
        }
    }
}

impl Drop for DevicePages {
    fn drop(&mut self) {
        if let Ok(c) = cuda() {
            if c.make_current(self.ordinal).is_ok() && !self.idle {
                // Uploads into a shadow may still run after a failure.
                // SAFETY: plain driver call.
                unsafe { sys::cuCtxSynchronize() };
            }
        }
        self.unview();
        // SAFETY: our handle, mapped nowhere now.
        unsafe { sys::cuMemRelease(self.handle) };
    }
}

impl DeviceRegion {
    /// A shadow for this region: fresh physical memory of its mapped size
    /// at addresses of its own. Bytes from `len` on (the granule's tail
    /// past the param) are zeroed, as after a restore; the update writes
    /// the rest. `what` names the param in errors.
    pub fn shadow(&self, len: usize, what: &str) -> Result<DevicePages> {
        let context = |e: Error| e.context(format!("{what}: device page swap shadow"));
        cuda().map_err(context)?.make_current(self.ordinal)?;
        let mut ptr = 0u64;
        check(
            // SAFETY: valid out-pointer; any address, aligned as the param's.
            unsafe { sys::cuMemAddressReserve(&mut ptr, self.mapped, self.granule, 0, 0) },
            "cuMemAddressReserve",
        )
        .map_err(context)?;
        let handle = match create(self.ordinal, self.mapped) {
            Ok(h) => h,
            Err(e) => {
                // SAFETY: our reservation, nothing mapped.
                unsafe { sys::cuMemAddressFree(ptr, self.mapped) };
                return Err(context(e));
            }
        };
        let mut pages = DevicePages {
            ordinal: self.ordinal,
            handle,
            len: self.mapped,
            view: None,
            idle: false,
        };
        // SAFETY: a fresh reservation of the allocation's size.
        if let Err(e) = unsafe { map_rw(self.ordinal, ptr, self.mapped, handle) } {
            // SAFETY: as above.
            unsafe { sys::cuMemAddressFree(ptr, self.mapped) };
            return Err(context(e));
        }
        pages.view = Some(ptr);
        let tail = self.mapped.saturating_sub(len);
        check(
            // SAFETY: the last `tail` bytes of the view, just mapped read-write.
            unsafe { sys::cuMemsetD8_v2(ptr + (self.mapped - tail) as u64, 0, tail) },
            "cuMemsetD8",
        )
        .map_err(context)?;
        Ok(pages)
    }

    /// Put `pages` in place of the region's memory, at the region's
    /// addresses, after waiting for the device. Returns the memory taken
    /// out (None when the region held none), unmapped and not yet freed.
    ///
    /// On error `pages` are freed and the region holds what it held before
    /// or, when mapping that again failed too, nothing
    /// ([`DeviceRegion::is_mapped`] false).
    pub fn swap_in(&self, pages: DevicePages) -> Result<Option<DevicePages>> {
        self.swap(pages, true)
    }

    /// [`DeviceRegion::swap_in`] when the caller has just synchronized the
    /// device (a commit swapping many params waits once, not per param).
    pub fn swap_in_synchronized(&self, pages: DevicePages) -> Result<Option<DevicePages>> {
        self.swap(pages, false)
    }

    fn swap(&self, pages: DevicePages, wait: bool) -> Result<Option<DevicePages>> {
        if pages.len != self.mapped || pages.ordinal != self.ordinal {
            return Err(Error::invalid_argument(format!(
                "device page swap: {} bytes of GPU {} cannot replace {} bytes of GPU {}",
                pages.len, pages.ordinal, self.mapped, self.ordinal
            )));
        }
        let mut handle = self.handle.lock();
        cuda()?.make_current(self.ordinal)?;
        // SAFETY: plain driver calls on our own range.
        unsafe {
            // Nothing may read or write the old memory when it goes: the
            // engine's queued kernels, the uploads into `pages`.
            if wait {
                check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
            }
            if handle.is_some() {
                check(sys::cuMemUnmap(self.ptr, self.mapped), "cuMemUnmap")?;
            }
        }
        let old = handle.take().map(|h| DevicePages {
            ordinal: self.ordinal,
            handle: h,
            len: self.mapped,
            view: None,
            idle: true,
        });
        // SAFETY: the range is ours, unmapped; the allocation is its size.
        match unsafe { map_rw(self.ordinal, self.ptr, self.mapped, pages.handle) } {
            Ok(()) => {
                let (new, view) = pages.into_parts();
                *handle = Some(new);
                // The shadow's view goes with the old memory (field docs),
                // or now when the region held none.
                match old {
                    Some(mut old) => {
                        old.view = view;
                        Ok(Some(old))
                    }
                    None => {
                        if let Some(ptr) = view {
                            unmap_view(self.ordinal, ptr, self.mapped);
                        }
                        Ok(None)
                    }
                }
            }
            Err(e) => {
                drop(pages);
                let Some(old) = old else { return Err(e) };
                // SAFETY: as above, for the allocation just unmapped here.
                match unsafe { map_rw(self.ordinal, self.ptr, self.mapped, old.handle) } {
                    Ok(()) => {
                        *handle = Some(old.into_handle());
                        Err(e.context("device page swap failed, the old memory is mapped again"))
                    }
                    Err(again) => Err(e.context(format!(
                        "device page swap failed and mapping the old memory back failed too \
                         ({again}): the param holds no memory until the next update"
                    ))),
                }
            }
        }
    }
}
