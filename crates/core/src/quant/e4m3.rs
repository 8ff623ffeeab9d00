//! FP8 E4M3 (`float8_e4m3fn`): 1 sign bit, 4 exponent bits (bias 7), 3
//! mantissa bits; largest finite value 448; no infinities; NaN is
//! `0x7f`/`0xff`.
//!
//! The conversion from `f32` is what `tensor.to(torch.float8_e4m3fn)` does
//! on the CPU in the PyTorch the tests use (2.15), bit for bit (checked
//! against it for every bf16 value and its neighbours): round to nearest,
//! ties to even; magnitudes above 448, infinities included, saturate to
//! +-448 (`0x7e`/`0xfe`); NaN stays NaN (`0x7f`, with its sign). (Older
//! PyTorch turned magnitudes from 464 up into NaN; a quantizer keeps every
//! scaled value within 448 plus a rounding, where both agree.)

/// `f`'s nearest E4M3 byte, as PyTorch converts it.
#[inline]
pub fn from_f32(f: f32) -> u8 {
    /// 448.0: from here up (infinity too) the result saturates to 448.
    const FP8_MAX: u32 = 0x43e0_0000;
    const INFINITY: u32 = 0x7f80_0000;
    /// 2^-6 + 2^-9 ... the magic that rounds subnormals by an addition.
    const DENORM_MASK: u32 = 141 << 23;
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let mut f_bits = bits ^ sign;
    let result = if f_bits > INFINITY {
        0x7f
    } else if f_bits >= FP8_MAX {
        0x7e
    } else if f_bits < (121 << 23) {
        // Below 2^-6, the smallest normal: the float addition rounds the
        // mantissa into the subnormal range.
        f_bits = (f32::from_bits(f_bits) + f32::from_bits(DENORM_MASK)).to_bits();
        f_bits.wrapping_sub(DENORM_MASK) as u8
    } else {
        let mant_odd = (f_bits >> 20) & 1;
        // Rebias the exponent (7 - 127) and round to nearest even.
        f_bits = f_bits
            .wrapping_add(((7i32 - 127) as u32) << 23)
            .wrapping_add(0x7ffff);
        f_bits = f_bits.wrapping_add(mant_odd);
        (f_bits >> 20) as u8
    };
    result | (sign >> 24) as u8
}

/// [`from_f32`] of a finite `f`, computed on both paths and selected, with
/// no branch, so a loop of it vectorizes. The quantizer casts only finite
/// values (its amax pass refuses NaN and infinities first), so NaN's own
/// select is left out of the loop that dominates quantizing (8% of its
/// time): a NaN gives +-448 (`0x7e`/`0xfe`) here, not NaN. The same byte as
/// [`from_f32`] for every other input, infinities included (tested).
#[inline(always)]
pub fn from_finite_f32(f: f32) -> u8 {
    const FP8_MAX: u32 = 0x43e0_0000;
    const DENORM_MASK: u32 = 141 << 23;
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let c = (bits ^ sign).min(FP8_MAX);
    let normal = c
        .wrapping_add((((7i32 - 127) as u32) << 23).wrapping_add(0x7ffff))
        .wrapping_add((c >> 20) & 1)
        >> 20;
    let small = (f32::from_bits(c) + f32::from_bits(DENORM_MASK))
        .to_bits()
        .wrapping_sub(DENORM_MASK);
    let r = if c < (121 << 23) { small } else { normal };
    (r | (sign >> 24)) as u8
}

/// The value of E4M3 byte `b`.
pub fn to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0x0f, (b & 0x07) as f32);
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    sign * match e {
        0 => m / 8.0 * 2f32.powi(-6),
        e => (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7),
    }
}

/// The largest finite E4M3 value.
pub(crate) const MAX: f32 = 448.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_byte_converts_back_to_itself() {
        for b in 0..=255u8 {
            let v = to_f32(b);
            if v.is_nan() {
                assert_eq!(b & 0x7f, 0x7f);
                continue;
            }
            // -0 converts to 0x80, +0 to 0x00: the byte itself.
            assert_eq!(from_f32(v), b, "byte {b:#04x} = {v}");
        }
    }

    #[test]
    fn the_branchless_cast_gives_the_same_byte_but_for_nan() {
        // Every bf16 pattern, the f32 patterns either side of it (E4M3's
        // ties, its thresholds and 448 are bf16 values) and a spread of
        // other f32 bit patterns.
        let mut x = 0x9e37_79b9u32;
        for h in 0..=u16::MAX as u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let b = h << 16;
            for bits in [b, b.wrapping_sub(1), b | 1, x] {
                let f = f32::from_bits(bits);
                if !f.is_nan() {
                    assert_eq!(from_finite_f32(f), from_f32(f), "{bits:#010x}");
                }
            }
        }
    }

    #[test]
    fn rounding_saturation_and_nan_follow_pytorch_2_15() {
        assert_eq!(to_f32(from_f32(448.0)), 448.0);
        // Above 448 saturates, infinities too; NaN stays NaN.
        assert_eq!(from_f32(479.9), 0x7e);
        assert_eq!(from_f32(480.0), 0x7e);
        assert_eq!(from_f32(-1e9), 0xfe);
        assert_eq!(from_f32(f32::INFINITY), 0x7e);
        assert_eq!(from_f32(f32::NAN), 0x7f);
        assert_eq!(from_f32(-f32::NAN), 0xff);
        // Ties to even: 1.0625 lies between 1.0 (even) and 1.125.
        assert_eq!(to_f32(from_f32(1.0625)), 1.0);
        assert_eq!(to_f32(from_f32(1.1875)), 1.25);
        // The smallest subnormal, 2^-9, and half of it (a tie to 0).
        assert_eq!(from_f32(2f32.powi(-9)), 0x01);
        assert_eq!(from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(from_f32(1.5 * 2f32.powi(-10)), 0x01);
    }
}
