use super::*;
use crate::test_rng::Rng;

/// `old` with a `share` of its elements changed (at random places).
fn changed(rng: &mut Rng, old: &[u8], esize: usize, share: f64) -> Vec<u8> {
    let mut new = old.to_vec();
    for e in new.chunks_exact_mut(esize) {
        if (rng.next() % 1_000_000) as f64 / 1e6 < share {
            e[0] ^= 1 + (rng.next() % 255) as u8;
        }
    }
    new
}

fn round_trip(old: &[u8], new: &[u8], esize: usize) -> (usize, Encoded) {
    let mut delta = Vec::new();
    let stats = encode(old, new, esize, &mut delta);
    let mut run = old.to_vec();
    apply(&delta, &mut run, esize).unwrap();
    assert!(
        run == new,
        "esize {esize}: the delta applied gives the new bytes"
    );
    // The listed changes (a GPU receiver's) give the same bytes.
    let listed = list_changes(&delta, old.len(), esize).unwrap();
    let mut run = old.to_vec();
    for (at, bytes) in &listed.whole {
        run[*at as usize..*at as usize + bytes.len()].copy_from_slice(&delta[bytes.clone()]);
    }
    assert!(listed.positions.windows(2).all(|w| w[0] < w[1]));
    for (p, x) in listed
        .positions
        .iter()
        .zip(listed.values.chunks_exact(esize))
    {
        run[*p as usize * esize..(*p as usize + 1) * esize].copy_from_slice(x);
    }
    assert!(
        run == new,
        "esize {esize}: the listed changes give the new bytes"
    );
    (delta.len(), stats)
}

#[test]
fn every_share_and_element_size_round_trips_exactly() {
    let mut rng = Rng(3);
    for esize in [1, 2, 3, 4] {
        for len in [0, 1, 63, 64, 65, CHUNK - 1, CHUNK, 2 * CHUNK + 17] {
            let old: Vec<u8> = (0..len * esize).map(|_| rng.next() as u8).collect();
            for share in [0.0, 0.0001, 0.02, 0.3, 0.9, 1.0] {
                let new = changed(&mut rng, &old, esize, share);
                round_trip(&old, &new, esize);
            }
        }
    }
}

#[test]
fn the_smallest_form_is_chosen_and_two_percent_costs_under_four_percent() {
    let mut rng = Rng(5);
    let old: Vec<u8> = (0..8 * CHUNK * 2).map(|_| rng.next() as u8).collect();
    let same = round_trip(&old, &old, 2);
    assert_eq!((same.0, same.1.unchanged), (8, 8));
    // 2% of bf16 elements: gaps, about 3 bytes per change (a varint and
    // the value): under 0.04 of the whole bytes.
    let new = changed(&mut rng, &old, 2, 0.02);
    let (n, s) = round_trip(&old, &new, 2);
    assert_eq!(s.gaps, 8, "{s:?}");
    let ratio = n as f64 / old.len() as f64;
    assert!(ratio < 0.035, "2% changed: delta / whole = {ratio}");
    // Half changed: a bitmask; all changed: whole.
    let new = changed(&mut rng, &old, 2, 0.5);
    assert_eq!(round_trip(&old, &new, 2).1.bitmask, 8);
    let new: Vec<u8> = old.iter().map(|b| !b).collect();
    assert_eq!(round_trip(&old, &new, 2).1.whole, 8);
}

/// A delta of one chunk of `elems` 2-byte elements: `body` after tag `tag`.
/// Applying may write part of it before it finds the error (one pass);
/// `check`, which a receiver runs before writing, refuses it the same way.
fn hostile(tag: u8, body: &[u8], elems: usize) -> String {
    let mut delta = vec![tag];
    delta.extend_from_slice(body);
    let mut run = vec![7u8; elems * 2];
    let e = apply(&delta, &mut run, 2).unwrap_err();
    assert_eq!(check(&delta, elems * 2, 2).unwrap_err(), e);
    assert_eq!(list_changes(&delta, elems * 2, 2).unwrap_err(), e);
    e.0
}

#[test]
fn hostile_deltas_are_refused_naming_the_chunk() {
    let cases: Vec<(u8, Vec<u8>, usize, &str)> = vec![
        // Gaps: a position past the chunk (8 elements, gap 8).
        (
            GAPS,
            vec![1, 0, 0, 8],
            8,
            "chunk 0: a position past the chunk's 8 elements",
        ),
        // Two positions, the second past the end (0 then gap 7 -> 8).
        (GAPS, vec![2, 0, 0, 0, 0, 0, 7], 8, "past the chunk"),
        // A count that disagrees with the bytes: 3 announced, values for 1.
        (GAPS, vec![3, 9, 9], 8, "6 bytes announced, 2 left"),
        (GAPS, vec![0], 8, "0 changed elements"),
        (GAPS, vec![9], 8, "9 changed elements in a chunk of 8"),
        (
            GAPS,
            vec![1, 5, 5, 0x80, 0x80, 0x80, 0x80, 0x80, 0],
            8,
            "more than 5 bytes",
        ),
        (GAPS, vec![1, 5, 5, 0x80], 8, "cut short"),
        // Bitmask: bits past the last element, values missing.
        (
            BITMASK,
            vec![0b1000_0000],
            7,
            "bits set past the chunk's last element",
        ),
        (BITMASK, vec![0b11, 1, 2], 8, "4 bytes announced, 2 left"),
        (WHOLE, vec![1, 2, 3], 8, "16 bytes announced, 3 left"),
        (9, vec![], 8, "unknown form 9"),
    ];
    for (tag, body, elems, want) in cases {
        let e = hostile(tag, &body, elems);
        assert!(e.contains(want), "want '{want}' in: {e}");
    }
    let mut run = vec![0u8; 16];
    let e = apply(&[UNCHANGED, 0], &mut run, 2).unwrap_err();
    assert!(e.0.contains("1 bytes after the run's last chunk"), "{e}");
    let e = apply(&[], &mut run, 2).unwrap_err();
    assert!(e.0.contains("chunk 0: the delta ends before it"), "{e}");
    assert!(apply(&[], &mut run[..3], 2).is_err());
}

/// A gaps chunk of `count` changes at positions `gaps` (varint bytes as
/// given, each a position's), over a chunk of `elems` bf16 elements.
fn gaps_body(count: u8, gaps: &[&[u8]]) -> Vec<u8> {
    let mut body = vec![count];
    body.extend(std::iter::repeat_n(9u8, 2 * count as usize));
    gaps.iter().for_each(|g| body.extend_from_slice(g));
    body
}

/// The unchecked reading of gaps (`fast.rs`, taken while 3 bytes of the
/// delta are left) refuses what the checked one does, at any place in a
/// long chunk: a position past the chunk found mid-way, a 4-byte varint
/// (left to the checked loop, which refuses it as past), 2- and 3-byte
/// varints read right, and positions that run out.
#[test]
fn long_gaps_chunks_are_checked_as_short_ones() {
    let ones: Vec<&[u8]> = vec![&[0]; 20];
    let mut past = ones.clone();
    past[10] = &[0x80, 0x80, 0x01]; // 16384: past 1000 elements
    let e = hostile(GAPS, &gaps_body(20, &past), 1000);
    assert!(e.contains("past the chunk's 1000 elements"), "{e}");
    let mut long = ones.clone();
    long[5] = &[0x80, 0x80, 0x80, 0x01]; // 2^21, in 4 bytes
    let e = hostile(GAPS, &gaps_body(20, &long), 1000);
    assert!(e.contains("past the chunk's 1000 elements"), "{e}");
    let e = hostile(GAPS, &gaps_body(20, &ones[..12]), 1000);
    assert!(e.contains("cut short"), "{e}");
    // 2- and 3-byte gaps land where the checked loop puts them.
    // A 4-byte varint of 1 (not the shortest form, as the checked loop
    // allows) hands over to the checked loop, which goes on.
    let mut wide = ones.clone();
    (wide[3], wide[7]) = (&[0x81, 0x01], &[0x80, 0x80, 0x01]); // 129, 16384
    wide[10] = &[0x81, 0x80, 0x80, 0x00];
    let mut delta = vec![GAPS];
    delta.extend(gaps_body(20, &wide));
    let mut run = vec![0u8; 2 * 20000];
    apply(&delta, &mut run, 2).unwrap();
    let set: Vec<usize> = (0..20000).filter(|&k| run[2 * k] == 9).collect();
    let mut want = vec![0, 1, 2, 3 + 129, 4 + 129, 5 + 129, 6 + 129];
    want.extend((7..10).map(|k| k + 129 + 16384));
    want.extend((10..20).map(|k| k + 1 + 129 + 16384));
    assert_eq!(set, want);
}

#[test]
fn the_predicted_ratio_is_what_encoding_random_changes_gives() {
    let mut rng = Rng(9);
    let old: Vec<u8> = (0..16 * CHUNK * 2).map(|_| rng.next() as u8).collect();
    for share in [0.001, 0.005, 0.02, 0.1, 0.5, 1.0] {
        let new = changed(&mut rng, &old, 2, share);
        let (n, _) = round_trip(&old, &new, 2);
        let got = n as f64 / old.len() as f64;
        let want = predicted_ratio(share, 2);
        assert!(
            (got - want).abs() <= 0.05 * want + 1e-4,
            "{share}: encoded {got}, predicted {want}"
        );
    }
}

/// Patching window by window (whole chunks, a short last one) gives what
/// one call gives, and counts the elements it rewrote; `check` takes what
/// applies and refuses what does not, writing nothing.
#[test]
fn windows_and_checks_agree_with_apply() {
    let elems = 3 * CHUNK + 777;
    let old: Vec<u8> = (0..elems * 2).map(|i| (i * 13 % 251) as u8).collect();
    let mut new = old.clone();
    for i in (0..elems).step_by(41) {
        new[2 * i] ^= 0x11;
    }
    let mut delta = Vec::new();
    let stats = encode(&old, &new, 2, &mut delta);
    check(&delta, old.len(), 2).unwrap();
    let mut whole = old.clone();
    assert_eq!(apply(&delta, &mut whole, 2).unwrap(), stats.changed);
    let mut run = old.clone();
    let mut p = Patcher::new(&delta, 2).unwrap();
    for w in run.chunks_mut(2 * CHUNK * 2) {
        p.patch(w).unwrap();
    }
    assert_eq!(p.finish().unwrap(), stats.changed);
    assert!(run == new && whole == new);
    // A short window must be the last.
    let mut p = Patcher::new(&delta, 2).unwrap();
    let _ = p.patch(&mut run[..10]);
    let e = p.patch(&mut run[10..20]).unwrap_err();
    assert!(e.0.contains("a window of 10 bytes"), "{e}");
    // Cut short, or one byte over: refused by both.
    for bad in [
        &delta[..delta.len() - 1],
        &[delta.as_slice(), &[0]].concat()[..],
    ] {
        let e = check(bad, old.len(), 2).unwrap_err();
        assert_eq!(apply(bad, &mut old.clone(), 2).unwrap_err(), e);
    }
    assert!(check(&delta, old.len() + 1, 2).is_err());
}

/// The vectorized change masks (1- and 2-byte elements) are the plain
/// loop's, word for word, partial last words included.
#[test]
fn the_vector_change_masks_match_the_plain_loop() {
    let mut rng = Rng(11);
    for esize in [1, 2] {
        for elems in [0, 1, 63, 64, 65, 127, 1000, CHUNK] {
            let old: Vec<u8> = (0..elems * esize).map(|_| rng.next() as u8).collect();
            let new = changed(&mut rng, &old, esize, 0.1);
            let mut got = vec![0u64; elems.div_ceil(64)];
            super::changes::diff_bits(&old, &new, esize, &mut got);
            let want: Vec<u64> = (0..elems.div_ceil(64))
                .map(|w| {
                    (0..64.min(elems - w * 64)).fold(0u64, |m, j| {
                        let i = (w * 64 + j) * esize;
                        m | ((old[i..i + esize] != new[i..i + esize]) as u64) << j
                    })
                })
                .collect();
            assert_eq!(got, want, "esize {esize}, {elems} elements");
        }
    }
}

/// The one-pass change finder (AVX-512 VBMI2, where the CPU has it) gives
/// the bits, values and positions of the plain one, at every length and
/// share.
#[test]
fn the_one_pass_changes_match_the_plain_ones() {
    use super::changes::{changes, changes_scalar};
    let mut rng = Rng(11);
    for esize in [1, 2, 4] {
        for len in [1, 31, 32, 33, 63, 64, 65, 127, 128, 1000, CHUNK] {
            let old: Vec<u8> = (0..len * esize).map(|_| rng.next() as u8).collect();
            for share in [0.0, 0.02, 0.3, 1.0] {
                let new = changed(&mut rng, &old, esize, share);
                let w = len.div_ceil(64);
                let (mut wa, mut wb) = (vec![7u64; w], vec![0u64; w]);
                let (mut va, mut vb, mut pa, mut pb) = (vec![], vec![], vec![], vec![]);
                let a = changes((&old, &new), esize, &mut wa, &mut va, &mut pa);
                let b = changes_scalar((&old, &new), esize, &mut wb, &mut vb, &mut pb);
                assert_eq!(a, b, "esize {esize} len {len} share {share}");
                assert_eq!(wa, wb, "esize {esize} len {len} share {share}");
                assert!(va[..a * esize] == vb[..b * esize]);
                assert_eq!(pa[..a], pb[..b]);
            }
        }
    }
}

/// The gaps form's varints (32 at a time where all gaps are under 128)
/// are the one-at-a-time LEB128 of each gap: lengths around 32, gaps from
/// 0 to past 2^14, a first position past 127.
#[test]
fn gaps_are_written_as_one_varint_each() {
    use super::changes::{put_gaps, put_varint};
    let mut rng = Rng(5);
    for len in [0, 1, 31, 32, 33, 63, 64, 65, 100, 1000] {
        for widest in [1u64, 8, 127, 128, 300, 20_000] {
            let mut pos = Vec::with_capacity(len);
            let mut next = 0u64;
            for _ in 0..len {
                let p = next + rng.next() % widest;
                if p >= CHUNK as u64 {
                    break;
                }
                pos.push(p as u16);
                next = p + 1;
            }
            let mut want = Vec::new();
            let mut prev = 0usize;
            for &p in &pos {
                put_varint(p as usize - prev, &mut want);
                prev = p as usize + 1;
            }
            let mut got = Vec::new();
            put_gaps(&pos, &mut got);
            assert_eq!(got, want, "{} positions, gaps below {widest}", pos.len());
        }
    }
}
