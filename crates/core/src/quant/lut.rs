//! The bf16 cast by table, 64 elements at a time with AVX-512 VBMI byte
//! permutes: the same bytes as the arithmetic cast
//! ([`super::kernels::scale_run`], tested on every bf16 value), about 3x
//! as fast on one core (34 against 11 GB/s of bf16 from cache here).
//!
//! Why a table gives the same byte: a bf16 `x = (1 + m/128) * 2^(E-127)`
//! times a factor `F` rounds to f32 (`fl(x * F)`) by its mantissa product
//! alone, whatever `E` is (while the product is a normal f32), and a
//! normal E4M3 result rounds the same way; so the E4M3 byte of a normal
//! result is `(E << 3) + T[m]` for a table `T` of 128 bytes made once per
//! factor (the byte of one `x` per mantissa, less its exponent's part),
//! its sign bit the source's. 128x128 blocks and one scale per tensor
//! take a table per block; their magnitudes never pass 448 (`|x| <= amax`
//! and `F = 448 / amax`, rounded: at most a few f32 ulps over 448, which
//! E4M3 rounds to 448), so nothing saturates. MXFP8's factors are powers
//! of two, so factor 1's table serves every block, each adding its
//! exponent's part, and its products reach 512, so each byte is saturated
//! at 448 ([`scale_each_mx`]). Results below E4M3's smallest normal
//! (2^-6), zeros among them, are not a function of the mantissa alone: a
//! run of 64 holding any such element (found from the exponents,
//! conservatively) is cast the arithmetic way.

use super::kernels;

/// The table for one factor: `table[m]` is the byte's part from the
/// mantissa `m`, added to `(E << 3 | m >> 4)` (what the permutes gather
/// from the source's bits shifted right by 4: `m >> 4` is taken back out
/// here); `slow` is the largest exponent `E` whose results may be
/// subnormal.
#[derive(Clone, Copy)]
pub(super) struct Table {
    factor: f32,
    table: [u8; 128],
    slow: u8,
}

impl Table {
    /// The table for `factor`, None where its exponent is too far from 1
    /// to make it (no factor of the block schemes is).
    pub(super) fn new(factor: f32) -> Option<Table> {
        let ef = ((factor.to_bits() >> 23) & 0xff) as i32 - 127;
        if !factor.is_normal() || !(-120..=120).contains(&ef) {
            return None;
        }
        // x = (1 + m/128) * 2^-ef: products in [1, 4), normal E4M3. Plain
        // loops (vectorized): a table is made per block of 16,384 elements.
        let e0 = (127 - ef) as u16;
        let mut xs = [0u8; 256];
        for (m, x) in xs.chunks_exact_mut(2).enumerate() {
            x.copy_from_slice(&((e0 << 7) | m as u16).to_le_bytes());
        }
        let mut table = [0u8; 128];
        kernels::scale_run::<super::Bf16>(&xs, factor, &mut table);
        // The product's exponent field, less E, for the smallest mantissa:
        // results are normal when E + d >= 1.
        let d = (table[0] >> 3) as i32 - e0 as i32;
        for (m, t) in table.iter_mut().enumerate() {
            *t = t.wrapping_sub(((e0 << 3) as u8) | (m as u8 >> 4));
        }
        Some(Table {
            factor,
            table,
            slow: (-d).clamp(0, 255) as u8,
        })
    }
}

/// Whether this CPU takes the table path (AVX-512 F, BW and VBMI).
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VBMI.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vbmi")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// bf16 elements `xs` times the table's factor, cast to E4M3, into `out`
/// (one per element): [`kernels::scale_run`]'s bytes.
pub(super) fn scale_run(xs: &[u8], t: &Table, out: &mut [u8]) {
    scale_each::<0>(xs, std::slice::from_ref(t), out)
}

/// [`scale_run`] of each run of `W` elements with its own table (a row's
/// whole 128x128 blocks, one call: per block, a call's setup cost a
/// fifth of the block's work); `W` = 0: all of `xs` with `tables[0]`.
pub(super) fn scale_each<const W: usize>(xs: &[u8], tables: &[Table], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512 F, BW and VBMI (checked just above).
        return unsafe { scale_each_vbmi::<W>(xs, tables, out) };
    }
    if W == 0 {
        return kernels::scale_run::<super::Bf16>(xs, tables[0].factor, out);
    }
    let runs = xs.chunks_exact(2 * W).zip(out.chunks_exact_mut(W));
    for ((run, q), t) in runs.zip(tables) {
        kernels::scale_run::<super::Bf16>(run, t.factor, q);
    }
}

/// The even bytes (bf16's low bytes) of two registers, then the odd.
#[cfg(target_arch = "x86_64")]
static LOW_HIGH: [[u8; 64]; 2] = {
    let mut out = [[0u8; 64]; 2];
    let mut i = 0;
    while i < 64 {
        out[0][i] = (2 * i) as u8;
        out[1][i] = (2 * i + 1) as u8;
        i += 1;
    }
    out
};

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn scale_each_vbmi<const W: usize>(xs: &[u8], tables: &[Table], out: &mut [u8]) {
    use std::arch::x86_64::*;
    let w = if W == 0 { out.len() } else { W };
    // SAFETY: loads of 64 bytes from arrays of 64.
    let (low, high) = unsafe {
        (
            _mm512_loadu_si512(LOW_HIGH[0].as_ptr().cast()),
            _mm512_loadu_si512(LOW_HIGH[1].as_ptr().cast()),
        )
    };
    let magnitude = _mm512_set1_epi8(0x7f);
    let runs = xs
        .chunks_exact(2 * w.max(1))
        .zip(out.chunks_exact_mut(w.max(1)));
    for ((run, out), t) in runs.zip(tables) {
        // SAFETY: loads of 64 bytes from an array of 128.
        let (t0, t1) = unsafe {
            (
                _mm512_loadu_si512(t.table.as_ptr().cast()),
                _mm512_loadu_si512(t.table[64..].as_ptr().cast()),
            )
        };
        let slow = _mm512_set1_epi8(t.slow as i8);
        let n = out.len() / 64 * 64;
        for i in (0..n).step_by(64) {
            let (src, q) = (&run[2 * i..2 * i + 128], &mut out[i..i + 64]);
            // SAFETY: `src` holds 128 bytes (sliced just above).
            let (sum, sign_e) = unsafe { gather_sum(src, (t0, t1), (low, high)) };
            // 2 * (E >> 1) <= slow: some element may be subnormal.
            if _mm512_cmple_epu8_mask(_mm512_add_epi8(sign_e, sign_e), slow) != 0 {
                kernels::scale_run::<super::Bf16>(src, t.factor, q);
                continue;
            }
            // sum's low 7 bits, the source's sign.
            let b = _mm512_ternarylogic_epi32::<0xe4>(sum, sign_e, magnitude);
            // SAFETY: `q` holds 64 bytes.
            unsafe { store64(q, b) };
        }
        kernels::scale_run::<super::Bf16>(&run[2 * n..], t.factor, &mut out[n..]);
    }
    // The streaming stores are weakly ordered: make them visible before
    // the caller's synchronization publishes the bytes.
    _mm_sfence();
}

/// Store 64 bytes at `q`: streaming (no read of the line for ownership,
/// and it does not evict what the cast reads) when `q` is aligned to 64,
/// as a param's rows are. A large cast's destination is not read back
/// soon: the FP8 update from a snapshot in place writes its params with
/// them (measured 0.53-0.54 of the bf16 snapshot's speed with plain
/// stores, 0.56-0.57 with these, on the 2-core machine, alternating;
/// over UCX the publisher's packing was not slower). The caller issues
/// `_mm_sfence` after its last store. Inlined into the callers, compiled
/// with their features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store64(q: &mut [u8], b: std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    debug_assert!(q.len() >= 64);
    // SAFETY: the caller's: `q` holds 64 bytes, the CPU has AVX-512 F.
    unsafe {
        match (q.as_ptr() as usize).is_multiple_of(64) {
            true => _mm512_stream_si512(q.as_mut_ptr().cast(), b),
            false => _mm512_storeu_si512(q.as_mut_ptr().cast(), b),
        }
    }
}

/// A register of byte `a` in its first 32 lanes, `b` in the others.
/// Inlined into the callers (a closure would not be compiled with their
/// features, and its intrinsics would become calls).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn halves(a: u8, b: u8) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's: the CPU has AVX-512 F.
    unsafe {
        let v = _mm512_castsi256_si512(_mm256_set1_epi8(a as i8));
        _mm512_inserti64x4::<1>(v, _mm256_set1_epi8(b as i8))
    }
}

/// For 64 bf16 at `src` (128 bytes): each one's `(E << 3 | m >> 4)` plus
/// its table byte `table[m]`, and its high byte (sign, E >> 1). Inlined
/// into the callers, compiled with their features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gather_sum(
    src: &[u8],
    (t0, t1): (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i),
    (low, high): (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i),
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's: `src` holds 128 bytes, the CPU has AVX-512
    // F, BW and VBMI.
    unsafe {
        let x0 = _mm512_loadu_si512(src.as_ptr().cast());
        let x1 = _mm512_loadu_si512(src[64..].as_ptr().cast());
        let m = _mm512_permutex2var_epi8(x0, low, x1);
        let sign_e = _mm512_permutex2var_epi8(x0, high, x1);
        let (h0, h1) = (_mm512_srli_epi16::<4>(x0), _mm512_srli_epi16::<4>(x1));
        let e = _mm512_permutex2var_epi8(h0, low, h1);
        // The index's bit 7 (E's lowest bit) is not read: m alone.
        let sum = _mm512_add_epi8(e, _mm512_permutex2var_epi8(t0, m, t1));
        (sum, sign_e)
    }
}

/// MXFP8's cast of a row's whole blocks of 32 bf16 (`factors[k]`, a power
/// of two, for block `k`) into `out`: [`kernels::scale_each`]'s bytes.
/// Its factors are exact powers of two, so one table (factor 1's) serves
/// every block, each block adding its exponent's part; its products reach
/// 512, so each byte is saturated at 448 (`0x7e`: the sum is the byte's
/// magnitude exactly, up to 0x80, where it would carry past 448).
pub(super) fn scale_each_mx(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512 F, BW and VBMI (checked just above).
        return unsafe { scale_each_mx_vbmi(xs, factors, out) };
    }
    kernels::scale_each::<super::Bf16, { super::MX_BLOCK }>(xs, factors, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn scale_each_mx_vbmi(xs: &[u8], factors: &[f32], out: &mut [u8]) {
    use std::arch::x86_64::*;
    const W: usize = super::MX_BLOCK;
    static ONE: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    let one = ONE.get_or_init(|| Table::new(1.0).expect("factor 1 has a table"));
    // SAFETY: loads of 64 bytes from arrays of 128 and 64.
    let (t0, t1, low, high) = unsafe {
        (
            _mm512_loadu_si512(one.table.as_ptr().cast()),
            _mm512_loadu_si512(one.table[64..].as_ptr().cast()),
            _mm512_loadu_si512(LOW_HIGH[0].as_ptr().cast()),
            _mm512_loadu_si512(LOW_HIGH[1].as_ptr().cast()),
        )
    };
    let (magnitude, max) = (_mm512_set1_epi8(0x7f), _mm512_set1_epi8(0x7e));
    // Per block: its exponent's part of the byte, and the largest E whose
    // results may be subnormal (E - e - 120 < 1; e = 127 - the factor's
    // exponent field). A subnormal factor (2^-127) has neither.
    let part = |f: f32| {
        let fe = (f.to_bits() >> 23) & 0xff;
        let slow = (247 - fe as i32).clamp(0, 255);
        (fe != 0).then_some((((fe as i32 - 127) * 8) as u8, slow as u8))
    };
    let pairs = xs.chunks_exact(4 * W).zip(out.chunks_exact_mut(2 * W));
    for ((src, q), f) in pairs.zip(factors.chunks_exact(2)) {
        let (Some((o0, s0)), Some((o1, s1))) = (part(f[0]), part(f[1])) else {
            kernels::scale_each::<super::Bf16, W>(src, f, q);
            continue;
        };
        // SAFETY: the caller's features.
        let (offset, slow) = unsafe { (halves(o0, o1), halves(s0, s1)) };
        // SAFETY: `src` holds 128 bytes (whole pairs of blocks).
        let (sum, sign_e) = unsafe { gather_sum(src, (t0, t1), (low, high)) };
        if _mm512_cmple_epu8_mask(_mm512_add_epi8(sign_e, sign_e), slow) != 0 {
            kernels::scale_each::<super::Bf16, W>(src, f, q);
            continue;
        }
        let sum = _mm512_min_epu8(_mm512_add_epi8(sum, offset), max);
        let b = _mm512_ternarylogic_epi32::<0xe4>(sum, sign_e, magnitude);
        // SAFETY: as above.
        unsafe { store64(q, b) };
    }
    _mm_sfence();
    // An odd last block.
    let done = factors.len() / 2 * 2;
    kernels::scale_each::<super::Bf16, W>(
        &xs[done * 2 * W..],
        &factors[done..],
        &mut out[done * W..],
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// The table's bytes are the arithmetic cast's, for factors of amax
    /// from 1e-4 to 2^12 and values from amax down past the subnormals
    /// (zeros, both signs, and runs not a multiple of 64 included).
    #[test]
    fn the_table_gives_the_arithmetic_casts_bytes() {
        if !available() {
            eprintln!("no AVX-512 VBMI here: the table path is not taken");
        }
        let mut y = Rng(0x9e37_79b9_7f4a_7c15);
        for trial in 0..4000 {
            let r = y.next();
            let bits = (r as u32 >> 9) | (((100 + (r >> 40) % 40) as u32) << 23);
            let amax = f32::from_bits(bits).max(1e-4);
            let factor = (1.0f32 / amax) * 448.0;
            let table = Table::new(factor).expect("a block factor");
            let top = (amax.to_bits() >> 23) as u64;
            let spread = if trial % 3 == 0 { 30 } else { 6 };
            let n = 256 + trial % 70;
            let xs: Vec<u8> = (0..n)
                .flat_map(|k| {
                    let r = y.next();
                    let sign = (r >> 20 & 1) << 15;
                    let e = top.saturating_sub(r % spread);
                    let mut b = sign | e << 7 | (r >> 30 & 0x7f);
                    if k % 97 == 5 {
                        b = sign;
                    }
                    if f32::from_bits((b as u32) << 16).abs() > amax {
                        b = sign | (amax.to_bits() >> 16) as u64;
                    }
                    (b as u16).to_le_bytes()
                })
                .collect();
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            kernels::scale_run::<super::super::Bf16>(&xs, factor, &mut want);
            scale_run(&xs, &table, &mut got);
            assert_eq!(got, want, "trial {trial}: amax {amax}, factor {factor}");
        }
    }

    /// Whatever the destination's alignment (streaming stores where it is
    /// aligned to 64, plain ones elsewhere), both casts write the
    /// arithmetic cast's bytes, and nothing outside the destination.
    #[test]
    fn the_casts_bytes_do_not_depend_on_the_destinations_alignment() {
        let mut y = Rng(0x5151_7a7a_0f0f_3c3c);
        let n = 128 * 6;
        let xs: Vec<u8> = (0..n)
            .flat_map(|_| {
                // In [1, 2), either sign: no result near the subnormals,
                // so every run of 64 takes the table's stores.
                let r = y.next() as u16;
                ((r & 0x8000) | 0x3f80 | (r & 0x7f)).to_le_bytes()
            })
            .collect();
        let table = Table::new(448.0 / 2.0).expect("a block factor");
        let factors = vec![2f32.powi(6); n / super::super::MX_BLOCK];
        let mut want = vec![0u8; n];
        kernels::scale_run::<super::super::Bf16>(&xs, 448.0 / 2.0, &mut want);
        let mut want_mx = vec![0u8; n];
        kernels::scale_each::<super::super::Bf16, 32>(&xs, &factors, &mut want_mx);
        let mut room = vec![0xa5u8; n + 256];
        let aligned = room.as_ptr().align_offset(64);
        for skew in [0, 1, 8, 32, 63] {
            let at = aligned + 64 + skew;
            room.fill(0xa5);
            scale_run(&xs, &table, &mut room[at..at + n]);
            assert_eq!(&room[at..at + n], &want[..], "skew {skew}");
            assert!(room[..at].iter().chain(&room[at + n..]).all(|&b| b == 0xa5));
            room.fill(0xa5);
            scale_each_mx(&xs, &factors, &mut room[at..at + n]);
            assert_eq!(&room[at..at + n], &want_mx[..], "MXFP8, skew {skew}");
            assert!(room[..at].iter().chain(&room[at + n..]).all(|&b| b == 0xa5));
        }
    }

    /// MXFP8's table cast gives the arithmetic cast's bytes: blocks whose
    /// values reach 512 after scaling (saturated), down past the
    /// subnormals, zeros, factors from 2^-127 to 2^127, odd block counts.
    #[test]
    fn mxfp8s_table_cast_gives_the_arithmetic_casts_bytes() {
        let mut y = Rng(0x2545_f491_4f6c_dd1d);
        for trial in 0..3000 {
            let blocks = 1 + trial % 9;
            let mut factors = Vec::new();
            let mut xs = Vec::new();
            for _ in 0..blocks {
                let r = y.next();
                // The block's amax exponent, and e = floor(log2 amax) - 8.
                let ea = match trial % 5 {
                    0 => (r % 255) as i32,
                    _ => 100 + (r % 40) as i32,
                };
                let e = (ea - 127 - 8).clamp(-127, 127);
                factors.push(match e {
                    127 => f32::from_bits(1 << 22),
                    e => f32::from_bits(((127 - e) as u32) << 23),
                });
                let spread = if trial % 3 == 0 { 30 } else { 6 };
                for k in 0..super::super::MX_BLOCK {
                    let r = y.next();
                    let sign = (r >> 20 & 1) << 15;
                    let ee = (ea as u64).saturating_sub(r % spread).min(254);
                    let b = match k % 29 == 3 {
                        true => sign,
                        false => sign | ee << 7 | (r >> 30 & 0x7f),
                    };
                    xs.extend((b as u16).to_le_bytes());
                }
            }
            let n = blocks * super::super::MX_BLOCK;
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            kernels::scale_each::<super::super::Bf16, 32>(&xs, &factors, &mut want);
            scale_each_mx(&xs, &factors, &mut got);
            assert_eq!(got, want, "trial {trial}: factors {factors:?}");
        }
    }

    /// Every bf16 value a block of amax `a` can hold (|x| <= a, both
    /// signs), cast with the block's table, for amax across the range
    /// (the floor 1e-4 included): the arithmetic cast's bytes.
    #[test]
    fn every_bf16_value_of_a_block_casts_as_the_arithmetic_way() {
        let mut y = Rng(0x1234_5678_9abc_def1);
        let mut amaxes = vec![1e-4f32, 448.0, 1.0, 3.0e38];
        amaxes.extend((0..40).map(|_| f32::from_bits((y.next() as u32 >> 2) & 0x7f7f_ffff)));
        for amax in amaxes {
            let amax = amax.max(1e-4);
            let factor = (1.0f32 / amax) * 448.0;
            let table = Table::new(factor).expect("a block factor");
            let xs: Vec<u8> = (0..=u16::MAX)
                .filter(|&h| f32::from_bits((h as u32) << 16).abs() <= amax)
                .flat_map(|h| h.to_le_bytes())
                .collect();
            let n = xs.len() / 2;
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            kernels::scale_run::<super::super::Bf16>(&xs, factor, &mut want);
            scale_run(&xs, &table, &mut got);
            assert_eq!(got, want, "amax {amax}");
        }
    }

    /// MXFP8: every bf16 value a block of exponent `e` can hold (below
    /// 2^(e + 9)), in blocks of 32, for e across its range.
    #[test]
    fn every_bf16_value_of_an_mxfp8_block_casts_as_the_arithmetic_way() {
        const W: usize = super::super::MX_BLOCK;
        for e in (-127..=119).step_by(3) {
            let factor = 2f32.powi(-e);
            let top = 2f32.powi(e + 9);
            let mut xs: Vec<u8> = (0..=u16::MAX)
                .filter(|&h| f32::from_bits((h as u32) << 16).abs() < top)
                .flat_map(|h| h.to_le_bytes())
                .collect();
            xs.truncate(xs.len() / (2 * W) * (2 * W));
            let n = xs.len() / 2;
            let factors = vec![factor; n / W];
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            kernels::scale_each::<super::super::Bf16, W>(&xs, &factors, &mut want);
            scale_each_mx(&xs, &factors, &mut got);
            assert_eq!(got, want, "e {e}");
        }
    }

    #[test]
    fn factors_far_from_one_have_no_table() {
        assert!(Table::new(2f32.powi(127)).is_none());
        assert!(Table::new(f32::from_bits(1)).is_none());
        assert!(Table::new(448.0 / 1e-4).is_some());
    }
}
