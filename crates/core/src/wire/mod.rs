//! The wire format shared by the IPC path and the network path (staged or
//! direct).
//! Documented for implementers in `docs/wire.md`.
//!
//! A frame is `[length u32 LE][type u8][payload]`, `length` counting type and
//! payload. Every length, count and offset is checked against limits before
//! use: nothing a peer sends can make the reader allocate without bound, read
//! past a frame, or (through the plan and the applier) write outside a param.

//!
//! Files: the frame types here; `encode` and `decode`, one small function
//! per frame; `fields`, the bounds-checked field reader and writer; and
//! `buckets`, splitting entries into network messages and checking a
//! peer's entries.

mod buckets;
mod decode;
mod deltas;
mod encode;
mod fields;
mod want;
mod want_bounds;

use crate::manifest::TensorMeta;

pub use buckets::{
    check_bucket, check_windows, max_scatter_parts, message_source, message_tag, net_message_bytes,
    split_entries,
};
pub use deltas::{DeltaBase, DeltaRun, RunVerdict, DELTA_PIECE};
pub(crate) use fields::{In, Out};
pub use want::{check_requests, Request, WantRun, MAX_BLOCKS};
pub use want_bounds::{check_cuts, check_size};

pub(crate) const MAGIC: u32 = 0x574d_4950; // "WMIP"
/// 2: manifest tensors carry their shard placement. 3: WANT asks for
/// requests (strided runs of a tensor), buckets carry request bytes, SUMS.
/// 4: a published version's buckets are WINDOWS (entries the engine
/// expands from its own requests), whatever the requests' shapes.
/// 5: over the network, a bucket's SUMS follows its messages (the engine
/// takes it before it finishes a part it covers), so the publisher packs
/// and sends a bucket a chunk at a time.
/// 6: WANT may name the version the engine's params hold (a base, with
/// fingerprints); the publisher answers DELTAS and DELTA frames
/// (`deltas.rs`).
pub(crate) const PROTOCOL: u32 = 6;
/// Largest frame accepted (a manifest of ~500k tensors).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// Bucket offsets are multiples of this (`docs/wire.md`).
pub(crate) const ALIGN: u64 = 256;
/// Most shared buffers a session may use.
pub(crate) const MAX_BUFFERS: usize = 8;
/// Largest UCX worker address accepted.
pub(crate) const MAX_ADDRESS: usize = 64 << 10;
/// Longest name or version string.
pub(crate) const MAX_STRING: usize = 4096;

/// The type byte of each frame, after its length.
mod kind {
    pub(super) const HELLO: u8 = 1;
    pub(super) const MANIFEST: u8 = 2;
    pub(super) const WANT: u8 = 3;
    pub(super) const BUFFERS: u8 = 4;
    pub(super) const BUCKET: u8 = 5;
    pub(super) const ACK: u8 = 6;
    pub(super) const END: u8 = 7;
    pub(super) const ERROR: u8 = 8;
    pub(super) const CHALLENGE: u8 = 9;
    pub(super) const PROOF: u8 = 10;
    pub(super) const READY: u8 = 11;
    pub(super) const CUDA_BUFFERS: u8 = 12;
    pub(super) const DIGESTS: u8 = 13;
    pub(super) const SUMS: u8 = 14;
    pub(super) const WINDOWS: u8 = 15;
    pub(super) const DELTAS: u8 = 16;
    pub(super) const DELTA: u8 = 17;
}

/// One bucket entry: `len` bytes of WANT request `request` starting at its
/// byte `offset` (request bytes: its runs' blocks back to back), found at
/// `buffer_offset` in the bucket's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    pub request: u32,
    pub offset: u64,
    pub len: u64,
    pub buffer_offset: u64,
}

/// One GPU buffer of a CUDA_BUFFERS frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaBuffer {
    pub handle: [u8; 64],
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Engine to publisher: who asks, for which version ("" = latest).
    Hello {
        rank: u32,
        world_size: u32,
        gpu_id: String,
        version: String,
    },
    /// Publisher to engine: the tensors this rank gets, and their version.
    Manifest {
        version: String,
        tensors: Vec<TensorMeta>,
    },
    /// Engine to publisher: the bytes it wants, one request per plan entry
    /// (`want.rs`), and the version its params hold, when it would take
    /// deltas against it (`deltas.rs`).
    Want {
        requests: Vec<Request>,
        base: Option<DeltaBase>,
    },
    /// Publisher to engine, right after WANT when it named a base: whether
    /// the publisher keeps that version, and how each request with a
    /// fingerprint comes.
    Deltas { kept: bool, runs: Vec<DeltaRun> },
    /// Publisher to engine, after DELTAS: the next piece of request
    /// `request`'s delta.
    Delta { request: u32, bytes: Vec<u8> },
    /// Publisher to engine: sizes of the shared buffers whose descriptors
    /// travel with this frame (SCM_RIGHTS).
    Buffers { sizes: Vec<u64> },
    /// Publisher to engine: GPU buffers shared by CUDA IPC (64-byte
    /// `cuIpcGetMemHandle` handles) and their sizes, used like BUFFERS'.
    CudaBuffers { buffers: Vec<CudaBuffer> },
    /// Publisher to engine: bucket `seq` is ready in buffer `buffer`.
    Bucket {
        seq: u64,
        buffer: u32,
        entries: Vec<BucketEntry>,
    },
    /// Publisher to engine (IPC): bucket `seq` is ready as windows into
    /// buffer `buffer`, which holds the requests' tensors as they are (a
    /// published version): each entry's `buffer_offset` is where byte 0 of
    /// its request's tensor is, and the engine finds the entry's bytes by
    /// its own request's runs (`docs/wire.md`, "Published versions").
    Windows {
        seq: u64,
        buffer: u32,
        entries: Vec<BucketEntry>,
    },
    /// Engine to publisher: bucket `seq` is applied; its buffer may be reused.
    Ack { seq: u64 },
    /// Publisher to engine: every bucket was sent.
    End { buckets: u64 },
    /// Either way: giving up, with the reason and its `wm_result` code (so a
    /// missing version reads as NOT_FOUND, a wrong secret as AUTH).
    Error { code: u32, text: String },
    /// Network, publisher to engine, after HELLO: prove you hold the secret.
    Challenge { nonce: [u8; 32] },
    /// Network, both ways: an HMAC answer (`transport::auth`); the engine's
    /// carries its own nonce for the publisher to answer, the publisher's a
    /// zero nonce.
    Proof { mac: [u8; 32], nonce: [u8; 32] },
    /// Network, engine to publisher after WANT: where to send the bytes (the
    /// engine's UCX worker address), the largest bucket it takes, how many
    /// buckets may be in flight, and whether each bucket entry comes as its
    /// own message (`direct`: received straight into param memory, gdr).
    Ready {
        address: Vec<u8>,
        bucket_size: u64,
        depth: u32,
        direct: bool,
        /// Asks for a DIGESTS frame after each BUCKET.
        keyed: bool,
    },
    /// Network, publisher to engine, right after BUCKET `seq` when READY
    /// asked for it: the keyed BLAKE3 digest of each entry's bytes, in
    /// entry order (`checksum::keyed`, key from the session).
    Digests { seq: u64, digests: Vec<[u8; 32]> },
    /// Publisher to engine, right after BUCKET `seq` (and its DIGESTS) when
    /// the bucket holds the last byte of requests that asked for sums: the
    /// xxh3-128 of each such request's bytes, as (request, sum).
    Sums { seq: u64, sums: Vec<(u32, u128)> },
}

impl Frame {
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "HELLO",
            Frame::Manifest { .. } => "MANIFEST",
            Frame::Want { .. } => "WANT",
            Frame::Deltas { .. } => "DELTAS",
            Frame::Delta { .. } => "DELTA",
            Frame::Buffers { .. } => "BUFFERS",
            Frame::Bucket { .. } => "BUCKET",
            Frame::Windows { .. } => "WINDOWS",
            Frame::Ack { .. } => "ACK",
            Frame::End { .. } => "END",
            Frame::Error { .. } => "ERROR",
            Frame::Challenge { .. } => "CHALLENGE",
            Frame::Proof { .. } => "PROOF",
            Frame::Ready { .. } => "READY",
            Frame::CudaBuffers { .. } => "CUDA_BUFFERS",
            Frame::Digests { .. } => "DIGESTS",
            Frame::Sums { .. } => "SUMS",
        }
    }
}

#[cfg(test)]
mod tests {
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
        });
        round_trip(Frame::Manifest {
            version: "12".into(),
            tensors: vec![shard(&[2, 3], &[4, 3], &[2, 0]), shard(&[], &[], &[])],
        });
        round_trip(Frame::Want {
            requests: vec![
                Request::whole(0, 12, false),
                Request::of_blocks(2, [(4, 4), (12, 4), (40, 8)], true),
            ],
            base: None,
        });
        round_trip(Frame::Want {
            requests: vec![Request::whole(0, 12, false), Request::whole(1, 8, true)],
            base: Some(DeltaBase {
                version: "step-3".into(),
                fingerprints: vec![(0, 5 << 90), (1, 3)],
            }),
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
        }
        .encode();
        let flag = good.len() - 17; // the placement flag, then 2 dims
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
        }
        .encode();
        assert!(Frame::decode(&nul[4..])
            .unwrap_err()
            .message
            .contains("NUL"));
        let at = m.len() - 10; // nbytes field, then two flags
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
}
