//! Bucket entries: splitting them into network messages, checking a
//! peer's entries against the buffer they claim to lie in, and expanding
//! WINDOWS entries into the blocks they stand for.

use super::{BucketEntry, Request, ALIGN};
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
        for (_, at, len) in requests[e.request as usize].extents(e.offset, e.len) {
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

/// The smallest average block of a network message of several blocks
/// that the engine receives straight where the blocks go (UCX scatters
/// them: an IOV receive) rather than into a bounce buffer it scatters from
/// after. Below it (rows of a few hundred bytes) one copy pass costs less
/// than UCX stepping through that many pieces; from it up (a column half's
/// 4 KiB rows) the second copy and the bounce buffer's memory traffic are
/// what cost (`wm bench shard --section ucx`). The publisher still packs
/// such messages on its copy threads: UCX packs an IOV send itself over
/// TCP, on its one thread, which measured slower.
pub(crate) const MIN_SCATTER_PART: u64 = 1024;

/// The most pieces a message of `len` bytes is scattered into by UCX: as
/// many as average at least [`MIN_SCATTER_PART`] bytes, and always one.
pub fn max_scatter_parts(len: u64) -> usize {
    (len / MIN_SCATTER_PART).max(1) as usize
}

/// Where network message `e` starts in its publisher's tensor when it is
/// (part of) one block, sent from the tensor itself; None when it packs
/// several blocks ([`split_entries`]).
pub fn message_source(e: &BucketEntry, requests: &[Request]) -> Option<u64> {
    let mut pieces = requests[e.request as usize].extents(e.offset, e.len);
    match (pieces.next(), pieces.next()) {
        (None, _) => Some(0),
        (Some((from, ..)), None) => Some(from),
        _ => None,
    }
}

/// Check a bucket's entries against its buffer before any byte is read: each
/// range inside the buffer, `align`-byte aligned (IPC: [`ALIGN`]; network
/// messages, which may be blocks of a strided request: 1), entries not
/// overlapping, and at most one empty entry per request (an empty request
/// is served as one: more are work without bytes, 2 million of them a
/// bucket made an engine spend a second a bucket until its deadline).
pub fn check_bucket(
    seq: u64,
    entries: &[BucketEntry],
    buffer_len: u64,
    requests: usize,
    align: u64,
) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(entries.len());
    let mut empty = std::collections::HashSet::new();
    for e in entries {
        let bad = |why: String| Err(Error::peer(format!("bucket {seq}: {why}")));
        if e.request as usize >= requests {
            return bad(format!("entry names request #{} of {requests}", e.request));
        }
        if e.len == 0 && !empty.insert(e.request) {
            return bad(format!(
                "more than one empty entry of request #{}",
                e.request
            ));
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

/// A WINDOWS bucket's entries, checked and expanded into the contiguous
/// blocks they stand for: `blocks` (entries with BUCKET's meaning: request
/// bytes at their buffer offset, in entry order) and, per entry with bytes,
/// the extent of the buffer its blocks lie in (first byte, end).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WindowBlocks {
    pub blocks: Vec<BucketEntry>,
    pub extents: Vec<(u64, u64)>,
}

/// Check and expand the entries of WINDOWS bucket `seq` in a buffer of
/// `buffer_len` bytes, before any byte is read. An entry's `buffer_offset`
/// is where byte 0 of its request's tensor lies ([`ALIGN`]-byte aligned, so
/// a whole tensor handed to a callback is aligned); its bytes are found by
/// the engine's own request (`requests`, as sent in WANT): request bytes
/// `[offset, offset + len)` are blocks of the tensor, each at
/// `buffer_offset` plus its tensor offset. Refused, naming the entry: a
/// request not in WANT, a range past the request's bytes, an entry not
/// starting where the same request's entry before it in the bucket ended,
/// an unaligned offset, or any block past the buffer. Windows only read
/// the buffer, so entries of different requests may overlap (two requests
/// for the same bytes).
pub fn check_windows(
    seq: u64,
    entries: &[BucketEntry],
    buffer_len: u64,
    requests: &[Request],
) -> Result<WindowBlocks> {
    let mut out = WindowBlocks::default();
    // Where each request's last entry in this bucket ended: its next entry
    // must start there, so the blocks expanded here are at most those of
    // the engine's own requests, however many entries a peer sends.
    let mut ends: std::collections::HashMap<u32, u64> = Default::default();
    let mut empty = std::collections::HashSet::new();
    for (k, e) in entries.iter().enumerate() {
        let bad = |why: String| Error::peer(format!("bucket {seq}: entry {k}: {why}"));
        let q = check_window(e, requests, &mut ends).map_err(bad)?;
        if e.len == 0 {
            if !empty.insert(e.request) {
                let why = format!("more than one empty entry of request #{}", e.request);
                return Err(bad(why));
            }
            out.blocks.push(*e);
            continue;
        }
        let mut extent = (u64::MAX, 0);
        for (at, offset, len) in q.extents(e.offset, e.len) {
            let start = e.buffer_offset.checked_add(at);
            let Some((start, end)) = start.and_then(|s| Some((s, s.checked_add(len)?))) else {
                return Err(bad(format!("tensor offset {} overflows", e.buffer_offset)));
            };
            if end > buffer_len {
                return Err(bad(format!(
                    "block of {len} bytes at {start} (request #{}) runs past the \
                     {buffer_len}-byte buffer",
                    e.request
                )));
            }
            extent = (extent.0.min(start), extent.1.max(end));
            match out.blocks.last_mut() {
                // Blocks that follow on in the buffer (rows of a range) are
                // one copy.
                Some(b)
                    if b.request == e.request
                        && b.buffer_offset + b.len == start
                        && b.offset + b.len == offset =>
                {
                    b.len += len
                }
                _ => out.blocks.push(BucketEntry {
                    request: e.request,
                    offset,
                    len,
                    buffer_offset: start,
                }),
            }
        }
        out.extents.push(extent);
    }
    Ok(out)
}

/// Window `e`'s request (one of `requests`), once its range lies in the
/// request's bytes, follows on from the request's entry before it (`ends`)
/// and its tensor offset is aligned; else why not.
fn check_window<'q>(
    e: &BucketEntry,
    requests: &'q [Request],
    ends: &mut std::collections::HashMap<u32, u64>,
) -> std::result::Result<&'q Request, String> {
    let Some(q) = requests.get(e.request as usize) else {
        return Err(format!(
            "names request #{} of {}",
            e.request,
            requests.len()
        ));
    };
    let size = q.bytes();
    if e.offset.checked_add(e.len).is_none_or(|end| end > size) {
        return Err(format!(
            "{} bytes from byte {} run past the {size} bytes of request #{}",
            e.len, e.offset, e.request
        ));
    }
    if !e.buffer_offset.is_multiple_of(ALIGN) {
        return Err(format!(
            "tensor offset {} is not {ALIGN}-byte aligned",
            e.buffer_offset
        ));
    }
    match ends.insert(e.request, e.offset + e.len) {
        Some(end) if end != e.offset => Err(format!(
            "starts at byte {} of request #{}, whose entry before it ended at {end}",
            e.offset, e.request
        )),
        _ => Ok(q),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One empty entry per request in a bucket (an empty request is served
    /// as one), BUCKET and WINDOWS; a second is refused naming it.
    #[test]
    fn a_second_empty_entry_of_a_request_is_refused() {
        let e = |off, len| BucketEntry {
            request: 0,
            offset: 0,
            len,
            buffer_offset: off,
        };
        assert!(check_bucket(0, &[e(0, 0), e(0, 100)], 1024, 1, ALIGN).is_ok());
        let twice = check_bucket(0, &[e(0, 0), e(256, 0)], 1024, 1, ALIGN);
        let why = twice.unwrap_err().message;
        assert!(
            why.contains("more than one empty entry of request #0"),
            "{why}"
        );
        let empties = [e(0, 0), e(0, 0)];
        let requests = [Request::whole(0, 0, false)];
        assert!(check_windows(0, &empties[..1], 1024, &requests).is_ok());
        let why = check_windows(0, &empties, 1024, &requests)
            .unwrap_err()
            .message;
        assert!(
            why.contains("entry 1: more than one empty entry of request #0"),
            "{why}"
        );
    }

    /// A message lands in its pieces when it is one, or when they average
    /// at least MIN_SCATTER_PART bytes (4 KiB rows of a column half); 256-byte
    /// rows go through a bounce buffer.
    #[test]
    fn messages_land_in_pieces_averaging_min_piece() {
        assert_eq!(max_scatter_parts(0), 1);
        assert_eq!(max_scatter_parts(10), 1);
        assert_eq!(max_scatter_parts(1 << 20), 1024);
        assert!(max_scatter_parts(1 << 20) >= (1 << 20) / 4096, "4 KiB rows");
        assert_eq!(max_scatter_parts(MIN_SCATTER_PART * 7), 7);
        assert_eq!(max_scatter_parts(MIN_SCATTER_PART * 7 - 1), 6);
        assert!(max_scatter_parts(256 * 128) < 128, "256-byte rows");
    }

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

    fn window(request: u32, offset: u64, len: u64, tensor_at: u64) -> BucketEntry {
        BucketEntry {
            request,
            offset,
            len,
            buffer_offset: tensor_at,
        }
    }

    /// Columns 8..16 of rows of 32 bytes (a strided request) and a range
    /// of another tensor: expanded into their blocks where they lie.
    #[test]
    fn windows_expand_into_blocks_inside_the_buffer() {
        let cols = Request::of_blocks(0, (0..4).map(|r| (r * 32 + 8, 8)), false);
        let range = Request::of_blocks(1, [(40, 24)], false);
        let requests = [cols, range];
        let w = check_windows(
            3,
            &[window(0, 4, 20, 256), window(1, 0, 24, 512)],
            1024,
            &requests,
        )
        .unwrap();
        let got: Vec<(u32, u64, u64, u64)> = w
            .blocks
            .iter()
            .map(|b| (b.request, b.offset, b.len, b.buffer_offset))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 4, 4, 256 + 12),
                (0, 8, 8, 256 + 40),
                (0, 16, 8, 256 + 72),
                (1, 0, 24, 552)
            ]
        );
        assert_eq!(w.extents, vec![(268, 336), (552, 576)]);
        // Equal blocks back to back (a run of rows of a range) are one block.
        let rows = [Request::of_blocks(0, (0..4).map(|r| (r * 32, 32)), false)];
        let w = check_windows(0, &[window(0, 8, 100, 256)], 1024, &rows).unwrap();
        assert_eq!(w.blocks, vec![window(0, 8, 100, 264)]);
        // The same bytes for two requests (of one tensor) are fine.
        let twice = [requests[1].clone(), requests[1].clone()];
        let both = [window(0, 0, 24, 0), window(1, 0, 24, 0)];
        assert!(check_windows(0, &both, 64, &twice).is_ok());
    }

    #[test]
    fn hostile_windows_are_refused_naming_the_entry() {
        let requests = [Request::of_blocks(
            0,
            (0..4).map(|r| (r * 32 + 8, 8)),
            false,
        )];
        let refuse = |e: BucketEntry, len: u64| {
            check_windows(7, &[window(0, 0, 8, 0), e], len, &requests)
                .unwrap_err()
                .message
        };
        let cases = [
            (
                refuse(window(0, 8, 24, 1 << 20), 1 << 20),
                "runs past the 1048576-byte buffer",
            ),
            (
                refuse(window(0, 8, 24, 768), 800),
                "block of 8 bytes at 808 (request #0) runs past the 800-byte buffer",
            ),
            (
                refuse(window(0, 8, 32, 0), 1024),
                "32 bytes from byte 8 run past the 32 bytes of request #0",
            ),
            (refuse(window(0, u64::MAX, 2, 0), 1024), "run past"),
            (refuse(window(1, 0, 8, 0), 1024), "names request #1 of 1"),
            (
                refuse(window(0, 0, 8, 0), 1024),
                "starts at byte 0 of request #0, whose entry before it ended at 8",
            ),
            (
                refuse(window(0, 0, 8, 100), 1024),
                "tensor offset 100 is not 256-byte aligned",
            ),
        ];
        for (message, want) in cases {
            assert!(
                message.contains("bucket 7: entry 1: ") && message.contains(want),
                "{want}: {message}"
            );
        }
    }
}
