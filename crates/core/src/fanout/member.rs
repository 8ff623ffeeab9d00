//! Where a member's broadcasts land: the applier decides, as for every
//! source. In place the bytes land in the params themselves (the applier's
//! `receive_scatter`, in one piece, with device params written directly as
//! with gdr) and are accounted for once moved. Atomic, the applier stages in host
//! memory, which NCCL cannot write: each batch lands in a [`Bounce`]
//! buffer on the GPU first and is handed to the applier from there
//! (`apply_batch`), which copies it into its staging; its commit then
//! writes the params.

use super::transfer::{batches, Landing};
use crate::apply::{Applier, Chunk};
use crate::memory::aligned_offsets;
use crate::memory::copy::CopySource;
use crate::memory::device::DeviceAllocation;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use std::ops::Range;

/// Memory an atomic member's batch lands in before the applier takes it.
pub enum Bounce {
    /// GPU memory (what NCCL writes).
    Device(DeviceAllocation),
    /// Host memory, for a mover that writes host memory.
    #[cfg_attr(
        not(test),
        expect(
            dead_code,
            reason = "NCCL writes device memory; the tests' mover writes host memory"
        )
    )]
    Host(HostRegion),
}

impl Bounce {
    /// The bytes a bounce buffer needs to hold the largest batch of
    /// `sizes` (tensors packed at aligned offsets): at most `limit`, or the
    /// largest tensor, both the engine's own numbers.
    pub fn size_for(sizes: &[usize], limit: usize) -> Result<usize> {
        let mut most = 0;
        for batch in batches(sizes, limit) {
            let (_, n) = aligned_offsets(sizes[batch].iter().map(|&n| n as u64))
                .ok_or_else(|| Error::out_of_memory("the fan-out landing buffer is too large"))?;
            most = most.max(n);
        }
        Ok(most)
    }

    fn base(&self) -> u64 {
        match self {
            Bounce::Device(d) => d.ptr(),
            Bounce::Host(h) => h.ptr() as u64,
        }
    }

    /// The applier's view of the byte at `at`.
    fn source(&self, at: u64) -> CopySource<'static> {
        match self {
            Bounce::Device(d) => CopySource::Device {
                ptr: at,
                ordinal: d.ordinal(),
            },
            Bounce::Host(_) => CopySource::Memory(SendPtr(at as *mut u8)),
        }
    }
}

/// A member's [`Landing`]: plan entry `t` is broadcast tensor `t`, of
/// `sizes[t]` bytes.
pub struct MemberLanding<'a, 'p, 'h> {
    applier: &'a mut Applier<'p, 'h>,
    sizes: &'a [usize],
    /// Atomic: where batches land first (None: in place).
    bounce: Option<&'a Bounce>,
    /// The current batch's addresses.
    placed: Vec<u64>,
    /// Names where the bytes come from in errors.
    origin: &'a str,
}

impl<'a, 'p, 'h> MemberLanding<'a, 'p, 'h> {
    /// Land in place, or through `bounce` (atomic; sized by
    /// [`Bounce::size_for`] with the same limit as the broadcast).
    pub fn new(
        applier: &'a mut Applier<'p, 'h>,
        sizes: &'a [usize],
        bounce: Option<&'a Bounce>,
        origin: &'a str,
    ) -> Self {
        MemberLanding {
            applier,
            sizes,
            bounce,
            placed: Vec::new(),
            origin,
        }
    }

    /// In place: where tensor `t`'s bytes land, all of them in one piece
    /// (one broadcast writes them).
    fn in_one_piece(&mut self, t: usize) -> Result<u64> {
        let n = self.sizes[t];
        match self.applier.receive_scatter(t, 0, n, 1)?.as_deref() {
            Some([(at, _)]) => Ok(at.0 as u64),
            _ => Err(Error::format(format!(
                "tensor #{t}: its {n} bytes are not contiguous where they land"
            ))),
        }
    }

    fn chunks(&self, batch: Range<usize>) -> Vec<Chunk<'static>> {
        batch
            .zip(&self.placed)
            .map(|(t, &at)| Chunk {
                tensor: t,
                offset: 0,
                len: self.sizes[t],
                // In place the bytes are where the applier said; the source
                // is only accounted for, never read.
                src: match self.bounce {
                    Some(b) => b.source(at),
                    None => CopySource::Memory(SendPtr(at as *mut u8)),
                },
            })
            .collect()
    }
}

impl Landing for MemberLanding<'_, '_, '_> {
    fn place(&mut self, batch: Range<usize>) -> Result<Vec<u64>> {
        self.placed = match self.bounce {
            Some(b) => {
                let sizes = self.sizes[batch].iter().map(|&n| n as u64);
                let (offsets, n) = aligned_offsets(sizes)
                    .ok_or_else(|| Error::out_of_memory("a fan-out batch is too large"))?;
                let room = match b {
                    Bounce::Device(d) => d.len(),
                    Bounce::Host(h) => h.len(),
                };
                if n > room {
                    return Err(Error::state(format!(
                        "a fan-out batch of {n} bytes does not fit the {room}-byte landing buffer (internal)"
                    )));
                }
                offsets.iter().map(|&o| b.base() + o as u64).collect()
            }
            None => batch.map(|t| self.in_one_piece(t)).collect::<Result<_>>()?,
        };
        Ok(self.placed.clone())
    }

    fn moved(&mut self, batch: Range<usize>) -> Result<()> {
        let chunks = self.chunks(batch);
        match self.bounce {
            Some(_) => self.applier.apply_batch(self.origin, &chunks),
            None => self.applier.account_landed(self.origin, &chunks),
        }
    }
}
