//! The publisher's settings.

use crate::defaults;
use crate::logging::Logger;
use crate::memory::copy::default_threads;
use crate::result::{Error, Result};
use std::time::Duration;

#[derive(Clone)]
pub struct PublisherConfig {
    /// Largest bucket (default 512 MiB).
    pub bucket_size: usize,
    /// Buffers in flight (default 2).
    pub buffers: usize,
    /// Permissions of the socket file.
    pub socket_mode: u32,
    /// Serve engines running as another uid.
    pub allow_other_uids: bool,
    /// Bound on one engine's acknowledgement of a bucket.
    pub bucket_timeout: Duration,
    /// Bound on a new connection's handshake (HELLO, and the network
    /// challenge): one that has not finished by then is dropped, and never
    /// counts as one of the engines `serve` waits for.
    pub handshake_timeout: Duration,
    /// Bound on a whole session.
    pub session_timeout: Duration,
    /// Compute checksums of in-memory tensors for the manifest.
    pub checksums: bool,
    /// Threads packing buckets and copying and hashing published versions;
    /// 0: one per core.
    pub threads: usize,
    /// Network: the shared secret (None: `WM_NET_SECRET`).
    pub secret: Option<Vec<u8>>,
    /// Versions kept by `publish` (the oldest is dropped first).
    pub keep_versions: usize,
    /// Test hook, in test builds only (`cfg(test)`, or the `test-hooks`
    /// feature the integration tests turn on): flip one bit of this tensor
    /// after packing it, to prove that verification catches corruption.
    /// Sessions then pack every bucket (no zero-copy path), to have a copy
    /// to flip the bit in (see `hooks`).
    #[cfg(any(test, feature = "test-hooks"))]
    pub corrupt_tensor: Option<String>,
    pub logger: Logger,
}

/// Whether this build has the test hooks (`cfg(test)` or the `test-hooks`
/// feature): `wm --version` says so, and the tests check it before they
/// drive `wm serve --corrupt`.
pub const TEST_HOOKS: bool = cfg!(any(test, feature = "test-hooks"));

impl PublisherConfig {
    /// The `corrupt_tensor` test hook, set where the build has it (the
    /// `test-hooks` feature); an error naming the hook in a product build,
    /// so that `wm serve --corrupt` needs no feature of its own.
    pub fn with_corrupt_tensor(
        self,
        tensor: String,
    ) -> std::result::Result<PublisherConfig, String> {
        #[cfg(any(test, feature = "test-hooks"))]
        return Ok(PublisherConfig {
            corrupt_tensor: Some(tensor),
            ..self
        });
        #[cfg(not(any(test, feature = "test-hooks")))]
        {
            let _ = (self, tensor);
            Err("--corrupt is a test hook, only in builds with the test-hooks feature".into())
        }
    }

    /// Threads that pack buckets and copy and hash published versions (0
    /// in the config: one per core).
    pub(crate) fn pack_threads(&self) -> usize {
        if self.threads == 0 {
            default_threads()
        } else {
            self.threads
        }
    }
}

impl Default for PublisherConfig {
    fn default() -> PublisherConfig {
        PublisherConfig {
            bucket_size: defaults::BUCKET_SIZE,
            buffers: defaults::BUFFERS_IN_FLIGHT,
            socket_mode: 0o600,
            allow_other_uids: false,
            bucket_timeout: defaults::BUCKET_TIMEOUT,
            handshake_timeout: Duration::from_secs(5),
            session_timeout: defaults::UPDATE_TIMEOUT,
            checksums: true,
            threads: 0,
            #[cfg(any(test, feature = "test-hooks"))]
            corrupt_tensor: None,
            secret: None,
            keep_versions: defaults::KEEP_VERSIONS,
            logger: Logger::default(),
        }
    }
}

/// Refuse bucket sizes and buffer counts the wire format cannot carry,
/// naming the setting that is out of range.
pub(super) fn check_config(cfg: &PublisherConfig) -> Result<()> {
    let align = crate::wire::ALIGN as usize;
    if cfg.bucket_size < align {
        return Err(Error::invalid_argument(format!(
            "publisher: bucket_size {} is below the smallest bucket, {align} bytes",
            cfg.bucket_size
        )));
    }
    if cfg.buffers == 0 || cfg.buffers > crate::wire::MAX_BUFFERS {
        return Err(Error::invalid_argument(format!(
            "publisher: buffers {} is out of range (1 to {})",
            cfg.buffers,
            crate::wire::MAX_BUFFERS
        )));
    }
    if cfg.keep_versions == 0 {
        return Err(Error::invalid_argument(
            "publisher: keep_versions 0 is out of range (at least 1; default 2)",
        ));
    }
    if cfg.socket_mode & !0o777 != 0 {
        return Err(Error::invalid_argument(format!(
            "publisher: socket_mode {:#o} has bits besides the permissions (0 to 0777)",
            cfg.socket_mode
        )));
    }
    for (what, wait) in [
        ("bucket_timeout", cfg.bucket_timeout),
        ("handshake_timeout", cfg.handshake_timeout),
        ("session_timeout", cfg.session_timeout),
    ] {
        if wait.is_zero() || wait > MAX_WAIT {
            return Err(Error::invalid_argument(format!(
                "publisher: {what} of {} ms is out of range (1 ms to 7 days)",
                wait.as_millis()
            )));
        }
    }
    Ok(())
}

/// The longest bound a publisher's wait may be given: 7 days.
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);
