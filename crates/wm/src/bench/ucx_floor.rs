//! The raw UCX floor of `wm bench net` and `wm bench shard`: the same bytes
//! moved by plain tagged UCX messages, with no library logic (no protocol,
//! plan, checksums or acknowledgements), between the same sender and
//! receiver pairs, each pair on its own two workers as each session has.
//!
//! A pair's messages take their bytes from its source the way the session's
//! do ([`Take`]): contiguous ranges, or blocks strided through the source
//! (a column split: each 4 KiB half of an 8 KiB row), which raw UCX moves
//! either gathered by UCX itself (an IOV send) or packed by a copy first.
//! The receiver takes every message into one contiguous range (a column
//! split's rows follow each other in the engine's param).

use std::collections::HashSet;
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::SendPtr;
use weight_manager_core::internals::transport::ucx::Pump;

/// How a pair's messages take their bytes from its source.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Take {
    /// Message k is the k-th `message` bytes of the source.
    Contiguous,
    /// Message k is the next `message / block` blocks of `block` bytes,
    /// one every `stride` bytes of the source, gathered by UCX (an IOV
    /// send: nothing is copied first).
    Gathered { block: usize, stride: usize },
    /// The same blocks as `Gathered`, copied into a send buffer of the
    /// pair's own first, then sent as one range.
    Packed { block: usize, stride: usize },
}

/// One sender and one receiver of a raw UCX floor: `src`'s bytes, taken as
/// `take` says, sent in messages of `message` bytes (the session's message
/// size), `slots.len()` of them in flight (the messages of `depth`
/// buckets). `slots` are the receiving buffers (`message` bytes each; host
/// memory, or GPU memory for the gdr floor: UCX tells them apart) and
/// `packs` the send buffers of `Take::Packed` (as many), allocated once by
/// the caller: fresh memory each run would cost page faults and compaction.
pub(crate) struct FloorPair<'a> {
    pub src: &'a [u8],
    pub message: usize,
    pub slots: &'a [SendPtr],
    pub take: Take,
    pub packs: &'a mut [Vec<u8>],
}

impl FloorPair<'_> {
    /// The bytes this pair moves.
    fn bytes(&self) -> usize {
        match self.take {
            Take::Contiguous => self.src.len(),
            Take::Gathered { block, stride } | Take::Packed { block, stride } => {
                self.src.len().div_ceil(stride) * block
            }
        }
    }

    /// Message `k`'s blocks: (address, length) in the source.
    fn blocks(&self, k: usize, block: usize, stride: usize) -> Vec<(SendPtr, usize)> {
        let per = self.message / block;
        (k * per..(k + 1) * per)
            .map(|b| (SendPtr(self.src[b * stride..].as_ptr().cast_mut()), block))
            .collect()
    }
}

/// The receiving slots of host buffers (see [`FloorPair::slots`]).
pub(crate) fn slots_of(buffers: &mut [Vec<u8>]) -> Vec<SendPtr> {
    buffers
        .iter_mut()
        .map(|b| SendPtr(b.as_mut_ptr()))
        .collect()
}

/// Raw UCX, every pair at once (each its own two workers, as each session
/// has): the time from when all are connected until the last one is done.
pub(crate) fn raw_floor(pairs: &mut [FloorPair]) -> Result<Duration, String> {
    let connected = std::sync::Barrier::new(pairs.len());
    std::thread::scope(|s| {
        let runs: Vec<_> = pairs
            .iter_mut()
            .map(|p| s.spawn(|| floor_pair(p, &connected)))
            .collect();
        let mut span: Option<(Instant, Instant)> = None;
        for r in runs {
            let (a, b) = r.join().map_err(|_| "a floor thread panicked")??;
            span = Some(span.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
        }
        Ok(span.map_or(Duration::ZERO, |(a, b)| b - a))
    })
}

/// One pair of [`raw_floor`]: connect, wait for the others, move the
/// bytes; when it started moving them and when it was done.
fn floor_pair(
    p: &mut FloorPair,
    connected: &std::sync::Barrier,
) -> Result<(Instant, Instant), String> {
    let pumps = Pump::start("floor-tx").and_then(|tx| {
        let rx = Pump::start("floor-rx")?;
        tx.connect(rx.address())?;
        Ok((tx, rx))
    });
    // Every pair reaches the barrier, connected or not: none waits forever.
    connected.wait();
    let (tx, rx) = pumps.map_err(|e| e.to_string())?;
    let mut sender = Sender {
        tx: &tx,
        sent: HashSet::new(),
        deadline: Instant::now() + Duration::from_secs(300),
    };
    let (in_flight, message) = (p.slots.len(), p.message);
    let n = p.bytes().div_ceil(message);
    let t = Instant::now();
    let mut posted = 0;
    for done in 0..n {
        while posted < n && posted < done + in_flight {
            let slot = p.slots[posted % in_flight].0;
            // SAFETY: the buffers (`message` bytes each, as the caller
            // promises) outlive both pumps (dropped at the end of this
            // function, before the caller's buffers).
            unsafe { rx.recv(posted as u64, slot, message) }.map_err(|e| e.to_string())?;
            sender.post(p, posted)?;
            posted += 1;
        }
        let c = rx
            .next(sender.deadline)
            .map_err(|e| e.to_string())?
            .ok_or("raw UCX transfer timed out")?;
        c.result.map_err(|e| e.to_string())?;
    }
    Ok((t, Instant::now()))
}

/// A floor pair's sending side: the sends it saw complete (a packed send
/// buffer is refilled only once its last send completed).
struct Sender<'a> {
    tx: &'a Pump,
    sent: HashSet<u64>,
    deadline: Instant,
}

impl Sender<'_> {
    /// Send message `k` of `p`.
    fn post(&mut self, p: &mut FloorPair, k: usize) -> Result<(), String> {
        let tag = k as u64;
        // In all three: the source and the send buffers outlive the pumps
        // (dropped at the end of `floor_pair`), the source is never written,
        // and a send buffer is not refilled before its send completed. The
        // callers size the source in whole messages of whole blocks (it
        // holds every byte a message reads: not checked here).
        let posted = match p.take {
            // SAFETY: as above; `piece` is `message` bytes of the source.
            Take::Contiguous => unsafe { self.tx.send(tag, piece(p.src, k, p.message), p.message) },
            // SAFETY: as above; every block lies in the source.
            Take::Gathered { block, stride } => unsafe {
                self.tx.send_scatter(tag, p.blocks(k, block, stride))
            },
            Take::Packed { block, stride } => {
                let slots = p.packs.len();
                if k >= slots {
                    self.wait_sent((k - slots) as u64)?;
                }
                let buf = p.packs[k % slots].as_mut_ptr();
                for (i, (at, len)) in p.blocks(k, block, stride).into_iter().enumerate() {
                    // SAFETY: block i of the source, to block i of this send
                    // buffer (`message` bytes: message / block blocks), which
                    // no send reads any more (message k - slots completed).
                    unsafe { std::ptr::copy_nonoverlapping(at.0, buf.add(i * block), len) };
                }
                // SAFETY: as above; the buffer holds `message` bytes and is
                // not touched again before this send completes.
                unsafe { self.tx.send(tag, buf, p.message) }
            }
        };
        posted.map_err(|e| e.to_string())
    }

    /// Wait until the send of message `tag` completed.
    fn wait_sent(&mut self, tag: u64) -> Result<(), String> {
        while !self.sent.remove(&tag) {
            let c = self
                .tx
                .next(self.deadline)
                .map_err(|e| e.to_string())?
                .ok_or("raw UCX send timed out")?;
            c.result.map_err(|e| e.to_string())?;
            self.sent.insert(c.tag);
        }
        Ok(())
    }
}

/// Message `k`'s bytes: its own part of `src`, as a session sends each
/// entry from its own tensor bytes (a last short part is padded by reading
/// from the start, which only a size not a multiple of the message has).
fn piece(src: &[u8], k: usize, message: usize) -> *const u8 {
    let at = k * message;
    if at + message <= src.len() {
        src[at..].as_ptr()
    } else {
        src.as_ptr()
    }
}
