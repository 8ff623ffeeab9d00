//! Deltas of GPU params, on the GPU: the checksum (XXH3-128, the same
//! digest as `crate::checksum`) of runs of device memory, and a delta's
//! changes written into one, by the kernels of `device.cu` (compiled at
//! run time by NVRTC: `memory::nvrtc`).
//!
//! An engine names the base of a delta by the checksum of the bytes its
//! param holds, and checks the result against the new version's checksum:
//! for a GPU param, reading the bytes back over PCIe for that would cost
//! more than a whole update moves over a fast link, so the GPU hashes
//! them where they are and only 64 bytes a run come back. The delta
//! itself is decoded and checked on the host (`delta::list_changes`);
//! its changed elements go up with their positions and one launch writes
//! them. Launches go on the legacy default stream, after the engine's own
//! work there, and every call returns with its work finished.

use super::Changes;
use crate::checksum;
use crate::memory::cuda::check;
use crate::memory::cuda_ipc::{download, upload};
use crate::memory::device::DeviceAllocation;
use crate::memory::nvrtc::{self, Kernel};
use crate::result::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

pub(crate) const SOURCE: &str = include_str!("device.cu");
pub(crate) const PROGRAM: &str = "wm_delta.cu";
/// XXH3's block (`WM_XXH3_BLOCK`): 16 stripes of 64 bytes.
const BLOCK: u64 = 1024;
/// Runs of at most this many bytes take XXH3's short paths: hashed on the
/// host (a read of at most 240 bytes).
const SHORT: u64 = 240;
/// Blocks a round hashes at most: the sums scratch is 64 bytes a block
/// (64 MiB), whatever the params' size.
const ROUND_BLOCKS: u64 = 1 << 20;
const THREADS: u32 = 256;
/// Threads a block of the chain kernel: 4 runs, so runs spread over the
/// GPU's processors.
const CHAIN_THREADS: u32 = 32;
const MAX_BLOCKS: u64 = 1 << 16;
/// The most device memory the changes of deltas take on their way up.
const SCRATCH: usize = 64 << 20;

/// XXH3's default secret (the seed-0 digest's; also in the kernels' reads
/// of it, uploaded with each call).
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];
const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;
const INIT: [u64; 8] = [
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
];

/// `struct wm_hash_piece` of `device.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Piece {
    src: u64,
    len: u64,
    block0: u64,
    blocks: u64,
    sums: u64,
    acc: u64,
    last: u64,
}

/// The checksum of each run `(device address, bytes)` of GPU `ordinal`'s
/// memory, as `crate::checksum::of` gives for the same bytes.
pub fn checksums(ordinal: i32, runs: &[(u64, u64)]) -> Result<Vec<u128>> {
    checksums_in_rounds(ordinal, runs, ROUND_BLOCKS)
}

/// The checksums of `runs` (tag, (device address, bytes), GPU), one
/// [`checksums`] call per GPU; a GPU whose call failed (no NVRTC, a driver
/// error) gives that error for each of its runs.
pub fn checksums_by_gpu<K: Copy>(runs: &[(K, (u64, u64), i32)]) -> Vec<(K, Result<u128>)> {
    let mut gpus: Vec<i32> = runs.iter().map(|r| r.2).collect();
    gpus.sort_unstable();
    gpus.dedup();
    let mut out = Vec::with_capacity(runs.len());
    for g in gpus {
        let mine: Vec<_> = runs.iter().filter(|r| r.2 == g).collect();
        let spans: Vec<(u64, u64)> = mine.iter().map(|r| r.1).collect();
        match checksums(g, &spans) {
            Ok(sums) => out.extend(mine.iter().zip(sums).map(|(r, s)| (r.0, Ok(s)))),
            Err(e) => out.extend(mine.iter().map(|r| (r.0, Err(e.clone())))),
        }
    }
    out
}

/// [`checksums`] with rounds of at most `round_blocks` blocks (tests cut
/// runs across rounds with small ones).
#[doc(hidden)]
pub fn checksums_in_rounds(
    ordinal: i32,
    runs: &[(u64, u64)],
    round_blocks: u64,
) -> Result<Vec<u128>> {
    let round_blocks = round_blocks.max(1);
    let mut out = vec![0u128; runs.len()];
    let mut long = Vec::new();
    for (i, &(ptr, len)) in runs.iter().enumerate() {
        if len > SHORT {
            long.push(i);
            continue;
        }
        let mut bytes = vec![0u8; len as usize];
        // SAFETY: the caller's device run, into a buffer of its length.
        unsafe { download(ordinal, bytes.as_mut_ptr(), ptr, bytes.len())? };
        out[i] = checksum::of(&bytes);
    }
    if long.is_empty() {
        return Ok(out);
    }
    let long_runs: Vec<(u64, u64)> = long.iter().map(|&i| runs[i]).collect();
    let accs = hash_long(ordinal, &long_runs, round_blocks)?;
    for (k, &i) in long.iter().enumerate() {
        out[i] = merge(&accs[k], runs[i].1);
    }
    Ok(out)
}

/// The 8 accumulators of each long run, after its last stripe.
fn hash_long(ordinal: i32, runs: &[(u64, u64)], round_blocks: u64) -> Result<Vec<[u64; 8]>> {
    let blocks_kernel = nvrtc::kernel(ordinal, PROGRAM, SOURCE, "wm_xxh3_blocks")?;
    let chain_kernel = nvrtc::kernel(ordinal, PROGRAM, SOURCE, "wm_xxh3_chain")?;
    let total: u64 = runs.iter().map(|&(_, len)| whole_blocks(len)).sum();
    let what = "the GPU checksum's scratch";
    let secret = DeviceAllocation::new(what, ordinal, SECRET.len())?;
    let accs = DeviceAllocation::new(what, ordinal, runs.len() * 64)?;
    let sums = DeviceAllocation::new(what, ordinal, (total.min(round_blocks) * 64) as usize)?;
    let pieces = DeviceAllocation::new(what, ordinal, runs.len() * size_of::<Piece>())?;
    let init: Vec<u64> = runs.iter().flat_map(|_| INIT).collect();
    // SAFETY: synchronous copies into allocations of those sizes.
    unsafe {
        upload(ordinal, secret.ptr(), SECRET.as_ptr(), SECRET.len())?;
        upload(ordinal, accs.ptr(), init.as_ptr().cast(), init.len() * 8)?;
    }
    // Per run: the next block to hash.
    let mut next: Vec<Option<u64>> = vec![Some(0); runs.len()];
    while next.iter().any(Option::is_some) {
        let (round, used) = next_round(runs, &mut next, round_blocks);
        // SAFETY: the round's pieces fit the allocation (one per run at
        // most); the previous round's launches are done (a synchronous
        // copy waits for the legacy stream).
        unsafe {
            upload(
                ordinal,
                pieces.ptr(),
                round.as_ptr().cast(),
                size_of_val(&*round),
            )?
        };
        let (mut p, mut n, mut s, mut sm, mut a) = (
            pieces.ptr(),
            round.len() as u64,
            secret.ptr(),
            sums.ptr(),
            accs.ptr(),
        );
        let mut total = used;
        if used > 0 {
            let mut params = [
                ptr(&mut p),
                ptr(&mut n),
                ptr(&mut total),
                ptr(&mut s),
                ptr(&mut sm),
            ];
            // SAFETY: the kernel's parameters; the runs are the caller's
            // device memory, the scratch holds `used` blocks' sums.
            unsafe { launch(blocks_kernel, used * 8, THREADS, &mut params)? };
        }
        let mut params = [
            ptr(&mut p),
            ptr(&mut n),
            ptr(&mut s),
            ptr(&mut sm),
            ptr(&mut a),
        ];
        // SAFETY: as above; the accumulators hold every run's 8.
        unsafe { launch(chain_kernel, n * 8, CHAIN_THREADS, &mut params)? };
    }
    let mut found = vec![[0u64; 8]; runs.len()];
    // SAFETY: a synchronous copy after the launches, into a buffer of that
    // size.
    unsafe {
        download(
            ordinal,
            found.as_mut_ptr().cast(),
            accs.ptr(),
            runs.len() * 64,
        )?
    };
    Ok(found)
}

/// The pieces of the next round: a share of `round_blocks` for every run
/// not yet hashed (so the runs' chains go side by side, each round), in
/// run order (`next`: per run, the next block to hash; None once its last
/// piece was planned). Returns the pieces and the blocks they use.
fn next_round(
    runs: &[(u64, u64)],
    next: &mut [Option<u64>],
    round_blocks: u64,
) -> (Vec<Piece>, u64) {
    let left = next.iter().filter(|n| n.is_some()).count() as u64;
    let share = (round_blocks / left.max(1)).max(1);
    let mut round = Vec::new();
    let mut used = 0;
    for (j, &(src, len)) in runs.iter().enumerate() {
        let Some(at) = next[j] else { continue };
        let take = (whole_blocks(len) - at).min(share).min(round_blocks - used);
        let last = at + take == whole_blocks(len);
        if take == 0 && !last {
            continue; // the round is full: next round
        }
        round.push(Piece {
            src,
            len,
            block0: at,
            blocks: take,
            sums: used,
            acc: j as u64,
            last: last as u64,
        });
        used += take;
        next[j] = (!last).then_some(at + take);
    }
    (round, used)
}

/// The whole blocks of a long run of `len` bytes that chain before its
/// tail (the last block is never whole: XXH3 takes it with the tail).
fn whole_blocks(len: u64) -> u64 {
    (len - 1) / BLOCK
}

/// XXH3-128's end of a long input of `len` bytes from its accumulators.
fn merge(acc: &[u64; 8], len: u64) -> u128 {
    let low = final_merge(acc, len.wrapping_mul(PRIME64_1), &SECRET[11..]);
    let high = final_merge(acc, !len.wrapping_mul(PRIME64_2), &SECRET[192 - 75..]);
    (high as u128) << 64 | low as u128
}

fn final_merge(acc: &[u64; 8], init: u64, secret: &[u8]) -> u64 {
    let word = |i: usize| u64::from_le_bytes(secret[8 * i..8 * i + 8].try_into().expect("8"));
    let mut r = init;
    for i in 0..4 {
        let m = ((acc[2 * i] ^ word(2 * i)) as u128) * ((acc[2 * i + 1] ^ word(2 * i + 1)) as u128);
        r = r.wrapping_add(m as u64 ^ (m >> 64) as u64);
    }
    r ^= r >> 37;
    r = r.wrapping_mul(PRIME_MX1);
    r ^ (r >> 32)
}

/// One delta for [`apply`]: `changes` (decoded from `delta`, elements of
/// `esize` bytes) for the run at device address `dst`, which holds the
/// base.
pub struct OnGpu<'d> {
    pub dst: u64,
    pub changes: &'d Changes,
    pub delta: &'d [u8],
    pub esize: usize,
}

/// Write every delta of `jobs` into its run on GPU `ordinal`: the chunks
/// sent whole copied up, the other changes through one scratch of at most
/// 64 MiB (their positions and values, uploaded a slice at a time) and a
/// launch per slice. Returns once written.
///
/// # Safety
/// Each `dst` is device memory holding at least the run its changes were
/// checked against (`delta::list_changes`), which nothing else writes
/// meanwhile; the runs do not overlap.
pub unsafe fn apply(ordinal: i32, jobs: &[OnGpu]) -> Result<()> {
    apply_in_slices(ordinal, jobs, SCRATCH)
}

/// [`apply`] through a scratch of at most `scratch` bytes (tests cut the
/// changes into many slices with a small one).
///
/// # Safety
/// As [`apply`].
#[doc(hidden)]
pub unsafe fn apply_in_slices(ordinal: i32, jobs: &[OnGpu], scratch: usize) -> Result<()> {
    for j in jobs {
        for (at, bytes) in &j.changes.whole {
            upload(
                ordinal,
                j.dst + at,
                j.delta[bytes.clone()].as_ptr(),
                bytes.len(),
            )?;
        }
    }
    // The changes go up a slice at a time through one scratch of at most
    // `scratch` bytes (whatever a publisher's deltas hold): a slice's
    // positions, then its values. Reusing it is safe: a copy from pageable
    // memory waits for the launches before it on the stream.
    let slice = |esize: usize| (scratch / (4 + esize)).max(1);
    let largest = (jobs.iter())
        .map(|j| j.changes.positions.len().min(slice(j.esize)) * (4 + j.esize))
        .max()
        .unwrap_or(0);
    if largest == 0 {
        return Ok(());
    }
    let kernel = nvrtc::kernel(ordinal, PROGRAM, SOURCE, "wm_delta_scatter")?;
    let buf = DeviceAllocation::new("a delta's changes on the GPU", ordinal, largest)?;
    for j in jobs {
        let c = j.changes;
        let per = slice(j.esize);
        for (k, positions) in c.positions.chunks(per).enumerate() {
            let n = positions.len();
            let values = &c.values[k * per * j.esize..(k * per + n) * j.esize];
            let (mut p, mut v) = (buf.ptr(), buf.ptr() + n as u64 * 4);
            upload(ordinal, p, positions.as_ptr().cast(), n * 4)?;
            upload(ordinal, v, values.as_ptr(), values.len())?;
            let (mut d, mut count, mut e) = (j.dst, n as u64, j.esize as u32);
            let mut params = [
                ptr(&mut d),
                ptr(&mut p),
                ptr(&mut v),
                ptr(&mut count),
                ptr(&mut e),
            ];
            launch(kernel, n as u64, THREADS, &mut params)?;
        }
    }
    // Wait before the scratch is freed (a kernel's fault surfaces here).
    check(
        sys::cuStreamSynchronize(std::ptr::null_mut()),
        "cuStreamSynchronize(deltas' changes)",
    )
}

fn ptr<T>(x: &mut T) -> *mut c_void {
    (x as *mut T).cast()
}

/// Launch `kernel` with `threads` threads in all (blocks of `per`), at
/// most [`MAX_BLOCKS`] blocks (each thread loops over the rest).
///
/// # Safety
/// `params` are the kernel's, pointing at live values and device memory.
unsafe fn launch(kernel: Kernel, threads: u64, per: u32, params: &mut [*mut c_void]) -> Result<()> {
    let blocks = threads.div_ceil(per as u64).clamp(1, MAX_BLOCKS) as u32;
    nvrtc::launch(kernel, (blocks, per), std::ptr::null_mut(), params)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host end of the digest (`merge`) against twox-hash: the
    /// accumulators of a long input computed here as the kernels do.
    #[test]
    fn merge_and_kernel_arithmetic_give_xxh3_128() {
        let mut rng = crate::test_rng::Rng(7);
        for len in [241usize, 1023, 1024, 1025, 2048, 4097, 70_000] {
            let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            assert_eq!(
                merge(&accumulate(&bytes), len as u64),
                checksum::of(&bytes),
                "{len}"
            );
        }
    }

    /// The kernels' arithmetic on the host, for one run.
    fn accumulate(input: &[u8]) -> [u64; 8] {
        let read = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let stripe = |at: usize, key: usize, lane: usize| {
            let v = read(input, at + 8 * (lane ^ 1));
            let k = read(input, at + 8 * lane) ^ read(&SECRET, key + 8 * lane);
            v.wrapping_add((k & 0xffff_ffff) * (k >> 32))
        };
        let mut acc = INIT;
        let len = input.len();
        let whole = (len - 1) / BLOCK as usize;
        for (lane, a) in acc.iter_mut().enumerate() {
            for b in 0..whole {
                for s in 0..16 {
                    *a = a.wrapping_add(stripe(b * 1024 + 64 * s, 8 * s, lane));
                }
                *a ^= *a >> 47;
                *a ^= read(&SECRET, 128 + 8 * lane);
                *a = a.wrapping_mul(PRIME32_1);
            }
            for s in 0..(len - 1 - whole * 1024) / 64 {
                *a = a.wrapping_add(stripe(whole * 1024 + 64 * s, 8 * s, lane));
            }
            *a = a.wrapping_add(stripe(len - 64, 121, lane));
        }
        acc
    }
}
