//! The frames' encodings round-trip, and bad ones are refused.
use super::*;
use crate::tensor::DType;

fn round_trip(f: Frame) {
    let bytes = f.encode();
    let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
    assert_eq!(len, bytes.len() - 4);
    assert_eq!(Frame::decode(&bytes[4..]).unwrap(), f);
}

#[test]
fn frames_round_trip() {
    round_trip(Frame::Hello {
        rank: 3,
        world_size: 8,
        gpu_id: "5".into(),
        version: "latest".into(),
        base: String::new(),
    });
    round_trip(Frame::Ack { seq: 9 });
    round_trip(Frame::End { buckets: 4 });
    round_trip(Frame::Error {
        code: 6,
        text: "boom".into(),
    });
    round_trip(Frame::Challenge { nonce: [7; 32] });
    round_trip(Frame::Proof {
        mac: [1; 32],
        nonce: [2; 32],
    });
    round_trip(Frame::Ready {
        address: vec![1, 2, 3],
        bucket_size: 1 << 29,
        depth: 2,
        direct: true,
        keyed: true,
    });
}

#[test]
fn plan_frames_round_trip() {
    round_trip(Frame::Manifest {
        version: "12".into(),
        tensors: vec![TensorMeta {
            name: "w".into(),
            dtype: DType::Bf16,
            shape: vec![2, 3],
            nbytes: 12,
            checksum: Some(0xabcdef),
            placement: None,
        }],
        base_kept: false,
    });
    round_trip(Frame::Manifest {
        version: "12".into(),
        tensors: vec![shard(&[2, 3], &[4, 3], &[2, 0]), shard(&[], &[], &[])],
        base_kept: false,
    });
    round_trip(Frame::Want {
        requests: vec![
            Request::whole(0, 12, false),
            Request::of_blocks(2, [(4, 4), (12, 4), (40, 8)], true),
        ],
        base: None,
        quant: vec![],
    });
    round_trip(Frame::Want {
        requests: vec![Request::whole(0, 12, false), Request::whole(1, 8, true)],
        base: Some(DeltaBase {
            version: "step-3".into(),
            fingerprints: vec![(0, 5 << 90), (1, 3)],
        }),
        quant: vec![],
    });
    round_trip(Frame::Deltas {
        kept: true,
        runs: vec![
            DeltaRun {
                request: 0,
                verdict: RunVerdict::Delta,
                len: 77,
                sum: 1 << 127,
            },
            DeltaRun {
                request: 1,
                verdict: RunVerdict::Differs,
                len: 0,
                sum: 0,
            },
            DeltaRun {
                request: 2,
                verdict: RunVerdict::NotSmaller,
                len: 0,
                sum: 0,
            },
            DeltaRun {
                request: 3,
                verdict: RunVerdict::BaseNotHeld,
                len: 0,
                sum: 0,
            },
        ],
    });
    round_trip(Frame::Delta {
        request: 3,
        bytes: vec![1, 2, 3],
    });
    round_trip(Frame::Sums {
        seq: 2,
        sums: vec![(1, 7 << 100), (4, 9)],
    });
    round_trip(Frame::Digests {
        seq: 3,
        digests: vec![[7; 32], [9; 32]],
    });
}

#[test]
fn bad_bases_are_refused() {
    let want = |fingerprints| {
        Frame::Want {
            requests: vec![Request::whole(0, 4, false), Request::whole(1, 4, false)],
            base: Some(DeltaBase {
                version: "v".into(),
                fingerprints,
            }),
            quant: vec![],
        }
        .encode()
    };
    // A request past WANT's, and one named twice.
    for bad in [vec![(2, 1)], vec![(1, 1), (1, 2)], vec![(1, 1), (0, 2)]] {
        let e = Frame::decode(&want(bad)[4..]).unwrap_err();
        assert!(e.message.contains("fingerprint for request"), "{e}");
    }
}

#[test]
fn transfer_frames_round_trip() {
    round_trip(Frame::Buffers {
        sizes: vec![1 << 20, 1 << 20],
    });
    let mut handle = [0u8; 64];
    handle
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8 ^ 0xa5);
    round_trip(Frame::CudaBuffers {
        buffers: vec![CudaBuffer {
            handle,
            size: 3 << 30,
        }],
    });
    round_trip(Frame::Bucket {
        seq: 1,
        buffer: 1,
        entries: vec![BucketEntry {
            request: 0,
            offset: 0,
            len: 12,
            buffer_offset: 256,
        }],
    });
    round_trip(Frame::Windows {
        seq: 2,
        buffer: 0,
        entries: vec![BucketEntry {
            request: 1,
            offset: 8,
            len: 40,
            buffer_offset: 512,
        }],
    });
}

fn shard(shape: &[u64], global: &[u64], offset: &[u64]) -> TensorMeta {
    TensorMeta {
        name: "layers.0.w".into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        nbytes: shape.iter().product::<u64>() * 4,
        checksum: None,
        placement: Some(crate::manifest::Placement {
            global_shape: global.to_vec(),
            offset: offset.to_vec(),
        }),
    }
}

/// A placement whose box leaves the global shape, whose global tensor
/// overflows, or whose flag is neither 0 nor 1, is refused naming the
/// tensor; so is one cut short.
#[test]
fn hostile_placements_are_refused() {
    let decode = |t: TensorMeta| {
        let f = Frame::Manifest {
            version: "1".into(),
            tensors: vec![t],
            base_kept: false,
        };
        Frame::decode(&f.encode()[4..])
    };
    let cases = [
        (shard(&[2, 3], &[4, 3], &[3, 0]), "dimension 0: offset 3"),
        (shard(&[2, 3], &[4, 3], &[0, u64::MAX]), "dimension 1"),
        (shard(&[1], &[u64::MAX], &[0]), "(global)"),
    ];
    for (t, want) in cases {
        let e = decode(t).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_PEER);
        assert!(e.message.contains("'layers.0.w'"), "{e}");
        assert!(e.message.contains(want), "{want}: {e}");
    }
    let good = Frame::Manifest {
        version: "1".into(),
        tensors: vec![shard(&[2], &[4], &[2])],
        base_kept: false,
    }
    .encode();
    let flag = good.len() - 18; // the placement flag, 2 dims, then base kept
    let mut bad_flag = good.clone();
    bad_flag[flag] = 2;
    let e = Frame::decode(&bad_flag[4..]).unwrap_err();
    assert!(e.message.contains("'layers.0.w': placement flag 2"), "{e}");
    let e = Frame::decode(&good[4..good.len() - 3]).unwrap_err();
    assert!(e.message.contains("ends early"), "{e}");
}

#[test]
fn hostile_frames_are_refused() {
    let mut hello = Frame::Hello {
        rank: 0,
        world_size: 1,
        gpu_id: "0".into(),
        version: String::new(),
        base: String::new(),
    }
    .encode();
    hello[9] = 99; // protocol version
    assert!(Frame::decode(&hello[4..])
        .unwrap_err()
        .message
        .contains("protocol version 99"));
    // A count far larger than the frame: refused before allocating.
    let mut want = vec![3u8];
    want.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(Frame::decode(&want)
        .unwrap_err()
        .message
        .contains("cannot fit"));
    let mut ready = vec![11u8];
    ready.extend_from_slice(&(MAX_ADDRESS as u32 + 1).to_le_bytes());
    assert!(Frame::decode(&ready)
        .unwrap_err()
        .message
        .contains("worker address"));
    assert!(Frame::decode(&[9, 1, 2])
        .unwrap_err()
        .message
        .contains("ends early"));
    assert!(Frame::decode(&[42])
        .unwrap_err()
        .message
        .contains("unknown frame type"));
}

#[test]
fn hostile_manifests_are_refused() {
    // A manifest whose byte size disagrees with its shape.
    let mut m = Frame::Manifest {
        version: "1".into(),
        tensors: vec![TensorMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![4],
            nbytes: 16,
            checksum: None,
            placement: None,
        }],
        base_kept: false,
    }
    .encode();
    // A tensor name holding a NUL (it would be cut in a C string).
    let nul = Frame::Manifest {
        version: "1".into(),
        tensors: vec![TensorMeta {
            name: "w\0x".into(),
            dtype: DType::F32,
            shape: vec![4],
            nbytes: 16,
            checksum: None,
            placement: None,
        }],
        base_kept: false,
    }
    .encode();
    assert!(Frame::decode(&nul[4..])
        .unwrap_err()
        .message
        .contains("NUL"));
    let at = m.len() - 11; // nbytes field, then three flags
    m[at] = 17;
    assert!(Frame::decode(&m[4..])
        .unwrap_err()
        .message
        .contains("claims 17 bytes"));
}

/// GPU buffers: none, or more than the limit.
#[test]
fn hostile_gpu_buffer_counts_are_refused() {
    let mut none = vec![12u8];
    none.extend_from_slice(&0u32.to_le_bytes());
    assert!(Frame::decode(&none)
        .unwrap_err()
        .message
        .contains("0 GPU buffers"));
    let many = Frame::CudaBuffers {
        buffers: vec![
            CudaBuffer {
                handle: [0; 64],
                size: 1
            };
            MAX_BUFFERS + 1
        ],
    }
    .encode();
    assert!(Frame::decode(&many[4..])
        .unwrap_err()
        .message
        .contains("GPU buffers (1 to"));
}

#[test]
fn hostile_buckets_are_refused() {
    let e = |off, len| BucketEntry {
        request: 0,
        offset: 0,
        len,
        buffer_offset: off,
    };
    assert!(check_bucket(0, &[e(0, 100)], 1024, 1, ALIGN).is_ok());
    assert!(check_bucket(0, &[e(10, 100)], 1024, 1, 1).is_ok());
    assert!(check_bucket(0, &[e(10, 100)], 1024, 1, ALIGN)
        .unwrap_err()
        .message
        .contains("aligned"));
    assert!(check_bucket(0, &[e(768, 512)], 1024, 1, ALIGN)
        .unwrap_err()
        .message
        .contains("run past"));
    assert!(check_bucket(0, &[e(0, 512), e(256, 10)], 1024, 1, ALIGN)
        .unwrap_err()
        .message
        .contains("overlap"));
    assert!(check_bucket(0, &[e(0, 1)], 1024, 0, ALIGN)
        .unwrap_err()
        .message
        .contains("#0"));
}

/// Protocol 7's quantization: WANT's quantized requests, AMAX and SCALES
/// round trip; bad ones are refused naming what is wrong.
#[test]
fn quantization_frames_round_trip_and_bad_ones_are_refused() {
    use crate::quant::Scheme;
    let want = |quant: Vec<(u32, Scheme)>| Frame::Want {
        requests: vec![Request::whole(0, 4, false), Request::whole(1, 4, true)],
        base: None,
        quant,
    };
    round_trip(want(vec![(0, Scheme::Fp8Block128), (1, Scheme::Fp8Tensor)]));
    round_trip(Frame::Amax {
        values: vec![(0, vec![1.5, 0.0]), (3, vec![])],
    });
    round_trip(Frame::Scales {
        values: vec![(2, vec![448.0])],
    });
    // Powers of two and zeros (MXFP8's amax) go as a byte each.
    let exponents = Frame::Amax {
        values: vec![
            (0, vec![0.5, 0.0, 2f32.powi(-120), 2f32.powi(100)]),
            (1, vec![1.5]),
        ],
    };
    round_trip(exponents.clone());
    let fours = Frame::Amax {
        values: vec![(0, vec![1.5; 4]), (1, vec![1.5])],
    };
    assert_eq!(fours.encode().len() - exponents.encode().len(), 4 * 3);
    let mut odd = exponents.encode();
    odd[4 + 1 + 4 + 4] = 2;
    let e = Frame::decode(&odd[4..]).unwrap_err();
    assert!(
        e.message
            .contains("AMAX: request #0: values of 2 bytes (1 or 4)"),
        "{e}"
    );
    for (bad, says) in [
        (
            want(vec![(2, Scheme::Fp8Block128)]),
            "quantized request #2 (of 2",
        ),
        (
            want(vec![(1, Scheme::Fp8Block128), (0, Scheme::Fp8Tensor)]),
            "quantized request #0",
        ),
    ] {
        let e = Frame::decode(&bad.encode()[4..]).unwrap_err();
        assert!(e.message.contains(says), "{e}");
    }
    let mut scheme = want(vec![(0, Scheme::Fp8Block128)]).encode();
    let n = scheme.len();
    scheme[n - 4..].copy_from_slice(&9u32.to_le_bytes());
    let e = Frame::decode(&scheme[4..]).unwrap_err();
    assert!(e.message.contains("quantization scheme 9"), "{e}");
    for x in [f32::NAN, f32::INFINITY, -1.0] {
        let amax = Frame::Amax {
            values: vec![(0, vec![1.0, x])],
        };
        let e = Frame::decode(&amax.encode()[4..]).unwrap_err();
        assert!(e.message.contains("AMAX: request #0: block value"), "{e}");
    }
    let twice = Frame::Scales {
        values: vec![(1, vec![1.0]), (1, vec![2.0])],
    };
    let e = Frame::decode(&twice.encode()[4..]).unwrap_err();
    assert!(e.message.contains("SCALES: request #1 out of order"), "{e}");
}

/// AMAX and SCALES over several frames: cut where a frame fills, every
/// request listed, and gathered back exactly; a frame out of step with
/// what the receiver expects is refused naming why.
#[test]
fn block_values_take_as_many_frames_as_they_need() {
    use super::{frames, Gathering};
    let values: BlockValues = vec![
        (0, vec![1.0, 2.0, 3.0]),
        (2, vec![]),
        (5, (0..7).map(|x| x as f32).collect()),
    ];
    let expected = || vec![(0, 3), (2, 0), (5, 7)];
    for most in [1, 2, 3, 4, 10, 100] {
        let fs = frames(values.clone(), most);
        assert!(fs
            .iter()
            .all(|f| f.iter().map(|e| e.1.len()).sum::<usize>() <= most));
        assert_eq!(fs.len(), 10usize.div_ceil(most).max(1), "at most {most}");
        let mut g = Gathering::new(expected(), "AMAX").unwrap();
        for f in fs {
            assert!(!g.complete());
            let again = Frame::Amax { values: f };
            let Frame::Amax { values } = Frame::decode(&again.encode()[4..]).unwrap() else {
                panic!("AMAX decodes as AMAX");
            };
            g.take(values, "AMAX").unwrap();
        }
        assert!(g.complete(), "at most {most}");
        assert_eq!(g.into_values(), values);
    }
    let mut g = Gathering::new(expected(), "SCALES").unwrap();
    g.take(vec![(0, vec![1.0])], "SCALES").unwrap();
    for (bad, says) in [
        (vec![(0, vec![])], "request #0 continued with no value"),
        (
            vec![(2, vec![1.0])],
            "request #2 with values 1..2 where request #0 has 3",
        ),
        (
            vec![(0, vec![1.0, 1.0, 1.0])],
            "request #0 with values 1..4 where request #0 has 3",
        ),
        (
            vec![(0, vec![1.0]), (2, vec![])],
            "request #0 short of its 3 values mid-frame",
        ),
        (vec![], "a frame with no request"),
    ] {
        let e = g.take(bad, "SCALES").unwrap_err();
        assert!(e.message.contains(says), "{e}");
    }
    let mut g = Gathering::new(vec![(0, 1)], "AMAX").unwrap();
    g.take(vec![(0, vec![1.0])], "AMAX").unwrap();
    let e = g.take(vec![(1, vec![1.0])], "AMAX").unwrap_err();
    assert!(e.message.contains("after every request's values"), "{e}");
}
