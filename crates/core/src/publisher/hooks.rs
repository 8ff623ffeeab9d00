//! Test hooks, compiled into test builds only: `cfg(test)`, or the
//! `test-hooks` feature, which the integration tests turn on through the
//! crate's dev-dependency on itself. A product build (`cargo build`) has no
//! `PublisherConfig::corrupt_tensor` at all, and [`corrupt_victim`] is
//! always None there, so the zero-copy paths are always taken.

use super::config::PublisherConfig;
use crate::manifest::Manifest;
use crate::wire::{BucketEntry, Request};

/// The tensor whose first byte sessions flip after packing it (the
/// `corrupt_tensor` test hook); None in a product build.
pub(super) fn corrupt_victim(cfg: &PublisherConfig) -> Option<&str> {
    #[cfg(any(test, feature = "test-hooks"))]
    return cfg.corrupt_tensor.as_deref();
    #[cfg(not(any(test, feature = "test-hooks")))]
    {
        let _ = cfg;
        None
    }
}

/// Flip the lowest bit of the first byte each request of tensor `victim`
/// gets, in this bucket (packed at `base`), after it was hashed (it stands
/// for bytes corrupted on the way); nothing without a victim.
pub(super) fn corrupt(
    manifest: &Manifest,
    requests: &[Request],
    entries: &[BucketEntry],
    base: *mut u8,
    victim: Option<&str>,
) {
    let Some(victim) = victim else { return };
    for e in entries {
        let tensor = requests[e.request as usize].tensor as usize;
        // An image of the session's (`Shard::add_image`) is no manifest
        // tensor: never a victim.
        let named = manifest
            .tensors
            .get(tensor)
            .is_some_and(|t| t.name == victim);
        if named && e.offset == 0 && e.len > 0 {
            // SAFETY: inside the entry's range in our own buffer.
            unsafe { *base.add(e.buffer_offset as usize) ^= 1 };
        }
    }
}
