//! What the publisher keeps between sessions: the bucket buffers (shared
//! memory a session packs buckets into) and the memory of FP8 images
//! (`quantize.rs`). Fresh memory costs a page fault per page (zeroing it
//! took about as long as quantizing into it), and the sequential updates
//! of an RL run ask for the same sizes again.

use crate::memory::host::HostRegion;
use crate::memory::pool::Pool;
use crate::memory::shared::SharedBuffer;
use crate::result::Result;
use std::sync::Arc;

/// The publisher's bucket buffers, kept between sessions.
pub(super) type BufferPool = Pool<SharedBuffer>;

/// Everything the publisher keeps between sessions.
#[derive(Default)]
pub(super) struct Pools {
    pub buffers: BufferPool,
    pub images: ImagePool,
}

/// `n` bucket buffers of at least `len` bytes, pooled ones first.
pub(super) fn take_buffers(pool: &BufferPool, n: usize, len: usize) -> Result<Vec<SharedBuffer>> {
    pool.take(n, len, |i| {
        SharedBuffer::create(&format!("bucket buffer {i}"), len)
    })
}

/// The memory of finished sessions' FP8 images, by length.
#[derive(Default)]
pub(super) struct ImagePool(Pool<HostRegion>);

impl ImagePool {
    /// Memory for an image of `len` bytes: a pooled region of that length,
    /// else a new one (its contents are whatever they were: an image is
    /// written whole).
    pub(super) fn take(&self, len: usize) -> Result<HostRegion> {
        self.0.take_exact(len, || {
            let region = HostRegion::new("a quantized request's image", len)?;
            // Huge pages: a 4 KiB page fault each took about as long as
            // quantizing its bytes.
            region.advise_huge(true);
            Ok(region)
        })
    }

    /// Keep a finished session's `images` that nothing else holds (an
    /// image the version keeps is not), newest first, up to `bound` bytes
    /// in all.
    pub(super) fn give_back(&self, images: Vec<Arc<HostRegion>>, bound: u64) {
        let free = images.into_iter().filter_map(|i| Arc::try_unwrap(i).ok());
        self.0.give_back_bounded(free.collect(), bound);
    }

    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.0.held_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_come_back_at_their_length_unless_kept_elsewhere() {
        let pool = ImagePool::default();
        let a = Arc::new(pool.take(4096).unwrap());
        let b = Arc::new(pool.take(8192).unwrap());
        let held = b.clone();
        let at = a.ptr();
        pool.give_back(vec![a, b], 1 << 20);
        assert_eq!(pool.bytes(), 4096, "the image held elsewhere is not pooled");
        assert_eq!(pool.take(4096).unwrap().ptr(), at, "the same memory again");
        assert_ne!(pool.take(8192).unwrap().ptr(), held.ptr());
    }

    #[test]
    fn the_pool_keeps_at_most_its_bound() {
        let pool = ImagePool::default();
        let images = (0..4).map(|_| Arc::new(pool.take(4096).unwrap())).collect();
        pool.give_back(images, 3 * 4096 + 100);
        assert_eq!(pool.bytes(), 3 * 4096);
        pool.give_back(Vec::new(), 0);
        assert_eq!(pool.bytes(), 0);
    }
}
