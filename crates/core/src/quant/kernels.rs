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
//! bits says a NaN or an infinity is in the run. The cast runs after it,
//! on finite values only ([`e4m3::from_finite_f32`]).

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

/// The `|x|` bits of the first `N` elements of `xs`: a fixed-size map the
/// compiler turns into a load and a conversion in vector registers.
#[inline(always)]
fn abs_bits_lanes<E: Element, const N: usize>(xs: &[u8]) -> [u32; N] {
    let mut v = [0u32; N];
    for (m, x) in v.iter_mut().zip(xs[..N * E::SIZE].chunks_exact(E::SIZE)) {
        *m = E::read(x).to_bits() & 0x7fff_ffff;
    }
    v
}

#[inline(always)]
fn scale_each_body<E: Element, const W: usize>(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    let blocks = xs.chunks_exact(W * E::SIZE).zip(out.chunks_exact_mut(W));
    for ((block, q), &f) in blocks.zip(factors) {
        scale_run_body::<E>(block, f, q);
    }
}

/// The vector paths of [`abs_bits_max_each`] fold each block's lanes with
/// the vector instructions themselves. Written as a fold per block (as the
/// baseline), the compiler vectorized across blocks instead, gathering
/// every element: 9 GB/s of bf16 against 34 for 128x128 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_bits_max_each_avx2<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    use std::arch::x86_64::*;
    if !W.is_multiple_of(8) {
        return abs_bits_max_each_body::<E, W>(xs, out);
    }
    let lanes = |x: &[u8]| {
        let v = abs_bits_lanes::<E, 8>(x);
        // SAFETY: an unaligned load of the 8 lanes of `v`.
        unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
    };
    for (o, block) in out.iter_mut().zip(xs.chunks_exact(W * E::SIZE)) {
        let mut v = lanes(block);
        for j in 1..W / 8 {
            v = _mm256_max_epu32(v, lanes(&block[j * 8 * E::SIZE..]));
        }
        let v = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_max_epu32(v, _mm_shuffle_epi32::<0b0100_1110>(v));
        let v = _mm_max_epu32(v, _mm_shuffle_epi32::<0b1011_0001>(v));
        *o = _mm_cvtsi128_si32(v) as u32;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scale_each_avx2<E: Element, const W: usize>(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    scale_each_body::<E, W>(xs, factors, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn abs_bits_max_each_avx512<E: Element, const W: usize>(xs: &[u8], out: &mut [u32]) {
    use std::arch::x86_64::*;
    if !W.is_multiple_of(16) {
        return abs_bits_max_each_body::<E, W>(xs, out);
    }
    let lanes = |x: &[u8]| {
        let v = abs_bits_lanes::<E, 16>(x);
        // SAFETY: an unaligned load of the 16 lanes of `v`.
        unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
    };
    for (o, block) in out.iter_mut().zip(xs.chunks_exact(W * E::SIZE)) {
        let mut v = lanes(block);
        for j in 1..W / 16 {
            v = _mm512_max_epu32(v, lanes(&block[j * 16 * E::SIZE..]));
        }
        *o = _mm512_reduce_max_epu32(v);
    }
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
        *q = e4m3::from_finite_f32(E::read(x) * factor);
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
        // Small values, and in block k its largest at lane (5k + 31) % 32
        // (the last lane, the first, and between), each block's another.
        let mut xs: Vec<u8> = (0..32 * 7 * E::SIZE)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        for (j, x) in xs.chunks_exact_mut(E::SIZE).enumerate() {
            let (k, lane) = (j / 32, j % 32);
            x[E::SIZE - 1] &= 0x2f;
            if lane == (5 * k + 31) % 32 {
                x[E::SIZE - 1] = 0x70 | k as u8;
            }
        }
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
        #[cfg(target_arch = "x86_64")]
        {
            let mut bits = vec![0u32; 7];
            if avx2() {
                // SAFETY: the CPU has AVX2.
                unsafe { abs_bits_max_each_avx2::<E, 32>(&xs, &mut bits) };
                assert_eq!(bits, want_bits, "AVX2");
            }
            if avx512() {
                // SAFETY: the CPU has AVX-512 F and BW.
                unsafe { abs_bits_max_each_avx512::<E, 32>(&xs, &mut bits) };
                assert_eq!(bits, want_bits, "AVX-512");
            }
        }
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
