//! Deltas: the elements of a run that changed since a base, encoded per
//! chunk in whichever form is smallest, and applied onto the base.
//!
//! From one RL step to the next most bf16 weights keep their exact bits, so
//! a run is sent as its changes against the version the engine holds. A run
//! is cut into chunks of [`CHUNK`] elements; each chunk is one of:
//!
//! | tag | form | bytes after the tag |
//! |---|---|---|
//! | 0 | unchanged | none |
//! | 1 | whole | every element's new bytes |
//! | 2 | bitmask | one bit per element (LSB first), then the changed elements' new bytes in order |
//! | 3 | gaps | the count (a LEB128 varint), the changed elements' new bytes in order, then each one's distance from the previous one minus one (the first: its index), LEB128 varints |
//!
//! The encoder picks the smallest (gaps for sparse changes: about 1 byte of
//! position per change at 2% changed; bitmask for dense ones; whole when
//! neither saves). Element bytes are compared and copied as bytes: the
//! result is the new run exactly, whatever the dtype (NaN payloads, -0).
//!
//! The decoder trusts nothing: a position outside the chunk, a count that
//! disagrees with the bytes, a tag it does not know, a run that ends early
//! or has bytes left over is a [`DeltaError`] naming the chunk; it
//! allocates nothing and its work is linear in the delta and the run.

mod changes;
pub mod device;
mod fast;
#[cfg(test)]
mod tests;

use changes::{changes, put_gaps, put_varint, varint_len};
use fast::gaps_fast;

/// Elements per chunk (crate-internal: cbindgen exports public constants):
/// positions in a chunk fit 16 bits, and a chunk's bitmask is 4 KiB.
pub(crate) const CHUNK: usize = 1 << 15;

const UNCHANGED: u8 = 0;
const WHOLE: u8 = 1;
const BITMASK: u8 = 2;
const GAPS: u8 = 3;

/// Why a delta cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaError(pub String);

impl std::fmt::Display for DeltaError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What an encoding made: chunks of each form, changed elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    pub unchanged: u64,
    pub whole: u64,
    pub bitmask: u64,
    pub gaps: u64,
    pub changed: u64,
}

/// Append the delta turning `old` into `new` (elements of `esize` bytes,
/// same length) to `out`; returns what it chose.
pub fn encode(old: &[u8], new: &[u8], esize: usize, out: &mut Vec<u8>) -> Encoded {
    assert!(esize > 0 && old.len() == new.len() && old.len().is_multiple_of(esize));
    let mut stats = Encoded::default();
    let mut diff = vec![0u64; CHUNK / 64];
    let (mut positions, mut values, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    let step = CHUNK * esize;
    for (o, n) in old.chunks(step).zip(new.chunks(step)) {
        if o == n {
            out.push(UNCHANGED);
            stats.unchanged += 1;
            continue;
        }
        let elems = o.len() / esize;
        let words = &mut diff[..elems.div_ceil(64)];
        let changed = changes((o, n), esize, words, &mut values, &mut pos);
        let values = &values[..changed * esize];
        stats.changed += changed as u64;
        let whole = elems * esize;
        let bitmask = elems.div_ceil(8) + changed * esize;
        // Values first, so a receiver applies a chunk in one pass over its
        // positions. Gaps cost at least a byte per change: tried only
        // when that could beat the bitmask.
        out.reserve(1 + whole);
        if changed < elems / 8 {
            put_gaps(&pos[..changed], &mut positions);
            if 1 + varint_len(changed) + positions.len() + values.len() < bitmask.min(whole) {
                out.push(GAPS);
                put_varint(changed, out);
                out.extend_from_slice(values);
                out.extend_from_slice(&positions);
                stats.gaps += 1;
                continue;
            }
        }
        if bitmask < whole {
            out.push(BITMASK);
            // A word's 8 bytes at a time (a byte-wise iterator cost a
            // quarter of encoding at 10% changed), the last word cut.
            let at = out.len();
            for w in words.iter() {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.truncate(at + elems.div_ceil(8));
            out.extend_from_slice(values);
            stats.bitmask += 1;
        } else {
            out.push(WHOLE);
            out.extend_from_slice(n);
            stats.whole += 1;
        }
    }
    stats
}

/// The delta / whole bytes [`encode`] is expected to reach when a share
/// `fraction` of elements of `esize` bytes changed at random places: per chunk the smallest of the
/// forms, a gap's varint taking its expected length (gaps are geometric:
/// one more byte with each 7 bits a gap may pass). What the wire carries:
/// [`predicted_wire_ratio`].
pub fn predicted_ratio(fraction: f64, esize: usize) -> f64 {
    let f = fraction.clamp(0.0, 1.0);
    let (n, e) = (CHUNK as f64, esize as f64);
    if f == 0.0 {
        return 1.0 / (n * e);
    }
    let k = f * n;
    let varint = 1.0 + (1.0 - f).powi(128) + (1.0 - f).powi(16384);
    let gaps = k * (varint + e) + 3.0;
    let bitmask = n / 8.0 + k * e;
    (1.0 + gaps.min(bitmask).min(n * e)) / (n * e)
}

/// Whether a delta of `delta` bytes is sent for `bytes` of a run: under
/// half of them (else the run goes whole: the engine then patches
/// less than it would receive, and a session holds at most half its bytes
/// in deltas). A publisher gives up encoding a run once its delta is not under
/// half of what it read so far.
pub fn worth_sending(delta: u64, bytes: u64) -> bool {
    delta.saturating_mul(2) < bytes
}

/// The wire bytes / whole bytes of a run when a share `fraction` of its
/// elements changed at random places: [`predicted_ratio`], or 1 where
/// that delta is not [`worth_sending`] (what `wm plan --delta-fraction`
/// predicts with).
pub fn predicted_wire_ratio(fraction: f64, esize: usize) -> f64 {
    let r = predicted_ratio(fraction, esize);
    match r * 2.0 < 1.0 {
        true => r,
        false => 1.0,
    }
}

/// Apply `delta` (as [`encode`] writes it) onto `run`, which holds the base
/// and ends holding the new bytes; returns the elements it rewrote. On
/// error `run` may hold part of the new bytes: apply onto a copy (atomic
/// updates) or mark the run failed.
pub fn apply(delta: &[u8], run: &mut [u8], esize: usize) -> Result<u64, DeltaError> {
    let mut p = Patcher::new(delta, esize)?;
    p.patch(run)?;
    p.finish()
}

/// Check `delta` against a run of `run_len` bytes (elements of `esize`
/// bytes) without applying it: every check [`Patcher`] makes, so a
/// receiver can refuse a bad delta before it writes a byte.
pub fn check(delta: &[u8], run_len: usize, esize: usize) -> Result<(), DeltaError> {
    if esize == 0 || !run_len.is_multiple_of(esize) {
        return Err(DeltaError(format!(
            "a run of {run_len} bytes is not whole elements of {esize} bytes"
        )));
    }
    walk(delta, run_len / esize, esize, &mut Checked)
}

/// Every chunk of `delta` for a run of `elems` elements of `esize` bytes,
/// front to back with every check, its changes given to `sink`.
fn walk<S: Sink>(delta: &[u8], elems: usize, esize: usize, sink: &mut S) -> Result<(), DeltaError> {
    let mut r = Reader { b: delta, at: 0 };
    for k in 0..elems.div_ceil(CHUNK) {
        let n = CHUNK.min(elems - k * CHUNK);
        let bad = |why: String| DeltaError(format!("chunk {k}: {why}"));
        let form = r
            .byte()
            .ok_or_else(|| bad("the delta ends before it".into()))?;
        sink.begin(k * CHUNK);
        match form {
            UNCHANGED => {}
            WHOLE => {
                let at = r.at;
                r.take(n * esize).map_err(bad)?;
                sink.whole(at..at + n * esize);
            }
            BITMASK => _ = apply_bitmask(&mut r, sink, n, esize).map_err(bad)?,
            GAPS => _ = apply_gaps(&mut r, sink, n, esize).map_err(bad)?,
            t => return Err(bad(format!("unknown form {t}"))),
        }
    }
    match r.b.len() - r.at {
        0 => Ok(()),
        n => Err(DeltaError(format!("{n} bytes after the run's last chunk"))),
    }
}

/// A delta's changes as lists, for a receiver that applies them elsewhere
/// (a GPU param: `device.rs`): the chunks sent whole, and every other
/// changed element with its new bytes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Chunks sent whole: (byte of the run, range of the delta's bytes).
    pub whole: Vec<(u64, std::ops::Range<usize>)>,
    /// Changed elements of the other chunks, as element indices of the
    /// run, distinct and ascending.
    pub positions: Vec<u32>,
    /// Their new bytes, `esize` per position, in the same order.
    pub values: Vec<u8>,
}

/// Decode `delta` against a run of `run_len` bytes (elements of `esize`
/// bytes, at most 2^32 of them) into [`Changes`], in one pass making every
/// check [`check`] makes. What it allocates is bounded by the delta's
/// size: each listed change took at least `esize` bytes of it, its
/// position costs 4 more.
pub fn list_changes(delta: &[u8], run_len: usize, esize: usize) -> Result<Changes, DeltaError> {
    if esize == 0 || !run_len.is_multiple_of(esize) || (run_len / esize) as u64 > 1 << 32 {
        return Err(DeltaError(format!(
            "a run of {run_len} bytes is not whole elements of {esize} bytes, or has more \
             than 2^32 of them"
        )));
    }
    let mut out = Changes::default();
    let mut listed = Listed {
        changes: &mut out,
        first: 0,
        esize,
    };
    walk(delta, run_len / esize, esize, &mut listed)?;
    Ok(out)
}

/// The element size a delta of a run uses: the dtype's when the run is
/// whole elements of it, else bytes (both sides derive it the same way
/// from the tensor's dtype and the run's length).
pub fn element_size(dtype_size: usize, run_len: u64) -> usize {
    match dtype_size > 0 && run_len.is_multiple_of(dtype_size as u64) {
        true => dtype_size,
        false => 1,
    }
}

/// A delta applied a window of the run at a time, front to back, so a
/// receiver patches a run of any size through a bounded buffer. Every
/// window but the last is whole chunks ([`WINDOW_CHUNKS`] suits).
pub struct Patcher<'a> {
    r: Reader<'a>,
    esize: usize,
    /// Chunks patched so far (errors name the chunk).
    chunk: usize,
    /// Elements the whole, bitmask and gaps chunks rewrote.
    rewritten: u64,
    /// A window that was not whole chunks came: it must be the last.
    ended: bool,
}

/// Chunks per window a receiver patches at once (4 MiB of bf16).
pub const WINDOW_CHUNKS: usize = 64;

impl<'a> Patcher<'a> {
    pub fn new(delta: &'a [u8], esize: usize) -> Result<Patcher<'a>, DeltaError> {
        if esize == 0 {
            return Err(DeltaError("elements of 0 bytes".into()));
        }
        Ok(Patcher {
            r: Reader { b: delta, at: 0 },
            esize,
            chunk: 0,
            rewritten: 0,
            ended: false,
        })
    }

    /// Patch the next `window` of the run (holding the base's bytes there).
    pub fn patch(&mut self, window: &mut [u8]) -> Result<(), DeltaError> {
        let esize = self.esize;
        if self.ended || !window.len().is_multiple_of(esize) {
            return Err(DeltaError(format!(
                "a window of {} bytes after chunk {} (elements of {esize} bytes)",
                window.len(),
                self.chunk
            )));
        }
        self.ended = !window.len().is_multiple_of(CHUNK * esize);
        for chunk in window.chunks_mut(CHUNK * esize) {
            let (k, elems) = (self.chunk, chunk.len() / esize);
            let bad = |why: String| DeltaError(format!("chunk {k}: {why}"));
            let r = &mut self.r;
            let form = r
                .byte()
                .ok_or_else(|| bad("the delta ends before it".into()))?;
            self.rewritten += match form {
                UNCHANGED => 0,
                WHOLE => {
                    chunk.copy_from_slice(r.take(chunk.len()).map_err(bad)?);
                    (chunk.len() / esize) as u64
                }
                BITMASK => apply_bitmask(r, &mut InChunk(chunk), elems, esize).map_err(bad)? as u64,
                GAPS => apply_gaps(r, &mut InChunk(chunk), elems, esize).map_err(bad)? as u64,
                t => return Err(bad(format!("unknown form {t}"))),
            };
            self.chunk += 1;
        }
        Ok(())
    }

    /// Every window patched: the delta must have ended too. Returns the
    /// elements rewritten (whole chunks count every element).
    pub fn finish(self) -> Result<u64, DeltaError> {
        match self.r.b.len() - self.r.at {
            0 => Ok(self.rewritten),
            n => Err(DeltaError(format!("{n} bytes after the run's last chunk"))),
        }
    }
}

/// The delta's bytes, read front to back with every length checked.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Option<u8> {
        let x = *self.b.get(self.at)?;
        self.at += 1;
        Some(x)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end =
            end.ok_or_else(|| format!("{n} bytes announced, {} left", self.b.len() - self.at))?;
        let out = &self.b[self.at..end];
        self.at = end;
        Ok(out)
    }

    /// A LEB128 varint of at most 5 bytes (positions fit 16 bits).
    fn varint(&mut self) -> Result<usize, String> {
        let mut x = 0usize;
        for shift in (0..35).step_by(7) {
            let b = self.byte().ok_or("a number cut short")?;
            x |= ((b & 0x7f) as usize) << shift;
            if b & 0x80 == 0 {
                return Ok(x);
            }
        }
        Err("a number of more than 5 bytes".into())
    }
}

/// Element `i` of `chunk` becomes `x`: a fixed-size store for the common
/// sizes (a copy call per element cost as much as the rest of applying).
#[inline(always)]
fn set(chunk: &mut [u8], i: usize, x: &[u8], esize: usize) {
    match esize {
        2 => chunk[2 * i..2 * i + 2].copy_from_slice(&x[..2]),
        1 => chunk[i] = x[0],
        4 => chunk[4 * i..4 * i + 4].copy_from_slice(&x[..4]),
        _ => chunk[i * esize..(i + 1) * esize].copy_from_slice(x),
    }
}

/// Where a decoded chunk's changed elements go.
trait Sink {
    /// False: the chunk is only checked (nothing needs its elements).
    const WRITES: bool = true;
    /// The next chunk starts at element `first` of the run.
    fn begin(&mut self, _first: usize) {}
    /// That chunk was sent whole: its bytes are `bytes` of the delta.
    fn whole(&mut self, _bytes: std::ops::Range<usize>) {}
    /// `count` changes come next (checked against the chunk).
    fn expect(&mut self, _count: usize, _esize: usize) {}
    /// Element `i` of the chunk becomes `x` (`esize` bytes).
    fn set(&mut self, i: usize, x: &[u8], esize: usize);
    /// A checked bitmask chunk's changes (`values`: exactly one per set
    /// bit) written at once; false: not done, set them one by one.
    fn expand(&mut self, _mask: &[u8], _values: &[u8], _esize: usize) -> bool {
        false
    }
}

/// Only checked.
struct Checked;

impl Sink for Checked {
    const WRITES: bool = false;
    fn set(&mut self, _: usize, _: &[u8], _: usize) {}
}

/// Patched onto the chunk's bytes.
struct InChunk<'c>(&'c mut [u8]);

impl Sink for InChunk<'_> {
    #[inline(always)]
    fn set(&mut self, i: usize, x: &[u8], esize: usize) {
        set(self.0, i, x, esize)
    }

    fn expand(&mut self, mask: &[u8], values: &[u8], esize: usize) -> bool {
        fast::expand_into(mask, values, self.0, esize)
    }
}

/// Listed, the chunk at hand starting at element `first` of the run.
struct Listed<'c> {
    changes: &'c mut Changes,
    first: u32,
    esize: usize,
}

impl Sink for Listed<'_> {
    fn begin(&mut self, first: usize) {
        // In range: the run has at most 2^32 elements (`list_changes`).
        self.first = first as u32;
    }

    fn whole(&mut self, bytes: std::ops::Range<usize>) {
        let byte = self.first as u64 * self.esize as u64;
        self.changes.whole.push((byte, bytes));
    }

    fn expect(&mut self, count: usize, esize: usize) {
        self.changes.positions.reserve(count);
        self.changes.values.reserve(count * esize);
    }

    #[inline(always)]
    fn set(&mut self, i: usize, x: &[u8], _: usize) {
        // In range: the run has at most 2^32 elements (`list_changes`).
        self.changes.positions.push(self.first + i as u32);
        self.changes.values.extend_from_slice(x);
    }
}

/// A bitmask chunk of `elems` elements: checked, and its changes given to
/// `sink`.
fn apply_bitmask<S: Sink>(
    r: &mut Reader,
    sink: &mut S,
    elems: usize,
    esize: usize,
) -> Result<usize, String> {
    let mask = r.take(elems.div_ceil(8))?;
    if !elems.is_multiple_of(8) && mask[mask.len() - 1] >> (elems % 8) != 0 {
        return Err("bits set past the chunk's last element".into());
    }
    let count = mask.iter().map(|b| b.count_ones() as usize).sum::<usize>();
    let values = r.take(count * esize)?;
    if !S::WRITES || sink.expand(mask, values, esize) {
        return Ok(count);
    }
    sink.expect(count, esize);
    let mut v = values.chunks_exact(esize);
    for (byte_at, &bits) in mask.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let i = byte_at * 8 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            sink.set(i, v.next().expect("counted"), esize);
        }
    }
    Ok(count)
}

/// A gaps chunk of `elems` elements: checked, and its changes given to
/// `sink`, in one pass over its positions.
fn apply_gaps<S: Sink>(
    r: &mut Reader,
    sink: &mut S,
    elems: usize,
    esize: usize,
) -> Result<usize, String> {
    let count = r.varint()?;
    if count == 0 || count > elems {
        return Err(format!("{count} changed elements in a chunk of {elems}"));
    }
    let values = r.take(count * esize)?;
    sink.expect(count, esize);
    let (done, mut next) = gaps_fast(r, sink, values, elems, esize)?;
    for x in values[done * esize..].chunks_exact(esize) {
        let i = next
            .checked_add(r.varint()?)
            .filter(|&p| p < elems)
            .ok_or_else(|| format!("a position past the chunk's {elems} elements"))?;
        if S::WRITES {
            sink.set(i, x, esize);
        }
        next = i + 1;
    }
    Ok(count)
}
