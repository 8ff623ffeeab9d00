//! Runs of equally spaced blocks, copied out of GPU memory with one 2D copy
//! each (`cuMemcpy2D`, `cuMemcpy2DAsync`).
//!
//! A strided part of a GPU version (a column split: one block per row)
//! reaches the engine as many small blocks, each at the same distance from
//! the one before in the trainer's buffer and in the destination. One
//! driver call per block costs a few microseconds of launch each (a 4096-row
//! column split: thousands of calls per tensor); one 2D copy per run of
//! equally spaced blocks costs one. [`runs`] finds the runs in blocks as
//! they come, in order; a block that does not continue a run starts the
//! next one, so any mix of blocks is copied exactly, run by run.

/// `height` blocks of `width` bytes: block `k` goes from `src + k *
/// src_pitch` to `dst + k * dst_pitch`. A single block has both pitches
/// equal to its width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub dst: u64,
    pub src: u64,
    pub width: usize,
    pub height: usize,
    pub dst_pitch: u64,
    pub src_pitch: u64,
}

/// Largest pitch a 2D copy is given: the driver refuses pitches above the
/// device's `CU_DEVICE_ATTRIBUTE_MAX_PITCH`, which is 2^31 - 1 on every
/// GPU so far. Blocks further apart are copied one by one.
pub(crate) const MAX_PITCH: u64 = (1 << 31) - 1;

impl Strided {
    /// One block of `len` bytes.
    pub fn block(dst: u64, src: u64, len: usize) -> Strided {
        Strided {
            dst,
            src,
            width: len,
            height: 1,
            dst_pitch: len as u64,
            src_pitch: len as u64,
        }
    }

    /// Bytes copied.
    pub fn bytes(&self) -> usize {
        self.width * self.height
    }

    /// Take block `(dst, src, len)` as this run's next row, when it is one:
    /// the same width, at the run's pitches (a second block sets them:
    /// forward, at least a width apart so no two rows overlap, within
    /// [`MAX_PITCH`]).
    fn extend(&mut self, (dst, src, len): (u64, u64, usize)) -> bool {
        if len != self.width || len == 0 {
            return false;
        }
        if self.height == 1 {
            let pitch = |from: u64, to: u64| {
                to.checked_sub(from)
                    .filter(|p| *p >= len as u64 && *p <= MAX_PITCH)
            };
            let (Some(dp), Some(sp)) = (pitch(self.dst, dst), pitch(self.src, src)) else {
                return false;
            };
            (self.dst_pitch, self.src_pitch) = (dp, sp);
        } else {
            let h = self.height as u64;
            let next =
                |base: u64, pitch: u64| pitch.checked_mul(h).and_then(|o| base.checked_add(o));
            if next(self.dst, self.dst_pitch) != Some(dst)
                || next(self.src, self.src_pitch) != Some(src)
            {
                return false;
            }
        }
        self.height += 1;
        true
    }
}

/// `blocks` (key, (dst, src, len)), in order, as runs of equally spaced
/// blocks of one width and one key (the GPU they are copied on); empty
/// blocks are dropped.
pub fn runs<K: Copy + PartialEq>(
    blocks: impl IntoIterator<Item = (K, (u64, u64, usize))>,
) -> Vec<(K, Strided)> {
    let mut out: Vec<(K, Strided)> = Vec::new();
    for (key, b) in blocks.into_iter().filter(|b| b.1 .2 > 0) {
        let extended = match out.last_mut() {
            Some((k, run)) => *k == key && run.extend(b),
            None => false,
        };
        if !extended {
            out.push((key, Strided::block(b.0, b.1, b.2)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte the runs copy, as (dst, src) pairs, in order.
    fn bytes_of(runs: &[((), Strided)]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (_, r) in runs {
            for k in 0..r.height as u64 {
                for i in 0..r.width as u64 {
                    out.push((r.dst + k * r.dst_pitch + i, r.src + k * r.src_pitch + i));
                }
            }
        }
        out
    }

    fn bytes_of_blocks(blocks: &[(u64, u64, usize)]) -> Vec<(u64, u64)> {
        let one = |&(d, s, n): &(u64, u64, usize)| (0..n as u64).map(move |i| (d + i, s + i));
        blocks.iter().flat_map(one).collect()
    }

    #[test]
    fn a_column_split_is_one_run() {
        // 64 rows of 96 bytes at 192-byte steps, landing back to back.
        let blocks: Vec<_> = (0..64u64)
            .map(|k| (1000 + k * 96, 32 + k * 192, 96))
            .collect();
        let r = runs(blocks.iter().map(|b| ((), *b)));
        assert_eq!(
            r,
            vec![(
                (),
                Strided {
                    dst: 1000,
                    src: 32,
                    width: 96,
                    height: 64,
                    dst_pitch: 96,
                    src_pitch: 192
                }
            )]
        );
        assert_eq!(bytes_of(&r), bytes_of_blocks(&blocks));
    }

    #[test]
    fn blocks_that_break_the_pattern_start_new_runs() {
        let blocks = [
            (0, 0, 8),
            (8, 16, 8),
            (16, 32, 8),
            // Another width.
            (24, 48, 4),
            // Backwards: its own run.
            (0, 100, 4),
            // Overlapping the row before (pitch below the width): a new
            // run, which the next block continues (pitches 98 and 98).
            (2, 102, 4),
            (100, 200, 4),
            // Off that run's pattern: a new one, then pitches 4 and 20.
            (104, 210, 4),
            (108, 230, 4),
            (0, 0, 0),
            // Too far apart for a 2D copy.
            (1 << 40, 0, 4),
            ((1 << 40) + MAX_PITCH + 1, 4, 4),
        ];
        let r = runs(blocks.iter().map(|b| ((), *b)));
        let heights: Vec<usize> = r.iter().map(|r| r.1.height).collect();
        assert_eq!(heights, vec![3, 1, 1, 2, 2, 1, 1]);
        assert_eq!(bytes_of(&r), bytes_of_blocks(&blocks));
    }

    #[test]
    fn blocks_on_another_gpu_start_a_new_run() {
        let blocks = [
            (0, (0, 0, 8)),
            (0, (8, 16, 8)),
            (1, (16, 32, 8)),
            (1, (24, 48, 8)),
        ];
        let r = runs(blocks);
        let got: Vec<(i32, usize)> = r.iter().map(|(k, r)| (*k, r.height)).collect();
        assert_eq!(got, vec![(0, 2), (1, 2)]);
    }
}
