//! What sessions and serve calls did.

use std::time::Duration;

/// What one session did.
#[derive(Clone, Debug, Default)]
pub struct SessionStats {
    pub rank: u32,
    pub version: String,
    pub tensors: u64,
    pub bytes: u64,
    pub buckets: u64,
    /// Bytes hashed for this session's manifest, and the time it took
    /// before the manifest could go out: 0 when every checksum was known
    /// (a published version, `wm_checksums.json`, or live tensors an
    /// earlier session of the same serve call hashed).
    pub hashed: u64,
    pub hash: Duration,
    /// Requests sent as deltas against the engine's base, and their bytes
    /// (in `bytes` too).
    pub delta_runs: u64,
    pub delta_bytes: u64,
    /// Of those, the deltas another session of the version had encoded
    /// already (engine ranks taking the same runs).
    pub delta_cached: u64,
    /// Source bytes of the requests quantized to FP8 for the engine (0 for
    /// a request served the image an earlier session of the same published
    /// version made: `kept_images.rs`), and
    /// the time the session spent on them: reading them and finding their
    /// amax, the engine's AMAX/SCALES round trip, quantizing on the GPU,
    /// and waiting for images in host memory, which are quantized while
    /// the buckets before them go out.
    pub quantized: u64,
    pub quantize: Duration,
    /// Network: UCX messages sent (one per bucket entry; small blocks of a
    /// request travel packed, several to a message). IPC: 0.
    pub messages: u64,
    /// Time spent packing buckets into the shared buffers.
    pub pack: Duration,
    /// Time spent waiting for the engine's acknowledgements.
    pub wait: Duration,
    pub total: Duration,
}

/// What `serve` did.
#[derive(Clone, Debug, Default)]
pub struct ServeStats {
    pub sessions: Vec<SessionStats>,
}
