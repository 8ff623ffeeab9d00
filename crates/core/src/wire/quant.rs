//! Quantization frames (protocol 7): WANT names the requests the engine
//! wants quantized to FP8 (and with which scheme); the publisher answers
//! with AMAX, the largest `|x|` of each block each such request touches
//! (over the elements the request reads); the engine takes every
//! publisher's AMAX, agrees each block's amax (the largest), and answers
//! SCALES with the agreed amax of the same blocks; the publisher then
//! serves each such request as one E4M3 byte per element. A request's
//! runs count elements of its tensor (not bytes), and its bytes on the
//! wire are its elements. Blocks are listed in the order
//! `quant::blocks::touched` gives (both sides compute it), so AMAX and
//! SCALES carry values only.
//!
//! Protocol 9: AMAX and SCALES are each one or more frames of at most
//! [`MAX_BLOCK_VALUES`] values ([`frames`]): the requests in order, a
//! request's values continuing into the next frame where a frame filled
//! (MXFP8's blocks of 32 make a large session's values outgrow one frame).
//! The receiver knows how many values each request has and takes frames
//! until all came ([`Gathering`]). Each entry says its values' width: 4
//! (f32), or 1 where every value is 0 or a power of two, sent as its
//! exponent byte: MXFP8's amax, which a publisher rounds down to its
//! power of two (the scale depends on the exponent alone), so its AMAX and
//! SCALES cost a byte a block, as its scales do.

use super::fields::{In, Out};
use super::want::MAX_REQUESTS;
use crate::quant::Scheme;
use crate::result::{try_vec, Error, Result};

/// Values per request, `(request, one f32 per block it touches)`,
/// requests increasing: AMAX's and SCALES' payload.
pub type BlockValues = Vec<(u32, Vec<f32>)>;

/// The most block values one AMAX or SCALES frame carries (a frame is at
/// most 64 MiB).
pub const MAX_BLOCK_VALUES: usize = 1 << 23;

pub(super) fn encode_quant(o: &mut Out, quant: &[(u32, Scheme)]) {
    o.u32(quant.len() as u32);
    for (k, s) in quant {
        o.u32(*k);
        o.u32(*s as u32);
    }
}

/// WANT's quantized requests, numbered below `requests` and increasing.
pub(super) fn decode_quant(i: &mut In, requests: usize) -> Result<Vec<(u32, Scheme)>> {
    let n = i.count(8, "quantized requests")?;
    let mut out = try_vec(n.min(MAX_REQUESTS), "wire: WANT's quantized requests")?;
    for _ in 0..n {
        let (k, raw) = (i.u32()?, i.u32()?);
        if k as usize >= requests || out.last().is_some_and(|&(p, _)| p >= k) {
            return Err(Error::peer(format!(
                "wire: WANT: quantized request #{k} (of {requests}, increasing)"
            )));
        }
        let s = Scheme::from_raw(raw)
            .ok_or_else(|| Error::peer(format!("wire: WANT: quantization scheme {raw}")))?;
        out.push((k, s));
    }
    Ok(out)
}

/// Each entry's values as f32 (width 4), or, when every one is 0 or a
/// positive power of two (MXFP8's amax, which counts by its exponent
/// alone: `quant::Scheme::wire_amax`), as its exponent byte (width 1): the
/// value is the f32 of bits `byte << 23`.
pub(super) fn encode_values(o: &mut Out, values: &BlockValues) {
    o.u32(values.len() as u32);
    for (k, v) in values {
        o.u32(*k);
        let exponents = v.iter().all(|x| x.to_bits() & !0x7f80_0000 == 0);
        o.0.push(if exponents { 1 } else { 4 });
        o.u32(v.len() as u32);
        match exponents {
            true => o.0.extend(v.iter().map(|x| (x.to_bits() >> 23) as u8)),
            false => v
                .iter()
                .for_each(|x| o.0.extend_from_slice(&x.to_le_bytes())),
        }
    }
}

/// AMAX's or SCALES' values (`what` names the frame): requests
/// increasing, every value finite and not negative, at most
/// [`MAX_BLOCK_VALUES`] in all.
pub(super) fn decode_values(i: &mut In, what: &str) -> Result<BlockValues> {
    let n = i.count(8, "requests")?;
    let mut out: BlockValues = try_vec(n.min(MAX_REQUESTS), "wire: block values")?;
    let mut total = 0usize;
    for _ in 0..n {
        let k = i.u32()?;
        if out.last().is_some_and(|(p, _)| *p >= k) {
            return Err(Error::peer(format!(
                "wire: {what}: request #{k} out of order"
            )));
        }
        let width = i.take(1)?[0];
        if width != 1 && width != 4 {
            return Err(Error::peer(format!(
                "wire: {what}: request #{k}: values of {width} bytes (1 or 4)"
            )));
        }
        let m = i.count(width as usize, "block values")?;
        total += m;
        if total > MAX_BLOCK_VALUES {
            return Err(Error::peer(format!(
                "wire: {what}: more than {MAX_BLOCK_VALUES} block values"
            )));
        }
        let mut v = try_vec(m, "wire: block values")?;
        for _ in 0..m {
            let x = match width {
                1 => f32::from_bits((i.take(1)?[0] as u32) << 23),
                _ => f32::from_le_bytes(i.take(4)?.try_into().expect("4")),
            };
            if !x.is_finite() || x < 0.0 {
                return Err(Error::peer(format!(
                    "wire: {what}: request #{k}: block value {x} (an amax is finite and not negative)"
                )));
            }
            v.push(x);
        }
        out.push((k, v));
    }
    Ok(out)
}

/// AMAX (`amax`) or SCALES.
pub(super) fn decode_frame(i: &mut In, amax: bool) -> Result<super::Frame> {
    Ok(match amax {
        true => super::Frame::Amax {
            values: decode_values(i, "AMAX")?,
        },
        false => super::Frame::Scales {
            values: decode_values(i, "SCALES")?,
        },
    })
}

/// Values in one AMAX or SCALES frame that a sender makes:
/// [`MAX_BLOCK_VALUES`]; in test builds (`cfg(test)`, the `test-hooks`
/// feature) `WM_TEST_BLOCK_VALUES_PER_FRAME` may ask fewer, so tests cross
/// frames with small tensors.
pub fn values_per_frame() -> usize {
    #[cfg(any(test, feature = "test-hooks"))]
    if let Some(n) = std::env::var("WM_TEST_BLOCK_VALUES_PER_FRAME")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        return n.clamp(1, MAX_BLOCK_VALUES);
    }
    MAX_BLOCK_VALUES
}

/// `values` as frames of at most `most` values each: requests in order,
/// each listed (an empty one too), a request cut where a frame fills and
/// continued as the next frame's first entry.
pub fn frames(values: BlockValues, most: usize) -> Vec<BlockValues> {
    let most = most.max(1);
    let (mut out, mut frame, mut room): (Vec<BlockValues>, BlockValues, usize) =
        (Vec::new(), Vec::new(), most);
    for (k, v) in values {
        let mut rest = &v[..];
        loop {
            let take = rest.len().min(room);
            frame.push((k, rest[..take].to_vec()));
            (rest, room) = (&rest[take..], room - take);
            if room == 0 {
                out.push(std::mem::take(&mut frame));
                room = most;
            }
            if rest.is_empty() {
                break;
            }
        }
    }
    if !frame.is_empty() || out.is_empty() {
        out.push(frame);
    }
    out
}

/// AMAX's or SCALES' values arriving over one or more frames ([`frames`]),
/// checked against what each request must have: its number and count of
/// values, in order.
pub struct Gathering {
    expected: Vec<(u32, usize)>,
    got: BlockValues,
    /// A request cut at the end of the last frame, continued next.
    open: bool,
}

impl Gathering {
    /// Values for `expected` (request, how many values), in that order;
    /// `WM_ERR_OUT_OF_MEMORY` when there is no room for them (the counts
    /// are the receiver's own, bounded by its params or tensors).
    pub fn new(expected: Vec<(u32, usize)>, what: &str) -> Result<Gathering> {
        Ok(Gathering {
            got: try_vec(expected.len(), what)?,
            expected,
            open: false,
        })
    }

    /// Whether every request has all its values.
    pub fn complete(&self) -> bool {
        !self.open && self.got.len() == self.expected.len()
    }

    /// Take one frame's `values` (`what` names the frame in errors): each
    /// entry the next request in order (the first may continue a request
    /// the last frame cut, with at least one value), no request given more
    /// values than it has, only the frame's last entry short of them.
    pub fn take(&mut self, values: BlockValues, what: &str) -> Result<()> {
        let bad = |why: String| Err(Error::peer(format!("wire: {what}: {why}")));
        if values.is_empty() {
            return bad("a frame with no request".into());
        }
        let last = values.len() - 1;
        for (j, (k, v)) in values.into_iter().enumerate() {
            let continues = j == 0 && self.open;
            if continues && v.is_empty() {
                return bad(format!("request #{k} continued with no value"));
            }
            if !continues {
                let Some(&(_, n)) = self.expected.get(self.got.len()) else {
                    return bad(format!("request #{k} after every request's values"));
                };
                self.got.push((k, try_vec(n, what)?));
            }
            let i = self.got.len() - 1;
            let (want_k, want_n) = self.expected[i];
            let have = self.got[i].1.len();
            if k != want_k || have + v.len() > want_n {
                return bad(format!(
                    "request #{k} with values {have}..{} where request #{want_k} has {want_n}",
                    have + v.len()
                ));
            }
            self.got[i].1.extend_from_slice(&v);
            self.open = self.got[i].1.len() < want_n;
            if self.open && j != last {
                return bad(format!(
                    "request #{k} short of its {want_n} values mid-frame"
                ));
            }
        }
        Ok(())
    }

    /// Every request's values (once [`Gathering::complete`]).
    pub fn into_values(self) -> BlockValues {
        self.got
    }
}
