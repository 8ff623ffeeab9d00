//! Bucket entries: splitting them into network messages, and checking a
//! peer's entries against the buffer they claim to lie in.

#[cfg(doc)]
use super::ALIGN;
use super::{BucketEntry, Request};
use crate::result::{Error, Result};

/// Largest UCX message of a network session: a bucket's entries are split
/// to at most this length, and each travels as its own message. Small enough
/// that the engine verifies (and, staged, copies) each one while its bytes
/// are still in cache, right after they land, instead of reading them back
/// from memory: on the 2-core CI machine, verified direct updates ran at
/// 0.81-1.01 of the raw UCX floor with 1 MiB messages against 0.69-0.78 with
/// 4 MiB (`wm bench net`, the floor using the same message size). Large
/// enough that a message's own cost (tens of microseconds) stays small.
/// Only publishers split; engines take entries of any length.
pub(crate) const NET_MESSAGE: u64 = 1 << 20;

/// [`NET_MESSAGE`], for benchmarks that mirror a session's messages.
pub fn net_message_bytes() -> usize {
    NET_MESSAGE as usize
}

/// The UCX tag of the message carrying entry `k` of network bucket `seq`:
/// `seq << 32 | (k + 1)`. Publisher and engine both name messages by it.
pub fn message_tag(seq: u64, k: usize) -> u64 {
    (seq << 32) | (k as u64 + 1)
}

/// Split entries into messages of a network bucket: at most
/// [`NET_MESSAGE`] bytes each, and each within one block of its request
/// (contiguous in the publisher's tensor, and where it lands in the
/// engine's param: see `docs/wire.md`).
pub fn split_entries(entries: &[BucketEntry], requests: &[Request]) -> Vec<BucketEntry> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        if e.len == 0 {
            out.push(*e);
            continue;
        }
        for (_, at, len) in requests[e.request as usize].pieces(e.offset, e.len) {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(NET_MESSAGE);
                out.push(BucketEntry {
                    request: e.request,
                    offset: at + done,
                    len: n,
                    buffer_offset: e.buffer_offset + (at - e.offset) + done,
                });
                done += n;
            }
        }
    }
    out
}

/// Check a bucket's entries against its buffer before any byte is read: each
/// range inside the buffer, `align`-byte aligned (IPC: [`ALIGN`]; network
/// messages, which may be blocks of a strided request: 1), entries not
/// overlapping.
pub fn check_bucket(
    seq: u64,
    entries: &[BucketEntry],
    buffer_len: u64,
    requests: usize,
    align: u64,
) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(entries.len());
    for e in entries {
        let bad = |why: String| Err(Error::peer(format!("bucket {seq}: {why}")));
        if e.request as usize >= requests {
            return bad(format!("entry names request #{} of {requests}", e.request));
        }
        if e.buffer_offset % align != 0 {
            return bad(format!(
                "offset {} is not {align}-byte aligned",
                e.buffer_offset
            ));
        }
        match e.buffer_offset.checked_add(e.len) {
            Some(end) if end <= buffer_len => ranges.push((e.buffer_offset, end)),
            _ => {
                return bad(format!(
                    "{} bytes at {} run past the {buffer_len}-byte buffer",
                    e.len, e.buffer_offset
                ))
            }
        }
    }
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(Error::peer(format!(
            "bucket {seq}: entries overlap in the buffer"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_entries_split_at_the_message_size_and_blocks() {
        let m = NET_MESSAGE;
        let e = |request, off, len| BucketEntry {
            request,
            offset: 0,
            len,
            buffer_offset: off,
        };
        let whole = [Request::whole(0, m, false), Request::whole(1, 2 * m, false)];
        let split = split_entries(&[e(0, 0, m), e(1, m, m + m / 2)], &whole);
        let got: Vec<(u32, u64, u64, u64)> = split
            .iter()
            .map(|x| (x.request, x.offset, x.len, x.buffer_offset))
            .collect();
        assert_eq!(got, vec![(0, 0, m, 0), (1, 0, m, m), (1, m, m / 2, 2 * m)]);
        // A zero-length entry stays one entry.
        assert_eq!(split_entries(&[e(0, 0, 0)], &whole).len(), 1);
        // A strided request: one message per block (rows of 8 bytes).
        let cols = [Request::of_blocks(0, [(8, 8), (24, 8), (40, 8)], false)];
        let split = split_entries(
            &[BucketEntry {
                request: 0,
                offset: 4,
                len: 20,
                buffer_offset: 256,
            }],
            &cols,
        );
        let got: Vec<(u64, u64, u64)> = split
            .iter()
            .map(|x| (x.offset, x.len, x.buffer_offset))
            .collect();
        assert_eq!(got, vec![(4, 4, 256), (8, 8, 260), (16, 8, 268)]);
    }
}
