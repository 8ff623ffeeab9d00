//! Finding a chunk's changes: one bit per element that differs (compared
//! 64 elements at a time, AVX2 for one- and two-byte elements where the
//! CPU has it), then one pass over the set bits gathering the changed
//! values and, for the gaps form, their gaps as LEB128 varints.

/// One bit per element, set where its bytes differ (64 elements a word).
pub(super) fn diff_bits(o: &[u8], n: &[u8], esize: usize, words: &mut [u64]) {
    #[cfg(target_arch = "x86_64")]
    if esize == 2 && avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { diff_bits_2_avx2(o, n, words) };
    }
    #[cfg(target_arch = "x86_64")]
    if esize == 1 && avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { diff_bits_1_avx2(o, n, words) };
    }
    let block = 64 * esize;
    for ((w, a), b) in words.iter_mut().zip(o.chunks(block)).zip(n.chunks(block)) {
        *w = match esize {
            2 => word_of::<2>(a, b),
            1 => word_of::<1>(a, b),
            4 => word_of::<4>(a, b),
            _ => a
                .chunks_exact(esize)
                .zip(b.chunks_exact(esize))
                .enumerate()
                .fold(0, |m, (j, (x, y))| m | ((x != y) as u64) << j),
        };
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

/// [`diff_bits`] of 2-byte elements, 64 at a time: equal 16-bit lanes
/// compared, packed to bytes (lane order restored by a permute) and their
/// top bits gathered; the bits inverted say which differ. A last partial
/// word goes through the plain loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn diff_bits_2_avx2(o: &[u8], n: &[u8], words: &mut [u64]) {
    use std::arch::x86_64::*;
    let full = (o.len() / 128).min(words.len());
    for (k, w) in words[..full].iter_mut().enumerate() {
        let half = |at: usize| {
            // SAFETY: `at + 64 <= 128 * full <= o.len() == n.len()`: the
            // four 32-byte loads from `at` stay inside both slices.
            unsafe {
                let ld = |s: &[u8], i: usize| _mm256_loadu_si256(s.as_ptr().add(i).cast());
                let a = _mm256_cmpeq_epi16(ld(o, at), ld(n, at));
                let b = _mm256_cmpeq_epi16(ld(o, at + 32), ld(n, at + 32));
                let packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0b11_01_10_00);
                _mm256_movemask_epi8(packed) as u32 as u64
            }
        };
        let at = k * 128;
        *w = !(half(at) | half(at + 64) << 32);
    }
    for ((w, a), b) in words[full..]
        .iter_mut()
        .zip(o[full * 128..].chunks(128))
        .zip(n[full * 128..].chunks(128))
    {
        *w = word_of::<2>(a, b);
    }
}

/// [`diff_bits`] of 1-byte elements (FP8), 64 at a time: equal bytes
/// compared and their top bits gathered, inverted. A last partial word
/// goes through the plain loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn diff_bits_1_avx2(o: &[u8], n: &[u8], words: &mut [u64]) {
    use std::arch::x86_64::*;
    let full = (o.len() / 64).min(words.len());
    for (k, w) in words[..full].iter_mut().enumerate() {
        let at = k * 64;
        // SAFETY: `at + 64 <= 64 * full <= o.len() == n.len()`: the two
        // 32-byte loads from `at` stay inside both slices.
        let equal = |i: usize| unsafe {
            let ld = |s: &[u8]| _mm256_loadu_si256(s.as_ptr().add(i).cast());
            _mm256_movemask_epi8(_mm256_cmpeq_epi8(ld(o), ld(n))) as u32 as u64
        };
        *w = !(equal(at) | equal(at + 32) << 32);
    }
    for ((w, a), b) in words[full..]
        .iter_mut()
        .zip(o[full * 64..].chunks(64))
        .zip(n[full * 64..].chunks(64))
    {
        *w = word_of::<1>(a, b);
    }
}

#[inline(always)]
fn word_of<const E: usize>(a: &[u8], b: &[u8]) -> u64 {
    let mut m = 0u64;
    for (j, (x, y)) in a.chunks_exact(E).zip(b.chunks_exact(E)).enumerate() {
        let x: [u8; E] = x.try_into().expect("E bytes");
        let y: [u8; E] = y.try_into().expect("E bytes");
        m |= ((x != y) as u64) << j;
    }
    m
}

/// The indices of the set bits, in order.
fn set_bits(words: &[u64]) -> impl Iterator<Item = usize> + '_ {
    words.iter().enumerate().flat_map(|(k, &w)| {
        let mut w = w;
        std::iter::from_fn(move || {
            (w != 0).then(|| {
                let i = w.trailing_zeros() as usize;
                w &= w - 1;
                k * 64 + i
            })
        })
    })
}

/// Each set bit's distance from the one before minus one (the first: its
/// index): the gaps form's positions.
fn gaps(words: &[u64]) -> impl Iterator<Item = usize> + '_ {
    let mut prev = None;
    set_bits(words).map(move |i| {
        let gap = prev.map_or(i, |p: usize| i - p - 1);
        prev = Some(i);
        gap
    })
}

pub(super) fn varint_len(x: usize) -> usize {
    (usize::BITS - (x | 1).leading_zeros()).div_ceil(7) as usize
}

/// The changed elements' new bytes, in order, into `values`, and with
/// `gaps` their gaps as varints (the gaps form's positions), in one pass
/// over the set bits of `words`.
pub(super) fn gather(
    words: &[u64],
    n: &[u8],
    esize: usize,
    values: &mut Vec<u8>,
    gaps: Option<&mut Vec<u8>>,
) {
    match esize {
        1 => gather_e::<1>(words, n, values, gaps),
        2 => gather_e::<2>(words, n, values, gaps),
        4 => gather_e::<4>(words, n, values, gaps),
        _ => {
            values.clear();
            for i in set_bits(words) {
                values.extend_from_slice(&n[i * esize..(i + 1) * esize]);
            }
            if let Some(g) = gaps {
                g.clear();
                self::gaps(words).for_each(|x| put_varint(x, g));
            }
        }
    }
}

/// [`gather`] of `E`-byte elements: fixed-size copies, the gaps' varints
/// written into room made once (at most 3 bytes each: a chunk's positions
/// fit 16 bits).
#[inline(always)]
fn gather_e<const E: usize>(
    words: &[u64],
    n: &[u8],
    values: &mut Vec<u8>,
    gaps: Option<&mut Vec<u8>>,
) {
    let changed: usize = words.iter().map(|w| w.count_ones() as usize).sum();
    values.clear();
    values.resize(changed * E, 0);
    let with_gaps = gaps.is_some();
    let mut room = Vec::new();
    let g = gaps.unwrap_or(&mut room);
    g.clear();
    if with_gaps {
        g.resize(changed * 3, 0);
    }
    let (mut k, mut at, mut next) = (0, 0, 0usize);
    for (w, &word) in words.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let i = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let v: [u8; E] = n[i * E..i * E + E].try_into().expect("E bytes");
            values[k * E..k * E + E].copy_from_slice(&v);
            k += 1;
            if with_gaps {
                let mut x = i - next;
                next = i + 1;
                while x >= 0x80 {
                    g[at] = x as u8 | 0x80;
                    x >>= 7;
                    at += 1;
                }
                g[at] = x as u8;
                at += 1;
            }
        }
    }
    g.truncate(at);
}

pub(super) fn put_varint(mut x: usize, out: &mut Vec<u8>) {
    while x >= 0x80 {
        out.push(x as u8 | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}
