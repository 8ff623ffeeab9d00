//! Seeded mutation fuzzing of everything that parses untrusted bytes: the
//! safetensors header parser, the wire frame decoder, the checksum file and
//! version.yaml readers, the plan builder (manifest against registry), and
//! WANT requests over hostile geometry (decoded, checked, walked).
//! A target passes when every input parses or is refused with an error,
//! without panic, within a time bound, and within bounded memory.
//!
//! A few seconds per target by default; `WM_FUZZ_SECONDS=60 cargo test
//! --release --test fuzz` runs longer, `WM_FUZZ_SEED=<n>` replays a run
//! (each target prints its seed).

#[path = "common/mutator.rs"]
mod mutator;

use mutator::{fuzz, Target};
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::checksums::Checksums;
use weight_manager_core::checkpoint::safetensors_file::parse_header;
use weight_manager_core::checkpoint::version::parse_version_yaml;
use weight_manager_core::internals::wire::{
    check_requests, split_entries, BucketEntry, CudaBuffer, DeltaBase, DeltaRun, Frame, Request,
    RunVerdict, MAX_BLOCKS,
};
use weight_manager_core::internals::Registry;
use weight_manager_core::plan::{make_plan, PlanOptions, Target as PlanTarget};
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::{LogLevel, Logger};
use weight_manager_core::{Manifest, Placement, TensorMeta};

const JSON_TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\\u0000",
    b"\\",
    b"null",
    b"true",
    b"-1",
    b"1e999",
    b"18446744073709551616",
    b"4294967296",
    b"\"dtype\"",
    b"\"shape\"",
    b"\"data_offsets\"",
    b"\"__metadata__\"",
    b"\"wm.shard.w\"",
    b"\\\"offset\\\":[9,0]",
    b"\"F32\"",
    b"\"BF16\"",
    b"\"U8\"",
    b"[0,8]",
    b"[1,1,1,1,1,1,1,1,1]",
];

/// The data bytes every fuzzed safetensors file has after its header.
const DATA: u64 = 256;

/// A header padded with spaces so that the data starts 8-aligned, as
/// safetensors writers do.
fn padded(json: &[u8]) -> Vec<u8> {
    let mut h = json.to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    h
}

#[test]
fn fuzz_safetensors_header() {
    let seeds = [
        r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}"#,
        r#"{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"e":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},"i":{"dtype":"I64","shape":[3,1],"data_offsets":[8,32]}}"#,
        r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b.c":{"dtype":"I8","shape":[2,2],"data_offsets":[3,7]}}"#,
        r#"{"__metadata__":{"wm.shard.w":"{\"tensor\":\"g\",\"global_shape\":[8,4],\"offset\":[6,0]}","format":"pt"},"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}}"#,
    ];
    let target = Target {
        name: "safetensors header",
        seeds: seeds.iter().map(|s| s.as_bytes().to_vec()).collect(),
        tokens: JSON_TOKENS,
        max_len: 4096,
    };
    let path = Path::new("fuzz.safetensors");
    fuzz(target, |input| {
        // Padded like a writer pads, so that a mutation's length does not
        // make every tensor misaligned.
        let json = padded(input);
        let file_len = 8 + json.len() as u64 + DATA;
        let Ok(h) = parse_header(&json, file_len, path) else {
            return false;
        };
        for w in h.tensors.windows(2) {
            assert!(w[0].offset + w[0].nbytes <= w[1].offset, "overlap accepted");
        }
        for t in &h.tensors {
            assert!(t.offset + t.nbytes <= file_len, "range outside the file");
            assert!(!t.name.contains('\0'), "NUL in a name accepted");
            assert_eq!(t.offset % t.dtype.size() as u64, 0, "misaligned");
            if let Some(shard) = &t.shard {
                let p = &shard.placement;
                p.check(&shard.tensor, &t.shape)
                    .expect("a parsed placement checks");
            }
        }
        true
    });
}

/// One frame of each kind, as the fuzzers' seeds.
fn frames() -> Vec<Frame> {
    let mut frames = plan_frames();
    frames.extend(transfer_frames());
    frames
}

/// The handshake and plan frames: hello, manifests, want, sums.
fn plan_frames() -> Vec<Frame> {
    let meta = |name: &str, shape: &[u64], checksum| TensorMeta {
        name: name.into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        nbytes: shape.iter().product::<u64>() * 4,
        checksum,
        placement: None,
    };
    vec![
        Frame::Hello {
            rank: 1,
            world_size: 2,
            gpu_id: "3".into(),
            version: "v1".into(),
            base: "v0".into(),
        },
        Frame::Manifest {
            version: "v1".into(),
            tensors: vec![meta("a", &[2, 3], Some(7)), meta("b", &[], None)],
            base_kept: false,
        },
        Frame::Manifest {
            version: "v1".into(),
            tensors: vec![
                TensorMeta {
                    placement: Some(Placement {
                        global_shape: vec![8, 3],
                        offset: vec![4, 0],
                    }),
                    ..meta("w", &[2, 3], Some(9))
                },
                TensorMeta {
                    placement: Some(Placement {
                        global_shape: vec![5],
                        offset: vec![5],
                    }),
                    ..meta("e", &[0], None)
                },
            ],
            base_kept: true,
        },
        Frame::Want {
            requests: vec![
                Request::whole(0, 64, false),
                Request::of_blocks(5, [(8, 4), (24, 4), (40, 4)], true),
            ],
            base: Some(DeltaBase {
                version: "step-1".into(),
                fingerprints: vec![(0, 7), (1, 1 << 100)],
            }),
            quant: vec![(1, weight_manager_core::quant::Scheme::Fp8Block128)],
        },
        Frame::Amax {
            values: vec![(1, vec![0.5, 448.0, 0.0])],
        },
        Frame::Scales {
            values: vec![(0, vec![]), (1, vec![1e-4])],
        },
        Frame::Deltas {
            kept: true,
            runs: vec![DeltaRun {
                request: 1,
                verdict: RunVerdict::Delta,
                len: 12,
                sum: 3,
            }],
        },
        Frame::Delta {
            request: 1,
            bytes: vec![3, 0, 1, 2],
        },
        Frame::Sums {
            seq: 4,
            sums: vec![(1, 1 << 90)],
        },
    ]
}

/// The transfer frames: buffers, buckets, acknowledgements, errors,
/// authentication, ready.
fn transfer_frames() -> Vec<Frame> {
    vec![
        Frame::Buffers {
            sizes: vec![4096, 8],
        },
        Frame::CudaBuffers {
            buffers: vec![CudaBuffer {
                handle: [9; 64],
                size: 1 << 20,
            }],
        },
        Frame::Bucket {
            seq: 4,
            buffer: 1,
            entries: vec![BucketEntry {
                request: 0,
                offset: 8,
                len: 16,
                buffer_offset: 0,
            }],
        },
        Frame::Ack { seq: 4 },
        Frame::End { buckets: 5 },
        Frame::Error {
            code: 3,
            text: "no such version".into(),
        },
        Frame::Challenge { nonce: [1; 32] },
        Frame::Proof {
            mac: [2; 32],
            nonce: [3; 32],
        },
        Frame::Ready {
            address: vec![5; 40],
            bucket_size: 1 << 20,
            depth: 2,
            direct: true,
            keyed: true,
        },
    ]
}

#[test]
fn fuzz_wire_frame_decode() {
    let target = Target {
        name: "wire frame",
        // encode() puts the 4-byte length in front of the body.
        seeds: frames().iter().map(|f| f.encode()[4..].to_vec()).collect(),
        tokens: &[
            &[0],
            &[1],
            &[2],
            &[0xff, 0xff, 0xff, 0xff],
            &[0, 0, 0, 0x10],
        ],
        max_len: 4096,
    };
    fuzz(target, |body| {
        let Ok(frame) = Frame::decode(body) else {
            return false;
        };
        // A shard that decodes lies inside its global tensor.
        if let Frame::Manifest { tensors, .. } = &frame {
            for t in tensors {
                if let Some(p) = &t.placement {
                    p.check(&t.name, &t.shape)
                        .expect("a decoded placement checks");
                }
            }
        }
        // Whatever decodes encodes back to the same frame.
        let again = Frame::decode(&frame.encode()[4..]).expect("a re-encoded frame decodes");
        assert_eq!(again, frame, "frame does not survive a round trip");
        true
    });
}

#[test]
fn fuzz_checksum_file() {
    let seed = r#"{
  "format": "weight_manager.checksums.v1",
  "algorithm": "xxh3-128",
  "files": {
    "a.safetensors": {"size": 123, "tensors": {"w": "000102030405060708090a0b0c0d0e0f", "b": "ffffffffffffffffffffffffffffffff"}},
    "b.safetensors": {"size": 8, "tensors": {}}
  }
}"#;
    let target = Target {
        name: "checksum file",
        seeds: vec![seed.as_bytes().to_vec()],
        tokens: JSON_TOKENS,
        max_len: 4096,
    };
    let path = Path::new("wm_checksums.json");
    fuzz(target, |text| {
        let Ok(c) = Checksums::parse(path, text) else {
            return false;
        };
        let _ = c.for_file("a.safetensors", 123);
        let _ = c.for_file("b.safetensors", 0);
        true
    });
}

#[test]
fn fuzz_version_yaml() {
    let seeds = [
        "step: 12345\n",
        "---\nname: run\nstep: '7'\nother: [1, {a: b}]\n...\n",
        "a: {b: [c, d]}\nstep: 1.5 # comment\n",
        "? step\n: !!str 9\n",
    ];
    let target = Target {
        name: "version.yaml",
        seeds: seeds.iter().map(|s| s.as_bytes().to_vec()).collect(),
        tokens: &[
            b"&a ",
            b"*a",
            b"[",
            b"]",
            b"{",
            b"}",
            b"step",
            b": ",
            b"\n",
            b"- ",
            b"!!str ",
            b"!!int ",
            b"---\n",
            b"...\n",
            b"? ",
            b"|\n",
            b">\n",
            b"'",
            b"\"",
            b"#",
            b"%YAML 1.2\n",
            b"~",
            b"\t",
            b"  ",
        ],
        max_len: 2048,
    };
    fuzz(target, |bytes| {
        let text = String::from_utf8_lossy(bytes);
        let deadline = Instant::now() + Duration::from_secs(60);
        match parse_version_yaml(&text, deadline) {
            Ok(step) => {
                assert!(!step.is_empty(), "an empty step accepted");
                true
            }
            Err(_) => false,
        }
    });
}

const PARAMS: [(&str, DType, &[u64]); 4] = [
    ("w0", DType::F32, &[4, 2]),
    ("w1", DType::Bf16, &[3]),
    ("w2", DType::U8, &[]),
    ("w3", DType::I64, &[2, 1, 2]),
];
const NAMES: [&str; 7] = ["w0", "w1", "w2", "w3", "x", "", "w0\0"];

/// A manifest from bytes: per tensor a name pick, a dtype, a byte `k` whose
/// low 4 bits count the dims that follow (0xff: u64::MAX, 0xfe: 2^32) and
/// whose top bit says it has a checksum, then whether its size is right,
/// off by one, or huge. Bytes that run out end the list.
fn manifest_from(bytes: &[u8]) -> Manifest {
    let mut it = bytes.iter().copied();
    let mut tensors = Vec::new();
    while let (Some(n), Some(d), Some(k)) = (it.next(), it.next(), it.next()) {
        let dtype = DType::from_raw(d as u32 % 16).unwrap_or(DType::U8);
        let shape: Vec<u64> = (0..k & 0x0f)
            .map_while(|_| it.next())
            .map(|b| match b {
                0xff => u64::MAX,
                0xfe => 1 << 32,
                b => b as u64,
            })
            .collect();
        let right = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d));
        let nbytes = match (it.next().unwrap_or(0) % 4, right) {
            (0 | 1, Some(n)) => n,
            (2, Some(n)) => n + 1,
            _ => u64::MAX,
        };
        tensors.push(TensorMeta {
            name: NAMES[n as usize % NAMES.len()].to_string(),
            dtype,
            shape,
            nbytes,
            checksum: (k & 0x80 != 0).then_some(k as u128),
            placement: None,
        });
    }
    Manifest {
        tensors: tensors.into(),
        version: None,
    }
}

/// The bytes `manifest_from` turns into exactly the registry's params.
fn manifest_seed(flags: u8) -> Vec<u8> {
    let mut out = vec![flags];
    for (i, (_, dtype, shape)) in PARAMS.iter().enumerate() {
        let raw = (0..16u8)
            .find(|&r| DType::from_raw(r as u32) == Some(*dtype))
            .expect("a raw dtype");
        out.extend([i as u8, raw, shape.len() as u8 | 0x80]);
        out.extend(shape.iter().map(|&d| d as u8));
        out.push(0);
    }
    out
}

#[test]
fn fuzz_plan_builder() {
    let mut registry = Registry::default();
    for (name, dtype, shape) in PARAMS {
        registry
            .allocate(&ParamSpec::host(name, dtype, shape))
            .unwrap();
    }
    let logger = Logger::closure(LogLevel::Off, |_, _| {});
    let target = Target {
        name: "plan builder",
        seeds: (0..8).map(manifest_seed).collect(),
        tokens: &[&[0xff], &[0xfe], &[0, 0, 0], &[4, 0, 0x81, 1, 0]],
        max_len: 1024,
    };
    fuzz(target, |bytes| {
        let Some((&flags, rest)) = bytes.split_first() else {
            return false;
        };
        let opts = PlanOptions {
            skip_unknown: flags & 1 != 0,
            callback: flags & 2 != 0,
            verify: flags & 4 != 0,
            ..Default::default()
        };
        let manifest = manifest_from(rest);
        let Ok(plan) = make_plan(&manifest, &registry, opts, &logger) else {
            return false;
        };
        assert_eq!(plan.entries.len(), manifest.tensors.len());
        let mut bytes = 0;
        for e in &plan.entries {
            match e.target {
                PlanTarget::Param(i) => {
                    let p = &registry.params()[i];
                    assert_eq!(
                        (p.name.as_str(), p.nbytes as u64),
                        (e.meta.name.as_str(), e.meta.nbytes)
                    );
                    bytes += e.meta.nbytes;
                }
                PlanTarget::Callback => bytes += e.meta.nbytes,
                PlanTarget::Skip => {}
            }
        }
        assert_eq!(plan.bytes, bytes, "plan bytes disagree with its entries");
        true
    });
}

/// The global tensor the geometry target splits: [512, 32768] f32 (no
/// bytes exist: plans only read manifests).
const GEOMETRY: [u64; 2] = [512, 32768];

/// Shards (of any source) and engine pieces of "g" decoded from `bytes`,
/// each a group of up to 16,384 boxes tiled along one dimension: one
/// column or one row each, overlapping, stray, or out of bounds, as
/// hostile trainers and engines announce them.
fn geometry_from(bytes: &[u8]) -> (Vec<Manifest>, Vec<weight_manager_core::plan::ParamLayout>) {
    use weight_manager_core::plan::ParamLayout;
    use weight_manager_core::Piece;
    use weight_manager_core::TensorBox;
    let mut sources: Vec<Vec<TensorMeta>> = vec![Vec::new(); 4];
    let mut pieces = Vec::new();
    for g in bytes.chunks_exact(6) {
        let (who, dim) = (g[0] as usize % 5, (g[1] % 2) as usize);
        let count = (u16::from_le_bytes([g[2], g[3]]) & 0x3fff) as u64 + 1;
        // A length of 0-15 shifted by 0-15 bits; starts in steps of 256.
        let (len, start) = (((g[4] & 0x0f) as u64) << (g[4] >> 4), g[5] as u64 * 256);
        for k in 0..count {
            let mut b = TensorBox::whole(&GEOMETRY);
            (b.offset[dim], b.len[dim]) = (start + k * len.max(1), len);
            if who == 4 {
                let at = vec![b.offset[0], b.offset[1]];
                pieces.push(Piece {
                    tensor: "g".into(),
                    global: b,
                    at,
                });
                continue;
            }
            sources[who].push(TensorMeta {
                name: "g".into(),
                dtype: DType::F32,
                nbytes: b.len.iter().product::<u64>() * 4,
                shape: b.len.clone(),
                checksum: None,
                placement: Some(Placement {
                    global_shape: GEOMETRY.to_vec(),
                    offset: b.offset.clone(),
                }),
            });
        }
    }
    let manifests = sources
        .into_iter()
        .map(|t| Manifest {
            tensors: t.into(),
            version: None,
        })
        .collect();
    let param = ParamLayout {
        pieces,
        whole: false,
        ..ParamLayout::whole("g", DType::F32, &GEOMETRY)
    };
    (manifests, vec![param])
}

/// Hostile shard and piece geometry (tens of thousands of one-column or
/// one-row boxes, overlaps, gaps) planned under a deadline: each input is
/// planned or refused within the fuzzer's time bound and memory bound, and
/// never by comparing every pair (80,000 column shards took 15 s).
#[test]
fn fuzz_sharded_plan_over_hostile_geometry() {
    use weight_manager_core::internals::check_pieces;
    use weight_manager_core::plan::make_sharded_plan;
    let logger = Logger::closure(LogLevel::Off, |_, _| {});
    let group = |who: u8, dim: u8, count: u16, len: u8, start: u8| {
        let c = count.to_le_bytes();
        [who, dim, c[0], c[1], len, start]
    };
    // Valid: 32,768 one-column shards over 2 sources, and 2 column pieces
    // of 16,384 columns (0xe1: 1 << 14).
    let mut columns = Vec::new();
    columns.extend(group(0, 1, 16383, 1, 0));
    columns.extend(group(1, 1, 16383, 1, 64));
    columns.extend(group(4, 1, 1, 0xe1, 0));
    // Valid: 512 one-row shards, one piece of all 512 rows (1 << 9).
    let mut rows = Vec::new();
    rows.extend(group(2, 0, 511, 1, 0));
    rows.extend(group(4, 0, 0, 0x91, 0));
    // Valid: 16,384 two-column shards, 32,768 one-column pieces (a piece
    // check comparing every pair took 31 s for 60,000).
    let mut many = Vec::new();
    many.extend(group(3, 1, 16383, 2, 0));
    many.extend(group(4, 1, 16383, 1, 0));
    many.extend(group(4, 1, 16383, 1, 64));
    let target = Target {
        name: "sharded plan geometry",
        seeds: vec![rows, columns, many],
        tokens: &[
            &[0xff, 0xff],
            &[0, 1, 0xff, 0xff, 1, 0],
            &[4, 1, 0xff, 0xff, 1, 0],
        ],
        max_len: 36,
    };
    fuzz(target, |bytes| {
        let (manifests, params) = geometry_from(bytes);
        let p = &params[0];
        if check_pieces(&p.name, &p.shape, &p.pieces).is_err() {
            return false;
        }
        let refs: Vec<&Manifest> = manifests.iter().collect();
        let opts = PlanOptions {
            deadline: Some(Instant::now() + Duration::from_secs(2)),
            ..Default::default()
        };
        make_sharded_plan(&refs, &params, opts, &logger).is_ok()
    });
}

/// A deadline that passes while planning stops the plan with TIMEOUT
/// instead of finishing late (a 9 MiB shard file used to make a 5 s update
/// succeed after 9-14 s).
#[test]
fn planning_stops_at_the_deadline() {
    use weight_manager_core::plan::make_sharded_plan;
    let logger = Logger::closure(LogLevel::Off, |_, _| {});
    let mut bytes = Vec::new();
    for who in 0..4u8 {
        let c = 8191u16.to_le_bytes();
        bytes.extend([who, 1, c[0], c[1], 1, who * 32]);
    }
    bytes.extend([4, 1, 0, 0, 0x01, 0]);
    let (manifests, params) = geometry_from(&bytes);
    let refs: Vec<&Manifest> = manifests.iter().collect();
    let opts = PlanOptions {
        deadline: Some(Instant::now()),
        ..Default::default()
    };
    let e = make_sharded_plan(&refs, &params, opts, &logger).unwrap_err();
    assert_eq!(
        e.code,
        weight_manager_core::wm_result::WM_ERR_TIMEOUT,
        "{e}"
    );
    assert!(e.message.contains("deadline passed while planning"), "{e}");
}

/// A delta (`weight_manager_core::delta`) checked, and applied onto a run of
/// bf16 elements:
/// hostile positions, counts, forms and lengths are refused or applied,
/// never a panic, within the time and memory bounds; what applies
/// re-encodes to a delta that gives the same bytes, and its changes as a
/// GPU receiver lists them give them too.
#[test]
fn fuzz_delta_apply() {
    use weight_manager_core::delta::{apply, check, encode, list_changes};
    let elems = 70_000;
    let old: Vec<u8> = (0..elems * 2).map(|i| (i * 7 % 251) as u8).collect();
    let seeds: Vec<Vec<u8>> = [1usize, 53, 3, 1]
        .iter()
        .enumerate()
        .map(|(k, &every)| {
            let mut new = old.clone();
            for (i, e) in new.chunks_exact_mut(2).enumerate() {
                if k < 3 && i % every == 0 {
                    e[1] ^= 0x40;
                }
            }
            let mut d = Vec::new();
            encode(&old, &new, 2, &mut d);
            d
        })
        .collect();
    let target = Target {
        name: "delta apply",
        seeds,
        tokens: &[&[0], &[1], &[2], &[3], &[0x80, 0x80], &[0xff, 0xff, 0x03]],
        max_len: 1 << 18,
    };
    fuzz(target, |bytes| {
        let mut run = old.clone();
        let applied = apply(bytes, &mut run, 2);
        // The check before writing refuses exactly what applying refuses.
        assert_eq!(
            check(bytes, old.len(), 2).is_ok(),
            applied.is_ok(),
            "{applied:?}"
        );
        let listed = list_changes(bytes, old.len(), 2);
        assert_eq!(listed.is_ok(), applied.is_ok(), "{applied:?}");
        let Ok(listed) = listed else {
            return false;
        };
        let mut patched = old.clone();
        for (at, range) in &listed.whole {
            patched[*at as usize..*at as usize + range.len()]
                .copy_from_slice(&bytes[range.clone()]);
        }
        for (p, x) in listed.positions.iter().zip(listed.values.chunks_exact(2)) {
            patched[*p as usize * 2..*p as usize * 2 + 2].copy_from_slice(x);
        }
        assert!(patched == run, "the listed changes give other bytes");
        let mut again = Vec::new();
        encode(&old, &run, 2, &mut again);
        let mut check = old.clone();
        apply(&again, &mut check, 2).expect("a delta the encoder wrote applies");
        assert!(check == run, "re-encoded delta gives other bytes");
        true
    });
}

/// The WANT decoder over hostile geometry: a WANT that decodes and checks
/// against a publisher's tensors (`check_requests`) is walked block by
/// block as the publisher walks it (its network messages, then every
/// block), within the fuzzer's time and memory bounds: a few bytes asking
/// for millions of one-byte rows cost steps, never a list of them, and no
/// more than `MAX_BLOCKS` of them pass the check.
#[test]
fn fuzz_want_geometry() {
    /// The publisher's tensors: 64 MiB, 1 MiB, 16 bytes and an empty one.
    const SIZES: [u64; 4] = [64 << 20, 1 << 20, 16, 0];
    let body = |requests| {
        Frame::Want {
            requests,
            base: None,
            quant: vec![],
        }
        .encode()[4..]
            .to_vec()
    };
    let every_other = |from, n: u64| (0..n).map(move |i| (from + 2 * i, 1));
    let seeds = vec![
        body(vec![Request::whole(0, SIZES[0], true)]),
        body(vec![
            Request::of_blocks(1, every_other(0, 1000), false),
            Request::of_blocks(2, [(3, 4), (7, 4), (11, 4)], true),
        ]),
        // Every other byte of 32 MiB and columns: exactly MAX_BLOCKS blocks.
        body(vec![
            Request::of_blocks(0, every_other(1, MAX_BLOCKS - 64), false),
            Request::of_blocks(1, (0..64).map(|r| (r * 4096 + 8, 96)), true),
        ]),
    ];
    let u64s = [1u64, 2, 3, MAX_BLOCKS, MAX_BLOCKS + 1, 1 << 32, u64::MAX].map(u64::to_le_bytes);
    let tokens: Vec<&[u8]> = u64s.iter().map(|t| t.as_slice()).collect();
    let target = Target {
        name: "WANT geometry",
        seeds,
        tokens: &tokens,
        max_len: 4096,
    };
    fuzz(target, |body| {
        let Ok(Frame::Want { requests, .. }) = Frame::decode(body) else {
            return false;
        };
        if check_requests(&requests, &SIZES).is_err() {
            return false;
        }
        let mut blocks = 0u64;
        for (k, q) in requests.iter().enumerate() {
            let (n, size) = (q.bytes(), SIZES[q.tensor as usize]);
            assert!(n <= size, "request #{k}: {n} bytes of a {size}-byte tensor");
            let whole = BucketEntry {
                request: k as u32,
                offset: 0,
                len: n,
                buffer_offset: 0,
            };
            let messages = split_entries(&[whole], &requests);
            assert_eq!(messages.iter().map(|m| m.len).sum::<u64>(), n);
            let mut at = 0;
            for (src, offset, len) in q.extents(0, n) {
                assert_eq!(offset, at, "request #{k}: pieces in order");
                assert!(
                    len > 0 && src + len <= size,
                    "request #{k}: a piece past its tensor"
                );
                at += len;
                blocks += 1;
            }
            assert_eq!(at, n, "request #{k}: pieces cover its bytes");
        }
        let counted: u64 = requests.iter().map(Request::blocks).sum();
        assert_eq!(blocks, counted, "blocks walked against blocks counted");
        assert!(blocks <= MAX_BLOCKS, "{blocks} blocks passed the check");
        true
    });
}
