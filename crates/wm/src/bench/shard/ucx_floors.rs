//! The raw UCX floors of `wm bench shard`, section ucx: each pattern's
//! bytes moved by plain UCX between the same pairs, as contiguous ranges
//! and in the pattern itself (`bench::ucx_floor` moves them).

use super::Row;
use crate::bench::harness::buffer;
use crate::bench::model::LAYER_SHAPE;
use crate::bench::ucx_floor::{raw_floor, slots_of, FloorPair, Take};
use crate::fmt::gbps;
use std::time::Duration;

/// Trainer ranks, and engine ranks.
pub(super) const HALVES: u64 = 2;
/// The engines' buckets in flight (per source).
pub(super) const DEPTH: usize = 2;

/// The bytes trainer `t` holds of engine rank `e`'s half along `dim`.
fn pair_bytes(total: u64, dim: usize, t: u64, e: u64) -> u64 {
    match dim {
        0 if t == e => total / HALVES,
        0 => 0,
        _ => total / (HALVES * HALVES),
    }
}

/// One floor measurement: raw UCX moving the pattern's bytes between the
/// same pairs as contiguous ranges, and in the pattern itself.
#[derive(Clone, Copy)]
pub(super) struct FloorTimes {
    pub contiguous: Duration,
    pub pattern: Duration,
}

/// The raw UCX floors of one pattern, with their buffers (allocated once)
/// and the best time each reached.
///
/// Row halves: each pair's bytes are one range of the trainer's tensors,
/// so the pattern is contiguous 1 MiB messages. Column halves: the pattern
/// is the pair's 4 KiB halves of the trainer's 8 KiB rows, received back
/// to back (the engine's param rows follow each other); raw UCX moves them
/// either gathered by UCX (an IOV send) or packed by a copy, and the floor
/// is the faster of the two.
pub(super) struct FloorSet<'a> {
    /// Per pair: its source (for a pattern, from the first block) and
    /// how many bytes it moves.
    pairs: Vec<(&'a [u8], usize)>,
    dim: usize,
    message: usize,
    slots: Vec<Vec<Vec<u8>>>,
    packs: Vec<Vec<Vec<u8>>>,
    best: FloorTimes,
}

impl<'a> FloorSet<'a> {
    pub fn new(dim: usize, bucket_mib: usize, src: &'a [u8]) -> FloorSet<'a> {
        let total = src.len() as u64;
        let message = weight_manager_core::internals::wire::net_message_bytes();
        let in_flight = (DEPTH * (bucket_mib << 20) / message).clamp(1, 64);
        let (trainer, row) = (src.len() / HALVES as usize, row_bytes());
        let pairs: Vec<(&[u8], usize)> = (0..HALVES)
            .flat_map(|t| (0..HALVES).map(move |e| (t, e)))
            .map(|(t, e)| (t as usize, e as usize, pair_bytes(total, dim, t, e)))
            .filter(|&(.., n)| n > 0)
            .map(|(t, e, n)| {
                let at = t * trainer + if dim == 0 { 0 } else { e * row / 2 };
                (&src[at..(t + 1) * trainer], n as usize)
            })
            .collect();
        let buffers = |n: usize| -> Vec<Vec<Vec<u8>>> {
            let one = || (0..n).map(|_| buffer(message)).collect();
            pairs.iter().map(|_| one()).collect()
        };
        // Send buffers for packing (none for row halves).
        let packs = buffers(if dim == 0 { 0 } else { in_flight });
        FloorSet {
            slots: buffers(in_flight),
            packs,
            pairs,
            dim,
            message,
            best: FloorTimes {
                contiguous: Duration::MAX,
                pattern: Duration::MAX,
            },
        }
    }

    /// Time the floors once (the pattern's two ways, for column halves).
    pub fn measure(&mut self) -> Result<FloorTimes, String> {
        let contiguous = self.time(Take::Contiguous)?;
        let pattern = match self.dim {
            0 => contiguous,
            _ => {
                let (block, stride) = (row_bytes() / 2, row_bytes());
                let gathered = self.time(Take::Gathered { block, stride })?;
                gathered.min(self.time(Take::Packed { block, stride })?)
            }
        };
        self.best.contiguous = self.best.contiguous.min(contiguous);
        self.best.pattern = self.best.pattern.min(pattern);
        Ok(FloorTimes {
            contiguous,
            pattern,
        })
    }

    fn time(&mut self, take: Take) -> Result<Duration, String> {
        let message = self.message;
        let slots: Vec<_> = self.slots.iter_mut().map(|s| slots_of(s)).collect();
        let mut pairs: Vec<FloorPair> = self
            .pairs
            .iter()
            .zip(slots.iter().zip(self.packs.iter_mut()))
            .map(|(&(src, n), (slots, packs))| FloorPair {
                src: if take == Take::Contiguous {
                    &src[..n]
                } else {
                    src
                },
                message,
                slots,
                take,
                packs,
            })
            .collect();
        raw_floor(&mut pairs)
    }

    /// The rows of the best floors.
    pub fn rows(&self, what: &str, total: u64) -> Vec<Row> {
        let in_flight = self.slots[0].len();
        let row = |what: String, t: Duration| Row {
            what,
            value: format!("{:.2} GB/s", gbps(total, t)),
            beside: "(best floor)".into(),
            ratio: 1.0,
            ok: None,
        };
        let what = format!(
            "{what}: raw UCX floor, {} pairs at once, 1 MiB messages, {in_flight} in flight",
            self.pairs.len()
        );
        match self.dim {
            0 => vec![row(what, self.best.contiguous)],
            _ => vec![
                row(
                    format!("{what}, 4 KiB blocks gathered or packed"),
                    self.best.pattern,
                ),
                row(format!("{what}, contiguous ranges"), self.best.contiguous),
            ],
        }
    }
}

/// Bytes of one row of a layer (bf16).
fn row_bytes() -> usize {
    LAYER_SHAPE[1] as usize * 2
}
