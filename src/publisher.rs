//! The publisher's handle: a trainer serves weights to engine ranks on its
//! node over IPC (`wm_publisher_create`), or on other nodes over the network
//! (`wm_publisher_create_net`: TCP control, UCX bytes, shared secret).

use super::{check_struct_size, opt_path, opt_str, HandleTable, Handled};
use crate::result::wm_result;
use std::ffi::c_char;
use std::time::Duration;
use weight_manager_core::Error;
use weight_manager_core::{Publisher, PublisherConfig};

/// A trainer's publisher. Opaque; create with `wm_publisher_create`, free
/// with `wm_publisher_destroy`.
pub struct wm_publisher {
    _private: [u8; 0],
}

/// ==========================================================================
/// THE TRAINER SIDE: the publisher's settings, what it serves, its statistics.
/// ==========================================================================
///
/// Publisher settings. Fill with `wm_publisher_config_init`. Growable.
#[repr(C)]
pub struct wm_publisher_config {
    /// `sizeof(wm_publisher_config)`; set by `wm_publisher_config_init`.
    pub struct_size: u32,
    /// Buffers in flight, 1 to 8 (default 2: packing overlaps applying).
    pub buffers: u32,
    /// Largest bucket in bytes, at least 256 (one aligned entry; 0 is
    /// refused: `wm_publisher_config_init` sets the default, 512 MiB).
    pub bucket_size: u64,
    /// Permissions of the socket file, 0 to 0777 (default 0600; other
    /// bits: `WM_ERR_INVALID_ARGUMENT`).
    pub socket_mode: u32,
    /// Non-zero: serve engines running as another uid (default 0). A
    /// published version is passed to an engine as one buffer holding all
    /// of its tensors: every engine admitted can read the whole version,
    /// other ranks' parts included. Admit only engines that may.
    pub allow_other_uids: u32,
    /// Bound on each frame a session waits for from its engine (the
    /// engine's requests and acknowledgements), in ms; 0: the default,
    /// 60000; at most 7 days.
    pub bucket_timeout_ms: u64,
    /// Non-zero (default): checksums of in-memory tensors go in the manifest.
    pub checksums: u32,
    /// Versions kept by `wm_publisher_publish`, at least 1 (default 2).
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

pub mod deprecated;
pub use deprecated::*;
/// Publishing versions and serving engines; destroy.
pub mod serve;
pub use serve::*;

/// ==========================================================================
/// THE TRAINER SIDE: the publisher.
/// create -> wm_publisher_add (each tensor) -> set_version -> publish -> serve -> destroy.
/// ==========================================================================
///
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
    if c.bucket_timeout_ms != 0 {
        cfg.bucket_timeout = Duration::from_millis(c.bucket_timeout_ms);
    }
    cfg.checksums = c.checksums != 0;
    cfg.keep_versions = c.keep_versions as usize;
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
        check_null_create!(socket_path, out_publisher);
        let path = opt_path(socket_path).expect("checked");
        create(|cfg| Publisher::bind(&path, cfg), config, out_publisher)
    })
}

/// Listen for engines on other nodes at the TCP address `address`
/// ("host:port"; port 0 picks a free one, see `wm_publisher_address`).
/// Engines pull with source rdma or gdr. Needs UCX (`WM_ERR_UNSUPPORTED`
/// without it) and a shared secret (config or `WM_NET_SECRET`;
/// `WM_ERR_AUTH` without one, `WM_ERR_INVALID_ARGUMENT` for one under 16
/// bytes). An address that is not host:port (a port above 65535, none at
/// all) is `WM_ERR_INVALID_ARGUMENT`, checked first; one that cannot be
/// bound (in use, not this host's) `WM_ERR_IO`. `config` may be NULL for
/// defaults. On success `*out_publisher` receives a handle owned by the
/// caller; on failure the reason is kept for `wm_last_create_error`. Does
/// not wait for engines; a host name is resolved, and the first network
/// publisher or update of a process loads UCX (about 0.4 s).
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_create_net(
    address: *const c_char,
    config: *const wm_publisher_config,
    out_publisher: *mut *mut wm_publisher,
) -> wm_result {
    ffi_guard!({
        check_null_create!(address, out_publisher);
        let addr = match opt_str(address, "address") {
            Ok(a) => a.expect("checked"),
            Err(e) => return super::created(&PUBLISHERS, Err(e), out_publisher),
        };
        create(|cfg| Publisher::bind_net(&addr, cfg), config, out_publisher)
    })
}

/// Copy where engines reach this publisher (the socket path, or the TCP
/// "host:port" with the port actually bound: bound to a wildcard such as
/// 0.0.0.0, that is what it reports, and engines on other nodes use this
/// host's name or address with the port) into `buf` (NUL-terminated,
/// truncated to `len`); `*out_written` gets the full length (without the
/// NUL), so a caller whose buffer was too small learns the size it needs.
/// `len` 0 (`buf` may be NULL then): nothing is copied, `*out_written`
/// gets the length, so a caller may ask for it first.
///
/// NULL `out_written`, or NULL `buf` with `len` above 0:
/// `WM_ERR_NULL_ARGUMENT` (said in `wm_publisher_last_error`). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn wm_publisher_address(
    publisher: *const wm_publisher,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        let h = try_publisher!(publisher);
        if out_written.is_null() || (buf.is_null() && len > 0) {
            let which = if out_written.is_null() {
                "out_written"
            } else {
                "buf"
            };
            let e = Error::null_argument(format!("wm_publisher_address: {which} is NULL"));
            return h.result(Err(e));
        }
        let address = h.value.address();
        if len > 0 {
            super::copy_text_out(&address, buf, len, out_written);
        }
        *out_written = address.len();
        wm_result::WM_OK
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
