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

/// [`abs_bits_max`] of each run of `W` elements of `xs` (whole runs: an
/// MXFP8 row's blocks) into `out`, one dispatch for all of them: per
/// block, a call costs as much as the block's work.
pub(super) fn abs_bits_max_each<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return unsafe { abs_bits_max_each_avx512::<E, W>(xs, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { abs_bits_max_each_avx2::<E, W>(xs, out) };
    }
    abs_bits_max_each_body::<E, W>(xs, out)
}

/// [`scale_run`] of each run of `W` elements of `xs` with its own factor
/// (`factors[k]` for run `k`), into `out`: one dispatch for all of them.
pub(super) fn scale_each<E: Element, const W: usize>(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return unsafe { scale_each_avx512::<E, W>(xs, factors, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { scale_each_avx2::<E, W>(xs, factors, out) };
    }
    scale_each_body::<E, W>(xs, factors, out)
}

#[inline(always)]
fn abs_bits_max_each_body<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    for (o, block) in out.iter_mut().zip(xs.chunks_exact(W * E::SIZE)) {
        *o = abs_bits_max_body::<E>(block);
    }
}

#[inline(always)]
fn scale_each_body<E: Element, const W: usize>(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    let blocks = xs.chunks_exact(W * E::SIZE).zip(out.chunks_exact_mut(W));
    for ((block, q), &f) in blocks.zip(factors) {
        scale_run_body::<E>(block, f, q);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_bits_max_each_avx2<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    abs_bits_max_each_body::<E, W>(xs, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scale_each_avx2<E: Element, const W: usize>(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    scale_each_body::<E, W>(xs, factors, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn abs_bits_max_each_avx512<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    abs_bits_max_each_body::<E, W>(xs, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scale_each_avx512<E: Element, const W: usize>(
    xs: &[u8],
    factors: &[f32],
    out: &mut [u8],
) {
    scale_each_body::<E, W>(xs, factors, out)
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

    /// The per-block batches give each block's own figures, on every path.
    fn blocks_on_every_path<E: Element>() {
        let xs: Vec<u8> = (0..32 * 7 * E::SIZE)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        let factors: Vec<f32> = (0..7).map(|k| 0.5 + k as f32).collect();
        let (mut want_bits, mut want_q) = (vec![0u32; 7], vec![0u8; 32 * 7]);
        for k in 0..7 {
            let block = &xs[k * 32 * E::SIZE..(k + 1) * 32 * E::SIZE];
            want_bits[k] = abs_bits_max_body::<E>(block);
            scale_run_body::<E>(block, factors[k], &mut want_q[k * 32..(k + 1) * 32]);
        }
        let (mut bits, mut q) = (vec![0u32; 7], vec![0u8; 32 * 7]);
        abs_bits_max_each::<E, 32>(&xs, &mut bits);
        scale_each::<E, 32>(&xs, &factors, &mut q);
        assert_eq!((bits, q), (want_bits.clone(), want_q.clone()));
        let (mut bits, mut q) = (vec![0u32; 7], vec![0u8; 32 * 7]);
        abs_bits_max_each_body::<E, 32>(&xs, &mut bits);
        scale_each_body::<E, 32>(&xs, &factors, &mut q);
        assert_eq!((bits, q), (want_bits, want_q));
    }

    #[test]
    fn every_compiled_path_gives_the_same_bytes() {
        blocks_on_every_path::<Bf16>();
        blocks_on_every_path::<F16>();
        blocks_on_every_path::<F32>();
        same_on_every_path::<Bf16>();
        same_on_every_path::<F16>();
        same_on_every_path::<F32>();
    }
}
