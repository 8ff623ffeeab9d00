//! A hostile IPC publisher for window tests: HELLO, MANIFEST of one u8
//! tensor "w" [64, 64], WANT, then its buffer (sent by `hand_over`: shared
//! memory or a GPU buffer) and a WINDOWS bucket of `entries` into buffer 0;
//! END once acknowledged. Stops quietly where the engine hangs up.

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};
use weight_manager::manifest::TensorMeta;
use weight_manager::tensor::DType;
use weight_manager::transport::conn::Conn;
use weight_manager::wire::{BucketEntry, Frame};

/// Serve one engine at `sock`; `hand_over` sends the buffer and returns
/// what must live until the session ends (the buffer), or None when the
/// engine is gone.
pub fn serve<K: Send + 'static>(
    sock: &Path,
    entries: Vec<BucketEntry>,
    hand_over: impl FnOnce(&mut Conn) -> Option<K> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (stream, _) = listener.accept().unwrap();
        let mut conn = Conn::new(stream, "the engine");
        if conn.recv(deadline).is_err() {
            return;
        }
        let w = TensorMeta {
            name: "w".into(),
            dtype: DType::U8,
            shape: vec![64, 64],
            nbytes: 4096,
            checksum: None,
            placement: None,
        };
        let manifest = Frame::Manifest {
            version: "hostile".into(),
            tensors: vec![w],
        };
        if conn.send(&manifest).is_err() || conn.recv(deadline).is_err() {
            return;
        }
        let Some(_buffer) = hand_over(&mut conn) else {
            return;
        };
        let bucket = Frame::Windows {
            seq: 0,
            buffer: 0,
            entries,
        };
        if conn.send(&bucket).is_ok() && conn.recv(deadline).is_ok() {
            let _ = conn.send(&Frame::End { buckets: 1 });
        }
    })
}
