use std::time::Instant;
use weight_manager_core::quant::{self, Scheme, Source};
use weight_manager_core::DType;
fn main() {
    let only = std::env::var("ONLY").is_ok();
    for &(rows, cols, reps) in if only {
        &[(4096usize, 8192usize, 12usize)][..]
    } else {
        &[
            (128usize, 1024usize, 2000usize),
            (128, 8192, 200),
            (4096, 8192, 6),
        ][..]
    } {
        let n = rows * cols;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = ((x as u32) & 0x3fff) as u16 | 0x3c00;
                v.to_le_bytes()
            })
            .collect();
        for scheme in [Scheme::Fp8Block128, Scheme::Mxfp8] {
            let [sr, sc] = scheme.scales_shape(rows, cols);
            let mut q = vec![0u8; n];
            let mut s = vec![0f32; sr * sc];
            let src = Source {
                dtype: DType::Bf16,
                bytes: &bytes,
                rows,
                cols,
            };
            quant::quantize(scheme, src, &mut q, &mut s).unwrap();
            let t = Instant::now();
            for _ in 0..reps {
                quant::quantize(scheme, src, &mut q, &mut s).unwrap();
            }
            let d = t.elapsed().as_secs_f64();
            let mut am = vec![0f32; sr * sc];
            let t2 = Instant::now();
            for _ in 0..reps {
                quant::block_amax(scheme, src, [0, 0], [rows, cols], &mut am).unwrap();
            }
            let d2 = t2.elapsed().as_secs_f64();
            println!(
                "{rows}x{cols} {scheme:?}: quantize {:.2} GB/s of bf16, amax alone {:.2} GB/s",
                (2 * n * reps) as f64 / d / 1e9,
                (2 * n * reps) as f64 / d2 / 1e9
            );
        }
    }
}
