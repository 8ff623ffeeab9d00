//! The quantizer's inner loops over one block's run of a row: written
//! without branches so the compiler vectorizes them, and compiled twice,
//! for the baseline x86-64 and for AVX2 (picked at run time, as the
//! checksums are), since the library is built for the baseline.
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
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { abs_bits_max_avx2::<E>(xs) };
    }
    abs_bits_max_body::<E>(xs)
}

/// Each element times `factor`, cast to E4M3, into `out` (one per element).
pub(super) fn scale_run<E: Element>(xs: &[u8], factor: f32, out: &mut [u8]) {
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
