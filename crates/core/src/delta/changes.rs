//! Finding a chunk's changes: one bit per element that differs (compared
//! 64 elements at a time, AVX2 for one- and two-byte elements where the
//! CPU has it), the changed values and their positions (in one pass with
//! the bits where the CPU has AVX-512 VBMI2), and the gaps form's varints.

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

/// A chunk's changes into `words` (one bit per element that differs, as
/// [`diff_bits`]), the front of `values` (the changed elements' new
/// bytes, in order) and of `pos` (their indices in the chunk, which has
/// at most 2^16 elements); returns how many changed. Both buffers are
/// grown as needed and never shrunk (zeroing them per chunk cost a pass),
/// so only their first `changed` entries are this chunk's. One pass over
/// `o` and `n` where the CPU has AVX-512 VBMI2 (1- and 2-byte elements);
/// else the bits first, then a pass over the set bits.
pub(super) fn changes(
    (o, n): (&[u8], &[u8]),
    esize: usize,
    words: &mut [u64],
    values: &mut Vec<u8>,
    pos: &mut Vec<u16>,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if (esize == 2 || esize == 1) && vbmi2() {
        // SAFETY: the CPU has AVX-512 F, BW and VBMI2 (checked just above).
        return unsafe { changes_compress(o, n, esize, words, values, pos) };
    }
    changes_scalar((o, n), esize, words, values, pos)
}

/// [`changes`] without AVX-512 VBMI2: the bits, then a pass over them.
pub(super) fn changes_scalar(
    (o, n): (&[u8], &[u8]),
    esize: usize,
    words: &mut [u64],
    values: &mut Vec<u8>,
    pos: &mut Vec<u16>,
) -> usize {
    diff_bits(o, n, esize, words);
    let changed: usize = words.iter().map(|w| w.count_ones() as usize).sum();
    grow(values, changed * esize);
    grow(pos, changed);
    gather(words, n, esize, values, pos);
    changed
}

/// The gaps form's positions of changes at `pos` (ascending): each one's
/// distance from the one before minus one (the first: its index), LEB128
/// varints, into `out`. Where the CPU has AVX-512 VBMI2, 32 gaps at a
/// time when all are under 128 (one byte each: nearly always at 10%
/// changed, where this loop was about half of encoding).
pub(super) fn put_gaps(pos: &[u16], out: &mut Vec<u8>) {
    const _: () = assert!(super::CHUNK <= 1 << 15);
    out.clear();
    out.resize(pos.len() * 3, 0);
    let (mut at, mut done, mut next) = (0usize, 0usize, 0usize);
    while done < pos.len() {
        #[cfg(target_arch = "x86_64")]
        if vbmi2() && done + 32 <= pos.len() {
            // SAFETY: the CPU has AVX-512 F and BW (checked); 32 positions
            // from `done` are read, 32 bytes written at `at <= 3 * done`
            // into `out` (`3 * pos.len()` bytes).
            if unsafe { short_gaps32(&pos[done..done + 32], next, &mut out[at..at + 32]) } {
                next = pos[done + 31] as usize + 1;
                (at, done) = (at + 32, done + 32);
                continue;
            }
        }
        let end = (done + 32).min(pos.len());
        for &p in &pos[done..end] {
            let mut x = p as usize - next;
            next = p as usize + 1;
            while x >= 0x80 {
                out[at] = x as u8 | 0x80;
                x >>= 7;
                at += 1;
            }
            out[at] = x as u8;
            at += 1;
        }
        done = end;
    }
    out.truncate(at);
}

/// The gaps of 32 ascending positions `p` (the one before them ending at
/// `next`), one byte each into `out`, when every gap is under 128; false
/// (nothing meaningful written) when one is not. Positions and `next` fit
/// 16 bits: a chunk has at most 2^15 elements.
///
/// # Safety
/// AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn short_gaps32(p: &[u16], next: usize, out: &mut [u8]) -> bool {
    use std::arch::x86_64::*;
    // Lane i takes position i - 1 (lane 0 its own, replaced by `next`).
    let shift: [u16; 32] = std::array::from_fn(|i| i.saturating_sub(1) as u16);
    // SAFETY: loads of 64 bytes from `p` (32 positions) and `shift` (32),
    // a store of 32 bytes into `out` (its length).
    unsafe {
        let v = _mm512_loadu_si512(p.as_ptr().cast());
        let shifted = _mm512_permutexvar_epi16(_mm512_loadu_si512(shift.as_ptr().cast()), v);
        let after_prev = _mm512_add_epi16(shifted, _mm512_set1_epi16(1));
        let before = _mm512_mask_mov_epi16(after_prev, 1, _mm512_set1_epi16(next as i16));
        let gaps = _mm512_sub_epi16(v, before);
        if _mm512_cmpge_epu16_mask(gaps, _mm512_set1_epi16(0x80)) != 0 {
            return false;
        }
        _mm256_storeu_si256(out.as_mut_ptr().cast(), _mm512_cvtepi16_epi8(gaps));
    }
    true
}

pub(super) fn varint_len(x: usize) -> usize {
    (usize::BITS - (x | 1).leading_zeros()).div_ceil(7) as usize
}

/// The set bits of `words` as positions and the new bytes there (each
/// element copied at its size, `super::set`); `values` and `pos` are sized.
fn gather(words: &[u64], n: &[u8], esize: usize, values: &mut [u8], pos: &mut [u16]) {
    let mut k = 0;
    for (w, &word) in words.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let i = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            super::set(values, k, &n[i * esize..(i + 1) * esize], esize);
            pos[k] = i as u16;
            k += 1;
        }
    }
}

/// Whether the CPU has AVX-512 F, BW and VBMI2 (compresses and expands
/// of bytes and 16-bit lanes).
#[cfg(target_arch = "x86_64")]
pub(super) fn vbmi2() -> bool {
    static VBMI2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VBMI2.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vbmi2")
    })
}

/// [`changes`] by AVX-512 with no branch on the elements' bits: compared
/// into a mask, the new values packed by a compress and stored whole (the
/// store's tail is overwritten by the next), their indices packed the same
/// way. 2-byte elements 32 at a time ([`compress16`]), 1-byte ones 64 at a
/// time ([`compress8`]: one compare and one compress of a whole vector,
/// where 32 at a time used half of each). The bit loop of [`gather`]
/// mispredicted its exit about once per word at 2% changed, and read `n`
/// again.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn changes_compress(
    o: &[u8],
    n: &[u8],
    esize: usize,
    words: &mut [u64],
    values: &mut Vec<u8>,
    pos: &mut Vec<u16>,
) -> usize {
    let elems = n.len() / esize;
    // Room for a whole vector stored at the last change.
    grow(values, elems * esize + 64);
    grow(pos, elems + 32);
    words.fill(0);
    // SAFETY: the CPU has the features (this function's own); the buffers
    // are sized as the loops need (just above).
    let (i, k) = unsafe {
        match esize {
            2 => compress16(o, n, words, values, pos),
            _ => compress8(o, n, words, values, pos),
        }
    };
    let mut k = k;
    for j in i..elems {
        if o[j * esize..(j + 1) * esize] != n[j * esize..(j + 1) * esize] {
            values[k * esize..(k + 1) * esize].copy_from_slice(&n[j * esize..(j + 1) * esize]);
            pos[k] = j as u16;
            words[j / 64] |= 1 << (j % 64);
            k += 1;
        }
    }
    k
}

/// [`changes_compress`]'s loop over 2-byte elements, 32 at a time: the
/// elements done and the changes found.
///
/// # Safety
/// AVX-512 F, BW and VBMI2; `values` holds `n.len() + 64` bytes and `pos`
/// `n.len() / 2 + 32` entries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn compress16(
    o: &[u8],
    n: &[u8],
    words: &mut [u64],
    values: &mut [u8],
    pos: &mut [u16],
) -> (usize, usize) {
    use std::arch::x86_64::*;
    let elems = n.len() / 2;
    let (mut k, mut i) = (0usize, 0usize);
    while i + 32 <= elems {
        // SAFETY: the loads read elements `i..i + 32` (64 bytes) of `o`
        // and `n`; `k <= i`: the stores of 64 bytes at element `k` stay
        // inside `values` and `pos` (sized as the caller promises).
        unsafe {
            let a = _mm512_loadu_si512(o.as_ptr().add(2 * i).cast());
            let b = _mm512_loadu_si512(n.as_ptr().add(2 * i).cast());
            let m = _mm512_cmpneq_epi16_mask(a, b);
            let x = _mm512_maskz_compress_epi16(m, b);
            _mm512_storeu_si512(values.as_mut_ptr().add(k * 2).cast(), x);
            store_positions(m, i, pos.as_mut_ptr().add(k));
            words[i / 64] |= (m as u64) << (i % 64);
            k += m.count_ones() as usize;
        }
        i += 32;
    }
    (i, k)
}

/// [`changes_compress`]'s loop over 1-byte elements, 64 at a time (a word
/// of bits each): the elements done and the changes found. The positions
/// (16-bit lanes) go in two compresses of 32.
///
/// # Safety
/// AVX-512 F, BW and VBMI2; `values` holds `n.len() + 64` bytes and `pos`
/// `n.len() + 32` entries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn compress8(
    o: &[u8],
    n: &[u8],
    words: &mut [u64],
    values: &mut [u8],
    pos: &mut [u16],
) -> (usize, usize) {
    use std::arch::x86_64::*;
    let elems = n.len();
    let (mut k, mut i) = (0usize, 0usize);
    while i + 64 <= elems {
        // SAFETY: the loads read bytes `i..i + 64` of `o` and `n`; `k <= i`:
        // the value store of 64 bytes at `k` stays inside `values`
        // (`elems + 64`), the position stores of 32 lanes at `k` and at
        // `k + (changes in the first half) <= i + 32` inside `pos`
        // (`elems + 32`).
        unsafe {
            let a = _mm512_loadu_si512(o.as_ptr().add(i).cast());
            let b = _mm512_loadu_si512(n.as_ptr().add(i).cast());
            let m = _mm512_cmpneq_epi8_mask(a, b);
            let x = _mm512_maskz_compress_epi8(m, b);
            _mm512_storeu_si512(values.as_mut_ptr().add(k).cast(), x);
            let (lo, hi) = (m as u32, (m >> 32) as u32);
            store_positions(lo, i, pos.as_mut_ptr().add(k));
            let k2 = k + lo.count_ones() as usize;
            store_positions(hi, i + 32, pos.as_mut_ptr().add(k2));
            words[i / 64] = m;
            k = k2 + hi.count_ones() as usize;
        }
        i += 64;
    }
    (i, k)
}

/// The indices `first + j` of the set bits `j` of `m`, packed into 32
/// lanes stored at `to` (the lanes past the count are overwritten later).
///
/// # Safety
/// AVX-512 F, BW and VBMI2; `to` has room for 32 entries; `first + 31`
/// fits 16 bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2")]
unsafe fn store_positions(m: u32, first: usize, to: *mut u16) {
    use std::arch::x86_64::*;
    let iota: [u16; 32] = std::array::from_fn(|k| k as u16);
    // SAFETY: a load of 64 bytes from an array of 64, a store of 64 bytes
    // where the caller has room.
    unsafe {
        let iota = _mm512_loadu_si512(iota.as_ptr().cast());
        let at = _mm512_add_epi16(iota, _mm512_set1_epi16(first as i16));
        _mm512_storeu_si512(to.cast(), _mm512_maskz_compress_epi16(m, at));
    }
}

fn grow<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

pub(super) fn put_varint(mut x: usize, out: &mut Vec<u8>) {
    while x >= 0x80 {
        out.push(x as u8 | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}
