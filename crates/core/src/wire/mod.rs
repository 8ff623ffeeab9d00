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
mod quant;
mod want;
mod want_bounds;

use crate::manifest::TensorMeta;
use crate::quant::Scheme;

pub use buckets::{
    check_bucket, check_windows, max_scatter_parts, message_source, message_tag, net_message_bytes,
    split_entries,
};
pub(crate) use buckets::{NET_MESSAGE, PACK_BELOW};
pub use deltas::{delta_tag, DeltaBase, DeltaRun, RunVerdict, DELTA_PIECE};
pub(crate) use fields::{In, Out};
pub use quant::{frames, values_per_frame, BlockValues, Gathering};
pub use want::{check_requests, Request, WantRun, MAX_BLOCKS, MAX_OVERLAP};
pub use want_bounds::{check_cuts, check_size};

pub(crate) const MAGIC: u32 = 0x574d_4950; // "WMIP"
/// 2: manifest tensors carry their shard placement. 3: WANT asks for
/// requests (strided runs of a tensor), buckets carry request bytes, SUMS.
/// 4: a published version's buckets are WINDOWS (entries the engine
/// expands from its own requests), whatever the requests' shapes.
/// 5: over the network, a bucket's SUMS follows its messages (the engine
/// takes it before it finishes a part it covers), so the publisher packs
/// and sends a bucket a chunk at a time.
/// 6: HELLO names the version the engine's params hold, MANIFEST says
/// whether the publisher keeps it, WANT may name it as a base (with
/// fingerprints), and the publisher answers DELTAS and DELTA frames
/// (`deltas.rs`). 7: WANT names quantized requests, AMAX and SCALES
/// agree their blocks' amax (`quant.rs`). 8: a quantized request may be
/// fingerprinted (its delta is over FP8 bytes), DELTAS' verdict 3. 9:
/// AMAX and SCALES may take several frames (`quant.rs`; MXFP8). 10: the
/// engine sends READY right after the challenge, before MANIFEST, so the
/// publisher connects to its worker while it hashes for the manifest.
pub(crate) const PROTOCOL: u32 = 10;
/// Largest frame accepted (a manifest of ~500k tensors).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// The largest frame either side reads before its peer is authenticated
/// (network; IPC: before the engine's HELLO is read), so a peer without
/// the secret cannot make it allocate [`MAX_FRAME`] per connection.
pub(crate) const HANDSHAKE_FRAME: usize = 64 << 10;
/// Bucket offsets are multiples of this (`docs/wire.md`).
pub(crate) const ALIGN: u64 = 256;
/// Most shared buffers a session may use.
pub(crate) const MAX_BUFFERS: usize = 8;
/// Largest UCX worker address accepted.
pub(crate) const MAX_ADDRESS: usize = 64 << 10;
/// Largest bucket a network engine may ask for in its READY.
pub(crate) const MAX_NET_BUCKET: u64 = 16 << 30;
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
    pub(super) const AMAX: u8 = 18;
    pub(super) const SCALES: u8 = 19;
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

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// Engine to publisher: who asks, for which version ("" = latest), and
    /// the version its params hold, to take deltas against ("" = none).
    Hello {
        rank: u32,
        world_size: u32,
        gpu_id: String,
        version: String,
        base: String,
    },
    /// Publisher to engine: the tensors this rank gets, their version, and
    /// whether it keeps HELLO's base where it can send deltas against it.
    Manifest {
        version: String,
        tensors: Vec<TensorMeta>,
        base_kept: bool,
    },
    /// Engine to publisher: the bytes it wants, one request per plan entry
    /// (`want.rs`), and the version its params hold, when it would take
    /// deltas against it (`deltas.rs`).
    Want {
        requests: Vec<Request>,
        base: Option<DeltaBase>,
        /// Requests to quantize to FP8 (`quant.rs`): their runs count
        /// elements.
        quant: Vec<(u32, Scheme)>,
    },
    /// Publisher to engine, after WANT when it asked for quantized
    /// requests: each one's blocks' amax (`quant.rs`).
    Amax { values: BlockValues },
    /// Engine to publisher, after every publisher's AMAX: the agreed amax
    /// of the same blocks.
    Scales { values: BlockValues },
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
    /// Network, engine to publisher right after the PROOFs (protocol 10;
    /// before MANIFEST): where to send the bytes (the
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
            Frame::Amax { .. } => "AMAX",
            Frame::Scales { .. } => "SCALES",
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
mod tests;
