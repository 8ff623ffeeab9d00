//! The C config read into the core's: each block's defaults, and the
//! translation of `wm_config` and its blocks into `ManagerConfig`.

use super::{wm_config, wm_fanout_config, wm_group_config, wm_memory_config, wm_net_config};
use crate::{check_struct_size, opt_path, opt_str};
use std::ffi::c_void;
use std::path::PathBuf;
use weight_manager_core::defaults;
use weight_manager_core::FanoutSettings;
use weight_manager_core::Logger;
use weight_manager_core::{Error, Result};
use weight_manager_core::{GroupSettings, ManagerConfig, NetSettings};

pub(super) const GROUP_DEFAULTS: wm_group_config = wm_group_config {
    struct_size: std::mem::size_of::<wm_group_config>() as u32,
    name: std::ptr::null(),
    local_world_size: 0,
    local_rank: 0,
    node_rank: 0,
    rendezvous_addr: std::ptr::null(),
    signal_timeout_ms: 0,
};

pub(super) const NET_DEFAULTS: wm_net_config = wm_net_config {
    struct_size: std::mem::size_of::<wm_net_config>() as u32,
    bucket_size: 0,
    secret: std::ptr::null(),
    depth: 0,
    gdr_fallback: 0,
    staged: 0,
    keyed_digests: 0,
};

pub(super) const FANOUT_DEFAULTS: wm_fanout_config = wm_fanout_config {
    struct_size: std::mem::size_of::<wm_fanout_config>() as u32,
    group: -1,
    nccl_library: std::ptr::null(),
};

pub(super) const MEMORY_DEFAULTS: wm_memory_config = wm_memory_config {
    struct_size: std::mem::size_of::<wm_memory_config>() as u32,
    release_callback: None,
    acquire_callback: None,
    callback_user_data: std::ptr::null_mut(),
    callback_staging_limit: 0,
    free_atomic_staging: 0,
    swap_device_params: 0,
};

/// An optional block of `wm_config`: NULL gives `defaults`; else its
/// `struct_size` (its first field) is checked.
///
/// # Safety
/// `p` is NULL or points to a `T` whose first field is a `u32` struct_size.
unsafe fn block<'a, T>(p: *const T, defaults: &'a T, what: &str) -> Result<&'a T> {
    if p.is_null() {
        return Ok(defaults);
    }
    let size = *p.cast::<u32>();
    check_struct_size(what, size, std::mem::size_of::<T>())?;
    Ok(&*p)
}

#[derive(Clone, Copy)]
struct UserData(*mut c_void);
// SAFETY: the user data is only handed back to the engine's release and
// acquire callbacks, which run on the thread calling wm_update or wm_clear
// (the header: "callbacks run on the calling thread"): a thread the engine
// itself calls from, so moving the pointer there is the engine's own use.
unsafe impl Send for UserData {}
// SAFETY: one update or clear runs at a time (WM_ERR_BUSY otherwise), so the
// callbacks never get it on two threads at once.
unsafe impl Sync for UserData {}

pub(super) unsafe fn config_from_c(c: &wm_config, logger: Logger) -> Result<ManagerConfig> {
    check_struct_size("wm_config", c.struct_size, std::mem::size_of::<wm_config>())?;
    let group = block(c.group, &GROUP_DEFAULTS, "wm_group_config")?;
    let net = block(c.net, &NET_DEFAULTS, "wm_net_config")?;
    let fanout = block(c.fanout, &FANOUT_DEFAULTS, "wm_fanout_config")?;
    let memory = block(c.memory, &MEMORY_DEFAULTS, "wm_memory_config")?;
    let fallback_dir = match opt_path(c.fallback_dir) {
        None => Some(PathBuf::from(defaults::FALLBACK_DIR)),
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p),
    };
    let user = UserData(memory.callback_user_data);
    let release_hook = memory
        .release_callback
        .map(|cb| -> weight_manager_core::ReleaseHook {
            Box::new(move |name: &str, ptr: *mut u8, len: usize| {
                let name = std::ffi::CString::new(name).unwrap_or_default();
                let user = user;
                // SAFETY: the engine registered this callback for exactly this use.
                unsafe { cb(user.0, name.as_ptr(), ptr.cast(), len) }
            })
        });
    let acquire_hook = memory
        .acquire_callback
        .map(|cb| -> weight_manager_core::AcquireHook {
            Box::new(move |name: &str, ptr: *mut u8, len: usize| {
                let name = std::ffi::CString::new(name).unwrap_or_default();
                let user = user;
                // SAFETY: as above.
                let p = unsafe { cb(user.0, name.as_ptr(), ptr.cast(), len) };
                (!p.is_null()).then_some(p.cast())
            })
        });
    Ok(ManagerConfig {
        rank: c.rank,
        world_size: c.world_size,
        device: c.device,
        model_dir: opt_path(c.model_dir),
        fallback_dir,
        control_cell: opt_str(c.control_cell, "control_cell")?,
        group: group_from_c(group)?,
        logger,
        threads: c.copy_threads as usize,
        allow_other_uids: c.allow_other_uids != 0,
        release_hook,
        acquire_hook,
        net: net_from_c(net)?,
        fanout: fanout_from_c(fanout)?,
        callback_staging_limit: match memory.callback_staging_limit {
            0 => defaults::CALLBACK_STAGING_LIMIT,
            n => n,
        },
        keep_atomic_staging: memory.free_atomic_staging == 0,
        swap_device_pages: memory.swap_device_params != 0,
    })
}

/// The signal group's settings, when the group block names one.
unsafe fn group_from_c(c: &wm_group_config) -> Result<Option<GroupSettings>> {
    let addr = opt_str(c.rendezvous_addr, "wm_group_config.rendezvous_addr")?;
    Ok(
        opt_str(c.name, "wm_group_config.name")?.map(|name| GroupSettings {
            name,
            local_rank: (c.local_world_size != 0).then_some(c.local_rank),
            local_world_size: (c.local_world_size != 0).then_some(c.local_world_size),
            node_rank: c.node_rank,
            addr,
            timeout: match c.signal_timeout_ms {
                0 => defaults::SIGNAL_TIMEOUT,
                ms => std::time::Duration::from_millis(ms),
            },
        }),
    )
}

/// The network paths' settings (0 means the default).
unsafe fn net_from_c(c: &wm_net_config) -> Result<NetSettings> {
    Ok(NetSettings {
        secret: opt_str(c.secret, "wm_net_config.secret")?.map(String::into_bytes),
        bucket_size: match c.bucket_size {
            0 => NetSettings::default().bucket_size,
            n => usize::try_from(n).map_err(|_| {
                Error::invalid_argument(format!("wm_net_config.bucket_size {n} does not fit"))
            })?,
        },
        depth: match c.depth {
            0 => NetSettings::default().depth,
            n => n as usize,
        },
        gdr_fallback: c.gdr_fallback != 0,
        staged: c.staged != 0,
        keyed_digests: c.keyed_digests != 0,
    })
}

/// Fan-out: -1 none, a group number, anything else refused.
unsafe fn fanout_from_c(c: &wm_fanout_config) -> Result<Option<FanoutSettings>> {
    match c.group {
        -1 => Ok(None),
        g if g < 0 => Err(Error::invalid_argument(format!(
            "wm_fanout_config.group {g} is not a group number (0 or more) or -1 (no fan-out)"
        ))),
        g => Ok(Some(FanoutSettings {
            group: g as u32,
            nccl_library: opt_path(c.nccl_library),
        })),
    }
}
