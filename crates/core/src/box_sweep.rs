//! Do any two of many boxes share an element? A sweep along the dimension
//! the boxes are split along, in `O(n log n)` for the layouts met in
//! practice and never more than a bounded amount of work.
//!
//! Shards of a global tensor (what sources announce) and pieces of a param
//! (what an engine registers) must not overlap. Comparing every pair is
//! quadratic: 80,000 column shards took 15 s, 60,000 pieces of one param
//! 31 s. Here the boxes are sorted by their start along the *sweep*
//! dimension (the one with the most distinct starts: rows for an FSDP
//! split, columns for a column split) and swept in that order. The boxes
//! still open at a box's start all contain that coordinate, so they must be
//! disjoint in the other dimensions; they are kept ordered by their start
//! along a second, *key* dimension, and a new box is compared only with
//! those whose key range may meet its own.
//!
//! When the boxes vary along at most two dimensions (every row, column,
//! expert or 2D grid split), the open boxes are disjoint along the key, so
//! one comparison per box decides: `O(n log n)`. Boxes varying along three
//! or more dimensions are compared with every open box whose key range may
//! meet theirs; the comparisons are counted, and past [`budget`] the sweep
//! stops with [`TooFragmented`] instead of growing quadratically (the
//! caller refuses the layout, naming it).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// A box: its offset and its length per dimension (all boxes of one sweep
/// have the same number of dimensions).
pub type BoxRef<'a> = (&'a [u64], &'a [u64]);

/// The sweep gave up: the boxes vary along three or more dimensions in a
/// way that needs more than [`budget`] comparisons.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooFragmented {
    pub boxes: usize,
}

/// The most box comparisons a sweep of `n` boxes makes: 32 n log2 n, and
/// at least 4,096.
pub fn budget(n: usize) -> u64 {
    let n = n as u64;
    let log = 64 - n.leading_zeros() as u64;
    (32 * n * log.max(1)).max(4096)
}

/// Some two boxes of `boxes` (given by `get`, `n` of them) that share an
/// element, as `(earlier, later)` indices; None when all are disjoint.
/// Empty boxes (a length of 0) share nothing.
pub fn find_overlap<'a>(
    n: usize,
    get: impl Fn(usize) -> BoxRef<'a>,
) -> Result<Option<(usize, usize)>, TooFragmented> {
    if n < 2 {
        return Ok(None);
    }
    let ndim = get(0).0.len();
    let (sweep, key, varying) = choose_dims(n, ndim, &get);
    let start = |i: usize, d: Option<usize>| d.map_or(0, |d| get(i).0[d]);
    let end = |i: usize, d: Option<usize>| d.map_or(1, |d| get(i).0[d] + get(i).1[d]);
    let mut order: Vec<usize> = (0..n).filter(|&i| !is_empty(get(i))).collect();
    order.sort_unstable_by_key(|&i| (start(i, sweep), i));
    let max_key_len = order
        .iter()
        .map(|&i| end(i, key) - start(i, key))
        .max()
        .unwrap_or(0);
    // Open boxes by (key start, index); when each closes along the sweep.
    let mut open: BTreeSet<(u64, usize)> = BTreeSet::new();
    let mut closing: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut work = 0u64;
    let limit = budget(n);
    for &b in &order {
        while let Some(&Reverse((at, j))) = closing.peek() {
            if at > start(b, sweep) {
                break;
            }
            closing.pop();
            open.remove(&(start(j, key), j));
        }
        let (lo, hi) = (start(b, key), end(b, key));
        for &(k, j) in open.range(..(hi, 0)).rev() {
            if k.saturating_add(max_key_len) <= lo {
                break;
            }
            work += 1;
            if work > limit {
                return Err(TooFragmented { boxes: n });
            }
            if meet(get(j), get(b)) {
                return Ok(Some((j.min(b), j.max(b))));
            }
            // Along at most two varying dimensions the open boxes are
            // disjoint along the key: only the nearest can meet this one.
            if varying <= 2 && end(j, key) <= lo {
                break;
            }
        }
        open.insert((lo, b));
        closing.push(Reverse((end(b, sweep), b)));
    }
    Ok(None)
}

/// The dimension `n` boxes are split along: the one with the most
/// distinct starts (None for scalars). Boxes sorted by their start along it
/// are found by a binary search.
pub fn split_dim<'a>(n: usize, get: impl Fn(usize) -> BoxRef<'a>) -> Option<usize> {
    match n {
        0 => None,
        _ => choose_dims(n, get(0).0.len(), &get).0,
    }
}

/// The sweep dimension (most distinct starts), the key dimension (the next
/// most), and how many dimensions the boxes vary along at all. `None`: no
/// such dimension (the boxes are all alike there, or too few dimensions).
fn choose_dims<'a>(
    n: usize,
    ndim: usize,
    get: &impl Fn(usize) -> BoxRef<'a>,
) -> (Option<usize>, Option<usize>, usize) {
    // Per dimension: distinct starts, distinct (start, length) pairs.
    let mut distinct: Vec<(usize, usize, usize)> = Vec::with_capacity(ndim);
    let mut varying = 0;
    let mut pairs: Vec<(u64, u64)> = Vec::with_capacity(n);
    for d in 0..ndim {
        pairs.clear();
        pairs.extend((0..n).map(|i| (get(i).0[d], get(i).1[d])));
        pairs.sort_unstable();
        pairs.dedup();
        if pairs.len() > 1 {
            varying += 1;
        }
        let mut starts: Vec<u64> = pairs.iter().map(|p| p.0).collect();
        starts.dedup();
        distinct.push((starts.len(), pairs.len(), d));
    }
    // Most distinct starts first, then dimensions that vary at all (so
    // the key is a varying one when there is one), then the lower one.
    distinct.sort_unstable_by_key(|&(starts, pairs, d)| (Reverse(starts), Reverse(pairs), d));
    let pick = |k: usize| distinct.get(k).map(|&(_, _, d)| d);
    (pick(0), pick(1), varying)
}

fn is_empty((_, len): BoxRef) -> bool {
    len.contains(&0)
}

/// Two boxes of one rank share an element (an empty box shares none).
/// Their ends fit 64 bits (boxes inside a global tensor's shape).
pub(crate) fn meet((ao, al): BoxRef, (bo, bl): BoxRef) -> bool {
    (0..ao.len()).all(|d| ao[d].max(bo[d]) < (ao[d] + al[d]).min(bo[d] + bl[d]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair compared: the reference.
    fn quadratic(boxes: &[(Vec<u64>, Vec<u64>)]) -> bool {
        (0..boxes.len()).any(|i| {
            (i + 1..boxes.len()).any(|j| {
                let (a, b) = (&boxes[i], &boxes[j]);
                !is_empty((&a.0, &a.1))
                    && !is_empty((&b.0, &b.1))
                    && meet((&a.0, &a.1), (&b.0, &b.1))
            })
        })
    }

    fn sweep(boxes: &[(Vec<u64>, Vec<u64>)]) -> Result<Option<(usize, usize)>, TooFragmented> {
        find_overlap(boxes.len(), |i| (&boxes[i].0[..], &boxes[i].1[..]))
    }

    /// A small deterministic generator (no dependency for tests).
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn agrees_with_comparing_every_pair_on_random_boxes() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..3000 {
            let ndim = 1 + round % 4;
            let n = 1 + (next(&mut seed) % 9) as usize;
            let boxes: Vec<(Vec<u64>, Vec<u64>)> = (0..n)
                .map(|_| {
                    let o: Vec<u64> = (0..ndim).map(|_| next(&mut seed) % 6).collect();
                    let l: Vec<u64> = (0..ndim).map(|_| next(&mut seed) % 4).collect();
                    (o, l)
                })
                .collect();
            let found = sweep(&boxes).unwrap();
            assert_eq!(found.is_some(), quadratic(&boxes), "{boxes:?}");
            if let Some((i, j)) = found {
                assert!(i < j && meet((&boxes[i].0, &boxes[i].1), (&boxes[j].0, &boxes[j].1)));
            }
        }
    }

    #[test]
    fn column_shards_rows_and_grids_are_checked_in_linear_logarithmic_work() {
        // 200,000 one-column shards of [64, 200000], then one overlapping.
        let n = 200_000u64;
        let mut cols: Vec<(Vec<u64>, Vec<u64>)> =
            (0..n).map(|c| (vec![0, c], vec![64, 1])).collect();
        assert_eq!(sweep(&cols).unwrap(), None);
        cols.push((vec![10, 77], vec![1, 2]));
        assert_eq!(sweep(&cols).unwrap(), Some((77, n as usize)));
        // A 400 x 400 grid: every box open along the sweep meets 400 others'
        // rows, but only its neighbour along the key is compared.
        let grid: Vec<(Vec<u64>, Vec<u64>)> = (0..160_000u64)
            .map(|i| (vec![i / 400 * 3, i % 400 * 5], vec![3, 5]))
            .collect();
        assert_eq!(sweep(&grid).unwrap(), None);
    }

    #[test]
    fn boxes_varying_along_three_dimensions_stop_at_the_budget() {
        // Along the key every box spans [0, 1000) or is one of many narrow
        // ones: open boxes overlap along the key, so comparisons add up.
        let mut boxes = Vec::new();
        for x in 0..400u64 {
            for y in 0..400u64 {
                boxes.push((vec![0, y, x], vec![1, 1, 1]));
            }
            boxes.push((vec![1, 0, x], vec![1, 1000, 1]));
        }
        match sweep(&boxes) {
            Ok(None) | Err(TooFragmented { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
