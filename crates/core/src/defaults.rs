//! Every default that more than one place needs, written once.
//!
//! The timeouts and the bucket shape are those of FastDeploy's weight-update
//! path, which this library replaces: engines and controllers built around
//! it already budget for them. A C field or request left at 0 gets the
//! value here; the C header's field comments state the same numbers.

use std::time::Duration;

/// Bound on one bucket: the engine waiting for it to arrive, the publisher
/// waiting for its acknowledgement (`wm_publisher_config.bucket_timeout_ms`),
/// a fan-out member waiting for its root.
pub const BUCKET_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound on rendezvous and on every per-step wait and barrier of a group
/// (`wm_group_config.signal_timeout_ms` = 0): a dead or stalled rank is reported
/// within it.
pub const SIGNAL_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound on a whole update (`wm_update_request.timeout_ms` = 0), and on a
/// publisher's session.
pub const UPDATE_TIMEOUT: Duration = Duration::from_secs(600);

/// Largest bucket: the size of each shared buffer (IPC) or staging slot
/// (network), so it is also what one buffer costs in memory.
pub const BUCKET_SIZE: usize = 512 << 20;

/// Buckets in flight: two let packing the next overlap applying this one.
pub const BUFFERS_IN_FLIGHT: usize = 2;

/// FastDeploy's shared directory, the last place a snapshot is looked for
/// (`wm_config.fallback_dir` = NULL; "" disables it).
pub const FALLBACK_DIR: &str = "/shared_ipc_meta";

/// Bound on the bytes the library stages for the per-tensor callback
/// (`wm_memory_config.callback_staging_limit` = 0). The library's own choice, as
/// the sizes come from the source with no registered param to bound them:
/// above any single tensor of today's models, far below a node's memory.
pub const CALLBACK_STAGING_LIMIT: u64 = 4 << 30;

/// Versions a publisher keeps on disk (`wm_publisher_config.keep_versions`).
pub const KEEP_VERSIONS: usize = 2;
