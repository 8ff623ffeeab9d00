//! A hostile IPC publisher for window tests: HELLO, MANIFEST of one u8
//! tensor "w" [64, 64], WANT, then its buffer (sent by `hand_over`: shared
//! memory or a GPU buffer) and a WINDOWS bucket of `entries` into buffer 0;
//! END once acknowledged. Stops quietly where the engine hangs up.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::{BucketEntry, Frame};
use weight_manager_core::DType;
use weight_manager_core::TensorMeta;

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
        if conn.send(&manifest_of_w("hostile", false)).is_err() {
            return;
        }
        match conn.recv(deadline) {
            Ok(want) if super::decline_base(&mut conn, &want).is_ok() => {}
            _ => return,
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

/// A MANIFEST of one u8 tensor "w" [64, 64] as version `version`, saying
/// whether the engine's base is kept.
pub fn manifest_of_w(version: &str, base_kept: bool) -> Frame {
    let w = TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![64, 64],
        nbytes: 4096,
        checksum: None,
        placement: None,
    };
    Frame::Manifest {
        version: version.into(),
        tensors: vec![w],
        base_kept,
    }
}

/// The hostile WINDOWS entries against an engine taking columns 0..32 of
/// "w" [64, 64] (a request of 64 blocks of 32 bytes), each with the text
/// its refusal names: blocks running past the 4096-byte buffer, and a
/// window covering more than its request.
pub fn cases() -> [(BucketEntry, &'static str); 2] {
    let window = |len, tensor_at| BucketEntry {
        request: 0,
        offset: 0,
        len,
        buffer_offset: tensor_at,
    };
    [
        (
            window(2048, 256),
            "block of 32 bytes at 4096 (request #0) runs past the 4096-byte buffer",
        ),
        (
            window(4096, 0),
            "4096 bytes from byte 0 run past the 2048 bytes of request #0",
        ),
    ]
}

/// The engine's first version: "w" [64, 64] u8 in a snapshot at
/// `dir`/model, version "v1"; the directory and the tensor.
pub fn first_version(dir: &Path) -> (PathBuf, super::T) {
    let model_dir = dir.join("model");
    std::fs::create_dir(&model_dir).unwrap();
    let full = super::tensor("w", DType::U8, &[64, 64], 3);
    super::write_safetensors(
        &model_dir.join("model.safetensors"),
        std::slice::from_ref(&full),
    );
    super::write_version(&model_dir, "v1");
    (model_dir, full)
}
