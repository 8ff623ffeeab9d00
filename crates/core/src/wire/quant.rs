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

pub(super) fn encode_values(o: &mut Out, values: &BlockValues) {
    o.u32(values.len() as u32);
    for (k, v) in values {
        o.u32(*k);
        o.u32(v.len() as u32);
        v.iter()
            .for_each(|x| o.0.extend_from_slice(&x.to_le_bytes()));
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
        let m = i.count(4, "block values")?;
        total += m;
        if total > MAX_BLOCK_VALUES {
            return Err(Error::peer(format!(
                "wire: {what}: more than {MAX_BLOCK_VALUES} block values"
            )));
        }
        let mut v = try_vec(m, "wire: block values")?;
        for _ in 0..m {
            let x = f32::from_le_bytes(i.take(4)?.try_into().expect("4"));
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
