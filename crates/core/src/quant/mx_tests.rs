//! MXFP8 against PyTorch running the OCP rule (`tests.rs`'s reference,
//! scheme "mx"): the edges of the rule, E8M0 bytes, and blocks split over
//! holders.

use super::tests::{encode, f32s, ours, python, run_reference, same, values, Job};
use super::*;
use crate::test_rng::Rng;
use std::path::Path;

/// MXFP8 at the edges of its rule: a block's exponent from its amax's
/// (powers of two, just below them, E4M3's saturation between 448 and 512
/// times the scale, all zeros, subnormal and tiny amax clamped to 2^-127),
/// its E8M0 byte, and partial blocks at a row's end; the bytes and scales
/// against PyTorch running the stated expression.
#[test]
fn mxfp8_blocks_match_pytorch_at_the_edges_of_the_rule() {
    let amaxes: [f32; 10] = [
        1.0,
        1.0 - f32::EPSILON / 2.0,
        448.0,
        479.0,
        511.9,
        0.0,
        1e-40,
        2f32.powi(-119),
        2f32.powi(-118),
        3.0e38,
    ];
    let n = 70; // two whole blocks and a partial one
    let mut x = Vec::new();
    for (k, &a) in amaxes.iter().enumerate() {
        for c in 0..n {
            // The block's amax at one element, the rest spread below it.
            let v = match c % 32 {
                5 => a,
                c => a * (c as f32 / 37.0) * if k % 2 == 0 { -1.0 } else { 1.0 },
            };
            x.push(v);
        }
    }
    let m = amaxes.len();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let (q, s) = ours(Scheme::Mxfp8, DType::F32, &bytes, (m, n));
    // The rule by hand: 1.0 -> e = -8 (byte 119); 448 -> e = 0; zeros and
    // amax below 2^-118 -> byte 0.
    let [_, sc] = Scheme::Mxfp8.scales_shape(m, n);
    let amax_of = |r: usize| amaxes[r].abs();
    let mut e8m0 = vec![0u8; m * sc];
    Scheme::Mxfp8.write_scales(
        &(0..m * sc).map(|i| amax_of(i / sc)).collect::<Vec<_>>(),
        &mut e8m0,
    );
    assert_eq!(&e8m0[..3], &[119, 119, 119]);
    assert_eq!(e8m0[sc], 118, "just below 1.0");
    assert_eq!(e8m0[2 * sc], 127, "448");
    assert_eq!(e8m0[5 * sc], 0, "all zeros");
    assert_eq!(e8m0[7 * sc], 0, "2^-119 clamps to 2^-127");
    assert_eq!(e8m0[8 * sc], 1, "2^-118");
    assert_eq!(q[2 * n + 5], 0x7e, "448 at 2^0 is 448");
    assert_eq!(q[4 * n + 5], 0x7e, "511.9 saturates");
    for (i, s) in s.iter().enumerate() {
        // 2^e's exponent field is the E8M0 byte (2^-127, subnormal: 0).
        assert_eq!((s.to_bits() >> 23) as u8, e8m0[i], "scale {i}");
    }
    let Some(py) = python() else { return };
    let job = Job {
        x: &bytes,
        dtype: "f32",
        shape: (m, n),
        scheme: "mx",
    };
    let (theirs, their_e8m0) = reference_e8m0(&py, job);
    same("mxfp8 edges", (q, s), theirs);
    assert_eq!(e8m0, their_e8m0, "E8M0 bytes");
}

/// PyTorch's bytes, scales and E8M0 bytes of one "mx" job.
fn reference_e8m0(py: &Path, job: Job) -> ((Vec<u8>, Vec<f32>), Vec<u8>) {
    let dir = run_reference(py, &[job], "cpu");
    let read = |ext: &str| std::fs::read(dir.path().join(format!("0.{ext}"))).unwrap();
    ((read("q"), f32s(&read("s"))), read("e8m0"))
}

/// MXFP8 blocks split over holders by columns (30 columns each: most
/// blocks of 32 have two holders) quantize as the whole tensor.
#[test]
fn an_mxfp8_block_split_over_holders_quantizes_as_the_whole() {
    let mut rng = Rng(12);
    let (m, n) = (40, 150);
    let x = encode(&values(&mut rng, (m, n)), DType::Bf16);
    let whole = ours(Scheme::Mxfp8, DType::Bf16, &x, (m, n));
    let cuts = [0, 30, 60, 90, 120, n];
    let part = |k: usize| -> Vec<u8> {
        (0..m)
            .flat_map(|r| x[(r * n + cuts[k]) * 2..(r * n + cuts[k + 1]) * 2].to_vec())
            .collect()
    };
    fn src(bytes: &[u8], rows: usize, cols: usize) -> Source<'_> {
        Source {
            dtype: DType::Bf16,
            bytes,
            rows,
            cols,
        }
    }
    let [sr, sc] = Scheme::Mxfp8.scales_shape(m, n);
    let mut amax = vec![0f32; sr * sc];
    let parts: Vec<Vec<u8>> = (0..cuts.len() - 1).map(part).collect();
    for (k, p) in parts.iter().enumerate() {
        let mut mine = vec![0f32; sr * sc];
        let w = cuts[k + 1] - cuts[k];
        block_amax(Scheme::Mxfp8, src(p, m, w), [0, cuts[k]], [m, n], &mut mine).unwrap();
        amax.iter_mut().zip(&mine).for_each(|(a, b)| *a = a.max(*b));
    }
    let (mut q, mut s) = (vec![0u8; m * n], vec![0f32; sr * sc]);
    for (k, p) in parts.iter().enumerate() {
        let w = cuts[k + 1] - cuts[k];
        let mut mine = vec![0u8; m * w];
        let whole_shape = ([0, cuts[k]], [m, n]);
        quantize_with(
            Scheme::Mxfp8,
            src(p, m, w),
            whole_shape,
            &amax,
            &mut mine,
            &mut s,
        )
        .unwrap();
        for r in 0..m {
            q[r * n + cuts[k]..r * n + cuts[k + 1]].copy_from_slice(&mine[r * w..(r + 1) * w]);
        }
    }
    same("mxfp8 split over holders", (q, s), whole);
}

#[test]
fn mxfp8_in_bands_quantizes_as_the_whole() {
    // 140 rows of 8193 bf16 (a partial block at each row's end): bands of
    // 15 rows in cache, against one pass of each kind over the whole.
    let mut rng = Rng(12);
    let (m, n) = (140, 8193);
    let x = encode(&values(&mut rng, (m, n)), DType::Bf16);
    let src = Source {
        dtype: DType::Bf16,
        bytes: &x,
        rows: m,
        cols: n,
    };
    let [sr, sc] = Scheme::Mxfp8.scales_shape(m, n);
    let mut amax = vec![0f32; sr * sc];
    block_amax(Scheme::Mxfp8, src, [0, 0], [m, n], &mut amax).unwrap();
    let (mut q, mut s) = (vec![0u8; m * n], vec![0f32; sr * sc]);
    quantize_with(Scheme::Mxfp8, src, ([0, 0], [m, n]), &amax, &mut q, &mut s).unwrap();
    let whole = ours(Scheme::Mxfp8, DType::Bf16, &x, (m, n));
    same("MXFP8 in bands", (q, s), whole);
}

#[test]
fn a_non_finite_element_past_mxfp8s_first_band_is_named() {
    // MXFP8 takes bands of the rows that fit in cache (16 of 8192 bf16):
    // past the first, the same.
    let mut wide = vec![0.25f32; 140 * 8192];
    wide[135 * 8192 + 100] = f32::NAN;
    let x = encode(&wide, DType::Bf16);
    let src = Source {
        dtype: DType::Bf16,
        bytes: &x,
        rows: 140,
        cols: 8192,
    };
    let (mut q4, mut s4) = (vec![0u8; 140 * 8192], vec![0f32; 140 * 256]);
    assert!(matches!(
        quantize(Scheme::Mxfp8, src, &mut q4, &mut s4),
        Err(QuantError::NonFinite {
            index: 1_106_020,
            ..
        })
    ));
}
