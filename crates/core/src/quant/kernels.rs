//! The quantizer's inner loops over one block's run of a row: written
//! without branches so the compiler vectorizes them, and compiled three
//! times, for the baseline x86-64, AVX2 and AVX-512 (picked at run time,
//! as the checksums are), since the library is built for the baseline.
//! The same source each time: the result is the same byte on every path
//! (tested).
//!
//! The amax is taken on bit patterns: for finite values `|x|`'s bits order
//! as the values do, so an integer maximum (which vectorizes; a float one
//! does not, for NaN's sake) finds it, and a maximum at or above infinity's
//! bits says a NaN or an infinity is in the run.

use super::e4m3;
use super::Element;

/// The largest `|x|` bit pattern of the run (`0x7f80_0000` and up: some
/// element is NaN or infinite).
pub(super) fn abs_bits_max<E: Element>(xs: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return unsafe { abs_bits_max_avx512::<E>(xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { abs_bits_max_avx2::<E>(xs) };
    }
    abs_bits_max_body::<E>(xs)
}

/// Each element times `factor`, cast to E4M3, into `out` (one per element).
pub(super) fn scale_run<E: Element>(xs: &[u8], factor: f32, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return unsafe { scale_run_avx512::<E>(xs, factor, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { scale_run_avx2::<E>(xs, factor, out) };
    }
    scale_run_body::<E>(xs, factor, out)
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX512.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    })
}

#[inline(always)]
fn abs_bits_max_body<E: Element>(xs: &[u8]) -> u32 {
    xs.chunks_exact(E::SIZE)
        .map(|x| E::read(x).to_bits() & 0x7fff_ffff)
        .fold(0, u32::max)
}

#[inline(always)]
fn scale_run_body<E: Element>(xs: &[u8], factor: f32, out: &mut [u8]) {
    for (q, x) in out.iter_mut().zip(xs.chunks_exact(E::SIZE)) {
        *q = e4m3::from_f32_branchless(E::read(x) * factor);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_bits_max_avx2<E: Element>(xs: &[u8]) -> u32 {
    abs_bits_max_body::<E>(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scale_run_avx2<E: Element>(xs: &[u8], factor: f32, out: &mut [u8]) {
    scale_run_body::<E>(xs, factor, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn abs_bits_max_avx512<E: Element>(xs: &[u8]) -> u32 {
    abs_bits_max_body::<E>(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scale_run_avx512<E: Element>(xs: &[u8], factor: f32, out: &mut [u8]) {
    scale_run_body::<E>(xs, factor, out)
}

#[cfg(test)]
mod tests {
    use super::super::{Bf16, F16, F32};
    use super::*;

    /// Every compiled path gives the baseline's result (the ones this CPU
    /// has): bit patterns of every kind, NaN and infinities included.
    fn same_on_every_path<E: Element>() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let xs: Vec<u8> = (0..4099 * E::SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for n in [0, 1, 7, 16, 33, 128, 4099] {
            let run = &xs[..n * E::SIZE];
            let want = abs_bits_max_body::<E>(run);
            let mut base = vec![0u8; n];
            scale_run_body::<E>(run, 3.7, &mut base);
            #[cfg(target_arch = "x86_64")]
            {
                let mut out = vec![0u8; n];
                if avx2() {
                    // SAFETY: the CPU has AVX2.
                    assert_eq!(unsafe { abs_bits_max_avx2::<E>(run) }, want);
                    // SAFETY: as above.
                    unsafe { scale_run_avx2::<E>(run, 3.7, &mut out) };
                    assert_eq!(out, base, "AVX2, {n} elements");
                }
                if avx512() {
                    // SAFETY: the CPU has AVX-512 F and BW.
                    assert_eq!(unsafe { abs_bits_max_avx512::<E>(run) }, want);
                    // SAFETY: as above.
                    unsafe { scale_run_avx512::<E>(run, 3.7, &mut out) };
                    assert_eq!(out, base, "AVX-512, {n} elements");
                }
            }
        }
    }

    #[test]
    fn every_compiled_path_gives_the_same_bytes() {
        same_on_every_path::<Bf16>();
        same_on_every_path::<F16>();
        same_on_every_path::<F32>();
    }
}
