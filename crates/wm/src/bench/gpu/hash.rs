//! `wm bench gpu`'s checksum row: the XXH3-128 of GPU params computed on
//! the GPU (`delta::device::checksums`: what a delta update of device
//! params runs twice, over the base and over the result), a run per
//! 64 MiB tensor. Beside, in the same run:
//!
//! - the floor: a device-to-device copy of the same bytes (it reads what
//!   the hash reads, and writes as much again);
//! - the way without the kernels: the bytes read back into pinned host
//!   memory and hashed on every host core (both give the same digests,
//!   checked).

use super::super::harness::best;
use super::ok;
use crate::fmt::gbps;
use cudarc::driver::sys;
use std::time::Instant;
use weight_manager_core::delta::device::checksums;
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::internals::memory::hashing::hash_all;
use weight_manager_core::internals::memory::SendPtr;

/// The rows for `count` tensors of `layer` bytes; `dtod` is the
/// device-to-device floor (GB/s) measured before.
pub(super) fn hash_rows(count: usize, layer: usize, dtod: f64) -> Result<(), String> {
    let total = count * layer;
    let buf = ExportedDeviceBuffer::new("bench", 0, total).map_err(|e| e.to_string())?;
    // SAFETY: the buffer holds `total` bytes (whole 32-bit words).
    let r = unsafe { sys::cuMemsetD32_v2(buf.ptr(), 0x9e37_79b9, total / 4) };
    ok(r, "cuMemsetD32")?;
    let runs: Vec<(u64, u64)> = (0..count)
        .map(|i| (buf.ptr() + (i * layer) as u64, layer as u64))
        .collect();
    let mut on_gpu = Vec::new();
    let gpu = best(|| {
        let t = Instant::now();
        on_gpu = checksums(0, &runs).map_err(|e| e.to_string())?;
        Ok(t.elapsed())
    })?;
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; freed below.
    let r = unsafe { sys::cuMemHostAlloc(&mut host, total, 0) };
    ok(r, "cuMemHostAlloc")?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut on_host = Vec::new();
    let readback = best(|| {
        let t = Instant::now();
        // SAFETY: both hold `total` bytes; synchronous.
        let r = unsafe { sys::cuMemcpyDtoH_v2(host, buf.ptr(), total) };
        ok(r, "cuMemcpyDtoH")?;
        let base = host.cast::<u8>();
        let regions: Vec<(SendPtr, usize)> = (0..count)
            .map(|i| (SendPtr(base.wrapping_add(i * layer)), layer))
            .collect();
        // SAFETY: the pinned copy, written above and not written now.
        on_host = unsafe { hash_all(&regions, threads) };
        Ok(t.elapsed())
    });
    // SAFETY: the pinned buffer allocated above.
    unsafe { sys::cuMemFreeHost(host) };
    let readback = readback?;
    if on_gpu != on_host {
        return Err("the GPU's checksums are not the host's".into());
    }
    let (g, h) = (gbps(total as u64, gpu), gbps(total as u64, readback));
    println!(
        "  wm     checksum on the GPU         {g:>8.2} GB/s   ratio {:.2} to DtoD ({dtod:.2} GB/s); \
         {:.1}x reading back + hashing on {threads} cores ({h:.2} GB/s)",
        g / dtod,
        g / h
    );
    Ok(())
}
