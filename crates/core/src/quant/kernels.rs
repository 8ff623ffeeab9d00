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
    if avx512() && E::SIZE == 2 {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return E::widen_abs16(unsafe { abs16_max_avx512(xs) });
    }
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
    if E::SIZE == 2 {
        let (mut xs, mut out) = (xs, out);
        if W == 32 {
            // MXFP8: 16 blocks of 32 at once.
            let groups = xs.chunks_exact(16 * 64).zip(out.chunks_exact_mut(16));
            for (group, o) in groups {
                // SAFETY: the caller's: the CPU has AVX-512 F and BW.
                let m = unsafe { abs16_max_16_of_32(group) };
                for (o, &m) in o.iter_mut().zip(&m) {
                    *o = E::widen_abs16(m);
                }
            }
            let done = out.len() / 16 * 16;
            (xs, out) = (&xs[done * 64..], &mut out[done..]);
        }
        for (o, block) in out.iter_mut().zip(xs.chunks_exact(W * 2)) {
            // SAFETY: the caller's: the CPU has AVX-512 F and BW.
            *o = E::widen_abs16(unsafe { abs16_max(block) });
        }
        return;
    }
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

/// The largest `|x|` bit pattern of 16-bit elements (bf16, f16): their
/// magnitudes order as their bits do (NaN and infinities above every
/// finite value), so 32 lanes of 16 bits take them, half the work of
/// widening each to f32 first.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn abs16_max_avx512(xs: &[u8]) -> u16 {
    // SAFETY: the caller's: the CPU has AVX-512 F and BW.
    unsafe { abs16_max(xs) }
}

/// [`abs16_max_avx512`], inlined into its callers (compiled with their
/// features).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn abs16_max(xs: &[u8]) -> u16 {
    use std::arch::x86_64::*;
    let n = xs.len() / 64 * 64;
    let magnitude = _mm512_set1_epi16(0x7fff);
    // SAFETY: the caller's features; each load reads 64 bytes of `xs`.
    unsafe {
        let mut m = _mm512_setzero_si512();
        for i in (0..n).step_by(64) {
            let v = _mm512_loadu_si512(xs[i..i + 64].as_ptr().cast());
            m = _mm512_max_epu16(m, _mm512_and_si512(v, magnitude));
        }
        let m = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64::<1>(m));
        let m = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        // The largest of 8 is the smallest of their complements.
        let top = 0xffff
            - _mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m, _mm_set1_epi16(-1)))) as u16;
        let tail = xs[n..]
            .chunks_exact(2)
            .map(|x| u16::from_le_bytes([x[0], x[1]]) & 0x7fff);
        tail.fold(top, u16::max)
    }
}

/// The largest `|x|` bits of each of 16 MXFP8 blocks of 32 16-bit elements
/// (1,024 bytes): the blocks' registers folded in pairs by whole-lane
/// shuffles, each fold halving every block's lanes (about 5 operations a
/// block, where reducing each block alone took 12).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn abs16_max_16_of_32(xs: &[u8]) -> [u16; 16] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's features; every load reads 64 of the 1,024
    // bytes of `xs`.
    unsafe {
        let magnitude = _mm512_set1_epi16(0x7fff);
        // Loops, not `array::from_fn`: a closure is not compiled with this
        // function's features, and its intrinsics become calls.
        let mut r = [_mm512_setzero_si512(); 16];
        for (k, r) in r.iter_mut().enumerate() {
            let v = _mm512_loadu_si512(xs[k * 64..k * 64 + 64].as_ptr().cast());
            *r = _mm512_and_si512(v, magnitude);
        }
        // Block k's 16 lanes in 128-bit lanes 0-1 of c[k/2] (k even) or 2-3.
        let mut c = [_mm512_setzero_si512(); 8];
        for (j, c) in c.iter_mut().enumerate() {
            let (a, b) = (r[2 * j], r[2 * j + 1]);
            *c = _mm512_max_epu16(
                _mm512_shuffle_i64x2::<0x44>(a, b),
                _mm512_shuffle_i64x2::<0xee>(a, b),
            );
        }
        // Block 4i + l's 8 lanes in 128-bit lane l of d[i].
        let mut d = [_mm512_setzero_si512(); 4];
        for (i, d) in d.iter_mut().enumerate() {
            let (a, b) = (c[2 * i], c[2 * i + 1]);
            *d = _mm512_max_epu16(
                _mm512_shuffle_i64x2::<0x88>(a, b),
                _mm512_shuffle_i64x2::<0xdd>(a, b),
            );
        }
        // Blocks 8h + l and 8h + 4 + l, 4 lanes each, in 128-bit lane l.
        let mut e = [_mm512_setzero_si512(); 2];
        for (h, e) in e.iter_mut().enumerate() {
            let (a, b) = (d[2 * h], d[2 * h + 1]);
            *e = _mm512_max_epu16(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
        }
        // Blocks l, 4 + l, 8 + l, 12 + l, 2 lanes each, in 128-bit lane l.
        let (a, b) = (_mm512_castsi512_ps(e[0]), _mm512_castsi512_ps(e[1]));
        let f = _mm512_max_epu16(
            _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(a, b)),
            _mm512_castps_si512(_mm512_shuffle_ps::<0xdd>(a, b)),
        );
        let g = _mm512_max_epu16(f, _mm512_srli_epi32::<16>(f));
        let mut lanes = [0u32; 16];
        _mm512_storeu_si512(lanes.as_mut_ptr().cast(), g);
        // 32-bit lane 4l + p holds block 4p + l.
        std::array::from_fn(|k| lanes[4 * (k % 4) + k / 4] as u16)
    }
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
            // The dispatched path: 16-bit lanes for 16-bit elements.
            assert_eq!(abs_bits_max::<E>(run), want, "{n} elements");
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

    /// Many MXFP8 blocks at once (groups of 16 folded together, and the
    /// rest), each block's largest at its own lane: each block's own.
    fn many_blocks<E: Element>() {
        let mut rng = crate::test_rng::Rng(0x9e37_79b9_7f4a_7c15);
        for blocks in [15, 16, 17, 53] {
            let mut xs: Vec<u8> = (0..blocks * 32 * E::SIZE)
                .map(|_| rng.next() as u8)
                .collect();
            for (j, v) in xs.chunks_exact_mut(E::SIZE).enumerate() {
                v[E::SIZE - 1] &= 0x3f;
                if j % 32 == (j / 32 * 7) % 32 {
                    v[E::SIZE - 1] = 0x40 | (j / 32 % 50) as u8 | (rng.next() as u8 & 0x80);
                }
            }
            let mut want = vec![0u32; blocks];
            abs_bits_max_each_body::<E, 32>(&xs, &mut want);
            let mut got = vec![0u32; blocks];
            abs_bits_max_each::<E, 32>(&xs, &mut got);
            assert_eq!(got, want, "{blocks} blocks");
        }
    }

    #[test]
    fn every_compiled_path_gives_the_same_bytes() {
        many_blocks::<Bf16>();
        many_blocks::<F16>();
        many_blocks::<F32>();
        blocks_on_every_path::<Bf16>();
        blocks_on_every_path::<F16>();
        blocks_on_every_path::<F32>();
        same_on_every_path::<Bf16>();
        same_on_every_path::<F16>();
        same_on_every_path::<F32>();
    }
}
