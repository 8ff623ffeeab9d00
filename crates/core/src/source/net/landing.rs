//! Where a network session's messages land, this side's decision alone,
//! from its own plan: in the bucket's staging slot at the entry's buffer
//! offset (staged); or (direct) straight where the applier wants the bytes:
//! in one piece, or scattered by UCX into the pieces where a message's
//! blocks (several small blocks of a strided request, packed into one
//! message) lie, when those are large enough to be worth it
//! (`wire::max_scatter_parts`); else back to back in a bounce buffer, from which the
//! applier scatters them as from a staging slot.

use super::SLOTS;
use crate::apply::Applier;
use crate::checksum::KEYED;
use crate::memory::copy::CopySource;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::result::Result;
use crate::source::publisher_link::PublisherLink;
use crate::transport::ucx::{Pump, ScatterList};
use crate::wire::message_tag as net_tag;
use crate::wire::{max_scatter_parts, BucketEntry};

/// Host memory per bucket in flight (bucket `seq` uses `seq % depth`):
/// staged receives' slots, and direct receives' bounce buffers. Taken when
/// a bucket first needs one, from the staging slots' pool, and grown as
/// buckets need: a 1 MiB update takes about 1 MiB a slot, not the bucket
/// size (512 MiB by default, populated page by page: an update of any size
/// used to cost `depth` whole buckets of memory, and the largest settings
/// more than the machine had). A bucket's messages lie inside the engine's
/// bucket size without overlapping, so none needs more.
pub(super) struct Bounce {
    /// What it is, in errors ("network staging slot").
    what: &'static str,
    regions: Vec<Option<HostRegion>>,
    bucket_size: u64,
}

impl Bounce {
    pub(super) fn new(what: &'static str, depth: usize, bucket_size: u64) -> Bounce {
        Bounce {
            what,
            regions: (0..depth).map(|_| None).collect(),
            bucket_size,
        }
    }

    /// At least `need` bytes (at most the bucket size) for bucket `seq`
    /// (its earlier user, bucket `seq - depth`, is acknowledged: nothing is
    /// received there any more).
    pub(super) fn take(&mut self, seq: u64, need: u64) -> Result<*mut u8> {
        let i = seq as usize % self.regions.len();
        if self.regions[i]
            .as_ref()
            .is_none_or(|r| (r.len() as u64) < need)
        {
            // Grown in steps, so a few sizes serve every bucket.
            let step = need.next_power_of_two().max(1 << 16);
            let size = step.min(self.bucket_size).max(need) as usize;
            let threads = crate::memory::copy::default_threads();
            let what = self.what;
            let fresh = SLOTS.take(1, size, |_| HostRegion::staging(what, size, threads))?;
            let old = std::mem::replace(&mut self.regions[i], fresh.into_iter().next());
            SLOTS.give_back(old.into_iter().collect());
        }
        Ok(self.regions[i].as_ref().expect("taken").ptr())
    }
}

impl Drop for Bounce {
    /// Back to the pool; the receiver dropped its pump first, cancelling
    /// every receive into them.
    fn drop(&mut self) {
        SLOTS.give_back(self.regions.iter_mut().filter_map(Option::take).collect());
    }
}

/// Entry `k` of `bucket` landed: hand it to the applier, from its staging
/// slot or bounce buffer, or (where the applier wanted it) from where it
/// already is.
pub(super) fn apply_landed(
    applier: &mut Applier,
    link: &PublisherLink,
    bucket: &Posted,
    k: usize,
) -> Result<()> {
    let e = &bucket.entries[k];
    let origin = format!("bucket {}", bucket.seq);
    match &bucket.landing[k] {
        Landing::Staged(at) => {
            applier.apply_batch(&origin, &[link.chunk(e, CopySource::Memory(*at))])
        }
        Landing::Applier(_) => {
            let nowhere = CopySource::Memory(SendPtr(std::ptr::null_mut()));
            applier.account_landed(&origin, &[link.chunk(e, nowhere)])
        }
    }
}

/// Where a message is received.
pub(super) enum Landing {
    /// Where the applier wants its bytes, in one piece or several:
    /// accounted for once landed.
    Applier(ScatterList),
    /// In a staging slot or bounce buffer: copied on (scattered) once landed.
    Staged(SendPtr),
}

impl Landing {
    /// The pieces the message's `len` bytes landed in, in order.
    pub(super) fn scatter_list(&self, len: usize) -> ScatterList {
        match self {
            Landing::Applier(pieces) => pieces.clone(),
            Landing::Staged(at) => vec![(*at, len)],
        }
    }
}

/// A bucket whose receives are posted.
pub(super) struct Posted {
    pub seq: u64,
    pub entries: Vec<BucketEntry>,
    /// Where each entry lands.
    pub landing: Vec<Landing>,
    /// Each entry's keyed digest (empty: not asked for).
    pub digests: Vec<[u8; KEYED]>,
}

/// Where a bucket's messages may land: its staging slot (staged), or the
/// bounce buffers (direct).
pub(super) struct Landings<'a> {
    pub slot: Option<*mut u8>,
    pub bounce: &'a mut Bounce,
}

/// Post one receive per entry of bucket `seq`: at the entry's offset in its
/// staging slot, or (direct) where the applier wants the bytes when they
/// lie there in one piece or in pieces worth scattering into, else back to
/// back in the bucket's bounce buffer.
pub(super) fn post(
    pump: &Pump,
    link: &PublisherLink,
    seq: u64,
    entries: Vec<BucketEntry>,
    to: Landings,
    applier: &mut Applier,
) -> Result<Posted> {
    let mut landing = Vec::with_capacity(entries.len());
    // Bytes of the messages that go to the bounce buffer (None: none do).
    let mut bounced: Option<u64> = None;
    for e in &entries {
        landing.push(match to.slot {
            Some(slot) => Landing::Staged(SendPtr(slot.wrapping_add(e.buffer_offset as usize))),
            None => {
                let (t, most) = (link.entry(e), max_scatter_parts(e.len));
                match applier.receive_scatter(t, e.offset, e.len as usize, most)? {
                    Some(pieces) => Landing::Applier(pieces),
                    None => {
                        // Placed below, once the bounce buffer's size is known.
                        bounced = Some(bounced.unwrap_or(0) + e.len);
                        Landing::Staged(SendPtr(std::ptr::null_mut()))
                    }
                }
            }
        });
    }
    if let Some(bytes) = bounced {
        // At most the bucket size: the entries were checked against it.
        let base = to.bounce.take(seq, bytes)?;
        let mut at = 0u64;
        for (l, e) in landing.iter_mut().zip(&entries) {
            if let Landing::Staged(p) = l {
                *p = SendPtr(base.wrapping_add(at as usize));
                at += e.len;
            }
        }
    }
    for (k, (e, l)) in entries.iter().zip(&landing).enumerate() {
        // SAFETY: the ranges are inside the slot (entries checked against
        // the bucket size), the bounce buffer (sized for the bucket's
        // bounced messages) or the entry's memory (checked by the applier).
        // The pump is dropped, cancelling any receive, before that memory
        // goes; a slot or bounce buffer is reposted only after its bucket
        // was applied (the publisher waits for the ACK).
        unsafe { pump.recv_scatter(net_tag(seq, k), l.scatter_list(e.len as usize))? };
    }
    Ok(Posted {
        seq,
        entries,
        landing,
        digests: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bounce buffer is at least what a bucket needs, grows in steps,
    /// and never beyond the bucket size for a need within it (even a bucket
    /// size below the first step).
    #[test]
    fn bounce_buffers_grow_within_the_bucket_size() {
        for (bucket, needs) in [(4096u64, [100u64, 4096]), (1 << 20, [70_000, 300_000])] {
            let mut b = Bounce::new("network bounce buffer", 2, bucket);
            for (seq, need) in needs.into_iter().enumerate() {
                b.take(seq as u64, need).unwrap();
                let len = b.regions[seq % 2].as_ref().unwrap().len() as u64;
                assert!(len >= need && len <= bucket.max(1 << 16), "{bucket}: {len}");
            }
            let again = b.take(2, needs[0]).unwrap();
            assert_eq!(
                again,
                b.regions[0].as_ref().unwrap().ptr(),
                "kept for the next bucket"
            );
        }
    }
}
