//! The publisher's handle: a trainer serves weights to engine ranks on its
//! node over IPC (`wm_publisher_create`), or on other nodes over the network
//! (`wm_publisher_create_net`: TCP control, UCX bytes, shared secret).

use super::{check_struct_size, opt_path, opt_str, HandleTable, Handled};
use std::ffi::c_char;
use std::time::Duration;
use weight_manager_core::publisher::{Publisher, PublisherConfig, ServeStats};
use crate::result::wm_result;
use weight_manager_core::result::Error;

/// A trainer's publisher. Opaque; create with `wm_publisher_create`, free
/// with `wm_publisher_destroy`.
pub struct wm_publisher {
    _private: [u8; 0],
}

/// Publisher settings. Fill with `wm_publisher_config_init`. Growable.
#[repr(C)]
pub struct wm_publisher_config {
    /// `sizeof(wm_publisher_config)`; set by `wm_publisher_config_init`.
    pub struct_size: u32,
    /// Buffers in flight, 1 to 8 (default 2: packing overlaps applying).
    pub buffers: u32,
    /// Largest bucket in bytes (default 512 MiB).
    pub bucket_size: u64,
    /// Permissions of the socket file (default 0600).
    pub socket_mode: u32,
    /// Non-zero: serve engines running as another uid (default 0). A
    /// published version is passed to an engine as one buffer holding all
    /// of its tensors: every engine admitted can read the whole version,
    /// other ranks' parts included. Admit only engines that may.
    pub allow_other_uids: u32,
    /// Bound on each engine acknowledgement, in ms (default 60000).
    pub bucket_timeout_ms: u64,
    /// Non-zero (default): checksums of in-memory tensors go in the manifest.
    pub checksums: u32,
    /// Versions kept by `wm_publisher_publish` (default 2).
    pub keep_versions: u32,
    /// Network: the shared secret (NUL-terminated, at least 16 bytes, copied
    /// at create); NULL: the `WM_NET_SECRET` environment variable.
    pub secret: *const c_char,
}

/// What `wm_publisher_serve` did, summed over its sessions.
#[repr(C)]
pub struct wm_serve_stats {
    /// Caller sets `sizeof(wm_serve_stats)`.
    pub struct_size: u32,
    pub sessions: u32,
    pub bytes: u64,
    /// Time packing buckets into the shared buffers.
    pub pack_ns: u64,
    /// Time waiting for engines to acknowledge buckets.
    pub wait_ns: u64,
    /// Longest session.
    pub total_ns: u64,
}

type PublisherHandle = Handled<Publisher>;

static PUBLISHERS: HandleTable<PublisherHandle> = HandleTable::new();

macro_rules! try_publisher {
    ($p:expr) => {
        try_get!(PUBLISHERS, $p)
    };
}

/// What a publisher serves: tensors and shards from host or GPU memory.
pub mod tensors;
pub use tensors::*;

/// Fill `config` with defaults and set `struct_size`.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_config_init(config: *mut wm_publisher_config) -> wm_result {
    ffi_guard!({
        check_null!(config);
        let d = PublisherConfig::default();
        config.write(wm_publisher_config {
            struct_size: std::mem::size_of::<wm_publisher_config>() as u32,
            buffers: d.buffers as u32,
            bucket_size: d.bucket_size as u64,
            socket_mode: d.socket_mode,
            allow_other_uids: 0,
            bucket_timeout_ms: d.bucket_timeout.as_millis() as u64,
            checksums: 1,
            keep_versions: d.keep_versions as u32,
            secret: std::ptr::null(),
        });
        wm_result::WM_OK
    })
}

/// Read a C publisher config (NULL: defaults).
unsafe fn config_from_c(config: *const wm_publisher_config) -> Result<PublisherConfig, Error> {
    let mut cfg = PublisherConfig::default();
    if config.is_null() {
        return Ok(cfg);
    }
    let c = &*config;
    check_struct_size(
        "wm_publisher_config",
        c.struct_size,
        std::mem::size_of::<wm_publisher_config>(),
    )?;
    cfg.buffers = c.buffers as usize;
    cfg.bucket_size = c.bucket_size as usize;
    cfg.socket_mode = c.socket_mode;
    cfg.allow_other_uids = c.allow_other_uids != 0;
    cfg.bucket_timeout = Duration::from_millis(c.bucket_timeout_ms.max(1));
    cfg.checksums = c.checksums != 0;
    cfg.keep_versions = c.keep_versions.max(1) as usize;
    cfg.secret = opt_str(c.secret, "secret")?.map(String::into_bytes);
    Ok(cfg)
}

unsafe fn create(
    bind: impl FnOnce(PublisherConfig) -> Result<Publisher, Error>,
    config: *const wm_publisher_config,
    out_publisher: *mut *mut wm_publisher,
) -> wm_result {
    let made = config_from_c(config)
        .and_then(bind)
        .map(PublisherHandle::new);
    super::created(&PUBLISHERS, made, out_publisher)
}

/// Listen on the Unix socket `socket_path` (a stale socket there is
/// replaced; the file is removed on destroy). `config` may be NULL for
/// defaults. On success `*out_publisher` receives a handle owned by the
/// caller; on failure it is left unchanged and the reason (e.g. "... exists
/// and is not a socket") is kept for `wm_last_create_error`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_create(
    socket_path: *const c_char,
    config: *const wm_publisher_config,
    out_publisher: *mut *mut wm_publisher,
) -> wm_result {
    ffi_guard!({
        check_null!(socket_path, out_publisher);
        let path = opt_path(socket_path).expect("checked");
        create(|cfg| Publisher::bind(&path, cfg), config, out_publisher)
    })
}

/// Listen for engines on other nodes at the TCP address `address`
/// ("host:port"; port 0 picks a free one, see `wm_publisher_address`).
/// Engines pull with source rdma or gdr. Needs UCX (`WM_ERR_UNSUPPORTED`
/// without it) and a shared secret (config or `WM_NET_SECRET`;
/// `WM_ERR_AUTH` without one). `config` may be NULL for defaults. On success
/// `*out_publisher` receives a handle owned by the caller; on failure the
/// reason is kept for `wm_last_create_error`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_create_net(
    address: *const c_char,
    config: *const wm_publisher_config,
    out_publisher: *mut *mut wm_publisher,
) -> wm_result {
    ffi_guard!({
        check_null!(address, out_publisher);
        let addr = match opt_str(address, "address") {
            Ok(a) => a.expect("checked"),
            Err(e) => return super::created(&PUBLISHERS, Err(e), out_publisher),
        };
        create(|cfg| Publisher::bind_net(&addr, cfg), config, out_publisher)
    })
}

/// Copy where engines reach this publisher (the socket path, or the TCP
/// "host:port" with the port actually bound) into `buf` (NUL-terminated,
/// truncated to `len`); `*out_written` gets the full length.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_address(
    publisher: *const wm_publisher,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(buf, out_written);
        let h = try_publisher!(publisher);
        super::copy_text_out(&h.value.address(), buf, len, out_written)
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

/// Serve the snapshot in directory `dir` instead of in-memory tensors: each
/// rank gets the files the snapshot layout rules pick for it.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_set_dir(
    publisher: *mut wm_publisher,
    dir: *const c_char,
) -> wm_result {
    ffi_guard!({
        check_null!(dir);
        let h = try_publisher!(publisher);
        h.value.set_dir(&opt_path(dir).expect("checked"));
        wm_result::WM_OK
    })
}

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
                weight_manager_core::publisher::check_version(v)?;
            }
            h.value.set_version(v);
            Ok(())
        });
        h.result(r)
    })
}

/// Forget every published tensor (before publishing the next version).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_clear(publisher: *mut wm_publisher) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        h.value.clear_tensors();
        wm_result::WM_OK
    })
}

/// Serve `engines` engine connections (each on its own thread), waiting at
/// most `accept_timeout_ms` for them to connect; returns when every session
/// ended. A failed session (engine died, refused, checksum...) gives its
/// error, the others still finish. `out_stats` is optional (NULL). Blocks.
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

/// Copy the text of this publisher's last error (see `wm_last_error`).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_last_error(
    publisher: *const wm_publisher,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(buf, out_written);
        let h = try_publisher!(publisher);
        let text = h.last_error_text();
        super::copy_text_out(&text, buf, len, out_written)
    })
}
