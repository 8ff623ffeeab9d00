//! Library buffers for tensors that cannot land where they end up: tensors
//! for the engine's per-tensor callback (in place), and device params'
//! bytes on their way up when no pinned buffer is free.
//!
//! Trust: a tensor's size comes from the peer's manifest. A device param's
//! size was checked by the plan against the registered param, so the engine
//! already agreed to hold that much. A callback tensor has no param behind
//! it: its bytes are bounded by the engine's `callback_staging_limit`
//! instead, checked before anything is allocated (see
//! [`check_callback_staging`] for the whole plan and
//! [`LooseBuffers::buffer_for`] for the buffers held at once). Every
//! allocation is fallible: memory that cannot be had is
//! `WM_ERR_OUT_OF_MEMORY`, never an abort.

use crate::result::{Error, Result};
use std::collections::HashMap;

/// What the engine changes to raise the bound, named in errors.
const RAISE: &str = "raise wm_memory_config.callback_staging_limit (Python: \
     Manager(callback_staging_limit=...)) if tensors this large are expected";

/// Check, before any byte of the update is allocated, that its callback
/// tensors (name, bytes) fit `limit`: all of them together when they are
/// staged at once (atomic mode), each one alone otherwise (in place).
pub fn check_callback_staging<'a>(
    tensors: impl Iterator<Item = (&'a str, u64)>,
    all_at_once: bool,
    limit: u64,
) -> Result<()> {
    let mut total = 0u64;
    let mut largest: Option<(&str, u64)> = None;
    for (name, n) in tensors {
        if !all_at_once && n > limit {
            return Err(Error::out_of_memory(format!(
                "tensor '{name}' for the per-tensor callback is {n} bytes, over the \
                 callback_staging_limit of {limit} bytes; {RAISE}"
            )));
        }
        total = total.saturating_add(n);
        if largest.is_none_or(|(_, m)| n > m) {
            largest = Some((name, n));
        }
    }
    match largest {
        Some((name, n)) if all_at_once && total > limit => Err(Error::out_of_memory(format!(
            "atomic mode stages every tensor for the per-tensor callback: {total} bytes \
             (largest: tensor '{name}', {n} bytes), over the callback_staging_limit of \
             {limit} bytes; {RAISE}, or update in place"
        ))),
        _ => Ok(()),
    }
}

/// One tensor's buffer, and the bytes it counts against the limit.
struct Loose {
    buf: Vec<u8>,
    counted: u64,
}

/// Buffers of tensors being received, by plan entry.
pub struct LooseBuffers {
    held: HashMap<usize, Loose>,
    /// A delivered buffer kept for the next tensor: fresh large allocations
    /// cost a page fault per page every time.
    spare: Option<Vec<u8>>,
    /// Bytes of bounded (callback) buffers held now.
    bounded: u64,
    limit: u64,
}

impl LooseBuffers {
    /// `limit`: the most bytes of callback tensors held at once.
    pub fn new(limit: u64) -> LooseBuffers {
        LooseBuffers {
            held: HashMap::new(),
            spare: None,
            bounded: 0,
            limit,
        }
    }

    pub fn contains(&self, t: usize) -> bool {
        self.held.contains_key(&t)
    }

    /// Where entry `t`'s `n` bytes land, allocating its buffer on first use
    /// (the spare if it is large enough). `bounded`: a callback tensor,
    /// refused if the callback tensors held would pass the limit.
    pub fn buffer_for(&mut self, t: usize, name: &str, n: usize, bounded: bool) -> Result<*mut u8> {
        if let Some(l) = self.held.get_mut(&t) {
            return Ok(l.buf.as_mut_ptr());
        }
        let bytes = n as u64;
        if bounded && self.bounded.saturating_add(bytes) > self.limit {
            return Err(Error::out_of_memory(format!(
                "tensor '{name}' for the per-tensor callback needs {n} bytes of staging while \
                 {} bytes of other callback tensors are held, over the callback_staging_limit \
                 of {} bytes; {RAISE}",
                self.bounded, self.limit
            )));
        }
        let buf = match self.spare.take() {
            Some(mut v) if v.capacity() >= n => {
                v.clear();
                v
            }
            // A spare too small is freed before the new buffer is had.
            _ => {
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(|e| {
                    Error::out_of_memory(format!(
                        "tensor '{name}': allocating {n} bytes to receive it: {e}"
                    ))
                })?;
                v
            }
        };
        let counted = if bounded { bytes } else { 0 };
        self.bounded += counted;
        let l = self.held.entry(t).or_insert(Loose { buf, counted });
        Ok(l.buf.as_mut_ptr())
    }

    /// Mark entry `t`'s buffer as holding its `n` bytes, all written.
    ///
    /// # Safety
    /// Every byte up to `n` of the buffer was written, and `n` is the size
    /// it was allocated for.
    pub unsafe fn filled(&mut self, t: usize, n: usize) {
        if let Some(l) = self.held.get_mut(&t) {
            l.buf.set_len(n);
        }
    }

    /// Take entry `t`'s buffer out (empty if it had none); hand it back
    /// with [`LooseBuffers::recycle`] once its bytes are used.
    pub fn take(&mut self, t: usize) -> Vec<u8> {
        match self.held.remove(&t) {
            Some(l) => {
                self.bounded -= l.counted;
                l.buf
            }
            None => Vec::new(),
        }
    }

    /// Keep `buf` as the spare if it is larger than the one kept.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        if self
            .spare
            .as_ref()
            .is_none_or(|s| s.capacity() < buf.capacity())
        {
            self.spare = Some(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::wm_result::WM_ERR_OUT_OF_MEMORY;

    #[test]
    fn callback_tensors_are_checked_one_by_one_or_together() {
        let ts = [("a", 600u64), ("b", 700)];
        check_callback_staging(ts.into_iter(), false, 1000).unwrap();
        let e = check_callback_staging(ts.into_iter(), true, 1000).unwrap_err();
        assert_eq!(e.code, WM_ERR_OUT_OF_MEMORY);
        assert!(e.message.contains("1300 bytes") && e.message.contains("tensor 'b'"));
        assert!(
            e.message.contains("callback_staging_limit of 1000 bytes"),
            "{e}"
        );
        let huge = [("huge", 1u64 << 40)];
        let e = check_callback_staging(huge.into_iter(), false, 1000).unwrap_err();
        assert!(e.message.contains("tensor 'huge'") && e.message.contains("1099511627776"));
        check_callback_staging(std::iter::empty(), true, 0).unwrap();
    }

    #[test]
    fn callback_buffers_held_at_once_stay_within_the_limit() {
        let mut l = LooseBuffers::new(1000);
        l.buffer_for(0, "a", 600, true).unwrap();
        // Device params' buffers do not count: the plan bounded them.
        l.buffer_for(5, "dev", 5000, false).unwrap();
        let e = l.buffer_for(1, "b", 500, true).unwrap_err();
        assert_eq!(e.code, WM_ERR_OUT_OF_MEMORY);
        assert!(
            e.message.contains("tensor 'b'") && e.message.contains("600 bytes"),
            "{e}"
        );
        // Once 'a' is delivered, 'b' fits, in a's buffer.
        let a = l.take(0);
        let at = a.as_ptr();
        l.recycle(a);
        assert_eq!(l.buffer_for(1, "b", 500, true).unwrap().cast_const(), at);
        assert_eq!(l.bounded, 500);
    }

    #[test]
    fn an_allocation_that_cannot_be_had_is_an_error() {
        let mut l = LooseBuffers::new(u64::MAX);
        let e = l.buffer_for(0, "huge", usize::MAX / 2, true).unwrap_err();
        assert_eq!(e.code, WM_ERR_OUT_OF_MEMORY);
        assert!(e.message.contains("tensor 'huge'"), "{e}");
    }
}
