//! Moving the announced tensors from the root to the members, batch by
//! batch: the same loop on every rank, with what moves the bytes (NCCL in
//! a session, [`Mover`]) apart from where they are on this rank
//! ([`Landing`]: the root's params, or the member's applier).

use crate::memory::aligned_offsets;
use crate::memory::device::DeviceAllocation;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Consecutive runs of `sizes` holding at most `limit` bytes each (a
/// larger tensor is a batch of its own): the broadcasts waited for together.
pub fn batches(sizes: &[usize], limit: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && bytes + n > limit {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// What moves a broadcast's bytes between the ranks.
pub trait Mover {
    /// Queue the broadcast of `len` bytes at `at` from the root (its bytes)
    /// to every other rank (written there); bounded by `deadline`.
    ///
    /// # Safety
    /// `at..at + len` is memory this mover can reach that nothing else
    /// touches until [`Mover::wait`] returns.
    unsafe fn broadcast(&mut self, at: u64, len: usize, deadline: Instant) -> Result<()>;
    /// Wait until every queued broadcast finished, at most until `deadline`.
    fn wait(&mut self, deadline: Instant) -> Result<()>;
    /// Stop for good, so that no rank waits for bytes this one no longer
    /// moves.
    fn abort(&mut self);
}

/// Where a batch of broadcast tensors is on this rank.
pub trait Landing {
    /// Each tensor of `batch`: where it is sent from (the root) or lands (a
    /// member), asked right before its broadcasts are queued. The memory
    /// must stay valid until [`Landing::moved`] is called for the batch.
    fn place(&mut self, batch: Range<usize>) -> Result<Vec<u64>>;
    /// Every byte of `batch` moved.
    fn moved(&mut self, batch: Range<usize>) -> Result<()>;
}

/// The root's side: it sends every tensor from its param (at `self.0[t]`).
pub struct FromParams<'a>(pub &'a [u64]);

impl Landing for FromParams<'_> {
    fn place(&mut self, batch: Range<usize>) -> Result<Vec<u64>> {
        Ok(self.0[batch].to_vec())
    }

    fn moved(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }
}

/// The root of a staged update: it sends every tensor from its staging
/// (host memory, `staged[t]`, `sizes[t]` bytes), which NCCL cannot read:
/// each batch is uploaded into `bounce` on the root's GPU first (sized by
/// [`crate::fanout::Bounce::size_for`] with the broadcast's limit).
pub struct FromStaged<'a> {
    pub staged: &'a [SendPtr],
    pub sizes: &'a [usize],
    pub bounce: &'a DeviceAllocation,
}

impl Landing for FromStaged<'_> {
    fn place(&mut self, batch: Range<usize>) -> Result<Vec<u64>> {
        let sizes = self.sizes[batch.clone()].iter().map(|&n| n as u64);
        let (offsets, n) = aligned_offsets(sizes)
            .ok_or_else(|| Error::out_of_memory("a fan-out batch is too large"))?;
        if n > self.bounce.len() {
            return Err(Error::state(format!(
                "a fan-out batch of {n} bytes does not fit the {}-byte bounce buffer (internal)",
                self.bounce.len()
            )));
        }
        let mut at = Vec::with_capacity(offsets.len());
        for (t, o) in batch.zip(offsets) {
            let dst = self.bounce.ptr() + o as u64;
            // SAFETY: the staging holds `sizes[t]` bytes at `staged[t]`
            // (every byte received, nothing writes it until the commit);
            // `dst` lies in the bounce buffer (checked just above), which
            // no broadcast reads until this batch is queued.
            unsafe {
                crate::memory::cuda_ipc::upload(
                    self.bounce.ordinal(),
                    dst,
                    self.staged[t].0,
                    self.sizes[t],
                )?;
            }
            at.push(dst);
        }
        // A copy from pageable memory may return before its DMA ended, and
        // the broadcast's stream does not wait for the default one: the
        // members must not get a batch's stale tail.
        // SAFETY: a driver call on the current context (the uploads made
        // the bounce buffer's GPU current).
        let synced = unsafe { cudarc::driver::sys::cuStreamSynchronize(std::ptr::null_mut()) };
        crate::memory::cuda::check(
            synced,
            "cuStreamSynchronize(the fan-out root's staged batch)",
        )?;
        Ok(at)
    }

    fn moved(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }
}

/// Broadcast tensors of `sizes` from the root, in `batches` of at most
/// `limit` bytes, each batch bounded by `batch_timeout`. A failure aborts
/// the mover, so the other ranks stop too instead of waiting; except a
/// rank's own failure to take the last batch (its progress callback
/// cancelling, say): every broadcast has completed on every rank by then,
/// so the communicator stays in step and the rank says why in the final
/// vote ([`super::FanoutSession::took`]), which the root hears.
pub fn move_batches(
    sizes: &[usize],
    limit: usize,
    batch_timeout: Duration,
    mover: &mut dyn Mover,
    landing: &mut dyn Landing,
) -> Result<()> {
    let all = batches(sizes, limit);
    for (k, batch) in all.iter().enumerate() {
        let deadline = Instant::now() + batch_timeout;
        let moved = (|| {
            let at = landing.place(batch.clone())?;
            for (&at, &len) in at.iter().zip(&sizes[batch.clone()]) {
                // SAFETY: the landing hands memory of this rank that
                // nothing else uses until the batch moved.
                unsafe { mover.broadcast(at, len, deadline)? };
            }
            mover.wait(deadline)
        })();
        if let Err(e) = moved {
            mover.abort();
            return Err(e);
        }
        if let Err(e) = landing.moved(batch.clone()) {
            if k + 1 < all.len() {
                mover.abort();
            }
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_hold_at_most_the_limit_and_big_tensors_alone() {
        assert_eq!(batches(&[4, 4, 4, 4], 8), vec![0..2, 2..4]);
        assert_eq!(batches(&[10, 2, 3], 8), vec![0..1, 1..3]);
        assert_eq!(batches(&[2, 10, 2], 8), vec![0..1, 1..2, 2..3]);
        assert!(batches(&[], 8).is_empty());
    }
}
