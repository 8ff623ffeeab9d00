//! Manager handles: configuration, creation, destruction, error text.

use crate::enums::wm_log_level;
use crate::result::wm_result;
use std::ffi::{c_char, c_void};
use weight_manager_core::{Error, LogLevel, Logger, Manager};

mod from_c;
use from_c::{config_from_c, FANOUT_DEFAULTS, GROUP_DEFAULTS, MEMORY_DEFAULTS, NET_DEFAULTS};

/// An engine rank's manager. Opaque; create with `wm_init`, free with `wm_destroy`.
pub struct wm_manager {
    _private: [u8; 0],
}

/// ==========================================================================
/// THE ENGINE: wm_config and its optional blocks, the callbacks.
/// ==========================================================================
///
/// Log sink: `(user_data, level, message)`. `level` is a `wm_log_level`; the
/// message is valid only during the call. Called from any library thread, so
/// it must be thread-safe, and it must not call back into the same manager.
pub type wm_log_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, level: u32, message: *const c_char)>;

/// Called on `wm_clear` for each engine-owned param: `(user_data, name, data, len)`.
/// The engine may free the memory; the library will not touch it again until
/// the acquire callback (or, without one, the next update) hands it back.
/// Also when an update after a clear fails after the acquire callbacks ran
/// (the memory is given back again): on the updating thread, which for
/// `wm_stage` is a thread of the library's.
pub type wm_release_callback = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        name: *const c_char,
        data: *mut c_void,
        len: usize,
    ),
>;

/// Called before the first update after a clear for each engine-owned param:
/// `(user_data, name, old_data, len)`; returns the memory to write (`len`
/// bytes, the old pointer or a new one) or NULL to fail the update. Runs
/// on the updating thread: for `wm_stage`, the library's staging thread
/// (set the CUDA device there if the callback allocates on a GPU). Calls
/// from it into this manager answer at once: `wm_update`, `wm_clear`,
/// `wm_stage` `WM_ERR_BUSY` or `WM_ERR_STATE`, `wm_destroy` stops the
/// update after the callback returns.
pub type wm_acquire_callback = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        name: *const c_char,
        old_data: *mut c_void,
        len: usize,
    ) -> *mut c_void,
>;

/// Manager configuration. Fill with `wm_config_init`, then set fields.
/// Growable: `struct_size` first.
///
/// The settings every engine has are fields here; the others come in
/// optional blocks, each its own growable struct with its own `_init`
/// (`wm_group_config`, `wm_net_config`, `wm_fanout_config`,
/// `wm_memory_config`), pointed to from here: NULL (what `wm_config_init`
/// sets) means that block's defaults. A new setting grows one block, not
/// this struct, and a block that grows leaves this struct's layout (and
/// every caller that does not use the block) as it was; the blocks are read
/// during `wm_init` only.
#[repr(C)]
pub struct wm_config {
    /// `sizeof(wm_config)`; set by `wm_config_init`.
    pub struct_size: u32,
    /// This rank's number, below `world_size`.
    pub rank: u32,
    /// Ranks in the engine (default 1).
    pub world_size: u32,
    /// CUDA device index of this rank, or -1 for a host-only engine (default).
    /// Picks `G` in snapshot file names through `CUDA_VISIBLE_DEVICES`.
    pub device: i32,
    /// Default snapshot location (directory or file); NULL: requests must name one.
    pub model_dir: *const c_char,
    /// Snapshot fallback directory; NULL: "/shared_ipc_meta"; "": none.
    pub fallback_dir: *const c_char,
    /// Shared-memory control cell name (`/dev/shm/<name>`, e.g. FastDeploy's
    /// `model_weights_status.<port>`), opened or created zeroed by rank 0,
    /// which alone reads and writes it; NULL: no control cell (the signal is
    /// always NORMAL).
    pub control_cell: *const c_char,
    /// A `wm_log_level` (default `WM_LOG_LEVEL_WARN`).
    pub log_level: u32,
    /// NULL: log to stderr.
    pub log_callback: wm_log_callback,
    pub log_user_data: *mut c_void,
    /// Copy threads; 0: one per core (default).
    pub copy_threads: u32,
    /// IPC: non-zero accepts a publisher running as another uid (checked with
    /// SO_PEERCRED); default 0: the same uid only.
    pub allow_other_uids: u32,
    /// The ranks' group (`wm_group_config`); NULL (default): no group. Ranks
    /// of a `world_size` above 1 need one for `wm_broadcast_signal` and the
    /// fan-out (`WM_ERR_STATE` there without it); `wm_init` does not
    /// require it, so ranks that only update may do without.
    pub group: *const wm_group_config,
    /// The network paths' settings (`wm_net_config`, sources rdma and gdr);
    /// NULL (default): their defaults.
    pub net: *const wm_net_config,
    /// NCCL fan-out (`wm_fanout_config`); NULL (default): none, every rank
    /// pulls its own.
    pub fanout: *const wm_fanout_config,
    /// Param memory: the release and acquire callbacks, staging
    /// (`wm_memory_config`); NULL (default): no callbacks, default staging.
    pub memory: *const wm_memory_config,
}

/// The ranks' group (`wm_config.group`). Fill with `wm_group_config_init`,
/// then set `name`. Growable: `struct_size` first.
#[repr(C)]
pub struct wm_group_config {
    /// `sizeof(wm_group_config)`; set by `wm_group_config_init`.
    pub struct_size: u32,
    /// The group's name: the ranks meet in
    /// `/dev/shm/wm.<name>.n<node_rank>` and, across nodes, over TCP.
    /// `wm_init` blocks until every rank arrived (bounded by
    /// `signal_timeout_ms`). NULL (the init's default): no group, as if
    /// `wm_config.group` were NULL.
    pub name: *const c_char,
    /// Ranks on this node; 0 (default): all `world_size` ranks are on one node.
    pub local_world_size: u32,
    /// This rank's index on its node (ignored when `local_world_size` is 0).
    pub local_rank: u32,
    /// This node's index; rank 0 is on node 0.
    pub node_rank: u32,
    /// `host:port` where rank 0 listens for the other nodes' leaders; needed
    /// when ranks span nodes.
    pub rendezvous_addr: *const c_char,
    /// Bound in milliseconds on rendezvous and on every per-step wait (a dead
    /// or stalled rank is reported within it); 0: 60000.
    pub signal_timeout_ms: u64,
}

/// The network paths' settings, sources rdma and gdr (`wm_config.net`).
/// Fill with `wm_net_config_init`. Growable: `struct_size` first.
#[repr(C)]
pub struct wm_net_config {
    /// `sizeof(wm_net_config)`; set by `wm_net_config_init`.
    pub struct_size: u32,
    /// Largest bucket (with `staged`, the most a staging slot grows to:
    /// each holds what its buckets need, so a small update takes little),
    /// 256 bytes to 16 GiB (`WM_ERR_INVALID_ARGUMENT` outside); 0: 512 MiB.
    pub bucket_size: u64,
    /// The shared secret (NUL-terminated, at least 16 bytes, copied by
    /// `wm_init`); NULL: the `WM_NET_SECRET` environment variable.
    pub secret: *const c_char,
    /// Buckets in flight (with `staged`, staging slots), 1 to 8; 0: 2.
    pub depth: u32,
    /// gdr: non-zero lets an update that cannot land in GPU memory run as
    /// rdma, with a warning; default 0: such an update fails.
    pub gdr_fallback: u32,
    /// rdma: non-zero receives each bucket into one of `depth` staging
    /// slots first and copies it to the params from there; default 0:
    /// bucket entries land straight in param memory (or the atomic staging
    /// arena), one copy fewer (README "Decisions": direct receive).
    pub staged: u32,
    /// rdma: non-zero authenticates every bucket entry's bytes with a keyed
    /// BLAKE3 digest (key from the session) that the publisher sends, for
    /// untrusted networks: the manifest's XXH3 checksums catch corruption,
    /// not forgery. Costs a BLAKE3 pass on both sides (`wm bench net`
    /// prints its GB/s beside XXH3's). Not for gdr. Default 0. Keyed
    /// digests cover bucket bytes, not deltas: with them, rdma updates
    /// take every run whole (`WM_DELTA_FALLBACK_NOT_APPLICABLE`).
    pub keyed_digests: u32,
}

/// NCCL fan-out (`wm_config.fanout`). Fill with `wm_fanout_config_init`,
/// then set `group`. Growable: `struct_size` first.
#[repr(C)]
pub struct wm_fanout_config {
    /// `sizeof(wm_fanout_config)`; set by `wm_fanout_config_init`.
    pub struct_size: u32,
    /// Ranks of one node with the same group number (0 or more) and the
    /// same device params take an update from one of them (the lowest
    /// local rank pulls from the source and broadcasts over NCCL); needs
    /// `wm_config.group` and `wm_config.device`. Default -1: every rank
    /// pulls its own (README "NCCL fan-out").
    pub group: i32,
    /// Path of NCCL (`libnccl.so.2`, 2.14 or later); NULL: the
    /// `WM_NCCL_LIB` environment variable, else `libnccl.so.2` through the
    /// dynamic linker. Copied by `wm_init`.
    pub nccl_library: *const c_char,
}

/// Param memory (`wm_config.memory`): the engine's release and acquire
/// callbacks, and how updates stage. Fill with `wm_memory_config_init`.
/// Growable: `struct_size` first.
#[repr(C)]
pub struct wm_memory_config {
    /// `sizeof(wm_memory_config)`; set by `wm_memory_config_init`.
    pub struct_size: u32,
    /// Optional; see `wm_release_callback`.
    pub release_callback: wm_release_callback,
    /// Optional; see `wm_acquire_callback`.
    pub acquire_callback: wm_acquire_callback,
    /// Passed to the release and acquire callbacks.
    pub callback_user_data: *mut c_void,
    /// Bound in bytes on tensors for the per-tensor callback the library
    /// stages: their sizes come from the source, with no registered param
    /// to bound them. Atomic mode stages all of an update's callback
    /// tensors at once, so together they must fit; in place, any one of
    /// them (and those received at once). Over it, the update fails with
    /// `WM_ERR_OUT_OF_MEMORY` naming the tensor before anything is
    /// allocated. 0 (default): 4 GiB; `UINT64_MAX`: no bound.
    pub callback_staging_limit: u64,
    /// Atomic mode stages an update in host memory of its size. Default 0:
    /// that memory is kept from one update to the next, so only the first
    /// update faults it in: the staging of engine-owned host params,
    /// device params and callback tensors, and for library-owned host
    /// params (whose update is swapped in page by page) the next update's
    /// pages, faulted in by a thread of the library after each update; in
    /// place too, the buffers a snapshot's bytes of FP8 (quantized) params
    /// land in before they are quantized.
    /// Costs one more copy of those params' bytes while the engine runs;
    /// `wm_clear` and `wm_destroy` free it. Non-zero: it is freed when each
    /// update ends, and every atomic update faults in fresh memory.
    pub free_atomic_staging: u32,
    /// Atomic mode, library-owned device params (`wm_allocate_param` with
    /// device memory) that an update writes whole: non-zero commits them
    /// by a device page swap. The update is uploaded into fresh GPU memory
    /// while the engine's kernels may still read the old weights; the
    /// commit (inside `wm_update`, after the uploads finished) waits for
    /// the device, maps the new memory at the param's addresses (they never
    /// change) and frees the old memory (after a staged commit, `wm_commit`,
    /// on a library thread right after it returns: the pause is the remaps
    /// alone; the next update, `wm_clear` and `wm_destroy` wait for it).
    /// Costs one more copy of those
    /// params in GPU memory during each update (an update that cannot get
    /// it fails before reading anything, the old weights kept). The engine
    /// must not run kernels reading such a param while `wm_update` runs:
    /// between unmapping the old memory and mapping the new one its
    /// addresses hold nothing. Default 0: the commit uploads into the
    /// params themselves.
    pub swap_device_params: u32,
}

/// ==========================================================================
/// THE ENGINE: config, init, errors, destroy.
/// wm_config_init (and the blocks' _init) -> wm_init -> ... -> wm_destroy.
/// ==========================================================================
///
/// Fill `config` with defaults (rank 0 of 1, host-only, warnings to
/// stderr, no optional blocks: `group`, `net`, `fanout` and `memory` NULL)
/// and set `struct_size`.
///
/// NULL `config`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_config_init(config: *mut wm_config) -> wm_result {
    ffi_guard!({
        check_null!(config);
        config.write(wm_config {
            struct_size: std::mem::size_of::<wm_config>() as u32,
            rank: 0,
            world_size: 1,
            device: -1,
            model_dir: std::ptr::null(),
            fallback_dir: std::ptr::null(),
            control_cell: std::ptr::null(),
            log_level: wm_log_level::Warn as u32,
            log_callback: None,
            log_user_data: std::ptr::null_mut(),
            copy_threads: 0,
            allow_other_uids: 0,
            group: std::ptr::null(),
            net: std::ptr::null(),
            fanout: std::ptr::null(),
            memory: std::ptr::null(),
        });
        wm_result::WM_OK
    })
}

/// Fill `group` with defaults (no name, all ranks on one node, node 0, a
/// 60 s bound) and set `struct_size`.
///
/// NULL `group`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_group_config_init(group: *mut wm_group_config) -> wm_result {
    ffi_guard!({
        check_null!(group);
        group.write(GROUP_DEFAULTS);
        wm_result::WM_OK
    })
}

/// Fill `net` with defaults (512 MiB buckets, 2 in flight, the secret from
/// `WM_NET_SECRET`, direct receive, no keyed digests, no gdr fallback) and
/// set `struct_size`.
///
/// NULL `net`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_net_config_init(net: *mut wm_net_config) -> wm_result {
    ffi_guard!({
        check_null!(net);
        net.write(NET_DEFAULTS);
        wm_result::WM_OK
    })
}

/// Fill `fanout` with defaults (group -1: no fan-out until it is set; NCCL
/// found as `nccl_library` says) and set `struct_size`.
///
/// NULL `fanout`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_fanout_config_init(fanout: *mut wm_fanout_config) -> wm_result {
    ffi_guard!({
        check_null!(fanout);
        fanout.write(FANOUT_DEFAULTS);
        wm_result::WM_OK
    })
}

/// Fill `memory` with defaults (no callbacks, a 4 GiB callback staging
/// bound, atomic staging kept between updates, no device page swap) and
/// set `struct_size`.
///
/// NULL `memory`: `WM_ERR_NULL_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_memory_config_init(memory: *mut wm_memory_config) -> wm_result {
    ffi_guard!({
        check_null!(memory);
        memory.write(MEMORY_DEFAULTS);
        wm_result::WM_OK
    })
}

/// Create a manager for one engine rank.
///
/// `config` is read during the call only (strings are copied). On success
/// `*out_manager` receives a new handle, owned by the caller and freed with
/// `wm_destroy`; on failure it is left unchanged, the reason is logged
/// through the config's log sink and kept for `wm_last_create_error`.
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`. Thread-safe; may block briefly to
/// open the control cell.
#[no_mangle]
pub unsafe extern "C" fn wm_init(
    config: *const wm_config,
    out_manager: *mut *mut wm_manager,
) -> wm_result {
    ffi_guard!({
        check_null_create!(config, out_manager);
        let c = &*config;
        let level = wm_log_level::from_raw(c.log_level).map(LogLevel::from);
        let logger = Logger::c_callback(
            level.unwrap_or(LogLevel::Warn),
            c.log_callback,
            c.log_user_data,
        );
        let made = match level {
            None => Err(Error::invalid_argument(format!(
                "wm_config.log_level {} is not a wm_log_level",
                c.log_level
            ))),
            Some(_) => config_from_c(c, logger.clone())
                .and_then(Manager::new)
                .map(super::EngineHandle::new),
        };
        if let Err(e) = &made {
            logger.log(LogLevel::Error, &format!("wm_init failed: {e}"));
        }
        super::created(&super::MANAGERS, made, out_manager)
    })
}

/// Copy why the last create-style call on this thread failed (`wm_init`,
/// `wm_publisher_create`, `wm_publisher_create_net`, `wm_controller_open`:
/// the calls that have no handle to keep their reason) into `buf` (`len`
/// bytes with the NUL), truncated to fit, and set `*out_written` to the
/// bytes written without the NUL. After a successful create, or none yet
/// on this thread: "". Per thread, so concurrent creates do not mix.
///
/// NULL arguments: `WM_ERR_NULL_ARGUMENT`; `len` 0:
/// `WM_ERR_INVALID_ARGUMENT`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_last_create_error(
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        let text = super::LAST_CREATE_ERROR.with(|t| t.borrow().clone());
        super::copy_text_out(&text, buf, len, out_written)
    })
}

/// Copy the text of this handle's last error into `buf` (`len` bytes with
/// the NUL), truncated to fit, and set `*out_written` to the bytes written
/// without the NUL. No error yet: writes "".
///
/// The text is the handle's (not the thread's): with several threads, it is
/// the last error of any of them. NULL arguments: `WM_ERR_NULL_ARGUMENT`;
/// `len` 0: `WM_ERR_INVALID_ARGUMENT`. Thread-safe, never blocks.
#[no_mangle]
pub unsafe extern "C" fn wm_last_error(
    manager: *const wm_manager,
    buf: *mut c_char,
    len: usize,
    out_written: *mut usize,
) -> wm_result {
    ffi_guard!({
        check_null!(buf, out_written);
        let m = try_handle!(manager);
        let text = m.status().last_error.map(|e| e.message).unwrap_or_default();
        super::copy_text_out(&text, buf, len, out_written)
    })
}

/// Stop a manager for good without destroying it. An update, stage or
/// commit running on another thread is cancelled as `wm_destroy` cancels it
/// (`WM_ERR_CANCELLED` at its next batch boundary, or when the wait it is in
/// ends), a staged version is dropped, and every later `wm_update`,
/// `wm_stage` or `wm_commit` on the handle is refused with
/// `WM_ERR_CANCELLED`. Unlike `wm_destroy` it does not wait for those calls
/// (it returns at once, also from inside the manager's own callbacks), and
/// the handle stays valid: `wm_status` and `wm_last_error` answer, and
/// library-owned param memory stays mapped until `wm_destroy`, which the
/// engine still calls. For an engine (or a binding: Python's
/// `Manager.close()`) that must stop an update from another thread while
/// pointers into library-owned params are still in use.
///
/// NULL: `WM_ERR_NULL_ARGUMENT`; a destroyed handle:
/// `WM_ERR_INVALID_HANDLE`. Idempotent.
#[no_mangle]
pub unsafe extern "C" fn wm_shutdown(manager: *mut wm_manager) -> wm_result {
    ffi_guard!({
        check_null!(manager);
        let m = try_handle!(manager);
        m.shut_down();
        wm_result::WM_OK
    })
}

/// Destroy a manager. Library-owned param memory is unmapped (pointers from
/// `wm_allocate_param` become invalid); engine-owned memory is untouched.
///
/// NULL, or a handle already destroyed: no-op. The handle is invalid to new
/// calls at once (`WM_ERR_INVALID_HANDLE`; handle values are never reused).
/// An update running on another thread is cancelled (`WM_ERR_CANCELLED`) at
/// its next batch boundary (one bucket, or one batch of snapshot reads), or
/// when the wait it is in ends (bounded by its request's and the
/// publisher's timeouts); `wm_destroy` waits for it and for every other call
/// on the handle to return, so when it returns the library will not touch
/// engine-owned memory again and the engine may free it. A callback of the
/// engine that blocks delays `wm_destroy` until it returns.
///
/// Called from inside one of this manager's own callbacks (progress,
/// tensor, release, acquire) on the updating thread, it cannot wait for that
/// update: it cancels it and returns at once; the update stops when the
/// callback returns (nothing more is committed), and the manager is freed
/// when `wm_update` returns. Engine memory must stay valid until then.
#[no_mangle]
pub unsafe extern "C" fn wm_destroy(manager: *mut wm_manager) {
    ffi_guard_or!((), {
        // The staging thread runs acquire and release callbacks.
        let on_stage_thread = |h: &super::EngineHandle| h.on_stage_thread();
        super::MANAGERS.destroy_inside(manager.cast(), |h| h.cancel(), on_stage_thread)
    })
}
