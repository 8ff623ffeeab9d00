//! The quantizer's GPU kernels (`device.rs`) against PyTorch's reference
//! run on the CPU, with the inputs and the reference of `tests.rs`.

use super::tests::{encode, python, reference_on, values, Job};
use super::*;
use crate::test_rng::Rng;

/// The GPU kernels (`device.rs`, compiled by NVRTC) against PyTorch's
/// reference run on the CPU, the rule as stated: every byte and scale the
/// same. Skipped (printed) where no GPU is usable, as on CI; there the
/// kernels are checked against this file's CPU quantizer under the test
/// driver (tests/device_quant.rs).
#[test]
fn the_gpu_kernels_match_pytorch_bit_for_bit() {
    if let Err(e) = crate::memory::cuda::cuda() {
        println!("skipped: no usable GPU here: {e}");
        return;
    }
    let Some(py) = python() else { return };
    let mut rng = Rng(5);
    let cases = [
        (DType::Bf16, (300, 260), "bf16"),
        (DType::Bf16, (128, 128), "bf16"),
        (DType::F16, (129, 385), "f16"),
        (DType::F32, (77, 200), "f32"),
        (DType::Bf16, (1, 1000), "bf16"),
    ];
    let schemes = [
        (Scheme::Fp8Block128, "blocks"),
        (Scheme::Fp8Tensor, "tensor"),
        (Scheme::Mxfp8, "mx"),
    ];
    let inputs: Vec<Vec<u8>> = (cases.iter())
        .map(|&(dtype, shape, _)| encode(&values(&mut rng, shape), dtype))
        .collect();
    let mut jobs = Vec::new();
    for ((_, shape, dtype), x) in cases.iter().zip(&inputs) {
        for (_, scheme) in schemes {
            jobs.push(Job {
                x,
                dtype,
                shape: *shape,
                scheme,
            });
        }
    }
    let mut theirs = reference_on(&py, &jobs, "cpu").into_iter();
    for ((dtype, (m, n), name), x) in cases.iter().zip(&inputs) {
        for (scheme, s) in schemes {
            let what = format!("{name} [{m}, {n}] {s} on the GPU");
            let (q, scales) = on_gpu(scheme, *dtype, x, (*m, *n));
            let (rq, rs) = theirs.next().unwrap();
            if let Some(i) = (0..q.len()).find(|&i| q[i] != rq[i]) {
                panic!(
                    "{what}: byte {i}: kernel {:#04x}, PyTorch {:#04x}",
                    q[i], rq[i]
                );
            }
            assert_eq!(q.len(), rq.len(), "{what}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&scales), bits(&rs), "{what}: scales");
        }
    }
}

/// `x` quantized by the kernels on GPU 0: its bytes and scales.
fn on_gpu(scheme: Scheme, dtype: DType, x: &[u8], (m, n): (usize, usize)) -> (Vec<u8>, Vec<f32>) {
    use crate::memory::device::DeviceAllocation;
    use cudarc::driver::sys;
    let src = DeviceAllocation::new("a test tensor", 0, x.len()).unwrap();
    let out = DeviceAllocation::new("its FP8 bytes", 0, m * n).unwrap();
    let shape = [m as u64, n as u64];
    let t = super::device::OnDevice {
        ordinal: 0,
        ptr: src.ptr(),
        dtype,
        scheme,
        placed: super::blocks::Placed::whole(&shape),
    };
    let all = (m * n) as u64;
    let runs = [super::device::Rows::all(all)];
    let mut q = vec![0u8; m * n];
    // SAFETY: synchronous copies within the allocations' sizes.
    unsafe {
        assert_eq!(
            sys::cuMemcpyHtoD_v2(src.ptr(), x.as_ptr().cast(), x.len()),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    let amax = super::device::amax(&t, &runs).unwrap().unwrap();
    super::device::quantize(&t, &runs, &amax, out.ptr()).unwrap();
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            sys::cuMemcpyDtoH_v2(q.as_mut_ptr().cast(), out.ptr(), m * n),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    (q, amax.iter().map(|&a| scheme.scale(a)).collect())
}
