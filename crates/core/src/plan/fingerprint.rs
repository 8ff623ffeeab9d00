//! A fingerprint of what a plan was made from, so that a caller holding a
//! plan can tell, for the price of one pass over the layouts (no
//! intersections, no runs), whether it still holds: same sources (names,
//! dtypes, shapes, sizes, placements, whether each has a checksum) and
//! same params (names, dtypes, shapes, pieces). The version and the
//! checksums' values change every update and are not part of it: a reused
//! plan takes the new checksums (the manager's plan cache). Options are the
//! caller's to compare.

use super::params::Params;
use crate::checksum::Checksum;
use crate::manifest::Manifest;

/// Feeds numbers and strings unambiguously (strings and lists
/// length-prefixed), through a buffer hashed 64 KiB at a time: the hasher
/// is slow on a few bytes at a time. Numbers go in native byte order: a
/// fingerprint is only compared with another made in the same process.
struct Feed {
    hash: Checksum,
    buf: Vec<u8>,
}

impl Feed {
    const FLUSH: usize = 64 << 10;

    fn new() -> Feed {
        Feed {
            hash: Checksum::default(),
            buf: Vec::with_capacity(Self::FLUSH + 4096),
        }
    }

    /// After each record (a tensor, a piece): hash what is buffered once
    /// there is enough of it.
    fn step(&mut self) {
        if self.buf.len() >= Self::FLUSH {
            self.hash.update(&self.buf);
            self.buf.clear();
        }
    }

    fn nums<const N: usize>(&mut self, n: [u64; N]) {
        for x in n {
            self.buf.extend_from_slice(&x.to_ne_bytes());
        }
    }

    /// A list's length, then its numbers.
    fn dims(&mut self, d: &[u64]) {
        self.nums([d.len() as u64]);
        for &x in d {
            self.buf.extend_from_slice(&x.to_ne_bytes());
        }
    }

    fn text(&mut self, s: &str) {
        self.nums([s.len() as u64]);
        self.buf.extend_from_slice(s.as_bytes());
    }

    fn digest(mut self) -> u128 {
        self.hash.update(&self.buf);
        self.hash.digest()
    }
}

/// XXH3-128 of everything of `sources` and `params` a plan depends on.
pub fn fingerprint<P: Params + ?Sized>(sources: &[&Manifest], params: &P) -> u128 {
    let mut f = Feed::new();
    f.nums([sources.len() as u64]);
    for m in sources {
        f.nums([m.tensors.len() as u64]);
        for t in &m.tensors {
            // Whether there is a checksum decides what verification may
            // do; its value changes every version and is not the layout.
            let placed = t.placement.as_ref();
            f.nums([
                t.dtype as u64,
                t.nbytes,
                u64::from(t.checksum.is_some()),
                placed.map_or(u64::MAX, |p| p.global_shape.len() as u64),
            ]);
            f.text(&t.name);
            f.dims(&t.shape);
            if let Some(p) = placed {
                f.dims(&p.global_shape);
                f.dims(&p.offset);
            }
            f.step();
        }
    }
    f.nums([params.count() as u64]);
    for i in 0..params.count() {
        let p = params.param(i);
        f.nums([p.dtype as u64, p.pieces.len() as u64]);
        f.text(p.name);
        f.dims(p.shape);
        for piece in p.pieces {
            f.text(&piece.tensor);
            f.dims(&piece.global.offset);
            f.dims(&piece.global.len);
            f.dims(&piece.at);
        }
        f.step();
    }
    f.digest()
}
