//! WANT's requests (protocol 3): exactly the bytes of a publisher's tensor
//! one engine entry needs, as strided runs, and where a request's bytes
//! lie in its tensor.
//!
//! A request's bytes are its runs' blocks back to back, in order: block
//! `i` of run `r` is `r.len` bytes at `r.offset + i * r.stride` of the
//! tensor. A whole tensor is one run `{0, nbytes, 1, nbytes}`.

use super::fields::{In, Out};
use crate::result::{try_vec, Error, Result};

/// Most requests in one WANT (engine entries of one source).
pub(crate) const MAX_REQUESTS: usize = 1 << 20;
/// Most runs in one WANT, all requests together.
pub(crate) const MAX_RUNS: usize = 1 << 20;
/// Most contiguous blocks one WANT may ask for, all requests together
/// (rows back to back count as one block). Bytes are bounded by the
/// publisher's tensors, but a block costs the publisher a copy and a step
/// whatever its length: 50 bytes on the wire asking for every other byte
/// of a 64 MiB tensor are 32 Mi one-byte blocks. 16 Mi blocks take the
/// publisher about a second to walk and copy; an engine's column split of
/// a whole model is far fewer (a row per param row it takes).
pub const MAX_BLOCKS: u64 = 1 << 24;
/// How many times over one WANT may ask for the bytes the publisher's rank
/// holds, all requests together (quantized ones count their elements): an
/// engine may hold the same elements in several params, each its own
/// request, but no engine needs every byte more than a few times, and the
/// publisher's reading, packing, hashing and (quantized) images grow with
/// what is asked, so they stay within this many times its tensors.
pub const MAX_OVERLAP: u64 = 4;

/// `rows` blocks of `len` bytes, the first at byte `offset` of the tensor,
/// each next `stride` bytes after the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WantRun {
    pub offset: u64,
    pub len: u64,
    pub rows: u64,
    pub stride: u64,
}

impl WantRun {
    /// Its contiguous blocks: (length, count). Rows back to back are one.
    fn block_shape(&self) -> (u64, u64) {
        match self.rows == 1 || self.stride == self.len {
            true => (self.len.saturating_mul(self.rows), 1),
            false => (self.len, self.rows),
        }
    }

    /// How many contiguous blocks the run is.
    pub fn blocks(&self) -> u64 {
        self.block_shape().1
    }
}

/// The contiguous pieces of a request's byte range ([`Request::extents`]):
/// (tensor offset, request offset, length) each.
#[derive(Clone, Debug)]
pub struct Extents<'q> {
    /// The runs not yet passed.
    runs: &'q [WantRun],
    /// The request offset where `runs[0]` starts.
    base: u64,
    /// The next request byte to place, and the end of the range.
    at: u64,
    end: u64,
}

impl Iterator for Extents<'_> {
    type Item = (u64, u64, u64);

    fn next(&mut self) -> Option<(u64, u64, u64)> {
        while let Some((r, rest)) = self.runs.split_first() {
            if self.at >= self.end {
                return None;
            }
            let (block, count) = r.block_shape();
            let n = block.saturating_mul(count);
            if self.at >= self.base.saturating_add(n) {
                (self.runs, self.base) = (rest, self.base.saturating_add(n));
                continue;
            }
            let row = (self.at - self.base) / block;
            let start = self.base + row * block;
            let to = (start + block).min(self.end);
            let piece = (
                r.offset + row * r.stride + (self.at - start),
                self.at,
                to - self.at,
            );
            self.at = to;
            return Some(piece);
        }
        None
    }
}

/// One engine entry's bytes of manifest tensor `tensor`; `sums` asks for
/// the xxh3-128 of the request's bytes (a SUMS frame) as they are served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub tensor: u32,
    pub runs: Vec<WantRun>,
    pub sums: bool,
}

impl Request {
    /// All of a tensor of `nbytes` bytes, in order (no run for 0 bytes).
    pub fn whole(tensor: u32, nbytes: u64, sums: bool) -> Request {
        let runs = match nbytes {
            0 => Vec::new(),
            n => vec![WantRun {
                offset: 0,
                len: n,
                rows: 1,
                stride: n,
            }],
        };
        Request { tensor, runs, sums }
    }

    /// The request of `blocks` ((tensor offset, length), in the order the
    /// bytes are wanted): equal blocks equally spaced make one strided run.
    pub fn of_blocks(
        tensor: u32,
        blocks: impl IntoIterator<Item = (u64, u64)>,
        sums: bool,
    ) -> Self {
        let mut runs: Vec<WantRun> = Vec::new();
        for (offset, len) in blocks {
            match runs.last_mut() {
                Some(r)
                    if r.len == len
                        && (r.rows == 1 && offset >= r.offset + len
                            || r.rows > 1 && offset == r.offset + r.rows * r.stride) =>
                {
                    r.stride = offset - r.offset - (r.rows - 1) * r.stride;
                    r.rows += 1;
                }
                _ => runs.push(WantRun {
                    offset,
                    len,
                    rows: 1,
                    stride: len,
                }),
            }
        }
        Request { tensor, runs, sums }
    }

    /// The request's byte count (checked requests only: no overflow).
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len * r.rows).sum()
    }

    /// The request reads its tensor's bytes in one contiguous range from
    /// `offset`: Some(offset).
    pub fn contiguous(&self) -> Option<u64> {
        match self.runs.as_slice() {
            [] => Some(0),
            [r] if r.rows == 1 || r.stride == r.len => Some(r.offset),
            _ => None,
        }
    }

    /// The request is its whole tensor of `nbytes`, in order.
    pub fn is_whole(&self, nbytes: u64) -> bool {
        self.contiguous() == Some(0) && self.bytes() == nbytes
    }

    /// Where request bytes `[at, at + len)` lie in the tensor: (tensor
    /// offset, request offset, length) of each contiguous extent, in order,
    /// walked as they are asked for (a request of millions of one-byte
    /// rows is never a list of them). A run of rows back to back
    /// (`stride == len`) is one piece.
    pub fn extents(&self, at: u64, len: u64) -> Extents<'_> {
        Extents {
            runs: &self.runs,
            base: 0,
            at,
            end: at.saturating_add(len),
        }
    }

    /// How many contiguous blocks the request's bytes lie in, as
    /// [`Request::extents`] walks them (saturating).
    pub fn blocks(&self) -> u64 {
        self.runs
            .iter()
            .fold(0u64, |n, r| n.saturating_add(r.blocks()))
    }

    /// Check the request against its publisher's tensors (`sizes`, bytes
    /// by manifest index): the tensor exists, and every run has blocks
    /// (`len > 0`, `rows > 0`), blocks that do not overlap (`stride >= len`
    /// when `rows > 1`) and lies inside the tensor, with no overflow.
    pub fn check(&self, k: usize, sizes: &[u64]) -> Result<()> {
        let bad = |why: String| Err(Error::peer(format!("WANT request #{k}: {why}")));
        let Some(&n) = sizes.get(self.tensor as usize) else {
            return bad(format!("names tensor #{} of {}", self.tensor, sizes.len()));
        };
        let mut total = 0u64;
        for (i, r) in self.runs.iter().enumerate() {
            if r.len == 0 || r.rows == 0 || (r.rows > 1 && r.stride < r.len) {
                return bad(format!(
                    "run {i} has len {}, rows {}, stride {} (len and rows at least 1, \
                     stride at least len)",
                    r.len, r.rows, r.stride
                ));
            }
            let end = (r.rows - 1)
                .checked_mul(r.stride)
                .and_then(|s| s.checked_add(r.offset))
                .and_then(|s| s.checked_add(r.len));
            total = match (end, r.len.checked_mul(r.rows)) {
                (Some(end), Some(b)) if end <= n => total.saturating_add(b),
                _ => {
                    return bad(format!(
                        "run {i} ({} rows of {} bytes from byte {}, stride {}) runs past \
                         the {n} bytes of tensor #{}",
                        r.rows, r.len, r.offset, r.stride, self.tensor
                    ))
                }
            };
        }
        // An entry's blocks are distinct bytes of its tensor: more is a
        // request for the same bytes again (and a way to make a publisher
        // plan without bound).
        if total > n {
            return bad(format!(
                "{total} bytes asked of the {n} bytes of tensor #{}",
                self.tensor
            ));
        }
        Ok(())
    }
}

/// Check every request of a WANT against the publisher's tensors (`sizes`)
/// before anything is planned or packed, and that all of them together ask
/// for at most [`MAX_BLOCKS`] blocks and [`MAX_OVERLAP`] times the bytes
/// the tensors hold.
pub fn check_requests(requests: &[Request], sizes: &[u64]) -> Result<()> {
    let held = sizes.iter().fold(0u64, |a, &b| a.saturating_add(b));
    let (mut blocks, mut bytes) = (0u64, 0u64);
    for (k, q) in requests.iter().enumerate() {
        q.check(k, sizes)?;
        blocks = blocks.saturating_add(q.blocks());
        if blocks > MAX_BLOCKS {
            return Err(Error::peer(format!(
                "WANT request #{k}: {blocks} blocks asked for so far, at most \
                 {MAX_BLOCKS} in one WANT"
            )));
        }
        bytes = bytes.saturating_add(q.bytes());
        if bytes > held.saturating_mul(MAX_OVERLAP) {
            return Err(Error::peer(format!(
                "WANT request #{k}: {bytes} bytes asked for so far, more than {MAX_OVERLAP} \
                 times the {held} this rank's tensors hold"
            )));
        }
    }
    Ok(())
}

pub(super) fn encode(o: &mut Out, requests: &[Request]) {
    o.u32(requests.len() as u32);
    for q in requests {
        o.u32(q.tensor);
        o.u8(q.sums as u8);
        o.u32(q.runs.len() as u32);
        for r in &q.runs {
            o.u64(r.offset);
            o.u64(r.len);
            o.u64(r.rows);
            o.u64(r.stride);
        }
    }
}

pub(super) fn decode(i: &mut In) -> Result<Vec<Request>> {
    let n = i.count(4 + 1 + 4, "requests")?;
    if n > MAX_REQUESTS {
        return Err(Error::peer(format!(
            "wire: WANT of {n} requests (at most {MAX_REQUESTS})"
        )));
    }
    let mut runs_left = MAX_RUNS;
    let mut out = try_vec(n, "wire: WANT's requests")?;
    for k in 0..n {
        let tensor = i.u32()?;
        let sums = match i.u8()? {
            0 => false,
            1 => true,
            f => return Err(Error::peer(format!("wire: request #{k}: sums flag {f}"))),
        };
        let m = i.count(32, "runs")?;
        if m > runs_left {
            return Err(Error::peer(format!(
                "wire: WANT of more than {MAX_RUNS} runs"
            )));
        }
        runs_left -= m;
        let mut runs = try_vec(m, "wire: WANT's runs")?;
        for _ in 0..m {
            runs.push(WantRun {
                offset: i.u64()?,
                len: i.u64()?,
                rows: i.u64()?,
                stride: i.u64()?,
            });
        }
        out.push(Request { tensor, runs, sums });
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn run(offset: u64, len: u64, rows: u64, stride: u64) -> WantRun {
        WantRun {
            offset,
            len,
            rows,
            stride,
        }
    }

    #[test]
    fn blocks_join_into_strided_runs_and_map_back() {
        // Columns 2..4 of a [3, 4] u8 tensor, then a lone block.
        let q = Request::of_blocks(0, [(2, 2), (6, 2), (10, 2), (20, 5)], false);
        assert_eq!(q.runs, vec![run(2, 2, 3, 4), run(20, 5, 1, 5)]);
        assert_eq!(q.bytes(), 11);
        assert_eq!(q.contiguous(), None);
        // Request bytes 1..8: the end of row 0, rows 1 and 2, 2 of the lone block.
        assert_eq!(
            q.extents(1, 8).collect::<Vec<_>>(),
            vec![(3, 1, 1), (6, 2, 2), (10, 4, 2), (20, 6, 3)]
        );
        let w = Request::whole(1, 16, false);
        assert!(w.is_whole(16) && !w.is_whole(17));
        assert_eq!(w.extents(4, 8).collect::<Vec<_>>(), vec![(4, 4, 8)]);
        // Equal blocks back to back are one contiguous run.
        let c = Request::of_blocks(0, [(8, 4), (12, 4)], false);
        assert_eq!(c.contiguous(), Some(8));
    }

    /// Rows back to back are one piece and one block; a WANT of more than
    /// MAX_BLOCKS blocks in all is refused naming the request that passes
    /// it, however few bytes it is.
    #[test]
    fn blocks_are_counted_walked_and_bounded() {
        let rows = Request {
            tensor: 0,
            runs: vec![run(8, 4, 5, 4), run(100, 1, 3, 2)],
            sums: false,
        };
        assert_eq!(rows.blocks(), 1 + 3);
        assert_eq!(
            rows.extents(2, 20).collect::<Vec<_>>(),
            vec![(10, 2, 18), (100, 20, 1), (102, 21, 1)]
        );
        let sizes = [1u64 << 40];
        let every_other = |rows| Request {
            tensor: 0,
            runs: vec![run(0, 1, rows, 2)],
            sums: false,
        };
        let fits = [every_other(MAX_BLOCKS / 2), every_other(MAX_BLOCKS / 2)];
        assert!(check_requests(&fits, &sizes).is_ok());
        let over = [every_other(MAX_BLOCKS / 2), every_other(MAX_BLOCKS / 2 + 1)];
        let e = check_requests(&over, &sizes).unwrap_err();
        assert!(
            e.message.contains("WANT request #1")
                && e.message.contains(&format!("{} blocks", MAX_BLOCKS + 1)),
            "{e}"
        );
    }

    /// All requests together ask for at most MAX_OVERLAP times the bytes
    /// the tensors hold: the same whole tensor asked for 4 times passes, 5
    /// times is refused at the request that goes over (an engine asked for
    /// 2^20 copies of a tensor: 2 TiB read, hashed and sent from 2 MiB).
    #[test]
    fn the_bytes_asked_for_are_bounded_by_the_tensors() {
        let sizes = [1000u64, 24];
        let whole = |t: u32| Request::whole(t, sizes[t as usize], false);
        let four: Vec<Request> = (0..4).flat_map(|_| [whole(0), whole(1)]).collect();
        assert!(check_requests(&four, &sizes).is_ok());
        let five: Vec<Request> = (0..5).map(|_| whole(0)).collect();
        let e = check_requests(&five, &sizes).unwrap_err();
        assert!(
            e.message.contains(
                "WANT request #4: 5000 bytes asked for so far, more than 4 times \
                                the 1024 this rank's tensors hold"
            ),
            "{e}"
        );
    }

    #[test]
    fn bad_requests_are_refused_naming_the_problem() {
        let sizes = [100u64, 16];
        let check = |runs: Vec<WantRun>, tensor| {
            Request {
                tensor,
                runs,
                sums: false,
            }
            .check(3, &sizes)
        };
        assert!(check(vec![run(0, 10, 10, 10)], 0).is_ok());
        let cases = [
            (check(vec![run(0, 4, 1, 4)], 2), "names tensor #2 of 2"),
            (check(vec![run(0, 0, 1, 0)], 0), "len 0"),
            (check(vec![run(0, 4, 2, 3)], 0), "stride 3"),
            (
                check(vec![run(0, 10, 11, 10)], 0),
                "runs past the 100 bytes",
            ),
            (check(vec![run(u64::MAX, 2, 1, 2)], 1), "runs past"),
            (check(vec![run(0, 1, u64::MAX, u64::MAX)], 1), "runs past"),
            (
                check(vec![run(0, 8, 1, 8), run(0, 16, 1, 16)], 1),
                "24 bytes asked",
            ),
        ];
        for (r, want) in cases {
            let e = r.unwrap_err();
            assert!(
                e.message.contains("request #3") && e.message.contains(want),
                "{want}: {e}"
            );
        }
    }
}
