//! The trainer side: serve weights to engine ranks on this node over IPC
//! (protocol: `docs/wire.md`).
//!
//! A [`Publisher`] listens on a Unix socket (mode 0600 by default, peers of
//! another uid refused unless allowed) and serves sessions, one per engine
//! rank that connects, each on its own thread.
//!
//! **Shards: one manifest per rank.** A rank says who it is (rank, GPU id)
//! in its HELLO and gets its own manifest:
//! - serving a directory, the rank's files are found with the snapshot
//!   layout rules (`model_state.tpR.G...`, or a HuggingFace directory that
//!   every rank gets whole), exactly as a snapshot update would find them;
//! - serving tensors from memory, each tensor is tagged with the rank it is
//!   for, or with "every rank".
//!
//! **Shards of global tensors.** A trainer rank that holds only a piece of
//! a global tensor serves it with [`Publisher::add`] and
//! [`TensorDesc::shard_of`]: the piece's own
//! box, placed at an offset in the global shape; every engine's manifest
//! carries the placement (`docs/wire.md`, protocol 2), and the engine takes
//! the parts its params need. Several publishers, one per trainer rank,
//! each on its own socket or address, serve one version together: nothing
//! ties them but the version name, and an engine pulls from each.
//!
//! **Network.** [`Publisher::bind_net`] listens on a TCP address instead:
//! control frames travel over TCP, after a shared-secret challenge
//! (`transport::auth`), and bucket bytes over UCX (`transport::ucx`), one
//! message per bucket entry; the engine lands each in its staging slot or
//! straight in its params, as it decides alone.
//!
//! **Versions.** [`Publisher::publish`] keeps the current content as a named
//! version (tensors are copied, so the trainer may overwrite its own at
//! once); the last `keep_versions` are kept and an engine asks for one by
//! name, or for "latest". Without any `publish`, the current content is the
//! one version served (the trainer keeps its tensors unchanged while serving).
//!
//! **Buckets.** The engine's requests (WANT: a tensor's bytes as strided
//! runs, one request per engine plan entry, checked before anything is
//! packed) are packed in order into buckets of at most `bucket_size` bytes
//! at 256-byte aligned offsets (a request larger than a bucket is split). Buffers alternate: while the engine applies bucket i,
//! bucket i+1 is packed into the other buffer, and a buffer is refilled only
//! after the engine acknowledged the bucket in it. Buffers return to a pool
//! when a session ends and serve the next session (sequential updates of an
//! RL run reuse them; concurrent sessions each take their own).
//!
//! **Files**, each importing only the ones below it:
//! - here: [`Publisher`], what the trainer calls;
//! - `accept`: admitting engines, one thread per connection;
//! - `handshake`: an engine's HELLO and, over the network, the challenge;
//! - `session`: one engine's session: manifest, WANT, then its buckets
//!   through `ipc` or `net`;
//! - `ipc`, `net`: how buckets go out over each (a `streamer::BucketSink`
//!   each);
//! - `streamer`: the one bucket streamer: BUCKET frames, the window of
//!   acknowledgements, END;
//! - `plan`: which request bytes go in which bucket; `shard`: one rank's
//!   manifest and bytes, and packing them; `sums`: slice checksums (SUMS); `buffers`: the pooled bucket buffers;
//! - `versions`: published versions and their copies; `offer`: what
//!   sessions serve; `socket`: the listener and the connections to shut
//!   down; `config`, `stats`; `hooks`: test-only hooks.

mod accept;
mod buffers;
mod clashes;
mod config;
mod delta_cache;
mod deltas;
mod desc;
mod device_sums;
mod engine_link;
mod handshake;
mod hooks;
mod ipc;
mod kept_images;
mod net;
mod offer;
mod plan;
mod quantize;
mod quantize_behind;
mod quantize_device;
mod quantize_job;
mod session;
mod shard;
mod socket;
mod stats;
mod streamer;
mod sums;
mod versions;

use crate::checkpoint::version::check_version;
use crate::result::{Error, Result};
use crate::transport::auth::Secret;
use parking_lot::Mutex;
use std::net::{TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The UCX tag of a network bucket entry's message (`wire::message_tag`).
pub use config::{PublisherConfig, TEST_HOOKS};
pub use desc::TensorDesc;
pub use offer::{Content, ServedTensor};
pub use stats::{ServeStats, SessionStats};
#[cfg(test)]
use versions::MAX_PREPARED;

use accept::Acceptor;
use config::check_config;
use offer::{Current, Offer};
use socket::{bind_unix, socket_identity, Connections, Listener};
use versions::Versions;

pub struct Publisher {
    /// The socket path, or the TCP address.
    path: PathBuf,
    /// Shared buffers of finished sessions, reused by the next ones: fresh
    /// shared memory costs a page fault (and, in a VM, more) per page.
    pool: buffers::Pools,
    listener: Listener,
    /// Network sessions: the shared secret, checked when binding.
    secret: Option<Secret>,
    /// The socket file's device and inode as bound (IPC).
    bound: Option<(u64, u64)>,
    cfg: PublisherConfig,
    content: Mutex<Current>,
    version: Mutex<Option<String>>,
    versions: Versions,
    /// The connections of running sessions, for [`Publisher::stop`].
    connections: Connections,
    /// A `serve` runs: one at a time, so that two never take each other's
    /// engines (the listener is one queue).
    serving: AtomicBool,
}

impl Publisher {
    /// Listen on `path`. A stale socket file there (nothing accepts on it)
    /// is replaced; a live publisher's socket, or any other file, is an
    /// error and left alone.
    pub fn bind(path: &Path, cfg: PublisherConfig) -> Result<Publisher> {
        check_config(&cfg)?;
        let (listener, bound) = bind_unix(path, cfg.socket_mode)?;
        let mut p =
            Publisher::with_listener(path.to_path_buf(), Listener::Unix(listener), None, cfg);
        p.bound = bound;
        Ok(p)
    }

    /// Listen on the TCP address `addr` ("host:port"; port 0 picks one, see
    /// [`Publisher::address`]) for engines on other nodes. Needs UCX and a
    /// shared secret (config, or `WM_NET_SECRET`).
    pub fn bind_net(addr: &str, cfg: PublisherConfig) -> Result<Publisher> {
        check_config(&cfg)?;
        // A malformed address is the caller's, and is refused before UCX
        // is loaded (which takes a while the first time).
        let addrs: Vec<std::net::SocketAddr> = (addr.to_socket_addrs())
            .map_err(|e| {
                Error::invalid_argument(format!(
                    "publisher address '{addr}' is not host:port ({e})"
                ))
            })?
            .collect();
        let secret = Secret::resolve(cfg.secret.as_deref())?;
        crate::transport::ucx::ucx()?;
        let listener = (TcpListener::bind(&addrs[..]))
            .map_err(|e| Error::io(format!("listening on {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))?;
        Ok(Publisher::with_listener(
            PathBuf::from(local.to_string()),
            Listener::Tcp(listener),
            Some(secret),
            cfg,
        ))
    }

    fn with_listener(
        path: PathBuf,
        listener: Listener,
        secret: Option<Secret>,
        cfg: PublisherConfig,
    ) -> Publisher {
        Publisher {
            path,
            pool: buffers::Pools::default(),
            listener,
            secret,
            bound: None,
            cfg,
            content: Mutex::new(Current::default()),
            version: Mutex::new(None),
            versions: Versions::default(),
            connections: Connections::default(),
            serving: AtomicBool::new(false),
        }
    }

    /// The socket path, or the TCP address with the port actually bound.
    pub fn address(&self) -> String {
        self.path.display().to_string()
    }

    /// Keep the current content as a version engines can ask for by name
    /// (tensors are copied now; a directory is read when served). Returns
    /// the version's name; the oldest beyond `keep_versions` is dropped.
    ///
    /// Tensors are copied into one shared-memory buffer, each at a 256-byte
    /// aligned offset. That copy is the only one the trainer makes for the
    /// version: IPC sessions hand the buffer itself to every rank and
    /// announce buckets as windows into it, so no session packs anything
    /// and the engine's copy into its params is the only copy per rank.
    pub fn publish(&self) -> Result<String> {
        let content = self.content.lock().content.clone();
        let offer = Offer::new(self.version.lock().clone(), content);
        let Some(name) = offer.version.clone() else {
            return Err(Error::no_version(
                "publish: set a version first (or serve a directory with a version.yaml)",
            ));
        };
        check_version(&name).map_err(|e| e.context("publish"))?;
        let on_device = matches!(self.listener, Listener::Unix(_));
        self.versions.publish(offer, &name, on_device, &self.cfg)?;
        Ok(name)
    }

    /// Make the shared buffers the next `count` publishes copy into, now
    /// (before the trainer's first step), sized for the current tensors:
    /// a publish that finds no free buffer creates one, and fresh shared
    /// pages cost far more than the copy itself (0.3-0.6 s per GiB on a
    /// 2-core machine against memory speed). `count` 0: `keep_versions + 1`,
    /// the buffers steady publishing cycles through when no session still
    /// reads the oldest version as the next is published (add one per
    /// version sessions may still be reading). Returns the bytes made.
    ///
    /// Host tensors only: with GPU tensors an IPC publisher publishes into
    /// GPU memory, which this does not make. At most 64 buffers; no room in
    /// /dev/shm is `WM_ERR_OUT_OF_MEMORY` with nothing kept of the call.
    pub fn prepare(&self, count: usize) -> Result<u64> {
        let current = self.content.lock();
        let ts = match &current.content {
            Content::Tensors(ts) if !ts.is_empty() => ts,
            _ => {
                return Err(Error::invalid_argument(
                    "prepare: add the tensors to publish first (a served directory is read \
                     when served, with no buffer to prepare)",
                ))
            }
        };
        if matches!(self.listener, Listener::Unix(_)) && ts.iter().any(|t| t.device.is_some()) {
            return Err(Error::unsupported(
                "prepare: GPU tensors are published into GPU memory, which prepare does not make",
            ));
        }
        let count = match count {
            0 => self.cfg.keep_versions.max(1) + 1,
            n => n,
        };
        self.versions.prepare(ts, count)
    }

    /// Names of the published versions, oldest first.
    pub fn versions(&self) -> Vec<String> {
        self.versions.names()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve the snapshot in `dir` (version from its `version.yaml`, unless set).
    pub fn set_dir(&self, dir: &Path) {
        *self.content.lock() = Current::of(Content::Dir(dir.to_path_buf()));
    }

    /// Serve one tensor, or one shard of a global tensor, from the
    /// trainer's host or GPU memory: the one entry point (the C API's
    /// deprecated `wm_publisher_add_*` calls wrap it too). Build the
    /// descriptor with [`TensorDesc::host`] or [`TensorDesc::device`].
    ///
    /// A shard (`placement` set) is its own box, row-major, placed at
    /// `placement.offset` in a global tensor of `placement.global_shape`
    /// (checked now: the box inside the global shape, the byte size). One
    /// publisher may hold several shards of a global tensor whose boxes do
    /// not overlap (same dtype and global shape); a shard sharing an
    /// element with one already published for that rank, or a whole tensor
    /// of that name, is an error. Engines get the placement in the manifest and take the parts
    /// their params need.
    ///
    /// GPU memory (`device` set) is checked with the driver and served once
    /// published: [`Publisher::publish`] copies it into one GPU buffer
    /// shared with engines by CUDA IPC (an IPC publisher), or into host
    /// memory (a network publisher).
    ///
    /// # Safety
    /// The descriptor only names memory; the caller keeps owning it. Host
    /// memory: `data..data+len` must stay valid and unchanged while
    /// sessions run (and through any `publish`, which copies it). GPU
    /// memory: the device range must stay valid until the next `publish`
    /// returns.
    pub unsafe fn add(&self, t: TensorDesc<'_>) -> Result<()> {
        // SAFETY: the caller's promise, for the one descriptor.
        unsafe { self.add_all(vec![t]) }
    }

    /// [`Publisher::add`] of every descriptor of `ts`, or of none: one
    /// refused (by the checks `add` makes, against what was published
    /// before and against the ones before it in `ts`; GPU ranges are asked
    /// about first) fails the call naming its place in `ts` (when there are
    /// several), and what was published before the call is left as
    /// it was (a served directory too). For a trainer adding a whole model
    /// at once, so a refused tensor does not leave the others published.
    ///
    /// # Safety
    /// As [`Publisher::add`], for each descriptor.
    pub unsafe fn add_all(&self, ts: Vec<TensorDesc<'_>>) -> Result<()> {
        let count = ts.len();
        let at = |k, e| TensorDesc::refused_among(e, k, count);
        let mut served = Vec::new();
        for (k, t) in ts.into_iter().enumerate() {
            let mut s =
                ServedTensor::new(t.name, t.dtype, t.shape, t.data, t.len, t.rank, t.device);
            s.placement = t.placement;
            if s.device.is_some() {
                check_device(&s).map_err(|e| at(k, e))?;
            }
            served.push(s);
        }
        (self.content.lock().add_all(served)).map_err(|(k, e)| at(k, e))
    }

    /// Forget every tensor (before publishing the next version).
    pub fn clear_tensors(&self) {
        *self.content.lock() = Current::default();
    }

    /// The version sessions announce (None: the directory's `version.yaml`).
    /// A name engines would refuse is refused by `publish` and `serve`; see
    /// [`check_version`] to refuse it here already.
    pub fn set_version(&self, version: Option<String>) {
        *self.version.lock() = version;
    }

    /// What sessions serve: the published versions (waiting until `until`
    /// for a publish that left none: [`Versions::to_serve`]), else, when
    /// nothing was ever published, the current content.
    fn offers(&self, until: Instant) -> Result<Vec<Arc<Offer>>> {
        let stopped = || self.connections.check_stopping(&self.path);
        match self.versions.to_serve(until, &stopped) {
            Some(published) => published,
            None => Ok(vec![Arc::new(Offer::new(
                self.version.lock().clone(),
                self.content.lock().content.clone(),
            ))]),
        }
    }

    /// Serve `engines` engines, each on its own thread until done: a
    /// connection counts once its handshake (HELLO, and over the network the
    /// challenge) finished within `handshake_timeout`; the others are
    /// dropped (see `accept`). Fails when fewer than `engines` got there
    /// within `accept_timeout`. The first failed session's error is
    /// returned (naming the rank); the others still run to their end.
    pub fn serve(&self, engines: usize, accept_timeout: Duration) -> Result<ServeStats> {
        if self.serving.swap(true, Ordering::AcqRel) {
            return Err(Error::busy(
                "serve: another serve is running on this publisher (one at a time: ask one serve for every engine)",
            ));
        }
        let _serving = ServingFlag(&self.serving);
        self.serve_alone(engines, accept_timeout)
    }

    fn serve_alone(&self, engines: usize, accept_timeout: Duration) -> Result<ServeStats> {
        // One bound for waiting on a publish and for the engines to come.
        let until = Instant::now() + accept_timeout;
        let offers = self.offers(until)?;
        let accept_timeout = until.saturating_duration_since(Instant::now());
        for version in offers.iter().filter_map(|o| o.version.as_deref()) {
            check_version(version).map_err(|e| e.context("serve"))?;
        }
        static SERVES: AtomicU64 = AtomicU64::new(0);
        let serve_id = SERVES.fetch_add(1, Ordering::Relaxed);
        let acceptor = Acceptor {
            path: &self.path,
            listener: &self.listener,
            secret: self.secret.as_ref(),
            cfg: &self.cfg,
            pool: &self.pool,
            connections: &self.connections,
        };
        let r = acceptor.admit_and_serve(&offers, engines, accept_timeout, serve_id);
        self.connections.forget(serve_id);
        r
    }

    /// Stop serving for good: a `serve` running on another thread stops
    /// accepting and shuts its sessions' connections down, so its sessions
    /// end at their next read or write (a bucket being packed is finished
    /// first) and it returns `WM_ERR_CANCELLED` or the sessions' errors;
    /// later `serve` calls are refused. Does not wait: `serve` returns once
    /// its session threads have ended, and only then stops reading the
    /// trainer's tensors.
    pub fn stop(&self) {
        self.connections.stop();
    }
}

/// A GPU tensor's range is memory of its GPU, as the driver says.
fn check_device(t: &ServedTensor) -> Result<()> {
    let what = format!("tensor '{}'", t.name);
    let ordinal = t.device.expect("a device tensor");
    crate::memory::cuda::cuda()
        .map_err(|e| e.context(&what))?
        .check_device_range(ordinal, t.data.0 as u64, t.len, &what)
}

/// Lowers the serving flag however `serve` ends.
struct ServingFlag<'a>(&'a AtomicBool);

impl Drop for ServingFlag<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Drop for Publisher {
    /// Remove the socket file only if it is still the one this publisher
    /// bound: another publisher may have replaced it since (ours was stale to
    /// it only if we had stopped accepting), and its socket must stay.
    fn drop(&mut self) {
        if let (Listener::Unix(_), Some(bound)) = (&self.listener, self.bound) {
            if socket_identity(&self.path) == Some(bound) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

#[cfg(test)]
mod tests;
