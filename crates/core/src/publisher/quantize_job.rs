//! One quantized request as a session works on it (`quantize.rs` finds
//! its amax, `quantize_behind.rs` makes its image): where its elements
//! are, and how a request's positions are cut and walked.

use crate::quant::Scheme;
use crate::tensor::DType;
use crate::wire::Request;
use std::ops::Range;

/// One quantized request: its source elements and blocks.
pub(super) struct Job {
    pub(super) request: u32,
    pub(super) scheme: Scheme,
    pub(super) dtype: DType,
    pub(super) tensor: usize,
    /// A shard of files: its elements read, in request order. In memory:
    /// None, read where they are.
    pub(super) wide: Option<Vec<u8>>,
    /// The blocks it touches (`quant::blocks::touched`), and their amax
    /// over its elements.
    pub(super) blocks: Vec<u64>,
    pub(super) amax: Vec<f32>,
    /// Where it holds its blocks whole (`quantize::own_blocks`): quantized a band
    /// of 128 rows at a time.
    pub(super) own: Option<(u64, u64, u64)>,
    /// In a GPU version on this GPU: quantized there (`quantize_device`).
    pub(super) device: Option<i32>,
}

/// Request `q` as (tensor element, count, request position) pieces,
/// clipped to the request positions `part`.
pub(super) fn pieces(q: &Request, part: Range<u64>) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    q.extents(part.start, part.end - part.start)
        .map(|(src, at, len)| (src, len, at))
}

/// The request's positions cut into `threads` parts.
pub(super) fn parts(q: &Request, threads: usize) -> Vec<Range<u64>> {
    let n = q.bytes();
    let per = n.div_ceil(threads.max(1) as u64).max(1 << 16);
    (0..n)
        .step_by(per as usize)
        .map(|a| a..(a + per).min(n))
        .collect()
}

/// Where the elements of a job are: the tensor in memory (element `src`),
/// or its read copy (request position `dst`).
#[derive(Clone, Copy)]
pub(super) struct Elements<'a> {
    pub(super) tensor: Option<&'a [u8]>,
    pub(super) wide: Option<&'a [u8]>,
    pub(super) esize: u64,
}

impl<'a> Elements<'a> {
    pub(super) fn at(&self, src: u64, dst: u64, n: u64) -> &'a [u8] {
        let (bytes, from) = match (self.tensor, self.wide) {
            (Some(t), _) => (t, src),
            (None, Some(w)) => (w, dst),
            (None, None) => unreachable!("a job's elements are somewhere"),
        };
        &bytes[(from * self.esize) as usize..((from + n) * self.esize) as usize]
    }
}

/// Where `block` is in `blocks` (one of them), looked for next to the
/// last one found (`last`) first: a row walks consecutive blocks.
pub(super) fn index_of(blocks: &[u64], block: u64, last: usize) -> usize {
    match blocks.get(last..last + 2) {
        Some([b, _]) if *b == block => last,
        Some([_, b]) if *b == block => last + 1,
        _ => blocks.binary_search(&block).expect("a touched block"),
    }
}
