//! `wm bench gpu`'s FP8 rows: the quantizer's kernels (`quant::device`,
//! compiled by NVRTC) on a bf16 `[rows, 7168]` tensor in GPU memory with
//! 128x128 blocks, as a publisher of a GPU version runs them: every
//! block's amax (read back to the host, where the scales are agreed), then
//! the FP8 bytes with it. Beside, measured in the same run:
//!
//! - the floor: a device-to-device copy of the same bf16 bytes (it reads
//!   what the quantizer reads and writes twice what it writes);
//! - PyTorch's reference expression (DeepGEMM's `per_block_cast_to_fp8`)
//!   on the same GPU and shape, alternating with ours, median of the
//!   per-pair ratios (above 1: ours is faster).

use super::super::harness::torch::TorchPeer;
use super::super::harness::{alternate, best, verdict};
use super::ok;
use crate::fmt::gbps;
use cudarc::driver::sys;
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::quant::blocks::Placed;
use weight_manager_core::quant::device::{self, OnDevice, Rows};
use weight_manager_core::quant::Scheme;
use weight_manager_core::DType;

const COLS: usize = 7168;
const PAIRS: usize = 5;

const TORCH: &str = r#"
import sys, time, torch
rows, cols = int(sys.argv[1]), int(sys.argv[2])
x = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
def quantize(x):
    m, n = x.shape
    xv = x.view(m // 128, 128, n // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (xv * (448.0 / amax)).to(torch.float8_e4m3fn)
    return q.view(m, n), (amax / 448.0).view(m // 128, n // 128)
quantize(x)
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    torch.cuda.synchronize()
    t = time.perf_counter()
    quantize(x)
    torch.cuda.synchronize()
    print(time.perf_counter() - t, flush=True)
"#;

/// The rows for about `bytes` of bf16; `dtod` is the device-to-device
/// floor (GB/s) measured before.
pub(super) fn quant_rows(bytes: usize, dtod: f64) -> Result<(), String> {
    let rows = (bytes / (COLS * 2) / 128).max(1) * 128;
    let n = rows * COLS;
    let src = ExportedDeviceBuffer::new("bench", 0, n * 2).map_err(|e| e.to_string())?;
    let out = ExportedDeviceBuffer::new("bench", 0, n).map_err(|e| e.to_string())?;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let host: Vec<u16> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04).to_bits() >> 16) as u16
        })
        .collect();
    // SAFETY: the buffer holds n bf16.
    let r = unsafe { sys::cuMemcpyHtoD_v2(src.ptr(), host.as_ptr().cast(), n * 2) };
    ok(r, "cuMemcpyHtoD")?;
    drop(host);
    let shape = [rows as u64, COLS as u64];
    let t = OnDevice {
        ordinal: 0,
        ptr: src.ptr(),
        dtype: DType::Bf16,
        scheme: Scheme::Fp8Block128,
        placed: Placed::whole(&shape),
    };
    let all = [Rows::all(n as u64)];
    let ours = || -> Result<Duration, String> {
        let t0 = Instant::now();
        let amax = device::amax(&t, &all)
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("element {e} is not finite"))?;
        device::quantize(&t, &all, &amax, out.ptr()).map_err(|e| e.to_string())?;
        Ok(t0.elapsed())
    };
    ours()?; // compiles the kernels
    let wm = gbps(n as u64 * 2, best(ours)?);
    println!(
        "  wm     FP8 quantize on the GPU       {wm:>8.2} GB/s of bf16   ratio {:.2} to device to device ({dtod:.2} GB/s)",
        wm / dtod
    );
    let mut torch = match TorchPeer::start(TORCH, &[rows.to_string(), COLS.to_string()]) {
        Ok(t) => t,
        Err(e) => {
            println!("  torch  FP8 row skipped: {e} (needs torch with CUDA)");
            return Ok(());
        }
    };
    let (ratio, o, th) = alternate(PAIRS, ours, || torch.run("quantize"))?;
    println!(
        "  wm/torch FP8 quantize on the GPU   {ratio:>5.2}x  (median of {PAIRS} pairs; best wm {:.2} GB/s, torch reference {:.2} GB/s) {}",
        gbps(n as u64 * 2, o),
        gbps(n as u64 * 2, th),
        verdict(ratio > 1.0)
    );
    torch.finish()
}
