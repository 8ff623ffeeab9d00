//! FP8 quantization of GPU memory, by the kernels of `fp8.cu` (compiled at
//! run time by NVRTC: `memory::nvrtc`), bit for bit the CPU quantizer's:
//! the factors (`448 / amax`, MXFP8's `2^-e`: [`Scheme::factor`]) are
//! computed here as the CPU computes them and uploaded; the kernel
//! multiplies (one f32 rounding, never fused) and casts as PyTorch does.
//!
//! Two users: a publisher serving a GPU version quantizes the requests an
//! engine asked quantized where they are ([`amax`] over the request's
//! runs, the amax agreed with the engine, then [`quantize`] into a device
//! image), and an engine quantizes a bf16 snapshot into FP8 params on its
//! GPU ([`write_from_host`]: the bytes it read, a band at a time through a
//! small device scratch, with the amax the CPU found while checking them
//! before the commit).
//!
//! Blocks are counted in a grid local to the shard's box (the blocks it
//! overlaps, so a small shard of a huge tensor needs few):
//! [`OnDevice::local_block`] maps a global block there. Launches go on the
//! legacy default stream, so they follow the engine's or trainer's own
//! work there, and every call returns with its work finished.

use super::bands::{bands, Wide};
use super::blocks::Placed;
use super::Scheme;
use crate::memory::cuda::check;
use crate::memory::cuda_ipc::{download, upload};
use crate::memory::device::DeviceAllocation;
use crate::memory::nvrtc::{self, Kernel};
use crate::result::Result;
use crate::tensor::DType;
use cudarc::driver::sys;
use std::ffi::c_void;

pub(crate) const SOURCE: &str = include_str!("fp8.cu");
pub(crate) const PROGRAM: &str = "wm_fp8.cu";
const THREADS: u32 = 256;
/// Elements a thread takes at a time (`WM_CHUNK` of `fp8.cu`).
const CHUNK: u64 = 16;
/// Thread blocks of a launch at most (each thread loops over the rest).
const MAX_BLOCKS: u64 = 1 << 16;

/// `struct wm_fp8_run` of `fp8.cu`: one launch's run and geometry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    src: u64,
    n: u64,
    offset: u64,
    len: u64,
    stride: u64,
    rows: u64,
    cols: u64,
    row0: u64,
    col0: u64,
    brows: u64,
    bcols: u64,
    dtype: u32,
    blocked: u32,
    small: u32,
    unused: u32,
}

/// Rows of a request's run: `rows` times `len` shard elements, row `k`
/// from element `offset + k * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub offset: u64,
    pub len: u64,
    pub rows: u64,
    pub stride: u64,
}

impl Rows {
    /// The first `n` elements, as one row.
    pub fn all(n: u64) -> Rows {
        Rows {
            offset: 0,
            len: n,
            rows: 1,
            stride: n,
        }
    }
}

/// A tensor, or a shard of a global one, in GPU memory.
#[derive(Clone, Copy, Debug)]
pub struct OnDevice<'a> {
    pub ordinal: i32,
    /// The device address of its first element.
    pub ptr: u64,
    pub dtype: DType,
    pub scheme: Scheme,
    pub placed: Placed<'a>,
}

impl OnDevice<'_> {
    /// The launch geometry of the shard, all of it (`Run::n` and the run
    /// fields are the caller's).
    fn geometry(&self) -> Run {
        let s = self.placed.shape;
        let n = s.len();
        let dtype = match self.dtype {
            DType::Bf16 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let cols = s.last().copied().unwrap_or(1);
        let (blocked, (bh, bw)) = match self.block_dims() {
            Some(dims) => (if dims.0 == 1 { 2 } else { 1 }, dims),
            None => {
                return Run {
                    src: self.ptr,
                    rows: 1,
                    cols: cols.max(1),
                    brows: 1,
                    bcols: 1,
                    dtype,
                    ..Run::default()
                }
            }
        };
        // A 1-D tensor (MXFP8) is one row.
        let (rows, row0) = match n {
            1 => (1, 0),
            _ => (s[n - 2], self.placed.offset[n - 2]),
        };
        let col0 = self.placed.offset[n - 1];
        let span = |first: u64, len: u64, b: u64| match len {
            0 => 0,
            _ => (first + len - 1) / b - first / b + 1,
        };
        Run {
            src: self.ptr,
            rows: rows.max(1),
            cols: cols.max(1),
            row0,
            col0,
            brows: span(row0, rows, bh),
            bcols: span(col0, cols, bw),
            dtype,
            blocked,
            ..Run::default()
        }
    }

    /// The block grid's rows and columns a block covers; None: one block
    /// for the whole tensor (one scale per tensor, and 1-D tensors with
    /// 128x128 blocks).
    fn block_dims(&self) -> Option<(u64, u64)> {
        let dims = self.scheme.block_dims()?;
        let n = self.placed.shape.len();
        (n >= 2 || (n == 1 && dims.0 == 1)).then_some(dims)
    }

    /// Blocks in the local grid.
    pub fn local_blocks(&self) -> usize {
        let g = self.geometry();
        let batches: u64 = match g.blocked {
            0 => 1,
            _ => (self.placed.shape[..self.placed.shape.len().saturating_sub(2)].iter()).product(),
        };
        (batches * g.brows * g.bcols) as usize
    }

    /// Where global block `block` (`quant::blocks` numbering) is in the
    /// local grid; None when the shard's box does not overlap it.
    pub fn local_block(&self, block: u64) -> Option<usize> {
        let g = self.geometry();
        let Some((bh, bw)) = self.block_dims().filter(|_| g.blocked != 0) else {
            return (block == 0).then_some(0);
        };
        let p = self.placed;
        let n = p.shape.len();
        let grows = if n >= 2 { p.global[n - 2] } else { 1 };
        let (srows, scols) = (grows.div_ceil(bh), p.global[n - 1].div_ceil(bw));
        let (bcol, rest) = (block % scols, block / scols);
        let (brow, mut gbatch) = (rest % srows, rest / srows);
        // The global batch index, back to the shard's.
        let mut local = 0;
        let mut scale = 1;
        for d in (0..n.saturating_sub(2)).rev() {
            let i = (gbatch % p.global[d].max(1)).checked_sub(p.offset[d])?;
            gbatch /= p.global[d].max(1);
            (i < p.shape[d]).then_some(())?;
            local += i * scale;
            scale *= p.shape[d];
        }
        let lrow = brow.checked_sub(g.row0 / bh).filter(|&r| r < g.brows)?;
        let lcol = bcol.checked_sub(g.col0 / bw).filter(|&c| c < g.bcols)?;
        Some(((local * g.brows + lrow) * g.bcols + lcol) as usize)
    }
}

/// Each local block's amax over `runs` of `t` (unclamped; 0 where no run
/// reaches). Ok(Err(e)): shard element `e` is NaN or infinite (the first).
pub fn amax(t: &OnDevice, runs: &[Rows]) -> Result<std::result::Result<Vec<f32>, u64>> {
    let kernel = nvrtc::kernel(t.ordinal, PROGRAM, SOURCE, "wm_fp8_amax")?;
    let blocks = t.local_blocks();
    let scratch = DeviceAllocation::new("the FP8 quantizer's amax", t.ordinal, 8 + blocks * 4)?;
    // The u64 first: its atomics need 8-byte alignment.
    let (bad, bits) = (scratch.ptr(), scratch.ptr() + 8);
    // SAFETY: the scratch is ours and that large; its context is current.
    unsafe {
        check(sys::cuMemsetD8_v2(bits, 0, blocks * 4), "cuMemsetD8")?;
        check(sys::cuMemsetD8_v2(bad, 0xff, 8), "cuMemsetD8")?;
    }
    for r in runs {
        let mut run = run_of(t, r);
        let (mut bits, mut bad) = (bits, bad);
        let mut params = [
            (&mut run as *mut Run).cast::<c_void>(),
            (&mut bits as *mut u64).cast(),
            (&mut bad as *mut u64).cast(),
        ];
        // SAFETY: the kernel's parameters; the shard's memory is the
        // caller's, the scratch is synchronized below.
        unsafe { launch_run(kernel, &run, &mut params)? };
    }
    let mut found = vec![0u32; blocks];
    let mut first_bad = 0u64;
    // SAFETY: synchronous copies out of the scratch (after the launches,
    // on the same stream), into buffers of that size.
    unsafe {
        download(t.ordinal, found.as_mut_ptr().cast(), bits, blocks * 4)?;
        download(t.ordinal, (&mut first_bad as *mut u64).cast(), bad, 8)?;
    }
    if first_bad != u64::MAX {
        return Ok(Err(first_bad));
    }
    Ok(Ok(found.into_iter().map(f32::from_bits).collect()))
}

/// `runs` of `t` quantized with the local grid's `amax` (as [`amax`]
/// found it, or agreed larger) into `out`: device memory of one byte per
/// element, the runs' elements in order.
pub fn quantize(t: &OnDevice, runs: &[Rows], amax: &[f32], out: u64) -> Result<()> {
    let kernel = nvrtc::kernel(t.ordinal, PROGRAM, SOURCE, "wm_fp8_quantize")?;
    let factors = upload_factors(t.ordinal, t.scheme, amax)?;
    let mut at = out;
    for r in runs {
        let mut run = run_of(t, r);
        let (mut f, mut o) = (factors.ptr(), at);
        let mut params = [
            (&mut run as *mut Run).cast::<c_void>(),
            (&mut f as *mut u64).cast(),
            (&mut o as *mut u64).cast(),
        ];
        // SAFETY: as in `amax`; `out` holds every run's elements.
        unsafe { launch_run(kernel, &run, &mut params)? };
        at += run.n;
    }
    finish()
}

/// Quantize `wide`, a whole param's bytes in host memory, with its blocks'
/// `amax` (the scales' shape, as `bands::amax` found it) into its FP8 bytes
/// at `fp8` on GPU `ordinal`: a band at a time (at most 128 rows), copied
/// into a device scratch of one band. The scales are the caller's to write
/// ([`Scheme::write_scales`]).
pub fn write_from_host(
    ordinal: i32,
    scheme: Scheme,
    wide: Wide,
    amax: &[f32],
    fp8: u64,
) -> Result<()> {
    let kernel = nvrtc::kernel(ordinal, PROGRAM, SOURCE, "wm_fp8_quantize")?;
    let (bands, cols) = bands(scheme, wide.shape);
    let esize = wide.dtype.size();
    let most = bands
        .iter()
        .map(|b| b.rows * cols * esize)
        .max()
        .unwrap_or(0);
    let scratch = DeviceAllocation::new("the FP8 quantizer's band", ordinal, most)?;
    let factors = upload_factors(ordinal, scheme, amax)?;
    for b in &bands {
        let bytes = &wide.bytes[b.row * cols * esize..(b.row + b.rows) * cols * esize];
        // SAFETY: the scratch holds a band; a synchronous copy, after the
        // previous band's launch on the same stream.
        unsafe { upload(ordinal, scratch.ptr(), bytes.as_ptr(), bytes.len()) }?;
        let shape = [b.rows as u64, cols as u64];
        let band = OnDevice {
            ordinal,
            ptr: scratch.ptr(),
            dtype: wide.dtype,
            scheme,
            placed: Placed::whole(&shape),
        };
        let mut run = run_of(&band, &Rows::all((b.rows * cols) as u64));
        let (mut f, mut o) = (
            factors.ptr() + 4 * b.scale as u64,
            fp8 + (b.row * cols) as u64,
        );
        let mut params = [
            (&mut run as *mut Run).cast::<c_void>(),
            (&mut f as *mut u64).cast(),
            (&mut o as *mut u64).cast(),
        ];
        // SAFETY: the band's bytes and factors are on the device; the
        // param holds `fp8 + elements` bytes (its registration).
        unsafe { launch_run(kernel, &run, &mut params)? };
    }
    finish()
}

fn run_of(t: &OnDevice, r: &Rows) -> Run {
    let elements: u64 = t.placed.shape.iter().product();
    // The run's last element, and every index the kernel divides, lie
    // below the shard's element count (and the run's own length).
    let last = r.offset + r.rows.saturating_sub(1) * r.stride + r.len;
    let small = elements.max(last).max(r.rows * r.len) < 1 << 32;
    Run {
        n: r.rows * r.len,
        offset: r.offset,
        len: r.len.max(1),
        stride: r.stride,
        small: small as u32,
        ..t.geometry()
    }
}

/// Each block's factor ([`Scheme::factor`]) as the CPU computes it, on
/// the GPU.
fn upload_factors(ordinal: i32, scheme: Scheme, amax: &[f32]) -> Result<DeviceAllocation> {
    let factors: Vec<f32> = amax.iter().map(|&a| scheme.factor(a)).collect();
    let d = DeviceAllocation::new("the FP8 quantizer's factors", ordinal, factors.len() * 4)?;
    // SAFETY: a synchronous copy into an allocation of that size.
    unsafe { upload(ordinal, d.ptr(), factors.as_ptr().cast(), factors.len() * 4) }?;
    Ok(d)
}

/// Launch `kernel` over `run`'s elements (none: nothing).
///
/// # Safety
/// `params` are the kernel's, pointing at live values and device memory.
unsafe fn launch_run(kernel: Kernel, run: &Run, params: &mut [*mut c_void]) -> Result<()> {
    if run.n == 0 {
        return Ok(());
    }
    let blocks = run
        .n
        .div_ceil(CHUNK)
        .div_ceil(THREADS as u64)
        .min(MAX_BLOCKS) as u32;
    nvrtc::launch(kernel, (blocks, THREADS), std::ptr::null_mut(), params)
}

/// Wait for the launches (a kernel's fault surfaces here). Not bounded by
/// a deadline, on purpose: the kernels are finite loops over the elements
/// they were given, and returning before they end would free the scratch
/// and factors they still read.
fn finish() -> Result<()> {
    // SAFETY: the legacy stream of the current context.
    check(
        unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) },
        "cuStreamSynchronize(the FP8 quantizer)",
    )
}
