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
//! **Network.** [`Publisher::bind_net`] listens on a TCP address instead:
//! control frames travel over TCP, after a shared-secret challenge
//! (`transport::auth`), and bucket bytes over UCX (`transport::ucx`), into
//! the engine's staging buffers (rdma) or straight into its params (gdr).
//!
//! **Versions.** [`Publisher::publish`] keeps the current content as a named
//! version (tensors are copied, so the trainer may overwrite its own at
//! once); the last `keep_versions` are kept and an engine asks for one by
//! name, or for "latest". Without any `publish`, the current content is the
//! one version served (the trainer keeps its tensors unchanged while serving).
//!
//! **Buckets.** Wanted tensors are packed in order into buckets of at most
//! `bucket_size` bytes at 256-byte aligned offsets (a tensor larger than a
//! bucket is split). Buffers alternate: while the engine applies bucket i,
//! bucket i+1 is packed into the other buffer, and a buffer is refilled only
//! after the engine acknowledged the bucket in it. Buffers return to a pool
//! when a session ends and serve the next session (sequential updates of an
//! RL run reuse them; concurrent sessions each take their own).

mod accept;
mod buffers;
mod config;
mod handshake;
mod hooks;
mod ipc;
mod net;
mod offer;
mod plan;
mod session;
mod shard;
mod streamer;

pub(crate) use crate::manager::check_version;
use crate::memory::copy::{copy_all, default_threads, hash_all, CopyJob, CopySource};
use crate::memory::cuda_ipc::{self, ExportedDeviceBuffer};
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, check_name, DType};
use crate::transport::auth::Secret;
use crate::transport::conn::Stream;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::net::TcpListener;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use config::PublisherConfig;
pub use net::tag as net_tag;
pub use offer::{Content, HostTensor};
pub use session::SessionStats;

use config::check_config;
use offer::{Offer, Published};

/// Where engines connect.
enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn set_nonblocking(&self) -> std::io::Result<()> {
        match self {
            Listener::Unix(l) => l.set_nonblocking(true),
            Listener::Tcp(l) => l.set_nonblocking(true),
        }
    }

    fn accept(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Stream::Unix(s)
            }
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        })
    }
}

pub struct Publisher {
    /// The socket path, or the TCP address.
    path: PathBuf,
    /// Shared buffers of finished sessions, reused by the next ones: fresh
    /// shared memory costs a page fault (and, in a VM, more) per page.
    pool: buffers::BufferPool,
    listener: Listener,
    /// Network sessions: the shared secret, checked when binding.
    secret: Option<Secret>,
    /// The socket file's device and inode as bound (IPC).
    bound: Option<(u64, u64)>,
    cfg: PublisherConfig,
    content: Mutex<Content>,
    version: Mutex<Option<String>>,
    published: Mutex<VecDeque<Arc<Offer>>>,
    /// Shared buffers of dropped versions, refilled by the next `publish`
    /// once no session serves them any more: an engine keeps its mappings
    /// of the buffers it read lately, so a reused buffer costs it nothing
    /// to map again (a fresh 4 GiB one costs about 0.3 s of page faults).
    retired: Mutex<VecDeque<Arc<SharedBuffer>>>,
    /// Set by [`Publisher::stop`]: `serve` stops accepting and its sessions'
    /// connections are shut down.
    stopping: AtomicBool,
    /// Second handles on the connections of running sessions, by serve
    /// call, for [`Publisher::stop`] to shut down.
    live: Mutex<Vec<(u64, Stream)>>,
}

/// What `serve` did.
#[derive(Clone, Debug, Default)]
pub struct ServeStats {
    pub sessions: Vec<SessionStats>,
}

impl Publisher {
    /// Listen on `path`. A stale socket file there (nothing accepts on it)
    /// is replaced; a live publisher's socket, or any other file, is an
    /// error and left alone.
    pub fn bind(path: &Path, cfg: PublisherConfig) -> Result<Publisher> {
        check_config(&cfg)?;
        clear_stale_socket(path)?;
        let listener = UnixListener::bind(path)
            .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
        // What we bound, so that Drop removes the path only while it is ours.
        let bound = socket_identity(path);
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(cfg.socket_mode))
            .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
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
        let secret = Secret::resolve(cfg.secret.as_deref())?;
        crate::transport::ucx::ucx()?;
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::io(format!("listening on {addr}"), e))?;
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
            pool: buffers::BufferPool::default(),
            listener,
            secret,
            bound: None,
            cfg,
            content: Mutex::new(Content::Tensors(Vec::new())),
            version: Mutex::new(None),
            published: Mutex::new(VecDeque::new()),
            retired: Mutex::new(VecDeque::new()),
            stopping: AtomicBool::new(false),
            live: Mutex::new(Vec::new()),
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
        let content = self.content.lock().clone();
        let mut offer = Offer::new(self.version.lock().clone(), content);
        let Some(name) = offer.version.clone() else {
            return Err(Error::no_version(
                "publish: set a version first (or serve a directory with a version.yaml)",
            ));
        };
        check_version(&name).map_err(|e| e.context("publish"))?;
        if let Content::Tensors(ts) = &mut offer.content {
            // The version this publish pushes out (when the list is full) is
            // dropped before the copy, so its buffer can take the new one:
            // steady publishing then cycles through keep_versions + 1
            // buffers. If the copy fails, that version is gone all the same.
            {
                let mut published = self.published.lock();
                let replaces = published
                    .iter()
                    .any(|o| o.version.as_deref() == Some(name.as_str()));
                if !replaces && published.len() >= self.cfg.keep_versions.max(1) {
                    if let Some(oldest) = published.pop_front() {
                        self.retire(oldest);
                    }
                }
            }
            // Kernels still writing the trainer's GPU tensors finish first.
            let mut gpus: Vec<i32> = ts.iter().filter_map(|t| t.device).collect();
            gpus.sort_unstable();
            gpus.dedup();
            for &g in &gpus {
                cuda_ipc::synchronize(g).map_err(|e| e.context(format!("publish '{name}'")))?;
            }
            // The version lives on the GPU of its first GPU tensor.
            offer.published = Some(match (ts.iter().find_map(|t| t.device), &self.listener) {
                (Some(gpu), Listener::Unix(_)) => {
                    Published::Device(Arc::new(copy_to_device(ts, gpu, &name)?))
                }
                _ => Published::Host(Arc::new(self.copy_to_shared(ts, &name)?)),
            });
            if self.cfg.checksums {
                hash_published(ts)?;
            }
        }
        let mut published = self.published.lock();
        let (same, others): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut *published)
            .into_iter()
            .partition(|o| o.version.as_deref() == Some(name.as_str()));
        *published = others;
        same.into_iter().for_each(|o| self.retire(o));
        published.push_back(Arc::new(offer));
        while published.len() > self.cfg.keep_versions.max(1) {
            if let Some(oldest) = published.pop_front() {
                self.retire(oldest);
            }
        }
        Ok(name)
    }

    /// Keep a dropped version's shared buffer for a later `publish` (it is
    /// reused once no session serves the version any more).
    fn retire(&self, offer: Arc<Offer>) {
        if let Some(shared) = offer.shared().cloned() {
            let mut retired = self.retired.lock();
            retired.push_back(shared);
            // Two spares cover a publisher alternating versions.
            while retired.len() > 2 {
                retired.pop_front();
            }
        }
    }

    /// Copy `ts` into one shared buffer (256-byte aligned offsets, copied on
    /// every core; a retired buffer no session holds is reused) and point
    /// them at their copies.
    fn copy_to_shared(&self, ts: &mut [HostTensor], version: &str) -> Result<SharedBuffer> {
        let (offsets, total) = packed_offsets(ts, version)?;
        // A memfd cannot be empty (fallocate refuses a zero length).
        let total = total.max(crate::wire::ALIGN as usize);
        let spare = {
            let mut retired = self.retired.lock();
            let free = retired
                .iter()
                .position(|b| Arc::strong_count(b) == 1 && b.len() >= total);
            free.and_then(|i| retired.remove(i))
                .and_then(|b| Arc::try_unwrap(b).ok())
        };
        let shared = match spare {
            Some(b) => b,
            None => SharedBuffer::create(&format!("version '{version}'"), total)?,
        };
        let jobs: Vec<CopyJob> = ts
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (t, &at))| CopyJob {
                src: tensor_source(t),
                dst: SendPtr(shared.ptr().wrapping_add(at)),
                len: t.len,
                tag: i,
            })
            .collect();
        // SAFETY: add_tensor's contract keeps each tensor valid for len bytes;
        // the destinations are disjoint ranges of the new buffer.
        unsafe { copy_all(&jobs, default_threads()) }.map_err(|e| e.error)?;
        for (t, at) in ts.iter_mut().zip(offsets) {
            t.data = SendPtr(shared.ptr().wrapping_add(at));
            t.device = None;
        }
        Ok(shared)
    }

    /// Names of the published versions, oldest first.
    pub fn versions(&self) -> Vec<String> {
        self.published
            .lock()
            .iter()
            .filter_map(|o| o.version.clone())
            .collect()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve the snapshot in `dir` (version from its `version.yaml`, unless set).
    pub fn set_dir(&self, dir: &Path) {
        *self.content.lock() = Content::Dir(dir.to_path_buf());
    }

    /// Serve a tensor from memory, for `rank` or (None) every rank.
    ///
    /// # Safety
    /// `data..data+len` must stay valid and unchanged while sessions run.
    pub unsafe fn add_tensor(
        &self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        data: *const u8,
        len: usize,
        rank: Option<u32>,
    ) -> Result<()> {
        self.push_tensor(name, dtype, shape, data as u64, len, rank, None)
    }

    /// Serve a tensor in the trainer's GPU memory: `len` bytes at device
    /// address `ptr` of GPU `ordinal` (checked with the driver). GPU tensors
    /// are served once published: [`Publisher::publish`] copies them into
    /// one GPU buffer shared with engines by CUDA IPC (an IPC publisher),
    /// or into host memory (a network publisher).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until the next `publish` returns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_device_tensor(
        &self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        ptr: u64,
        len: usize,
        ordinal: i32,
        rank: Option<u32>,
    ) -> Result<()> {
        let what = format!("tensor '{name}'");
        crate::memory::cuda::cuda()
            .map_err(|e| e.context(&what))?
            .check_device_range(ordinal, ptr, len, &what)?;
        self.push_tensor(name, dtype, shape, ptr, len, rank, Some(ordinal))
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn push_tensor(
        &self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        data: u64,
        len: usize,
        rank: Option<u32>,
        device: Option<i32>,
    ) -> Result<()> {
        check_name(name)?;
        let need = byte_size(&format!("tensor '{name}'"), dtype, shape)?;
        if need != len as u64 {
            return Err(Error::invalid_argument(format!(
                "tensor '{name}': {len} bytes given, {need} needed"
            )));
        }
        if data == 0 && len > 0 {
            return Err(Error::null_argument(format!(
                "tensor '{name}': data is NULL"
            )));
        }
        let mut content = self.content.lock();
        if let Content::Dir(_) = *content {
            *content = Content::Tensors(Vec::new());
        }
        let Content::Tensors(ts) = &mut *content else {
            unreachable!()
        };
        if ts
            .iter()
            .any(|t| t.name == name && (t.rank.is_none() || rank.is_none() || t.rank == rank))
        {
            return Err(Error::invalid_argument(format!(
                "tensor '{name}' is already published for that rank"
            )));
        }
        ts.push(HostTensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data: SendPtr(data as *mut u8),
            len,
            rank,
            checksum: None,
            device,
        });
        Ok(())
    }

    /// Forget every tensor (before publishing the next version).
    pub fn clear_tensors(&self) {
        *self.content.lock() = Content::Tensors(Vec::new());
    }

    /// The version sessions announce (None: the directory's `version.yaml`).
    /// A name engines would refuse is refused by `publish` and `serve`; see
    /// [`check_version`] to refuse it here already.
    pub fn set_version(&self, version: Option<String>) {
        *self.version.lock() = version;
    }

    /// What sessions serve: the published versions, else the current content.
    fn offers(&self) -> Vec<Arc<Offer>> {
        let published = self.published.lock();
        if published.is_empty() {
            vec![Arc::new(Offer::new(
                self.version.lock().clone(),
                self.content.lock().clone(),
            ))]
        } else {
            published.iter().cloned().collect()
        }
    }

    /// Serve `engines` engines, each on its own thread until done: a
    /// connection counts once its handshake (HELLO, and over the network the
    /// challenge) finished within `handshake_timeout`; the others are
    /// dropped (see `accept`). Fails when fewer than `engines` got there
    /// within `accept_timeout`. The first failed session's error is
    /// returned (naming the rank); the others still run to their end.
    pub fn serve(&self, engines: usize, accept_timeout: Duration) -> Result<ServeStats> {
        let offers = self.offers();
        for version in offers.iter().filter_map(|o| o.version.as_deref()) {
            check_version(version).map_err(|e| e.context("serve"))?;
        }
        static SERVES: AtomicU64 = AtomicU64::new(0);
        let serve_id = SERVES.fetch_add(1, Ordering::Relaxed);
        let r = self.admit_and_serve(&offers, engines, accept_timeout, serve_id);
        self.live.lock().retain(|(id, _)| *id != serve_id);
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
        self.stopping.store(true, Ordering::SeqCst);
        for (_, stream) in self.live.lock().iter() {
            shut_down(stream);
        }
    }

    fn check_stopping(&self) -> Result<()> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Error::cancelled(format!(
                "publisher at {}: stopped (the publisher is being destroyed)",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Keep a second handle on a session's connection for [`Publisher::stop`]
    /// (shut down at once when the stop came first).
    fn track(&self, serve_id: u64, stream: &Stream) {
        let second = match stream {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        };
        // Without a second handle (out of fds) the session still ends by
        // its own timeouts.
        let Ok(second) = second else { return };
        let mut live = self.live.lock();
        if self.stopping.load(Ordering::SeqCst) {
            shut_down(&second);
        }
        live.push((serve_id, second));
    }
}

/// Shut a connection down both ways: the session blocked on it wakes up.
fn shut_down(stream: &Stream) {
    let _ = match stream {
        Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
    };
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

/// The device and inode of the file at `path` (not following a link).
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Clear the way for a socket at `path`: nothing there, or a stale socket
/// (nobody accepts on it: a publisher that exited without removing it),
/// which is removed. A live publisher's socket, or any other file, is an
/// error and left alone.
fn clear_stale_socket(path: &Path) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(Error::invalid_argument(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        )));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(Error::invalid_argument(format!(
            "{}: another publisher is listening on this socket; refusing to replace it \
             (stop that publisher, or pick another path)",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => std::fs::remove_file(path)
            .map_err(|e| Error::io(format!("removing the stale socket {}", path.display()), e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(
            format!("checking whether a publisher listens on {}", path.display()),
            e,
        )),
    }
}

/// Where each tensor of a version's copy starts (256-byte aligned, in
/// order) and the bytes the copy needs.
fn packed_offsets(ts: &[HostTensor], version: &str) -> Result<(Vec<usize>, usize)> {
    crate::memory::aligned_offsets(ts.iter().map(|t| t.len as u64))
        .ok_or_else(|| Error::out_of_memory(format!("version '{version}' is too large")))
}

/// Where the copier reads tensor `t` (host memory, or GPU memory).
fn tensor_source(t: &HostTensor) -> CopySource<'static> {
    match t.device {
        Some(ordinal) => CopySource::Device {
            ptr: t.data.0 as u64,
            ordinal,
        },
        None => CopySource::Memory(t.data),
    }
}

/// Copy `ts` into one new GPU buffer on GPU `gpu` (256-byte aligned
/// offsets; host tensors are uploaded, other GPUs' copied peer to peer)
/// and point them at their copies.
fn copy_to_device(ts: &mut [HostTensor], gpu: i32, version: &str) -> Result<ExportedDeviceBuffer> {
    let (offsets, total) = packed_offsets(ts, version)?;
    let buf = ExportedDeviceBuffer::new(&format!("version '{version}'"), gpu, total)?;
    for (t, &at) in ts.iter().zip(&offsets) {
        // SAFETY: the tensor's memory is valid for len bytes (add_tensor's
        // contract); the range fits the buffer, which is sized for all.
        unsafe { buf.copy_in(at, t.data.0 as u64, t.len) }
            .map_err(|e| e.context(format!("publish '{version}': tensor '{}'", t.name)))?;
    }
    for (t, at) in ts.iter_mut().zip(offsets) {
        t.data = SendPtr((buf.ptr() + at as u64) as *mut u8);
        t.device = Some(gpu);
    }
    Ok(buf)
}

/// Checksums of a version's copies (GPU ones are read back to hash).
fn hash_published(ts: &mut [HostTensor]) -> Result<()> {
    let host: Vec<(SendPtr, usize)> = ts
        .iter()
        .filter(|t| t.device.is_none())
        .map(|t| (t.data, t.len))
        .collect();
    // SAFETY: our own copies, unchanged from here on.
    let mut sums = unsafe { hash_all(&host, default_threads()) }.into_iter();
    let mut scratch: Vec<u8> = Vec::new();
    for t in ts.iter_mut() {
        t.checksum = Some(match t.device {
            None => sums.next().expect("one per host tensor"),
            Some(gpu) => {
                scratch.resize(t.len, 0);
                // SAFETY: the scratch holds len bytes; the copy is ours.
                unsafe { cuda_ipc::download(gpu, scratch.as_mut_ptr(), t.data.0 as u64, t.len) }?;
                crate::checksum::of(&scratch)
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steady publishing with two versions kept cycles through the same
    /// shared buffers (engines keep them mapped), with each version's bytes.
    #[test]
    fn publishing_reuses_the_buffers_of_dropped_versions() {
        let dir = tempfile::tempdir().unwrap();
        let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
        let mut seen = Vec::new();
        for k in 0..6u8 {
            let data = vec![k; 3000];
            p.clear_tensors();
            // SAFETY: `data` outlives the publish, which copies it.
            unsafe { p.add_tensor("t", DType::U8, &[3000], data.as_ptr(), 3000, None) }.unwrap();
            p.set_version(Some(format!("v{k}")));
            p.publish().unwrap();
            let published = p.published.lock();
            let newest = published.back().unwrap();
            let Content::Tensors(ts) = &newest.content else {
                panic!("tensors")
            };
            let shared = newest.shared().unwrap();
            // SAFETY: the version's own bytes, kept while it is published.
            let bytes = unsafe { std::slice::from_raw_parts(ts[0].data.0, 3000) };
            assert!(bytes.iter().all(|&b| b == k));
            assert_eq!(ts[0].data.0, shared.ptr(), "first tensor at offset 0");
            seen.push(shared.ptr());
        }
        // v0 and v1 got new buffers; from v2 on each reuses the one of the
        // version it pushed out.
        assert_ne!(seen[0], seen[1]);
        for k in 2..6 {
            assert_eq!(seen[k], seen[k - 2], "{seen:?}");
        }
        // A version a session still serves is not reused: hold v4's offer.
        let held = p.published.lock().front().cloned().unwrap();
        assert_eq!(held.version.as_deref(), Some("v4"));
        p.set_version(Some("v6".into()));
        p.publish().unwrap();
        let v6 = p.published.lock().back().unwrap().shared().unwrap().ptr();
        assert_ne!(v6, held.shared().unwrap().ptr());
    }
}
