//! Received bytes of an entry mapped to where they lie in its param: the
//! entry's segments walked forward once, alongside the chunks that bring
//! the bytes. Chunks of an entry arrive in order, so a batch of many small
//! blocks (a column split's rows) costs one search for the first segment
//! and a step per block after it, not a search per block. [`Spans`] says
//! where an entry's received bytes go: back to back, or laid out like its
//! param.

use crate::memory::SendPtr;
use crate::plan::Segment;

/// Where part of a chunk goes: bytes `at..at + len` of the chunk to `dst`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub at: u64,
    pub dst: SendPtr,
    pub len: u64,
}

/// `spans` as (address, length) pieces, in order, each run of spans that
/// follow each other in memory joined into one.
pub(super) fn joined(spans: &[Span]) -> Vec<(SendPtr, usize)> {
    let mut out: Vec<(SendPtr, usize)> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some((at, n)) if at.0.wrapping_add(*n) == s.dst.0 => *n += s.len as usize,
            _ => out.push((s.dst, s.len as usize)),
        }
    }
    out
}

/// Where an entry's received bytes go, chunk after chunk (in order).
pub(super) enum Spans<'s> {
    /// Back to back from here (the entry's own buffer or arena slot).
    Packed(*mut u8),
    /// In memory laid out like the param, at `base`.
    Param {
        base: *mut u8,
        walk: SegmentWalk<'s>,
    },
}

impl Spans<'_> {
    /// Received bytes `[offset, offset + len)` (following on from the last
    /// call's), as spans handed to `f` in order. Err: a byte in no run.
    pub(super) fn map(
        &mut self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(Span),
    ) -> Result<(), u64> {
        match self {
            Spans::Packed(base) => {
                let dst = SendPtr(base.wrapping_add(offset as usize));
                f(Span { at: 0, dst, len });
                Ok(())
            }
            Spans::Param { base, walk } => walk.map(offset, len, |at, p, len| {
                let dst = SendPtr(base.wrapping_add(p as usize));
                f(Span { at, dst, len })
            }),
        }
    }
}

/// A forward walk over an entry's segments (in the order received).
pub(super) struct SegmentWalk<'s> {
    segs: &'s [Segment],
    /// The segment the next received byte is in (or past the last).
    i: usize,
}

impl<'s> SegmentWalk<'s> {
    /// A walk over `segs` from received byte `offset`.
    pub(super) fn at(segs: &'s [Segment], offset: u64) -> SegmentWalk<'s> {
        let i = segs.partition_point(|s| s.wanted + s.len <= offset);
        SegmentWalk { segs, i }
    }

    /// Received bytes `[offset, offset + len)`, which start at or after
    /// where the last call's ended, cut at segment edges: `f(byte of the
    /// range, param byte, length)` per piece, in order. Err: a byte in no
    /// segment.
    pub(super) fn map(
        &mut self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(u64, u64, u64),
    ) -> Result<(), u64> {
        let end = offset.checked_add(len).ok_or(offset)?;
        let mut at = offset;
        while at < end {
            while self
                .segs
                .get(self.i)
                .is_some_and(|s| s.wanted + s.len <= at)
            {
                self.i += 1;
            }
            let s = self.segs.get(self.i).filter(|s| s.wanted <= at).ok_or(at)?;
            let n = (s.wanted + s.len).min(end) - at;
            f(at - offset, s.param + (at - s.wanted), n);
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three 8-byte segments received back to back, at param bytes 100,
    /// 200 and 300.
    fn segs() -> Vec<Segment> {
        (0..3)
            .map(|k| Segment {
                source: 16 * k,
                wanted: 8 * k,
                param: 100 * (k + 1),
                len: 8,
            })
            .collect()
    }

    fn pieces(walk: &mut SegmentWalk, offset: u64, len: u64) -> Result<Vec<(u64, u64, u64)>, u64> {
        let mut out = Vec::new();
        walk.map(offset, len, |a, p, n| out.push((a, p, n)))?;
        Ok(out)
    }

    #[test]
    fn blocks_crossing_segment_edges_are_cut_there() {
        let segs = segs();
        let mut walk = SegmentWalk::at(&segs, 3);
        // 3..13 crosses the edge at 8; 13..24 crosses the one at 16.
        assert_eq!(
            pieces(&mut walk, 3, 10).unwrap(),
            [(0, 103, 5), (5, 200, 5)]
        );
        assert_eq!(
            pieces(&mut walk, 13, 11).unwrap(),
            [(0, 205, 3), (3, 300, 8)]
        );
        // Past the last segment: the first byte in none.
        assert_eq!(pieces(&mut walk, 24, 1), Err(24));
        // A walk started mid-way finds its segment.
        let mut walk = SegmentWalk::at(&segs, 17);
        assert_eq!(pieces(&mut walk, 17, 2).unwrap(), [(0, 301, 2)]);
        assert_eq!(pieces(&mut walk, 19, 6), Err(24));
    }
}
