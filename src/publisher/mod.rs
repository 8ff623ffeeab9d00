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
//! **Buckets.** Wanted tensors are packed in order into buckets of at most
//! `bucket_size` bytes at 256-byte aligned offsets (a tensor larger than a
//! bucket is split). Buffers alternate: while the engine applies bucket i,
//! bucket i+1 is packed into the other buffer, and a buffer is refilled only
//! after the engine acknowledged the bucket in it. Buffers return to a pool
//! when a session ends and serve the next session (sequential updates of an
//! RL run reuse them; concurrent sessions each take their own).

mod session;

use crate::logging::Logger;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, check_name, DType};
use parking_lot::Mutex;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use session::SessionStats;

#[derive(Clone)]
pub struct PublisherConfig {
    /// Largest bucket (SPEC.md: 512 MiB).
    pub bucket_size: usize,
    /// Buffers in flight (SPEC.md: 2).
    pub buffers: usize,
    /// Permissions of the socket file.
    pub socket_mode: u32,
    /// Serve engines running as another uid.
    pub allow_other_uids: bool,
    /// Bound on one engine's acknowledgement of a bucket, and on its HELLO.
    pub bucket_timeout: Duration,
    /// Bound on a whole session.
    pub session_timeout: Duration,
    /// Compute checksums of in-memory tensors for the manifest.
    pub checksums: bool,
    /// Threads packing buckets; 0: one per core.
    pub threads: usize,
    /// Test only: flip one bit of this tensor after packing it, to prove
    /// that verification catches corruption.
    pub corrupt_tensor: Option<String>,
    pub logger: Logger,
}

impl Default for PublisherConfig {
    fn default() -> PublisherConfig {
        PublisherConfig {
            bucket_size: 512 << 20,
            buffers: 2,
            socket_mode: 0o600,
            allow_other_uids: false,
            bucket_timeout: Duration::from_secs(60),
            session_timeout: Duration::from_secs(600),
            checksums: true,
            threads: 0,
            corrupt_tensor: None,
            logger: Logger::default(),
        }
    }
}

/// A tensor in the trainer's memory.
#[derive(Clone, Debug)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: SendPtr,
    pub len: usize,
    /// The rank it is for; None: every rank.
    pub rank: Option<u32>,
}

/// What a publisher serves.
#[derive(Clone, Debug)]
pub enum Content {
    /// A snapshot directory; each rank gets the files the layout rules pick for it.
    Dir(PathBuf),
    /// Tensors in memory, which must stay valid and unchanged while served.
    Tensors(Vec<HostTensor>),
}

pub struct Publisher {
    path: PathBuf,
    /// Shared buffers of finished sessions, reused by the next ones: fresh
    /// shared memory costs a page fault (and, in a VM, more) per page.
    pool: session::BufferPool,
    listener: UnixListener,
    cfg: PublisherConfig,
    content: Mutex<Content>,
    version: Mutex<Option<String>>,
}

/// What `serve` did.
#[derive(Clone, Debug, Default)]
pub struct ServeStats {
    pub sessions: Vec<SessionStats>,
}

impl Publisher {
    /// Listen on `path` (a stale socket file there is replaced; any other
    /// file is an error).
    pub fn bind(path: &Path, cfg: PublisherConfig) -> Result<Publisher> {
        if cfg.bucket_size < crate::wire::ALIGN as usize
            || cfg.buffers == 0
            || cfg.buffers > crate::wire::MAX_BUFFERS
        {
            return Err(Error::invalid_argument(format!(
                "publisher: bucket_size {} (at least 256) and buffers {} (1 to {}) are out of range",
                cfg.bucket_size,
                cfg.buffers,
                crate::wire::MAX_BUFFERS
            )));
        }
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(Error::invalid_argument(format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                )));
            }
            let _ = std::fs::remove_file(path);
        }
        let listener = UnixListener::bind(path)
            .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(cfg.socket_mode))
            .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
        Ok(Publisher {
            path: path.to_path_buf(),
            pool: session::BufferPool::default(),
            listener,
            cfg,
            content: Mutex::new(Content::Tensors(Vec::new())),
            version: Mutex::new(None),
        })
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
        check_name(name)?;
        let need = byte_size(&format!("tensor '{name}'"), dtype, shape)?;
        if need != len as u64 {
            return Err(Error::invalid_argument(format!(
                "tensor '{name}': {len} bytes given, {need} needed"
            )));
        }
        if data.is_null() && len > 0 {
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
        });
        Ok(())
    }

    /// Forget every tensor (before publishing the next version).
    pub fn clear_tensors(&self) {
        *self.content.lock() = Content::Tensors(Vec::new());
    }

    /// The version sessions announce (None: the directory's `version.yaml`).
    pub fn set_version(&self, version: Option<String>) {
        *self.version.lock() = version;
    }

    /// Accept `engines` connections within `accept_timeout` and serve each
    /// on its own thread until done. The first failed session's error is
    /// returned (naming the rank); the others still run to their end.
    pub fn serve(&self, engines: usize, accept_timeout: Duration) -> Result<ServeStats> {
        let content = self.content.lock().clone();
        let version = self.version.lock().clone();
        let deadline = Instant::now() + accept_timeout;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener", e))?;
        std::thread::scope(|s| {
            let mut sessions = Vec::new();
            let mut accept_error = None;
            while sessions.len() < engines {
                match self.listener.accept() {
                    Ok((stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let (content, version, cfg, pool) =
                            (&content, version.clone(), &self.cfg, &self.pool);
                        sessions.push(
                            s.spawn(move || session::run(stream, content, version, cfg, pool)),
                        );
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            accept_error = Some(Error::timeout(format!(
                                "publisher at {}: {} of {engines} engine(s) connected within {accept_timeout:?}",
                                self.path.display(),
                                sessions.len()
                            )));
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => {
                        accept_error = Some(Error::io("accepting an engine", e));
                        break;
                    }
                }
            }
            let mut stats = ServeStats::default();
            let mut first_error = accept_error;
            for h in sessions {
                match h.join().unwrap_or_else(|_| {
                    Err(Error::new(
                        crate::wm_result::WM_ERR_PANIC,
                        "session panicked",
                    ))
                }) {
                    Ok(st) => stats.sessions.push(st),
                    Err(e) => {
                        self.cfg.logger.warn(&format!("publisher: {e}"));
                        first_error.get_or_insert(e);
                    }
                }
            }
            match first_error {
                Some(e) => Err(e),
                None => Ok(stats),
            }
        })
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
