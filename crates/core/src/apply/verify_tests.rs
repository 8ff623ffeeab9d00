//! The applier's checksums: tensors verified as their chunks land or
//! are copied, in batches, on any number of threads, and whatever mix of
//! sources a batch holds.

use super::tests::{one_piece, plan_of};
use super::*;
use crate::manifest::TensorMeta;
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::{Plan, PlanEntry, Target};
use crate::result::Result;
use crate::tensor::DType;
use std::time::Duration;

/// In place, verifying, on `threads`.
fn verifying(threads: usize) -> ApplyOptions {
    ApplyOptions {
        mode: Mode::InPlace,
        verify: true,
        threads,
        timeout: Duration::from_secs(10),
        begun: std::time::Instant::now(),
        callback_staging_limit: crate::defaults::CALLBACK_STAGING_LIMIT,
    }
}

/// Feed `src` to an in-place applier in chunks of `piece` bytes; the
/// chunks are copied (`landed` false) or already in the param (true).
fn apply_in_pieces(plan: &Plan, src: &[u8], piece: usize, landed: bool) -> Result<Vec<u8>> {
    let mut param = vec![0u8; src.len()];
    let opts = verifying(2);
    let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
    let mut a = Applier::new(plan, vec![dest], opts, Hooks::default())?;
    for at in (0..src.len()).step_by(piece) {
        let len = piece.min(src.len() - at);
        if landed {
            let to = one_piece(&mut a, 0, at as u64, len)?;
            // SAFETY: the landing range is the param's, `len` bytes long.
            unsafe { std::ptr::copy_nonoverlapping(src[at..].as_ptr(), to.0, len) };
        }
        let chunk = Chunk {
            tensor: 0,
            offset: at as u64,
            len,
            src: CopySource::Memory(SendPtr(src[at..].as_ptr().cast_mut())),
        };
        if landed {
            a.account_landed("test", &[chunk])?;
        } else {
            a.apply_batch("test", &[chunk])?;
        }
    }
    a.finish().map_err(|f| f.error)?;
    Ok(param)
}

/// A tensor that arrives in several chunks is verified chunk by chunk
/// as they land; the result must be the whole tensor's xxh3-128, and a
/// flipped bit in any chunk must fail naming the tensor.
#[test]
fn tensors_in_chunks_are_verified_as_they_land() {
    let good: Vec<u8> = (0..3_000_001u32).map(|i| (i * 31 + 7) as u8).collect();
    let plan = plan_of(&good);
    for landed in [false, true] {
        for piece in [1usize << 20, 4096 + 3, good.len()] {
            let got = apply_in_pieces(&plan, &good, piece, landed).unwrap();
            assert!(got == good, "piece {piece}, landed {landed}");
            let mut bad = good.clone();
            bad[2_500_000] ^= 0x10;
            let e = apply_in_pieces(&plan, &bad, piece, landed).unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_CHECKSUM, "{e}");
            assert!(e.message.contains("tensor 'w'"), "{e}");
        }
    }
}

/// Tensors `t0`, `t1`, ... of `good`'s sizes and checksums, received from
/// `sent` in place on `threads`: every tensor's first half in one batch,
/// its second half in the next. The params' bytes, or the error.
fn apply_batches(good: &[Vec<u8>], sent: &[Vec<u8>], threads: usize) -> Result<Vec<Vec<u8>>> {
    let entries = good.iter().enumerate().map(|(i, b)| {
        let meta = TensorMeta {
            name: format!("t{i}"),
            dtype: DType::U8,
            shape: vec![b.len() as u64],
            nbytes: b.len() as u64,
            checksum: Some(crate::checksum::of(b)),
            placement: None,
        };
        PlanEntry::new(meta, 0, Target::Param(i))
    });
    let plan = Plan::new(entries.collect());
    let mut params: Vec<Vec<u8>> = good.iter().map(|b| vec![0u8; b.len()]).collect();
    let opts = verifying(threads);
    let dests = (params.iter_mut())
        .map(|p| Some(Dest::Host(SendPtr(p.as_mut_ptr()))))
        .collect();
    let mut a = Applier::new(&plan, dests, opts, Hooks::default())?;
    for half in [0, 1] {
        let chunks: Vec<Chunk> = (sent.iter().enumerate())
            .map(|(t, b)| {
                let (at, len) = (half * (b.len() / 2), b.len() / 2 + half * (b.len() % 2));
                let src = CopySource::Memory(SendPtr(b[at..].as_ptr().cast_mut()));
                let offset = at as u64;
                Chunk {
                    tensor: t,
                    offset,
                    len,
                    src,
                }
            })
            .collect();
        a.apply_batch("test", &chunks)?;
    }
    a.finish().map_err(|f| f.error)?;
    Ok(params)
}

/// Tensors copied out of memory are hashed as they are copied: with as
/// many tensors in a batch as threads, each tensor's copies and hash on
/// one thread; with fewer, the copies first on every thread and the
/// hashes after. Either way (1 to 4 threads, 3 tensors, each over two
/// batches) every byte lands and a flipped one fails naming its tensor.
#[test]
fn tensors_copied_in_batches_are_verified_as_they_are_copied() {
    let good: Vec<Vec<u8>> = (0..3usize)
        .map(|k| {
            (0..(1 << 20) * (k + 1) + k)
                .map(|i| (i * 7 + k) as u8)
                .collect()
        })
        .collect();
    for threads in 1..=4 {
        assert!(
            apply_batches(&good, &good, threads).unwrap() == good,
            "{threads}"
        );
        let mut bad = good.clone();
        bad[1][(3 << 19) + 5] ^= 1;
        let e = apply_batches(&good, &bad, threads).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_CHECKSUM, "{e}");
        assert!(e.message.contains("tensor 't1'"), "{threads}: {e}");
    }
}

/// One batch holding a tensor's chunks from a file and from memory in
/// turn (a snapshot's segment read partly through mapped windows, partly
/// with `pread` when no window could be mapped) hashes them in the order
/// they come: file, memory, file, memory.
#[test]
fn file_and_memory_chunks_of_a_tensor_hash_in_order() {
    use std::io::Write;
    let good: Vec<u8> = (0..4_000_000u32).map(|i| (i * 13 + 1) as u8).collect();
    let plan = plan_of(&good);
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&good).unwrap();
    let quarter = good.len() / 4;
    for threads in [1, 2] {
        let mut param = vec![0u8; good.len()];
        let opts = verifying(threads);
        let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
        let mut a = Applier::new(&plan, vec![dest], opts, Hooks::default()).unwrap();
        let chunks: Vec<Chunk> = (0..4)
            .map(|k| {
                let at = k * quarter;
                let src = match k % 2 {
                    0 => CopySource::File {
                        file: &f,
                        offset: at as u64,
                    },
                    _ => CopySource::Memory(SendPtr(good[at..].as_ptr().cast_mut())),
                };
                let len = if k == 3 { good.len() - at } else { quarter };
                Chunk {
                    tensor: 0,
                    offset: at as u64,
                    len,
                    src,
                }
            })
            .collect();
        a.apply_batch("test", &chunks).unwrap();
        a.finish().map_err(|f| f.error).unwrap();
        assert!(param == good, "{threads} threads");
    }
}
