//! The hot loops of applying a delta onto a run in memory: a gaps chunk's
//! positions read a varint at a time without a check per byte, and a
//! bitmask chunk's changes written by AVX-512 expanding loads. Both give
//! what the checked loops of `mod.rs` give (tested against them); their
//! callers have checked the chunk's counts first.
//!
//! Measured on one core of the 2-core machine (64 MiB of bf16 in memory,
//! `wm bench delta`, GB/s of the run): at 0.5% / 2% / 10% changed (gaps)
//! 23 / 12 / 6.7 before, 51 / 18.7 / 13.6 after; at 2% the stores' cache
//! misses bound it (58 GB/s when the run fits the cache). Tried and
//! slower: a software prefetch ahead of each change, and decoding a batch
//! of positions before their stores.

#[cfg(target_arch = "x86_64")]
use super::changes::vbmi2;
use super::{Reader, Sink};

/// The front of a gaps chunk's positions, while at least 3 bytes of the
/// delta are left: a well-formed position's varint is at most 3 bytes
/// (positions fit 16 bits), read without a check per byte and with one
/// well-predicted branch for the common 1-byte gap, each element stored at
/// its size (a per-byte loop and a store of run-time size cost more than
/// the rest of applying). Returns the changes applied and the next
/// position; a longer varint, and what follows it, is left to the checked
/// loop.
pub(super) fn gaps_fast<S: Sink>(
    r: &mut Reader,
    sink: &mut S,
    values: &[u8],
    elems: usize,
    esize: usize,
) -> Result<(usize, usize), String> {
    match esize {
        2 => gaps_fast_e::<S, 2>(r, sink, values, elems),
        1 => gaps_fast_e::<S, 1>(r, sink, values, elems),
        4 => gaps_fast_e::<S, 4>(r, sink, values, elems),
        _ => Ok((0, 0)),
    }
}

#[inline(always)]
fn gaps_fast_e<S: Sink, const E: usize>(
    r: &mut Reader,
    sink: &mut S,
    values: &[u8],
    elems: usize,
) -> Result<(usize, usize), String> {
    let rest = &r.b[r.at..];
    let (mut done, mut next, mut at) = (0usize, 0usize, 0usize);
    let mut vals = values.chunks_exact(E);
    while at + 3 <= rest.len() {
        let (b0, b1, b2) = (
            rest[at] as usize,
            rest[at + 1] as usize,
            rest[at + 2] as usize,
        );
        let (gap, n) = if b0 < 0x80 {
            (b0, 1)
        } else if b1 < 0x80 {
            (b0 & 0x7f | b1 << 7, 2)
        } else if b2 < 0x80 {
            (b0 & 0x7f | (b1 & 0x7f) << 7 | b2 << 14, 3)
        } else {
            break;
        };
        let Some(x) = vals.next() else { break };
        // No overflow: gap < 2^21 and next <= elems.
        let i = next + gap;
        if i >= elems {
            return Err(format!("a position past the chunk's {elems} elements"));
        }
        if S::WRITES {
            sink.set(i, x, E);
        }
        (at, next, done) = (at + n, i + 1, done + 1);
    }
    r.at += at;
    Ok((done, next))
}

/// A checked bitmask chunk's changes (`values`: one element of `esize`
/// bytes per set bit of `mask`, in order) written into `chunk`, 32 (bf16)
/// or 64 (one-byte) elements per expanding load and masked store; false
/// when the CPU has no AVX-512 VBMI2 or the size is another.
pub(super) fn expand_into(mask: &[u8], values: &[u8], chunk: &mut [u8], esize: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if (esize == 2 || esize == 1) && vbmi2() {
        // SAFETY: the CPU has AVX-512 F, BW and VBMI2 (checked just
        // above).
        unsafe {
            match esize {
                2 => expand16(mask, values, chunk),
                _ => expand8(mask, values, chunk),
            }
        }
        return true;
    }
    false
}

/// [`expand_into`] for elements of 2 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn expand16(mask: &[u8], values: &[u8], chunk: &mut [u8]) {
    use std::arch::x86_64::*;
    let elems = chunk.len() / 2;
    let (mut i, mut v) = (0usize, 0usize);
    while i + 32 <= elems {
        let m = u32::from_le_bytes([
            mask[i / 8],
            mask[i / 8 + 1],
            mask[i / 8 + 2],
            mask[i / 8 + 3],
        ]);
        if m != 0 {
            let n = 2 * m.count_ones() as usize;
            // Sliced: a mask with more bits than values panics here, not
            // reads past them.
            let src = &values[v..v + n];
            // SAFETY: the load reads the `n` bytes of `src` (one element
            // per set bit), the store writes the set lanes of elements
            // `i..i + 32` of the chunk (inside it); the CPU has the
            // features (this function's).
            unsafe {
                let x = _mm512_maskz_expandloadu_epi16(m, src.as_ptr().cast());
                _mm512_mask_storeu_epi16(chunk.as_mut_ptr().add(2 * i).cast(), m, x);
            }
            v += n;
        }
        i += 32;
    }
    for k in i..elems {
        if mask[k / 8] >> (k % 8) & 1 == 1 {
            chunk[2 * k..2 * k + 2].copy_from_slice(&values[v..v + 2]);
            v += 2;
        }
    }
}

/// [`expand_into`] for elements of 1 byte.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn expand8(mask: &[u8], values: &[u8], chunk: &mut [u8]) {
    use std::arch::x86_64::*;
    let elems = chunk.len();
    let (mut i, mut v) = (0usize, 0usize);
    while i + 64 <= elems {
        let mut b = [0u8; 8];
        b.copy_from_slice(&mask[i / 8..i / 8 + 8]);
        let m = u64::from_le_bytes(b);
        if m != 0 {
            let n = m.count_ones() as usize;
            let src = &values[v..v + n];
            // SAFETY: as in `expand16`, for bytes.
            unsafe {
                let x = _mm512_maskz_expandloadu_epi8(m, src.as_ptr().cast());
                _mm512_mask_storeu_epi8(chunk.as_mut_ptr().add(i).cast(), m, x);
            }
            v += n;
        }
        i += 64;
    }
    for k in i..elems {
        if mask[k / 8] >> (k % 8) & 1 == 1 {
            chunk[k] = values[v];
            v += 1;
        }
    }
}
