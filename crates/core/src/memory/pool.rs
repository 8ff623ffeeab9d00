//! Buffers kept between sessions: fresh memory costs a page fault per page
//! (and, in a VM, more), so the sequential updates of an RL run reuse what
//! the previous one had. Used for the publisher's bucket buffers and FP8
//! images, and the engine's network staging slots.

use crate::result::Result;
use parking_lot::Mutex;

/// Anything a pool can hold: it knows its size.
pub trait Buffer {
    fn capacity(&self) -> usize;
}

impl Buffer for super::shared::SharedBuffer {
    fn capacity(&self) -> usize {
        self.len()
    }
}

impl Buffer for super::host::HostRegion {
    fn capacity(&self) -> usize {
        self.len()
    }
}

pub struct Pool<T>(Mutex<Vec<T>>);

impl<T: Buffer> Default for Pool<T> {
    fn default() -> Self {
        Pool::new()
    }
}

impl<T: Buffer> Pool<T> {
    pub const fn new() -> Pool<T> {
        Pool(Mutex::new(Vec::new()))
    }

    /// `n` buffers of at least `len` bytes: pooled ones first, then
    /// `create(i)` for the i-th missing one.
    pub fn take(
        &self,
        n: usize,
        len: usize,
        mut create: impl FnMut(usize) -> Result<T>,
    ) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(n);
        {
            let mut free = self.0.lock();
            while out.len() < n {
                match free.iter().position(|b| b.capacity() >= len) {
                    Some(i) => out.push(free.swap_remove(i)),
                    None => break,
                }
            }
        }
        while out.len() < n {
            out.push(create(out.len())?);
        }
        Ok(out)
    }

    pub fn give_back(&self, buffers: Vec<T>) {
        self.0.lock().extend(buffers);
    }

    /// The bytes of the buffers the pool holds.
    #[cfg(test)]
    pub fn held_bytes(&self) -> u64 {
        self.0.lock().iter().map(|b| b.capacity() as u64).sum()
    }

    /// A pooled buffer of exactly `len` bytes, else `create()`.
    pub fn take_exact(&self, len: usize, create: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut free = self.0.lock();
        match free.iter().position(|b| b.capacity() == len) {
            Some(i) => Ok(free.remove(i)),
            None => {
                drop(free);
                create()
            }
        }
    }

    /// [`Pool::give_back`], then free the oldest until the pool holds at
    /// most `bound` bytes.
    pub fn give_back_bounded(&self, buffers: Vec<T>, bound: u64) {
        let mut free = self.0.lock();
        free.extend(buffers);
        let mut total = 0u64;
        let keep = (free.iter().rev())
            .take_while(|b| {
                total += b.capacity() as u64;
                total <= bound
            })
            .count();
        let oldest = free.len() - keep;
        free.drain(..oldest);
    }
}
