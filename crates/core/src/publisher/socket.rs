//! Where engines connect: the listening socket (a Unix socket file, or a
//! TCP address), replacing a stale socket file, and shutting connections
//! down.

use crate::result::{Error, Result};
use crate::transport::conn::Stream;
use parking_lot::Mutex;
use std::net::TcpListener;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where engines connect.
pub(super) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub(super) fn set_nonblocking(&self) -> std::io::Result<()> {
        match self {
            Listener::Unix(l) => l.set_nonblocking(true),
            Listener::Tcp(l) => l.set_nonblocking(true),
        }
    }

    /// Wait until a connection may be waiting, at most `most` (poll on the
    /// listening socket: a connection is taken at once, not at the next
    /// tick of a sleep).
    pub(super) fn wait_incoming(&self, most: std::time::Duration) {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd of a socket this listener owns; the wait is
        // bounded by `most`.
        unsafe { libc::poll(&mut p, 1, most.as_millis().clamp(1, 1000) as i32) };
    }

    pub(super) fn accept(&self) -> std::io::Result<Stream> {
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

/// The connections of a publisher's running sessions, for `stop` to shut
/// down.
#[derive(Default)]
pub(super) struct Connections {
    /// Set by `stop`: `serve` stops accepting and its sessions'
    /// connections are shut down.
    stopping: AtomicBool,
    /// Second handles on the connections of running sessions: (serve
    /// call, connection number, handle). A connection's handle goes when
    /// its session ends (`untrack`): kept until its serve call returned, a
    /// peer that connects and leaves over and over would hold the
    /// publisher's file descriptors until accepting failed.
    live: Mutex<Vec<(u64, u64, Stream)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Connections {
    /// Stop for good: shut every tracked connection down, refuse new ones.
    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        for (_, _, stream) in self.live.lock().iter() {
            shut_down(stream);
        }
    }

    /// Refuse to go on once stopped (the publisher at `path`).
    pub(super) fn check_stopping(&self, path: &Path) -> Result<()> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Error::cancelled(format!(
                "publisher at {}: stopped (the publisher is being destroyed)",
                path.display()
            )));
        }
        Ok(())
    }

    /// Keep a second handle on a session's connection for `stop` (shut
    /// down at once when the stop came first).
    /// Returns the connection's number for `untrack` (none without a
    /// second handle: out of fds, the session still ends by its own
    /// timeouts).
    pub(super) fn track(&self, serve_id: u64, stream: &Stream) -> Option<u64> {
        let second = match stream {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        };
        let second = second.ok()?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut live = self.live.lock();
        if self.stopping.load(Ordering::SeqCst) {
            shut_down(&second);
        }
        live.push((serve_id, id, second));
        Some(id)
    }

    /// Drop the second handle of connection `id` (its session ended).
    pub(super) fn untrack(&self, id: Option<u64>) {
        if let Some(id) = id {
            self.live.lock().retain(|(_, c, _)| *c != id);
        }
    }

    /// Forget the connections of serve call `serve_id` (it returned).
    pub(super) fn forget(&self, serve_id: u64) {
        self.live.lock().retain(|(id, _, _)| *id != serve_id);
    }
}

/// Listen on the Unix socket `path` with permissions `mode` (a stale
/// socket file there is replaced). Returns the listener and the socket
/// file's identity as bound, so that dropping the publisher removes the
/// path only while it is ours.
pub(super) fn bind_unix(path: &Path, mode: u32) -> Result<(UnixListener, Option<(u64, u64)>)> {
    if path.as_os_str().is_empty() {
        return Err(Error::invalid_argument("the socket path is empty"));
    }
    clear_stale_socket(path)?;
    let listener = UnixListener::bind(path)
        .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
    let bound = socket_identity(path);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok((listener, bound))
}

/// Shut a connection down both ways: the session blocked on it wakes up.
fn shut_down(stream: &Stream) {
    let _ = match stream {
        Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
    };
}

/// The device and inode of the file at `path` (not following a link).
pub(super) fn socket_identity(path: &Path) -> Option<(u64, u64)> {
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
