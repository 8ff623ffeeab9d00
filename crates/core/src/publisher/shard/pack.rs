//! Packing a shard's bytes into a bucket buffer: copied from memory,
//! a GPU or files, a batch of blocks at a time, hashed as they are packed
//! when the engine asks for slice sums.

use super::{Shard, ShardBytes};
use crate::checkpoint::Checkpoint;
use crate::checksum::Checksum;
use crate::memory::copy::{copy_all, copy_all_streaming, CopyJob, CopySource, PACK_STREAM_MIN};
use crate::memory::hashing::{copy_hashing, Hashed};
use crate::memory::host::HostRegion;
use crate::memory::mapped_file::MappedWindow;
use crate::memory::SendPtr;
use crate::publisher::offer::Published;
use crate::publisher::sums::bytes_at;
use crate::result::{try_vec, Error, Result};
use crate::wire::{BucketEntry, Request, PACK_BELOW};
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

/// Entry `e`'s blocks (of `requests`), its bytes landing back to back
/// from `dst`, walked as they are asked for.
fn blocks<'q>(
    requests: &'q [Request],
    e: &BucketEntry,
    dst: *mut u8,
) -> impl Iterator<Item = Block> + 'q {
    let q = &requests[e.request as usize];
    let (t, first) = (q.tensor as usize, e.offset);
    q.extents(e.offset, e.len).map(move |(src, at, len)| {
        let to = SendPtr(dst.wrapping_add((at - first) as usize));
        (t, src, to, len as usize)
    })
}

/// Copy entry `e`'s bytes (of `requests`, tensors at `tensors` in host
/// memory) to `dst`, back to back, and feed them to `sum` as they are
/// copied (`copy_hashing`: each byte read once; the engine checks the
/// packed bytes): one copy per block of its request's runs, on this
/// thread. Blocks under a page are copied plainly and hashed together
/// from the buffer, a run of them at a time while it is in cache (a
/// request of one-byte rows has a block per byte: a hash call each cost
/// more than the bytes).
///
/// # Safety
/// `dst` holds `e.len` writable bytes; the request lies inside its tensor
/// (checked when WANT came), which the trainer keeps unchanged.
unsafe fn pack_hashing(
    tensors: &[SendPtr],
    requests: &[Request],
    e: &BucketEntry,
    dst: *mut u8,
    sum: &mut Checksum,
) {
    /// Bytes of small blocks hashed at once.
    const SMALL_RUN: usize = 64 << 10;
    // The small blocks copied and not hashed yet: where they start, and
    // their bytes (back to back in the buffer).
    let mut small = (dst, 0usize);
    let hash_small = |small: &mut (*mut u8, usize), sum: &mut Checksum| {
        // SAFETY: those bytes were just packed into the buffer.
        sum.update(unsafe { std::slice::from_raw_parts(small.0, small.1) });
        small.1 = 0;
    };
    for (t, src, to, len) in blocks(requests, e, dst) {
        // SAFETY: the caller's promise.
        let from = unsafe { tensors[t].0.add(src as usize) };
        if len >= PACK_STREAM_MIN {
            hash_small(&mut small, sum);
            // SAFETY: the caller's promise.
            unsafe { copy_hashing(to.0, from, len, sum, Hashed::Source) };
            continue;
        }
        if small.1 == 0 {
            small.0 = to.0;
        }
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(from, to.0, len) };
        small.1 += len;
        if small.1 >= SMALL_RUN {
            hash_small(&mut small, sum);
        }
    }
    hash_small(&mut small, sum);
}

/// Feed entry `e`'s bytes (of `requests`) to `sum`: packed to `at` from
/// `tensors` as they are hashed ([`pack_hashing`]) when given, else read
/// where they already are, at `at` (packed before, or a tensor's own).
///
/// # Safety
/// With `tensors`: as [`pack_hashing`], `at` holding this entry's bytes
/// alone. Without: `at..at + e.len` holds the entry's bytes, unchanged.
pub(in crate::publisher) unsafe fn hash_entry(
    tensors: Option<&[SendPtr]>,
    requests: &[Request],
    e: &BucketEntry,
    at: SendPtr,
    sum: &mut Checksum,
) {
    match tensors {
        // SAFETY: the caller's promise.
        Some(tensors) => unsafe { pack_hashing(tensors, requests, e, at.0, sum) },
        // SAFETY: the caller's promise.
        None => sum.update(unsafe { bytes_at(at, e) }),
    }
}

/// Most blocks copied per batch: a bucket's blocks are walked a batch at
/// a time, never listed whole (a request of one-byte rows listed whole
/// cost the publisher about 80 bytes per byte asked for), while a batch
/// still spreads large blocks over the copy threads.
pub(in crate::publisher) const BLOCK_BATCH: usize = 1 << 16;

/// A block to copy: (tensor, tensor offset, destination, length).
type Block = (usize, u64, SendPtr, usize);

/// Copy the entries' bytes (of `requests`) into the bucket buffer at
/// `base` (which holds every entry's range): one copy per block of a
/// request's runs, a batch of blocks at a time.
pub(in crate::publisher) fn fill(
    shard: &mut Shard,
    requests: &[Request],
    entries: &[BucketEntry],
    base: *mut u8,
    threads: usize,
) -> Result<()> {
    let mut walk = entries
        .iter()
        .flat_map(|e| blocks(requests, e, base.wrapping_add(e.buffer_offset as usize)));
    let mut batch: Vec<Block> = try_vec(BLOCK_BATCH, "packing a bucket's blocks")?;
    loop {
        batch.clear();
        batch.extend(walk.by_ref().take(BLOCK_BATCH));
        if batch.is_empty() {
            return Ok(());
        }
        let first_image = shard.manifest.tensors.len();
        if let Some(Published::Device(d)) = &shard.published {
            copy_from_gpu(&shard.bytes, (d.ordinal(), first_image), &batch)?;
            continue;
        }
        copy_batch(
            &mut shard.bytes,
            (&shard.images, first_image),
            &batch,
            threads,
        )?;
    }
}

/// Copy `batch` of a GPU version's shard: its tensors' blocks out of GPU
/// `ordinal` (one synchronous copy each), its images' (tensors from
/// `first_image` on: quantized requests, made in host memory) from the
/// host. Packing happens only for sessions with images: others hand the
/// GPU buffer over and copy nothing here.
fn copy_from_gpu(
    bytes: &ShardBytes,
    (ordinal, first_image): (i32, usize),
    batch: &[Block],
) -> Result<()> {
    let ShardBytes::Memory(ptrs) = bytes else {
        unreachable!("a published version is in memory")
    };
    for &(t, src, dst, len) in batch {
        let from = ptrs[t].0.wrapping_add(src as usize);
        if t >= first_image {
            // SAFETY: an image of this session's, the block inside it; the
            // destination inside the bucket buffer (planned from its size).
            unsafe { std::ptr::copy_nonoverlapping(from, dst.0, len) };
            continue;
        }
        // SAFETY: the block lies in the version's GPU buffer (requests
        // were checked against their tensors when WANT came).
        unsafe { crate::memory::cuda_ipc::download(ordinal, dst.0, from as u64, len) }?;
    }
    Ok(())
}

/// Copy `batch` from where the shard's bytes are, on `threads`.
fn copy_batch(
    bytes: &mut ShardBytes,
    (images, first_image): (&[Arc<HostRegion>], usize),
    batch: &[Block],
    threads: usize,
) -> Result<()> {
    match bytes {
        ShardBytes::Memory(ptrs) => {
            let mut jobs: Vec<CopyJob> = try_vec(batch.len(), "packing a bucket's copies")?;
            jobs.extend(batch.iter().map(|&(t, src, dst, len)| CopyJob {
                src: CopySource::Memory(SendPtr(ptrs[t].0.wrapping_add(src as usize))),
                dst,
                len,
                tag: t,
            }));
            // SAFETY: entries lie inside the buffer (planned from its size) and
            // requests inside their tensors (checked when WANT came); the
            // trainer keeps tensors unchanged. Nothing here reads the
            // bucket again (bytes hashed here come from the tensors or a
            // snapshot's files).
            unsafe { copy_all_streaming(&jobs, threads) }.map_err(|e| e.error)
        }
        ShardBytes::Files { checkpoint, open } => {
            copy_from_files(checkpoint, open, (images, first_image), batch, threads)
        }
    }
}

/// A file one batch reads at least this many blocks of, averaging under
/// [`PACK_BELOW`] bytes, is mapped for the batch: a block is then a copy
/// from the page cache, where it was a `pread` each (2^24 one-byte blocks
/// asked for: 10.9 s of system calls).
const MAP_FROM_BLOCKS: u64 = 64;
/// At most this many files mapped per batch: each holds one of the
/// process's SIGBUS guard slots (`memory::sigbus`), which the engine's
/// shared mappings in the same process need too.
const MAPS_PER_BATCH: usize = 8;

/// [`copy_batch`] from a snapshot's files (and the session's images).
fn copy_from_files(
    checkpoint: &Checkpoint,
    open: &mut HashMap<PathBuf, File>,
    (images, first_image): (&[Arc<HostRegion>], usize),
    batch: &[Block],
    threads: usize,
) -> Result<()> {
    // The files this batch reads (each checked after it, not every file
    // opened so far: that made many files quadratic), with their blocks'
    // count and bytes.
    let mut read: HashMap<usize, (u64, u64)> = HashMap::new();
    for &(t, _, _, len) in batch.iter().filter(|b| b.0 < first_image) {
        let r = read.entry(checkpoint.tensor_file(t).0).or_default();
        *r = (r.0 + 1, r.1 + len as u64);
    }
    for &fi in read.keys() {
        let path = &checkpoint.files[fi].0;
        if !open.contains_key(path) {
            let f = checkpoint.open_data(path)?;
            open.insert(path.to_path_buf(), f);
        }
    }
    let maps: HashMap<usize, MappedWindow> = (read.iter())
        .filter(|(_, &(n, bytes))| n >= MAP_FROM_BLOCKS && bytes / n < PACK_BELOW)
        .filter_map(|(&fi, _)| {
            let (path, stamp) = &checkpoint.files[fi];
            let len = usize::try_from(stamp.len).ok().filter(|&n| n > 0)?;
            Some((fi, MappedWindow::map(&open[path], 0, len)?))
        })
        .take(MAPS_PER_BATCH)
        .collect();
    let mut jobs: Vec<CopyJob> = try_vec(batch.len(), "packing a bucket's copies")?;
    jobs.extend(batch.iter().map(|&(t, src, dst, len)| {
        let at =
            |base: *const u8, offset: u64| SendPtr(base.wrapping_add(offset as usize).cast_mut());
        let src = match t.checked_sub(first_image).map(|i| &images[i]) {
            Some(image) => CopySource::Memory(at(image.ptr(), src)),
            None => {
                let (fi, offset) = checkpoint.tensor_file(t);
                match maps.get(&fi) {
                    Some(w) => CopySource::Memory(at(w.bytes().as_ptr(), offset + src)),
                    None => CopySource::File {
                        file: &open[&checkpoint.files[fi].0],
                        offset: offset + src,
                    },
                }
            }
        };
        CopyJob {
            src,
            dst,
            len,
            tag: t,
        }
    }));
    // SAFETY: entries lie inside the buffer (planned from its size),
    // requests inside their tensors (checked when WANT came) and tensors
    // inside their files' stamped length (checked against it when the
    // headers were read): a mapping of that length holds them, and where
    // the file was cut short since, the mapping reads zeros (the guard),
    // caught below; file reads are bounds-checked by pread.
    unsafe { copy_all(&jobs, threads) }.map_err(|e| e.error)?;
    if let Some(fi) = maps.iter().find(|(_, w)| w.faulted()).map(|(fi, _)| *fi) {
        return Err(Error::format(format!(
            "{} was truncated while it was served",
            checkpoint.files[fi].0.display()
        )));
    }
    // A file rewritten while this batch was read: the batch may hold
    // another version's bytes under this one's name and sums.
    for path in read.keys().map(|&fi| &checkpoint.files[fi].0) {
        checkpoint.check_unchanged(path, &open[path], "while it was served")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::shard_for;
    use super::*;
    use crate::publisher::config::PublisherConfig;
    use crate::publisher::offer::{Content, Offer, ServedTensor};
    use crate::tensor::DType;

    /// An entry of rows of any width (one byte: a block per byte; under a
    /// page, plain and hashed in runs; a page and up, streamed and hashed
    /// from the tensor; a mix of them) packs exactly and hashes to the
    /// checksum of the packed bytes, split over two entries or not.
    #[test]
    fn packing_hashes_exactly_the_packed_bytes() {
        let tensor: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 37 % 253) as u8).collect();
        let tensors = [SendPtr(tensor.as_ptr().cast_mut())];
        let widths: [&[u64]; 4] = [&[1], &[300, 5000], &[8192], &[4096, 100, 70_000, 1]];
        for ws in widths {
            // Rows of the widths in turn, each followed by a gap of 7 bytes.
            let (mut at, mut blocks) = (0u64, Vec::new());
            while at + 80_000 < tensor.len() as u64 && blocks.len() < 60_000 {
                let w = ws[blocks.len() % ws.len()];
                blocks.push((at, w));
                at += w + 7;
            }
            let q = Request::of_blocks(0, blocks.iter().copied(), true);
            let n = q.bytes();
            let want: Vec<u8> = (blocks.iter())
                .flat_map(|&(o, w)| tensor[o as usize..(o + w) as usize].iter().copied())
                .collect();
            for cut in [n, n / 3] {
                let mut buf = vec![0u8; n as usize];
                let mut sum = Checksum::default();
                for (offset, len) in [(0, cut), (cut, n - cut)].into_iter().filter(|p| p.1 > 0) {
                    let e = BucketEntry {
                        request: 0,
                        offset,
                        len,
                        buffer_offset: offset,
                    };
                    let dst = buf[offset as usize..].as_mut_ptr();
                    unsafe { pack_hashing(&tensors, std::slice::from_ref(&q), &e, dst, &mut sum) };
                }
                assert!(buf == want, "{ws:?} cut at {cut}");
                assert_eq!(
                    sum.digest(),
                    crate::checksum::of(&want),
                    "{ws:?} cut at {cut}"
                );
            }
        }
    }

    /// GPU tensors are served only from a published version's buffer: a
    /// live one is refused by name (a session never reads device memory as
    /// host memory).
    #[test]
    fn live_gpu_tensors_are_refused_by_name() {
        let gpu_tensor = ServedTensor {
            name: "layers.0.w".into(),
            dtype: DType::F32,
            shape: vec![4],
            data: SendPtr(0x7000_0000_0000 as *mut u8),
            len: 16,
            rank: None,
            checksum: None,
            device: Some(0),
            placement: None,
        };
        let offer = Offer::new(Some("1".into()), Content::Tensors(vec![gpu_tensor]));
        let e = shard_for(&offer, 0, "0", &PublisherConfig::default())
            .err()
            .expect("refused");
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_INVALID_ARGUMENT);
        assert!(
            e.message.contains("'layers.0.w' is GPU memory") && e.message.contains("published"),
            "{e}"
        );
    }
}
