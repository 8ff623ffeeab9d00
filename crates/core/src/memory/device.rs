//! Library-owned device memory at a stable address, through CUDA virtual
//! memory management (cuMemAddressReserve / cuMemCreate / cuMemMap).
//!
//! The virtual range is reserved once, for the param's life. A clear unmaps
//! and releases the physical memory behind it (the GPU really gets it back)
//! but keeps the range; the next update maps fresh physical memory at the
//! same addresses. So pointers the engine captured, in CUDA graphs among
//! them, stay valid without a recapture. `cudaMalloc`'d memory cannot do
//! this: freeing it gives the address away.
//!
//! An atomic update may instead map fresh physical memory it filled in
//! place of the old (`device_swap`), at the same addresses too.
//!
//! Restored memory is zeroed before use (fresh physical memory holds
//! whatever the last owner left), like host params after a clear.

use super::cuda::{check, cuda};
use crate::result::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;

/// A reserved device address range and, while resident, the physical
/// allocation mapped into it.
#[derive(Debug)]
pub struct DeviceRegion {
    pub(super) ordinal: i32,
    pub(super) ptr: u64,
    /// The param's bytes.
    len: usize,
    /// Bytes reserved and mapped: the param's size rounded up to the
    /// allocation granularity (at least one granule).
    pub(super) mapped: usize,
    /// The allocation granularity, the reservation's alignment.
    pub(super) granule: usize,
    /// The physical allocation while mapped (after a page swap, the one
    /// swapped in: `device_swap`).
    pub(super) handle: Mutex<Option<sys::CUmemGenericAllocationHandle>>,
}

fn properties(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

impl DeviceRegion {
    /// Reserve and map `len` bytes on GPU `ordinal`, zeroed. `what` names
    /// the owner in errors.
    pub fn new(what: &str, ordinal: i32, len: usize) -> Result<DeviceRegion> {
        let cuda = cuda().map_err(|e| e.context(what))?;
        cuda.check_ordinal(ordinal, what)?;
        cuda.make_current(ordinal)?;
        let prop = properties(ordinal);
        let mut granule = 0usize;
        check(
            // SAFETY: valid out-pointer and properties.
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granule,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
        )
        .map_err(|e| e.context(what))?;
        let mapped = len
            .max(1)
            .checked_next_multiple_of(granule.max(1))
            .ok_or_else(|| Error::out_of_memory(format!("{what}: {len} bytes is too large")))?;
        let mut ptr = 0u64;
        check(
            // SAFETY: valid out-pointer; no fixed address asked for.
            unsafe { sys::cuMemAddressReserve(&mut ptr, mapped, granule, 0, 0) },
            "cuMemAddressReserve",
        )
        .map_err(|e| {
            e.context(format!(
                "{what}: reserving {mapped} bytes of GPU {ordinal} addresses"
            ))
        })?;
        let region = DeviceRegion {
            ordinal,
            ptr,
            len,
            mapped,
            granule,
            handle: Mutex::new(None),
        };
        region.restore().map_err(|e| e.context(what))?;
        Ok(region)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The param's bytes (what was asked for, before rounding).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Unmap and release the physical memory; the addresses stay reserved.
    /// Waits for the device's work first, so nothing still reads the old
    /// weights when their memory goes.
    pub fn release(&self) -> Result<()> {
        let mut handle = self.handle.lock();
        let Some(h) = *handle else {
            return Ok(());
        };
        let cuda = cuda()?;
        cuda.make_current(self.ordinal)?;
        // SAFETY: our own mapping of our own allocation, unmapped once.
        unsafe {
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
            check(sys::cuMemUnmap(self.ptr, self.mapped), "cuMemUnmap")?;
            *handle = None;
            check(sys::cuMemRelease(h), "cuMemRelease")?;
        }
        Ok(())
    }

    /// Map fresh, zeroed physical memory at the same addresses.
    pub fn restore(&self) -> Result<()> {
        let mut handle = self.handle.lock();
        if handle.is_some() {
            return Ok(());
        }
        cuda()?.make_current(self.ordinal)?;
        let h = create(self.ordinal, self.mapped)?;
        // SAFETY: the range is ours and unmapped; `h` is the size of the range.
        if let Err(e) = unsafe { map_rw(self.ordinal, self.ptr, self.mapped, h) } {
            // SAFETY: our handle, mapped nowhere.
            unsafe { sys::cuMemRelease(h) };
            return Err(e);
        }
        *handle = Some(h);
        check(
            // SAFETY: the range was just mapped read-write on this device.
            unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.mapped) },
            "cuMemsetD8",
        )
    }

    /// True while physical memory is mapped at the region's addresses.
    pub fn is_mapped(&self) -> bool {
        self.handle.lock().is_some()
    }

    /// Bytes reserved and mapped (the param's size rounded up to the
    /// allocation granularity).
    pub fn mapped_len(&self) -> usize {
        self.mapped
    }
}

/// A physical allocation of `len` bytes on GPU `ordinal` (its context
/// current).
pub(super) fn create(ordinal: i32, len: usize) -> Result<sys::CUmemGenericAllocationHandle> {
    let prop = properties(ordinal);
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    check(
        // SAFETY: valid out-pointer and properties.
        unsafe { sys::cuMemCreate(&mut h, len, &prop, 0) },
        "cuMemCreate",
    )
    .map_err(|e| e.context(format!("allocating {len} bytes on GPU {ordinal}")))?;
    Ok(h)
}

/// Map allocation `h` read-write at `[ptr, ptr + len)` of GPU `ordinal`;
/// on failure nothing stays mapped there.
///
/// # Safety
/// The range is a reservation of ours with nothing mapped; `h` is `len`
/// bytes of that GPU.
pub(super) unsafe fn map_rw(
    ordinal: i32,
    ptr: u64,
    len: usize,
    h: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    check(sys::cuMemMap(ptr, len, 0, h, 0), "cuMemMap")?;
    let access = sys::CUmemAccessDesc {
        location: properties(ordinal).location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let r = check(sys::cuMemSetAccess(ptr, len, &access, 1), "cuMemSetAccess");
    if r.is_err() {
        sys::cuMemUnmap(ptr, len);
    }
    r
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        let _ = self.release();
        if let Ok(cuda) = cuda() {
            if cuda.make_current(self.ordinal).is_ok() {
                // SAFETY: our reservation, unmapped above, freed once.
                unsafe { sys::cuMemAddressFree(self.ptr, self.mapped) };
            }
        }
    }
}

/// Free and total memory of GPU `ordinal`, as the driver reports them.
pub fn memory_info(ordinal: i32) -> Result<(usize, usize)> {
    let cuda = cuda()?;
    cuda.make_current(ordinal)?;
    let (mut free, mut total) = (0usize, 0usize);
    check(
        // SAFETY: valid out-pointers.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free, total))
}

/// `len` bytes of GPU memory at device address `ptr`, in the context of
/// GPU `ordinal`: what both ends of CUDA IPC hold.
#[derive(Debug)]
pub struct DeviceSpan {
    pub(crate) ordinal: i32,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
}

impl DeviceSpan {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }
}

/// Plain device memory (`cuMemAlloc`), freed on drop: CUDA IPC buffers and
/// the fan-out's scratch and a member's landing buffer.
#[derive(Debug)]
pub struct DeviceAllocation {
    span: DeviceSpan,
}

impl std::ops::Deref for DeviceAllocation {
    type Target = DeviceSpan;
    fn deref(&self) -> &DeviceSpan {
        &self.span
    }
}

impl DeviceAllocation {
    /// `len` bytes (at least one) on GPU `ordinal`, whose context is left
    /// current; `what` names the owner in errors.
    pub fn new(what: &str, ordinal: i32, len: usize) -> Result<DeviceAllocation> {
        let c = cuda().map_err(|e| e.context(what))?;
        c.check_ordinal(ordinal, what)?;
        c.make_current(ordinal)?;
        let mut ptr = 0u64;
        check(
            // SAFETY: a valid out-pointer.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) },
            "cuMemAlloc",
        )
        .map_err(|e| e.context(format!("{what}: {len} bytes on GPU {ordinal}")))?;
        Ok(DeviceAllocation {
            span: DeviceSpan { ordinal, ptr, len },
        })
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if cuda().and_then(|c| c.make_current(self.ordinal)).is_ok() {
            // SAFETY: our allocation; its users have finished with it.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
