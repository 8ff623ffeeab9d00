//! The applier's unit tests.

use super::*;
use crate::manifest::TensorMeta;
use crate::memory::copy::CopySource;
use crate::memory::SendPtr;
use crate::plan::{Plan, PlanEntry, Target};
use crate::result::Result;
use crate::tensor::DType;
use std::time::Duration;

pub(super) fn plan_of(bytes: &[u8]) -> Plan {
    Plan::new(vec![PlanEntry::new(
        TensorMeta {
            name: "w".into(),
            dtype: DType::U8,
            shape: vec![bytes.len() as u64],
            nbytes: bytes.len() as u64,
            checksum: Some(crate::checksum::of(bytes)),
            placement: None,
        },
        0,
        Target::Param(0),
    )])
}

/// Where `len` bytes of entry `t` from byte `offset` land, in one piece.
pub(super) fn one_piece(a: &mut Applier, t: usize, offset: u64, len: usize) -> Result<SendPtr> {
    let pieces = a.receive_scatter(t, offset, len, 1)?;
    Ok(pieces.expect("one piece")[0].0)
}

fn callback_plan(sizes: &[(&str, u64)]) -> Plan {
    let entries: Vec<PlanEntry> = sizes
        .iter()
        .enumerate()
        .map(|(i, &(name, n))| {
            PlanEntry::new(
                TensorMeta::whole(name, DType::U8, &[n]),
                i,
                Target::Callback,
            )
        })
        .collect();
    Plan::new(entries)
}

fn callback_opts(mode: Mode, limit: u64) -> ApplyOptions {
    ApplyOptions {
        mode,
        verify: false,
        threads: 2,
        timeout: Duration::from_secs(10),
        begun: std::time::Instant::now(),
        callback_staging_limit: limit,
    }
}

/// The manifest of a hostile peer (a 1 TiB callback tensor) is refused
/// before anything is allocated, in both modes, by the applier every
/// source shares (rdma included).
#[test]
fn a_callback_tensor_past_the_limit_is_refused_before_allocating() {
    let plan = callback_plan(&[("huge", 1 << 40)]);
    let limit = crate::defaults::CALLBACK_STAGING_LIMIT;
    for mode in [Mode::InPlace, Mode::Atomic] {
        let Err(e) = Applier::new(
            &plan,
            vec![None],
            callback_opts(mode, limit),
            Hooks::default(),
        ) else {
            panic!("{mode:?}: a 1 TiB callback tensor was accepted");
        };
        assert_eq!(
            e.code,
            crate::result::wm_result::WM_ERR_OUT_OF_MEMORY,
            "{e}"
        );
        assert!(e.message.contains("tensor 'huge'"), "{e}");
        assert!(e.message.contains("callback_staging_limit"), "{e}");
    }
}

/// rdma lands callback tensors through `receive_scatter`: tensors received
/// at once count together against the limit, each one alone fits.
#[test]
fn callback_tensors_received_at_once_share_the_limit() {
    let plan = callback_plan(&[("a", 3000), ("b", 3000)]);
    let opts = callback_opts(Mode::InPlace, 4096);
    let mut delivered = Vec::new();
    let mut hook = |v: &TensorView| {
        delivered.push(v.name.to_string());
        Ok(())
    };
    let hooks = Hooks {
        progress: None,
        tensor: Some(&mut hook),
    };
    let mut a = Applier::new(&plan, vec![None, None], opts, hooks).unwrap();
    one_piece(&mut a, 0, 0, 1000).unwrap();
    let e = one_piece(&mut a, 1, 0, 1000).unwrap_err();
    assert_eq!(
        e.code,
        crate::result::wm_result::WM_ERR_OUT_OF_MEMORY,
        "{e}"
    );
    assert!(
        e.message.contains("tensor 'b'") && e.message.contains("3000 bytes"),
        "{e}"
    );
    // Once 'a' is whole and delivered, 'b' fits.
    let whole = |t| Chunk {
        tensor: t,
        offset: 0,
        len: 3000,
        src: CopySource::Memory(SendPtr(std::ptr::null_mut())),
    };
    for t in 0..2 {
        let at = one_piece(&mut a, t, 0, 3000).unwrap();
        // SAFETY: the landing holds the tensor's 3000 bytes.
        unsafe { std::ptr::write_bytes(at.0, 1, 3000) };
        a.account_landed("test", &[whole(t)]).unwrap();
    }
    a.finish().map_err(|f| f.error).unwrap();
    assert_eq!(delivered, ["a", "b"]);
}

/// A chunk maps through its plan run to the param's byte range: a run that
/// puts a tensor's 4 bytes at bytes 4..8 of an 8-byte param writes only
/// those, in place (copied or landed) and atomically.
#[test]
fn chunks_land_where_their_run_says() {
    let data = [1u8, 2, 3, 4];
    let mut plan = plan_of(&data);
    plan.runs[0].param = 4..8;
    for (mode, landed) in [
        (Mode::InPlace, false),
        (Mode::InPlace, true),
        (Mode::Atomic, false),
    ] {
        let mut param = [0u8; 8];
        let opts = ApplyOptions {
            mode,
            ..callback_opts(mode, 0)
        };
        let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
        let mut a = Applier::new(&plan, vec![dest], opts, Hooks::default()).unwrap();
        let chunk = Chunk {
            tensor: 0,
            offset: 0,
            len: 4,
            src: CopySource::Memory(SendPtr(data.as_ptr().cast_mut())),
        };
        if landed {
            let to = one_piece(&mut a, 0, 0, 4).unwrap();
            // SAFETY: the landing is the run's 4 bytes of the param.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), to.0, 4) };
            a.account_landed("test", &[chunk]).unwrap();
        } else {
            a.apply_batch("test", &[chunk]).unwrap();
        }
        a.finish().map_err(|f| f.error).unwrap();
        assert_eq!(param, [0, 0, 0, 0, 1, 2, 3, 4], "{mode:?}, landed {landed}");
    }
}

/// The column split of the tests below: bytes 4..12 of each 16-byte row
/// of a 16-row tensor to 8 of every 12 bytes of a 192-byte param. Its
/// plan, the bytes a source sends (the 16 row parts in order), and the
/// param they make from one of 0xEE bytes.
fn column_split() -> (Plan, Vec<u8>, Vec<u8>) {
    let tensor: Vec<u8> = (0..256u32).map(|i| (i * 7 + 1) as u8).collect();
    let mut plan = plan_of(&tensor);
    plan.runs[0].source = 4..12;
    plan.runs[0].param = 0..8;
    plan.runs[0].rows = 16;
    plan.runs[0].source_stride = 16;
    plan.runs[0].param_stride = 12;
    plan.entries[0].bytes = 128;
    let received: Vec<u8> = tensor.chunks(16).flat_map(|r| r[4..12].to_vec()).collect();
    let mut want = vec![0xEEu8; 192];
    for (r, row) in received.chunks(8).enumerate() {
        want[r * 12..r * 12 + 8].copy_from_slice(row);
    }
    (plan, received, want)
}

/// A column split whose rows follow each other in the param (strided at
/// the source only): a message of several rows is received in one piece,
/// the param's own bytes, whatever the most pieces the source takes.
#[test]
fn rows_back_to_back_in_the_param_are_received_in_one_piece() {
    let (mut plan, ..) = column_split();
    plan.runs[0].param_stride = 8;
    let mut param = vec![0u8; 128];
    let opts = callback_opts(Mode::InPlace, 0);
    let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
    let mut a = Applier::new(&plan, vec![dest], opts, Hooks::default()).unwrap();
    let pieces = a.receive_scatter(0, 12, 100, 1).unwrap().unwrap();
    assert_eq!(pieces, vec![(SendPtr(param[12..].as_mut_ptr()), 100)]);
}

/// A column split: bytes 4..12 of each 16-byte row of a 16-row tensor go
/// to 8 of every 12 param bytes (16 segments). The received bytes come as
/// many small chunks of uneven lengths, most crossing a segment edge, in
/// two batches: each byte lands exactly where its run says (the gaps keep
/// their bytes), and the slice sum of the received bytes verifies (a
/// wrong one fails naming the tensor), in place and atomically.
#[test]
fn many_small_chunks_across_segments_land_and_verify() {
    let (plan, received, want) = column_split();
    let good = crate::checksum::of(&received);
    for mode in [Mode::InPlace, Mode::Atomic] {
        for sum in [good, good ^ 1] {
            let got = apply_small_chunks(&plan, &received, mode, sum);
            match (sum == good, got) {
                (true, Ok(param)) => assert_eq!(param, want, "{mode:?}"),
                (false, Err(e)) => {
                    assert_eq!(e.code, crate::result::wm_result::WM_ERR_CHECKSUM, "{e}");
                    assert!(e.message.contains("tensor 'w'"), "{e}");
                }
                (ok, got) => panic!("{mode:?}, good sum {ok}: {:?}", got.map(|_| ())),
            }
        }
    }
}

/// Apply `received` (entry 0's bytes) in chunks of 1 to 20 bytes, split
/// over two batches, into a 192-byte param of 0xEE bytes, verifying
/// against slice sum `sum`.
fn apply_small_chunks(plan: &Plan, received: &[u8], mode: Mode, sum: u128) -> Result<Vec<u8>> {
    let mut param = vec![0xEEu8; 192];
    let opts = ApplyOptions {
        verify: true,
        ..callback_opts(mode, 0)
    };
    let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
    let mut a = Applier::new(plan, vec![dest], opts, Hooks::default())?;
    a.expect_checksum(0, sum)?;
    let mut chunks = Vec::new();
    let mut at = 0;
    for len in [5usize, 11, 3, 20, 1, 8, 13].iter().cycle() {
        let len = (*len).min(received.len() - at);
        chunks.push(Chunk {
            tensor: 0,
            offset: at as u64,
            len,
            src: CopySource::Memory(SendPtr(received[at..].as_ptr().cast_mut())),
        });
        at += len;
        if at == received.len() {
            break;
        }
    }
    let (first, second) = chunks.split_at(chunks.len() / 2);
    a.apply_batch("test", first)?;
    a.apply_batch("test", second)?;
    a.finish().map_err(|f| f.error)?;
    Ok(param)
}

/// A source scattering received bytes itself (a UCX IOV receive): the
/// column split of `many_small_chunks_across_segments_land_and_verify`
/// received in 40-byte messages, each written into the pieces
/// `receive_scatter` names and accounted as landed: every byte where its
/// run says, the slice sum verified, in place and atomically. A message
/// in more pieces than the source takes gets None, and in place nothing
/// counts as written yet.
#[test]
fn bytes_scattered_into_their_pieces_land_and_verify() {
    let (plan, received, want) = column_split();
    for mode in [Mode::InPlace, Mode::Atomic] {
        let mut param = vec![0xEEu8; 192];
        let opts = ApplyOptions {
            verify: true,
            ..callback_opts(mode, 0)
        };
        let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
        let mut a = Applier::new(&plan, vec![dest], opts, Hooks::default()).unwrap();
        a.expect_checksum(0, crate::checksum::of(&received))
            .unwrap();
        // Bytes 4..44: pieces of 4, 8, 8, 8, 8 and 4 bytes.
        assert!(a.receive_scatter(0, 4, 40, 5).unwrap().is_none());
        assert!(!a.wrote_params(), "{mode:?}: nothing written yet");
        for at in (0..received.len()).step_by(40) {
            let len = 40.min(received.len() - at);
            let pieces = a.receive_scatter(0, at as u64, len, 8).unwrap().unwrap();
            let mut from = at;
            for (to, n) in pieces {
                // SAFETY: a piece of the param (or its shadow), n bytes.
                unsafe { std::ptr::copy_nonoverlapping(received[from..].as_ptr(), to.0, n) };
                from += n;
            }
            assert_eq!(from, at + len, "{mode:?}: the pieces hold the message");
            let nowhere = CopySource::Memory(SendPtr(std::ptr::null_mut()));
            let chunk = Chunk {
                tensor: 0,
                offset: at as u64,
                len,
                src: nowhere,
            };
            a.account_landed("test", &[chunk]).unwrap();
        }
        a.finish().map_err(|f| f.error).unwrap();
        assert_eq!(param, want, "{mode:?}");
    }
}

/// A stop flag set by another thread (a destroy, a clear of the staging
/// version) ends the update at its next look, which every waiting source
/// makes between steps (`check_deadline`), naming how far it got.
#[test]
fn a_stopped_update_is_cancelled_at_its_next_look() {
    let src = vec![7u8; 1024];
    let plan = plan_of(&src);
    let mut param = vec![0u8; 1024];
    let dest = Some(Dest::Host(SendPtr(param.as_mut_ptr())));
    let opts = ApplyOptions {
        mode: Mode::InPlace,
        verify: false,
        threads: 1,
        timeout: Duration::from_secs(10),
        begun: std::time::Instant::now(),
        callback_staging_limit: crate::defaults::CALLBACK_STAGING_LIMIT,
    };
    let stop = crate::stop::StopFlag::default();
    let a = Applier::new(&plan, vec![dest], opts, Hooks::default())
        .unwrap()
        .with_stop(Some(stop.clone()));
    a.check_deadline().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Release);
    let e = a.check_deadline().unwrap_err();
    assert_eq!(e.code, crate::result::wm_result::WM_ERR_CANCELLED, "{e}");
    assert!(e.message.contains("0 of 1024 bytes"), "{e}");
}
