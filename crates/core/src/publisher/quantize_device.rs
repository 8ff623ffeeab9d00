//! Quantized requests of a GPU version (an IPC publisher's copy on its
//! GPU): the blocks' amax and the FP8 bytes are made where the elements
//! are, by the quantizer's kernels (`quant::device`), and only the image,
//! one byte per element, is copied to host memory, where the session packs
//! it (with the version's other requests, copied out of the GPU buffer) as
//! it packs any image. `quantize.rs` runs the exchange around these two
//! steps, as for host memory.

use super::shard::Shard;
use crate::memory::device::DeviceAllocation;
use crate::memory::host::HostRegion;
use crate::quant::blocks::{touched, Placed};
use crate::quant::device::{self, OnDevice, Rows};
use crate::quant::Scheme;
use crate::result::{Error, Result};
use crate::wire::Request;

/// Request `q` of tensor `q.tensor` on GPU `ordinal` as the kernels see it.
fn on_device<'a>(shard: &'a Shard, q: &Request, scheme: Scheme, ordinal: i32) -> OnDevice<'a> {
    let meta = &shard.manifest.tensors[q.tensor as usize];
    let ptr = shard.in_memory().expect("a GPU version is in memory")[q.tensor as usize];
    OnDevice {
        ordinal,
        ptr: ptr.0 as u64,
        dtype: meta.dtype,
        scheme,
        placed: Placed::of(meta),
    }
}

fn rows(q: &Request) -> Vec<Rows> {
    (q.runs.iter())
        .map(|r| Rows {
            offset: r.offset,
            len: r.len,
            rows: r.rows,
            stride: r.stride,
        })
        .collect()
}

/// The blocks a request touches and their amax; Err: a non-finite
/// element of the tensor.
type Found = std::result::Result<(Vec<u64>, Vec<f32>), u64>;

/// The blocks request `q` touches (`quant::blocks::touched` order) and
/// their amax over its elements, found on the GPU. Ok(Err(e)): element
/// `e` of the tensor is NaN or infinite.
pub(super) fn amax(shard: &Shard, q: &Request, scheme: Scheme, ordinal: i32) -> Result<Found> {
    let t = on_device(shard, q, scheme, ordinal);
    let pieces = q.extents(0, q.bytes()).map(|(src, at, len)| (src, len, at));
    let blocks = touched(scheme, t.placed, pieces);
    let local = match device::amax(&t, &rows(q))? {
        Ok(local) => local,
        Err(element) => return Ok(Err(element)),
    };
    let amax = (blocks.iter())
        .map(|&b| local_of(&t, b).map(|l| local[l]))
        .collect::<Result<Vec<f32>>>()?;
    Ok(Ok((blocks, amax)))
}

/// Request `q` quantized on the GPU with its blocks' agreed `amax`
/// (`blocks` in `amax`'s order), copied into a host image.
pub(super) fn image(
    shard: &Shard,
    q: &Request,
    (scheme, ordinal): (Scheme, i32),
    blocks: &[u64],
    amax: &[f32],
) -> Result<HostRegion> {
    let t = on_device(shard, q, scheme, ordinal);
    let mut local = vec![0f32; t.local_blocks()];
    for (&b, &a) in blocks.iter().zip(amax) {
        local[local_of(&t, b)?] = a;
    }
    let n = q.bytes() as usize;
    let out = DeviceAllocation::new("a quantized request's image on the GPU", ordinal, n)?;
    device::quantize(&t, &rows(q), &local, out.ptr())?;
    let region = HostRegion::new("a quantized request's image", n)?;
    // SAFETY: the region holds n bytes; the device image as many.
    unsafe { crate::memory::cuda_ipc::download(ordinal, region.ptr(), out.ptr(), n) }?;
    Ok(region)
}

/// Where block `b`, which a request of the shard touches, is in the
/// shard's local grid (always there: the shard's box holds the request).
fn local_of(t: &OnDevice, b: u64) -> Result<usize> {
    t.local_block(b).ok_or_else(|| {
        Error::invalid_argument(format!(
            "block {b} is outside the shard's box (a request beyond its tensor)"
        ))
    })
}
