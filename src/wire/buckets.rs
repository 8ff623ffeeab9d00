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

/// [`PACK_BELOW`], for benchmarks that mirror a session's messages.
pub fn pack_below_bytes() -> usize {
    PACK_BELOW as usize
}

/// Blocks shorter than this travel packed: consecutive blocks of a
/// request, copied back to back into one message of up to
/// [`NET_MESSAGE`] bytes; from this size up a block goes alone, straight
/// from the publisher's memory, with no copy. Raw UCX over TCP loopback on
/// the 2-core CI machine (one pair, the machine busy) moved 4 KiB messages
/// at 0.3-0.65 GB/s, 16 KiB at 0.4-0.9, and 32 KiB to 1 MiB at 0.7-1.1 (up
/// to 1.6 at 256 KiB): below a few tens of KiB a message costs more than
/// its bytes, so a column split of 4 KiB rows sent a message per row ran at
/// a fifth of raw UCX (`wm bench shard --section ucx` measures both
/// patterns).
pub(crate) const PACK_BELOW: u64 = 64 << 10;

/// Split entries into messages of a network bucket: at most
/// [`NET_MESSAGE`] bytes each. A block of at least [`PACK_BELOW`] bytes
/// (contiguous in the publisher's tensor, and where it lands in the
/// engine's param) goes as messages of its own; consecutive smaller blocks
/// of an entry go together, packed, in one message (see `docs/wire.md`).
pub fn split_entries(entries: &[BucketEntry], requests: &[Request]) -> Vec<BucketEntry> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        if e.len == 0 {
            out.push(*e);
            continue;
        }
        // The entry's bytes from request offset `at`: buffer offsets
        // follow request offsets.
        let piece = |at: u64, len: u64| BucketEntry {
            request: e.request,
            offset: at,
            len,
            buffer_offset: e.buffer_offset + (at - e.offset),
        };
        // Small blocks gathered so far: (first request offset, bytes).
        let mut packed: Option<(u64, u64)> = None;
        for (_, at, len) in requests[e.request as usize].pieces(e.offset, e.len) {
            if let Some((from, n)) = packed {
                if len >= PACK_BELOW || n + len > NET_MESSAGE {
                    out.push(piece(from, n));
                    packed = None;
                }
            }
            if len < PACK_BELOW {
                let (from, n) = packed.unwrap_or((at, 0));
                packed = Some((from, n + len));
                continue;
            }
            let mut done = 0;
            while done < len {
                let n = (len - done).min(NET_MESSAGE);
                out.push(piece(at + done, n));
                done += n;
            }
        }
        if let Some((from, n)) = packed {
            out.push(piece(from, n));
        }
    }
    out
}

/// Where network message `e` starts in its publisher's tensor when it is
/// (part of) one block, sent from the tensor itself; None when it packs
/// several blocks ([`split_entries`]).
pub fn message_source(e: &BucketEntry, requests: &[Request]) -> Option<u64> {
    match requests[e.request as usize]
        .pieces(e.offset, e.len)
        .as_slice()
    {
        [] => Some(0),
        [(from, ..)] => Some(*from),
        _ => None,
    }
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
        // A strided request of small blocks (rows of 8 bytes): packed into
        // one message.
        let cols = [Request::of_blocks(0, [(8, 8), (24, 8), (40, 8)], false)];
        let entry = |offset, len| BucketEntry {
            request: 0,
            offset,
            len,
            buffer_offset: 256,
        };
        let got = split_entries(&[entry(4, 20)], &cols);
        assert_eq!(got, vec![entry(4, 20)]);
        // Large blocks go alone (split at the message size), small ones
        // between them packed, at most a message's worth each.
        let (big, small) = (PACK_BELOW, PACK_BELOW - 1);
        let per = NET_MESSAGE / small; // small blocks a message holds
        let mut blocks = vec![(0, big)];
        let mut at = 4 * big;
        for _ in 0..per + 1 {
            blocks.push((at, small));
            at += 2 * small;
        }
        blocks.push((at, 2 * m));
        let q = [Request::of_blocks(0, blocks, false)];
        let all = q[0].bytes();
        let got: Vec<(u64, u64)> = split_entries(&[entry(0, all)], &q)
            .iter()
            .map(|x| (x.offset, x.len))
            .collect();
        let tail = big + (per + 1) * small;
        assert_eq!(
            got,
            vec![
                (0, big),
                (big, per * small),
                (big + per * small, small),
                (tail, m),
                (tail + m, m)
            ]
        );
    }
}
