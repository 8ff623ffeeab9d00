//! The publisher's bucket buffers: shared memory a session packs buckets
//! into, pooled between sessions (fresh shared memory costs a page fault
//! per page, and sequential updates of an RL run reuse the same buffers).

use crate::memory::pool::Pool;
use crate::memory::shared::SharedBuffer;
use crate::result::Result;

/// The publisher's bucket buffers, kept between sessions.
pub(super) type BufferPool = Pool<SharedBuffer>;

/// `n` bucket buffers of at least `len` bytes, pooled ones first.
pub(super) fn take_buffers(pool: &BufferPool, n: usize, len: usize) -> Result<Vec<SharedBuffer>> {
    pool.take(n, len, |i| {
        SharedBuffer::create(&format!("bucket buffer {i}"), len)
    })
}
