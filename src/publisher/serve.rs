//! Publishing versions and serving engines: name a version, keep it,
//! serve sessions; and the publisher's end.

use super::{wm_publisher, wm_serve_stats, PUBLISHERS};
use crate::check_struct_size;
use crate::opt_str;
use crate::result::wm_result;
use std::ffi::c_char;
use std::time::Duration;
use weight_manager_core::ServeStats;

/// ==========================================================================
/// Publisher: versions, serving, destroy.
/// ==========================================================================
///
/// The version sessions announce; NULL: the directory's `version.yaml`.
/// A version is 1 to 255 bytes of UTF-8 (what engines accept); anything
/// else: `WM_ERR_INVALID_ARGUMENT`, and the version set before is kept.
/// (A `version.yaml` over the limit is refused by publish and serve.)
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_set_version(
    publisher: *mut wm_publisher,
    version: *const c_char,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = opt_str(version, "version").and_then(|v| {
            if let Some(v) = &v {
                weight_manager_core::check_version(v)?;
            }
            h.value.set_version(v);
            Ok(())
        });
        h.result(r)
    })
}

/// Keep the current tensors (copied now: the trainer may overwrite its own
/// at once) or directory as a version engines can ask for by name; the
/// oldest beyond `keep_versions` is dropped. The name is the one set with
/// `wm_publisher_set_version` (or the directory's `version.yaml`); none:
/// `WM_ERR_NO_VERSION`. Without any publish, the current content is the one
/// version served.
///
/// Tensors are copied into one shared-memory buffer that IPC sessions hand
/// to every rank as is: the trainer's only copy of the version, and the
/// fastest way to serve engines on this node (nothing is packed per
/// session). A dropped version's buffer takes a later version once no
/// session serves it.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_publish(publisher: *mut wm_publisher) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = h.value.publish().map(|_| ());
        h.result(r)
    })
}

/// Make the shared buffers the next `count` publishes copy into, now,
/// sized for the tensors added so far: call it once after adding them and
/// before the trainer's first step, so no step pays for fresh shared pages
/// (which cost far more than the copy itself: 0.3-0.6 s per GiB on a
/// 2-core machine, where a publish into a ready buffer runs at memory
/// speed). Without it, the first `keep_versions + 1` publishes (more while
/// sessions still read old versions) each create their buffer.
///
/// `count` 0: `keep_versions + 1`, the buffers steady publishing cycles
/// through; add one per version sessions may still be reading when the
/// next is published. At most 64. `*out_bytes` (optional, NULL) receives
/// the bytes made. No tensors added (or a served directory):
/// `WM_ERR_INVALID_ARGUMENT`; GPU tensors of an IPC publisher (published
/// into GPU memory): `WM_ERR_UNSUPPORTED`; no room in /dev/shm:
/// `WM_ERR_OUT_OF_MEMORY`, with nothing kept of the call. Tensors added
/// later that make a version larger than the buffers leave those unused.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_prepare(
    publisher: *mut wm_publisher,
    count: u32,
    out_bytes: *mut u64,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        let r = h.value.prepare(count as usize).map(|bytes| {
            if !out_bytes.is_null() {
                out_bytes.write(bytes);
            }
        });
        h.result(r)
    })
}

/// Serve `engines` engine connections (each on its own thread), waiting at
/// most `accept_timeout_ms` for them to connect; returns when every session
/// ended. A failed session (engine died, refused, checksum...) gives its
/// error, the others still finish. `out_stats` is optional (NULL). Blocks.
/// One serve at a time per publisher: another thread's
/// `wm_publisher_serve` meanwhile is `WM_ERR_BUSY` (ask one serve for
/// every engine).
/// It offers the versions published (or the tensors added) when it was
/// called: a version published while it runs is offered by the next
/// `wm_publisher_serve`, so a trainer that publishes every step serves in
/// a loop of short calls. Once any `wm_publisher_publish` started, only
/// published copies are served, never the tensors as they are: a serve
/// called while a publish has dropped the only version kept
/// (`keep_versions` 1, its buffer taking the new one) waits for that
/// publish (within `accept_timeout_ms`, else `WM_ERR_TIMEOUT`; the
/// publisher destroyed meanwhile: `WM_ERR_CANCELLED`) and offers
/// its version; when that publish failed, leaving none, the serve fails
/// with `WM_ERR_NO_VERSION` until a publish succeeds.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_serve(
    publisher: *mut wm_publisher,
    engines: u32,
    accept_timeout_ms: u64,
    out_stats: *mut wm_serve_stats,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        if !out_stats.is_null() {
            let size = (*out_stats).struct_size;
            if let Err(e) = check_struct_size(
                "wm_serve_stats",
                size,
                std::mem::size_of::<wm_serve_stats>(),
            ) {
                return h.result(Err(e));
            }
        }
        match h
            .value
            .serve(engines as usize, Duration::from_millis(accept_timeout_ms))
        {
            Ok(ServeStats { sessions }) => {
                if !out_stats.is_null() {
                    out_stats.write(wm_serve_stats {
                        struct_size: std::mem::size_of::<wm_serve_stats>() as u32,
                        sessions: sessions.len() as u32,
                        bytes: sessions.iter().map(|s| s.bytes).sum(),
                        pack_ns: sessions.iter().map(|s| s.pack.as_nanos() as u64).sum(),
                        wait_ns: sessions.iter().map(|s| s.wait.as_nanos() as u64).sum(),
                        total_ns: sessions
                            .iter()
                            .map(|s| s.total.as_nanos() as u64)
                            .max()
                            .unwrap_or(0),
                    });
                }
                wm_result::WM_OK
            }
            Err(e) => h.result(Err(e)),
        }
    })
}

/// Stop listening, remove the socket file and free the handle. NULL or
/// already destroyed: no-op. The handle is invalid to new calls at once
/// (handle values are never reused).
///
/// A `wm_publisher_serve` running on another thread is stopped: it accepts
/// no more engines and its sessions' connections are shut down, so each
/// session ends at its next read or write (after finishing the bucket it is
/// packing); it returns `WM_ERR_CANCELLED` (or its sessions' errors).
/// `wm_publisher_destroy` waits for it and every other call on the handle
/// to return: when it returns, the library reads none of the trainer's
/// tensors again and the trainer may free them.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_destroy(publisher: *mut wm_publisher) {
    ffi_guard_or!((), {
        PUBLISHERS.destroy(publisher.cast(), |h| h.value.stop())
    })
}
