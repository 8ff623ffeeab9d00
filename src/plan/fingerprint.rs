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

/// Feeds numbers and strings unambiguously (strings length-prefixed),
/// through a buffer: the hasher is slow on a few bytes at a time.
struct Feed {
    hash: Checksum,
    buf: Vec<u8>,
}

impl Feed {
    const FLUSH: usize = 64 << 10;

    fn num(&mut self, n: u64) {
        self.buf.extend_from_slice(&n.to_le_bytes());
        if self.buf.len() >= Self::FLUSH {
            self.hash.update(&self.buf);
            self.buf.clear();
        }
    }

    fn text(&mut self, s: &str) {
        self.num(s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
    }

    fn digest(mut self) -> u128 {
        self.hash.update(&self.buf);
        self.hash.digest()
    }

    fn dims(&mut self, d: &[u64]) {
        self.num(d.len() as u64);
        for &x in d {
            self.num(x);
        }
    }
}

/// XXH3-128 of everything of `sources` and `params` a plan depends on.
pub fn fingerprint<P: Params + ?Sized>(sources: &[&Manifest], params: &P) -> u128 {
    let mut f = Feed {
        hash: Checksum::default(),
        buf: Vec::with_capacity(Feed::FLUSH + 4096),
    };
    f.num(sources.len() as u64);
    for m in sources {
        f.num(m.tensors.len() as u64);
        for t in &m.tensors {
            f.text(&t.name);
            f.num(t.dtype as u64);
            f.dims(&t.shape);
            f.num(t.nbytes);
            // Whether there is a checksum decides what verification may
            // do; its value changes every version and is not the layout.
            f.num(u64::from(t.checksum.is_some()));
            match &t.placement {
                Some(p) => {
                    f.dims(&p.global_shape);
                    f.dims(&p.offset);
                }
                None => f.num(u64::MAX),
            }
        }
    }
    f.num(params.count() as u64);
    for i in 0..params.count() {
        let p = params.param(i);
        f.text(p.name);
        f.num(p.dtype as u64);
        f.dims(p.shape);
        f.num(p.pieces.len() as u64);
        for piece in p.pieces {
            f.text(&piece.tensor);
            f.dims(&piece.global.offset);
            f.dims(&piece.global.len);
            f.dims(&piece.at);
        }
    }
    f.digest()
}
