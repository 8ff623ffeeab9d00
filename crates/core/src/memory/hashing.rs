//! Hashing on the copy threads: copies that hash what they move, a chunk
//! at a time while it is in cache ([`copy_hashing`]), and regions hashed
//! on several threads, a region per thread (each sum is a stream).

use super::copy::{copy_plain, copy_streaming, PACK_STREAM_MIN, PARALLEL_MIN};
use super::SendPtr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes copied then hashed at a time by [`copy_hashing`]: well inside
/// L2, so the hash reads what the copy just brought into cache.
const HASH_CHUNK: usize = 256 << 10;

/// Which bytes [`copy_hashing`] feeds its hash.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hashed {
    /// The source, as the copy read it (left in cache by its reads); the
    /// copy streams its stores. For a publisher: the engine checks what
    /// it packed.
    Source,
    /// The destination, as the copy wrote it (plain stores, so the chunk
    /// is in cache when hashed): what landed is what is checked, a fault
    /// in the copy or a source changed under it included. For an engine.
    Destination,
}

/// Copy `len` bytes and feed them (the source's or the destination's,
/// `which`) to `sum`, in order, a chunk at a time: each chunk is hashed
/// right after it is copied, while it is in cache, where a copy and then a
/// hash read every byte twice from memory (one core here, 1 GiB: 12.3 GB/s
/// hashing the source against 9.6 copying then hashing; hashing the
/// destination, 9.5-9.7, saves the second read but the plain stores read
/// every line they write first). Hashing the source, stores stream from
/// [`PACK_STREAM_MIN`].
///
/// # Safety
/// `src..src+len` readable and unchanged, `dst..dst+len` writable, not
/// overlapping.
pub unsafe fn copy_hashing(
    dst: *mut u8,
    src: *const u8,
    len: usize,
    sum: &mut crate::checksum::Checksum,
    which: Hashed,
) {
    let stream = which == Hashed::Source && len >= PACK_STREAM_MIN;
    for at in (0..len).step_by(HASH_CHUNK) {
        let n = HASH_CHUNK.min(len - at);
        // SAFETY: inside the caller's ranges.
        unsafe {
            let (to, from) = (dst.add(at), src.add(at));
            match stream {
                true => copy_streaming(to, from, n),
                false => copy_plain(to, from, n),
            }
            let hashed = match which {
                Hashed::Source => from,
                Hashed::Destination => to.cast_const(),
            };
            sum.update(std::slice::from_raw_parts(hashed, n));
        }
    }
}

/// Copy each `(src, dst, len)` and return the xxh3-128 of each source, in
/// one pass ([`copy_hashing`]). Copies go to up to `threads` threads whole (a
/// hash is a stream): callers use it when there are several copies per
/// thread, so the threads stay busy.
///
/// # Safety
/// Every source readable and unchanged, every destination writable and
/// overlapping nothing else, until this returns.
pub unsafe fn copy_and_hash_all(copies: &[(SendPtr, SendPtr, usize)], threads: usize) -> Vec<u128> {
    let one = |&(src, dst, len): &(SendPtr, SendPtr, usize)| {
        let mut sum = crate::checksum::Checksum::default();
        // SAFETY: the caller's promise.
        unsafe { copy_hashing(dst.0, src.0, len, &mut sum, Hashed::Source) };
        sum.digest()
    };
    each(copies, threads, one)
}

/// `one` of every item, the items handed out whole to up to `threads`
/// threads from a shared counter (a sum is a stream: one thread each).
pub(crate) fn each<T: Sync, R: Default + Send>(
    items: &[T],
    threads: usize,
    one: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let slots: Vec<parking_lot::Mutex<R>> = items.iter().map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        let work = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            *slots[i].lock() = one(item);
        };
        for _ in 1..threads.clamp(1, items.len().max(1)) {
            s.spawn(work);
        }
        work();
    });
    slots.into_iter().map(|s| s.into_inner()).collect()
}

/// xxh3-128 of each `(ptr, len)` region, computed on up to `threads` threads.
///
/// # Safety
/// Every region must be readable and unchanged until this returns.
pub unsafe fn hash_all(regions: &[(SendPtr, usize)], threads: usize) -> Vec<u128> {
    let total: usize = regions.iter().map(|r| r.1).sum();
    let one = |(ptr, len): &(SendPtr, usize)| {
        crate::checksum::of(std::slice::from_raw_parts(ptr.0, *len))
    };
    if threads <= 1 || regions.len() < 2 || total < PARALLEL_MIN {
        return regions.iter().map(one).collect();
    }
    each(regions, threads, one)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copied and hashed in one pass, hashing the source or the
    /// destination, a copy of any offsets and length (under a page: plain;
    /// from a page up streamed when hashing the source; across several
    /// hash chunks and a tail) lands exactly and hashes to its bytes'
    /// checksum, also continuing a running hash; `copy_and_hash_all` the
    /// same.
    #[test]
    fn copy_hashing_lands_and_hashes_every_byte_once() {
        let src: Vec<u8> = (0..(3 << 20) + 77).map(|i| (i * 29 % 251) as u8).collect();
        for (s_off, d_off, len) in [
            (0, 0, 0),
            (3, 1, 100),
            (0, 16, PACK_STREAM_MIN - 1),
            (7, 5, PACK_STREAM_MIN),
            (64, 3, 3 * HASH_CHUNK + 17),
            (5, 0, (3 << 20) + 9),
        ] {
            for which in [Hashed::Source, Hashed::Destination] {
                let mut dst = vec![0u8; len + 64];
                let mut sum = crate::checksum::Checksum::default();
                sum.update(b"before");
                let to = unsafe { dst.as_mut_ptr().add(d_off) };
                unsafe { copy_hashing(to, src.as_ptr().add(s_off), len, &mut sum, which) };
                let bytes = &src[s_off..s_off + len];
                assert_eq!(&dst[d_off..d_off + len], bytes, "{s_off} {d_off} {len}");
                let outside = dst[..d_off].iter().chain(&dst[d_off + len..]);
                assert!(outside.copied().all(|b| b == 0));
                let whole = [&b"before"[..], bytes].concat();
                assert_eq!(sum.digest(), crate::checksum::of(&whole), "{len}");
            }
        }
        let mut dsts: Vec<Vec<u8>> = (1..6).map(|i| vec![0u8; i * 300_000]).collect();
        let copies: Vec<_> = (dsts.iter_mut())
            .map(|d| {
                (
                    SendPtr(src.as_ptr().cast_mut()),
                    SendPtr(d.as_mut_ptr()),
                    d.len(),
                )
            })
            .collect();
        let sums = unsafe { copy_and_hash_all(&copies, 2) };
        for (d, sum) in dsts.iter().zip(sums) {
            assert_eq!(&d[..], &src[..d.len()]);
            assert_eq!(sum, crate::checksum::of(d));
        }
    }

    #[test]
    fn hashes_match_serial() {
        let bufs: Vec<Vec<u8>> = (0..5).map(|i| vec![i as u8; (i + 1) << 20]).collect();
        let regions: Vec<_> = bufs
            .iter()
            .map(|b| (SendPtr(b.as_ptr() as *mut u8), b.len()))
            .collect();
        let got = unsafe { hash_all(&regions, 2) };
        for (g, b) in got.iter().zip(&bufs) {
            assert_eq!(*g, crate::checksum::of(b));
        }
    }
}
