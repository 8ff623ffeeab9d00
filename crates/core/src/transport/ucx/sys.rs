//! The few libucp entry points and structs this library uses, loaded with
//! `dlopen` at run time so that the library builds, links and loads on
//! machines without UCX.
//!
//! # The UCX version
//!
//! [`load`] refuses a UCX older than [`MIN_VERSION`] (1.14.0) unless
//! `WM_UCX_ALLOW_OLD=1`, and then warns on stderr. UCX 1.13 (1.13.1 is
//! Debian 12's `libucx0`) aborts the whole engine process on an internal
//! assertion while purging an endpoint whose peer died during wire-up
//! (`ucp_request.c:684 Assertion ... req %p ep %p: got REP message`), which a
//! publisher killed at the wrong moment of an update triggers:
//! `tests/net_kill_loop.rs` hit it within 11 to 45 kills in each of 4 runs on
//! 1.13.1. UCX removed that assertion in openucx/ucx pull request 8175
//! (merged to master in April 2022; 1.13.1 still has it, so 1.14.0 is the
//! first release without it). Older releases are not tried. Refusing, not
//! warning: a warning scrolls past, and an inference engine that aborts
//! loses every request in flight, while a refusal is one clear error on the
//! first network update that names the fix (`pip install libucx-cu12` and
//! `WM_UCX_LIB`, or a newer system UCX). The test suite runs against the
//! `libucx-cu12` wheel's UCX 1.22, where the kill loop's hundreds of kills
//! never abort (that build has UCX's debug assertions off altogether; with
//! them on, 1.14 and later keep only a narrower check there, that the purged
//! message is not a PRE_REQUEST).
//!
//! Struct layouts follow `ucp/api/ucp.h` (UCP API 1.10 and later). UCX reads
//! a parameter struct only through the fields its `field_mask` names, and
//! only ever appends fields, so each struct here is the stable prefix we set
//! plus spare room.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// `ucs_status_t` is a packed enum: one signed byte.
pub type Status = i8;
pub(crate) const UCS_OK: Status = 0;
pub(crate) const UCS_INPROGRESS: Status = 1;
pub(crate) const UCS_ERR_BUSY: Status = -15;
pub(crate) const UCS_ERR_LAST: usize = -100isize as usize;

pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const UCP_FEATURE_TAG: u64 = 1 << 0;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
pub(crate) const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;
pub(crate) const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
pub(crate) const UCS_MEMORY_TYPE_CUDA: u32 = 1;

#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub spare: [u64; 16],
}

#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub spare: [u64; 48],
}

#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler_cb: *const c_void,
    pub err_handler_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub spare: [u64; 32],
}

/// `ucp_request_param_t`: nothing set means contiguous bytes, no callback;
/// completion is polled with `ucp_request_check_status`.
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
    pub spare: [u64; 8],
}

/// `ucp_dt_make_iov()`: the buffer is an array of [`DtIov`] and the count
/// its length (UCX gathers a send from the pieces, scatters a receive into
/// them, in order).
pub(crate) const UCP_DATATYPE_IOV: u64 = 2;

/// `ucp_dt_iov_t`: one piece of an IOV send or receive.
#[repr(C)]
pub struct DtIov {
    pub buffer: *mut c_void,
    pub length: usize,
}

#[repr(C)]
pub struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

#[repr(C)]
pub struct ContextAttr {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: c_int,
    pub memory_types: u64,
    pub spare: [u64; 16],
}

crate::dynlib::dynamic_api! { "libucp", Api {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucp_config_read: fn(*const c_char, *const c_char, *mut *mut c_void) -> Status;
    ucp_config_release: fn(*mut c_void);
    ucp_config_modify: fn(*mut c_void, *const c_char, *const c_char) -> Status;
    ucp_init_version: fn(c_uint, c_uint, *const Params, *const c_void, *mut *mut c_void) -> Status;
    ucp_context_query: fn(*mut c_void, *mut ContextAttr) -> Status;
    ucp_worker_create: fn(*mut c_void, *const WorkerParams, *mut *mut c_void) -> Status;
    ucp_worker_destroy: fn(*mut c_void);
    ucp_worker_get_address: fn(*mut c_void, *mut *mut c_void, *mut usize) -> Status;
    ucp_worker_release_address: fn(*mut c_void, *mut c_void);
    ucp_worker_progress: fn(*mut c_void) -> c_uint;
    ucp_worker_get_efd: fn(*mut c_void, *mut c_int) -> Status;
    ucp_worker_arm: fn(*mut c_void) -> Status;
    ucp_ep_create: fn(*mut c_void, *const EpParams, *mut *mut c_void) -> Status;
    ucp_ep_close_nbx: fn(*mut c_void, *const RequestParam) -> *mut c_void;
    ucp_tag_send_nbx: fn(*mut c_void, *const c_void, usize, u64, *const RequestParam) -> *mut c_void;
    ucp_tag_recv_nbx: fn(*mut c_void, *mut c_void, usize, u64, u64, *const RequestParam) -> *mut c_void;
    ucp_tag_recv_request_test: fn(*mut c_void, *mut TagRecvInfo) -> Status;
    ucp_tag_probe_nb: fn(*mut c_void, u64, u64, c_int, *mut TagRecvInfo) -> *mut c_void;
    ucp_tag_msg_recv_nbx: fn(*mut c_void, *mut c_void, usize, *mut c_void, *const RequestParam) -> *mut c_void;
    ucp_request_check_status: fn(*mut c_void) -> Status;
    ucp_request_cancel: fn(*mut c_void, *mut c_void);
    ucp_request_free: fn(*mut c_void);
    ucs_status_string: fn(Status) -> *const c_char;
}}

/// The loaded library: its handle stays open for the life of the process.
pub struct Lib {
    pub api: Api,
    pub path: String,
    pub version: (u32, u32, u32),
}

// SAFETY: function pointers of a library never unloaded, an immutable path
// and a version: nothing tied to a thread (the compiler would derive this).
unsafe impl Send for Lib {}
// SAFETY: as for Send: nothing in it is mutated after loading.
unsafe impl Sync for Lib {}

/// Where libucp is looked for: `WM_UCX_LIB` alone when set (a path, e.g. the
/// libucx wheel's `libucx/lib/libucp.so.0`, which the Python package sets by
/// default when that wheel is installed), else that wheel beside this
/// executable (see [`wheel_beside_exe`]), then the dynamic linker's search
/// path.
fn candidates() -> Vec<String> {
    match std::env::var("WM_UCX_LIB") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => wheel_beside_exe()
            .into_iter()
            .chain(["libucp.so.0".into(), "libucp.so".into()])
            .collect(),
    }
}

/// The libucx-cu12 wheel's libucp in the Python environment this executable
/// was installed into (`<env>/bin/wm` beside
/// `<env>/lib/python3.X/{site,dist}-packages/libucx/lib/libucp.so.0`), so that
/// `wm` from `pip install weight_manager[ucx]` uses the same UCX as the
/// Python package does. None elsewhere (a cargo build, an engine binary).
fn wheel_beside_exe() -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let lib = exe.parent()?.parent()?.join("lib");
    let mut pythons: Vec<_> = std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        })
        .collect();
    pythons.sort();
    pythons.iter().find_map(|py| {
        ["site-packages", "dist-packages"].iter().find_map(|dir| {
            let libucp = py.join(dir).join("libucx/lib/libucp.so.0");
            libucp
                .is_file()
                .then(|| libucp.to_string_lossy().into_owned())
        })
    })
}

/// The oldest UCX the network paths accept (see the module doc: older ones
/// can abort the process when a publisher dies during wire-up).
pub(crate) const MIN_VERSION: (u32, u32, u32) = (1, 14, 0);

/// Set to `1` to run on a UCX older than [`MIN_VERSION`] anyway.
pub(crate) const ALLOW_OLD_ENV: &str = "WM_UCX_ALLOW_OLD";

pub(crate) const INSTALL_HINT: &str = "install UCX 1.14 or newer: `pip install libucx-cu12` (the weight_manager Python package then uses it by default; elsewhere set WM_UCX_LIB to its libucx/lib/libucp.so.0), or your distribution's UCX where it is 1.14 or newer (Debian 12's libucx0 is 1.13.1, too old)";

pub fn load() -> Result<Lib, String> {
    let (handle, path) = crate::dynlib::open_first(&candidates()).map_err(|tried| {
        format!(
            "UCX is not available ({}); {INSTALL_HINT}",
            tried.join("; ")
        )
    })?;
    // SAFETY: handle is live; symbols are checked one by one.
    let api = unsafe { Api::resolve(handle) }?;
    let (mut a, mut b, mut r) = (0, 0, 0);
    // SAFETY: three out-parameters.
    unsafe { (api.ucp_get_version)(&mut a, &mut b, &mut r) };
    let path = loaded_file(&api).unwrap_or(path);
    let lib = Lib {
        api,
        path,
        version: (a, b, r),
    };
    let allow_old = std::env::var(ALLOW_OLD_ENV).is_ok_and(|v| v == "1");
    if let Some(why) = too_old(lib.version, &lib.path) {
        if !allow_old {
            return Err(format!(
                "{why}; {INSTALL_HINT}; or set {ALLOW_OLD_ENV}=1 to use it at your own risk"
            ));
        }
        // Loud on purpose: the caller chose a UCX that can abort the process.
        eprintln!("weight_manager: WARNING: {why}; using it anyway ({ALLOW_OLD_ENV}=1)");
    }
    Ok(lib)
}

/// The file the library was loaded from (a name like `libucp.so.0` says
/// little when the system has several UCX installs).
fn loaded_file(api: &Api) -> Option<String> {
    // SAFETY: Dl_info is plain data, filled by dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: any address may be asked about; this one is a function of the library.
    let found = unsafe { libc::dladdr(api.ucp_get_version as *const c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader,
    // valid while the library stays loaded (for the process's life).
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Why `version` (loaded from `path`) is refused, or None when it is new
/// enough.
fn too_old(version: (u32, u32, u32), path: &str) -> Option<String> {
    if version >= MIN_VERSION {
        return None;
    }
    let (a, b, c) = version;
    let (x, y, z) = MIN_VERSION;
    Some(format!(
        "UCX {a}.{b}.{c} ({path}) is older than {x}.{y}.{z}, the oldest this library accepts: \
         it can abort the process on an internal assertion when a publisher dies \
         during an update (fixed in UCX 1.14, openucx/ucx pull request 8175)"
    ))
}

impl Lib {
    pub fn status_text(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a static string.
        unsafe {
            let p = (self.api.ucs_status_string)(status);
            if p.is_null() {
                format!("UCX status {status}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }
}

/// `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR` for request pointers.
pub fn ptr_status(p: *mut c_void) -> Option<Status> {
    let v = p as usize;
    if v == 0 {
        Some(UCS_OK)
    } else if v >= UCS_ERR_LAST {
        Some(v as isize as i8)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_before_the_minimum_are_refused_with_the_reason() {
        let why = too_old((1, 13, 1), "/usr/lib/libucp.so.0").unwrap();
        assert!(why.contains("UCX 1.13.1 (/usr/lib/libucp.so.0)"), "{why}");
        assert!(why.contains("older than 1.14.0"), "{why}");
        assert!(too_old((0, 99, 0), "x").is_some());
        assert!(too_old((1, 14, 0), "x").is_none());
        assert!(too_old((1, 22, 0), "x").is_none());
        assert!(too_old((2, 0, 0), "x").is_none());
    }
}
