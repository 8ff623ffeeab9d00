//! UCX (libucp), loaded at run time: the network transport under the rdma and
//! gdr paths. Over real RDMA hardware UCX moves bucket bytes with zero-copy
//! RDMA (and, built with CUDA, straight into GPU memory); on machines without
//! it, the same code runs over TCP (`UCX_TLS=tcp`).
//!
//! Only bulk bytes travel over UCX, as tagged messages (tag = bucket
//! sequence number). The control frames of `docs/wire.md` travel over a TCP
//! connection, which also tells at once when the peer process dies: UCX alone
//! would only let a receive wait for bytes that never come.
//!
//! One UCX context serves the process; each session drives its own worker on
//! its own thread ([`Pump`]), so bytes keep moving while the caller packs or
//! applies other buckets.

mod pump;
mod sys;

pub use pump::{Completion, Pump, ScatterList};

use crate::result::{Error, Result};
use std::ffi::c_void;
use std::sync::OnceLock;

/// The loaded library and the process's context.
pub struct Ucx {
    lib: sys::Lib,
    context: *mut c_void,
    cuda: bool,
}

// SAFETY: the context is created with `mt_workers_shared`, so workers may be
// created from any thread; it is never destroyed (process lifetime).
unsafe impl Send for Ucx {}
// SAFETY: as for Send: shared use of the context is creating workers on it,
// which `mt_workers_shared` allows from several threads at once.
unsafe impl Sync for Ucx {}

static UCX: OnceLock<std::result::Result<Ucx, String>> = OnceLock::new();

/// The process's UCX, loaded on first use. Without UCX: `WM_ERR_UNSUPPORTED`
/// saying what to install.
pub fn ucx() -> Result<&'static Ucx> {
    UCX.get_or_init(init)
        .as_ref()
        .map_err(|e| Error::unsupported(e.clone()))
}

fn init() -> std::result::Result<Ucx, String> {
    let lib = sys::load()?;
    let api = &lib.api;
    let mut config = std::ptr::null_mut();
    // SAFETY: NULL prefix and file: UCX_* environment variables apply.
    let st = unsafe { (api.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
    if st != sys::UCS_OK {
        return Err(format!(
            "UCX: reading its configuration failed: {}",
            lib.status_text(st)
        ));
    }
    choose_defaults(&lib, config);
    let params = sys::Params {
        field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        features: sys::UCP_FEATURE_TAG | sys::UCP_FEATURE_WAKEUP,
        request_size: 0,
        request_init: std::ptr::null(),
        request_cleanup: std::ptr::null(),
        tag_sender_mask: 0,
        mt_workers_shared: 1,
        spare: [0; 16],
    };
    let mut context = std::ptr::null_mut();
    // SAFETY: params and config are valid for the call; API 1.10 is the oldest we need.
    let st = unsafe { (api.ucp_init_version)(1, 10, &params, config, &mut context) };
    // SAFETY: config came from ucp_config_read.
    unsafe { (api.ucp_config_release)(config) };
    if st != sys::UCS_OK {
        return Err(format!(
            "UCX {}.{}.{} ({}): creating a context failed: {}",
            lib.version.0,
            lib.version.1,
            lib.version.2,
            lib.path,
            lib.status_text(st)
        ));
    }
    let mut attr = sys::ContextAttr {
        field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES,
        request_size: 0,
        thread_mode: 0,
        memory_types: 0,
        spare: [0; 16],
    };
    // SAFETY: a live context and an attr struct with room to spare.
    let st = unsafe { (api.ucp_context_query)(context, &mut attr) };
    let cuda = st == sys::UCS_OK && attr.memory_types & (1 << sys::UCS_MEMORY_TYPE_CUDA) != 0;
    Ok(Ucx { lib, context, cuda })
}

/// UCX settings the library chooses where the environment does not
/// (`UCX_<NAME>` set: the user's value stands). Over TCP, UCX moves bytes in
/// segments of 8 KiB (TX) and 64 KiB (RX) by default; buckets go as 1 MiB
/// messages, and segments of 1 MiB (one per message) carry them at about
/// 3x the speed on loopback here: raw UCX 1.1 -> 4 GB/s, an rdma update
/// 0.9 -> 2.7-3.4 GB/s, from 0.35 to 0.87-0.92 of gloo broadcasting the
/// same tensors (256 KiB: 0.68; 2 and 4 MiB: no better). Each TCP
/// endpoint's receive buffers grow with the segment: a few MiB per
/// session. RDMA transports ignore these.
const CHOSEN: [(&str, &str); 2] = [("TCP_TX_SEG_SIZE", "1m"), ("TCP_RX_SEG_SIZE", "1m")];

fn choose_defaults(lib: &sys::Lib, config: *mut c_void) {
    for (name, value) in CHOSEN {
        if std::env::var_os(format!("UCX_{name}")).is_some() {
            continue;
        }
        let (n, v) = (std::ffi::CString::new(name), std::ffi::CString::new(value));
        let (Ok(n), Ok(v)) = (n, v) else { continue };
        // SAFETY: a live config from ucp_config_read and two C strings. A
        // UCX without the setting refuses it; the default then stands.
        let _ = unsafe { (lib.api.ucp_config_modify)(config, n.as_ptr(), v.as_ptr()) };
    }
}

impl Ucx {
    /// "UCX 1.22.0 (/path/to/libucp.so.0)".
    pub fn describe(&self) -> String {
        let (a, b, c) = self.lib.version;
        format!("UCX {a}.{b}.{c} ({})", self.lib.path)
    }

    /// Whether this UCX can move bytes to and from CUDA memory (gdr).
    pub fn supports_cuda(&self) -> bool {
        self.cuda
    }

    /// Why this UCX cannot reach CUDA memory, for an error message: the
    /// usual cause on a machine with a CUDA-enabled UCX is a `UCX_TLS`
    /// that leaves out its CUDA transports.
    pub fn no_cuda_reason(&self) -> String {
        let tls = std::env::var("UCX_TLS").ok();
        match tls.as_deref().filter(|t| tls_leave_out_cuda(t)) {
            Some(t) => format!(
                "{} cannot reach CUDA memory: UCX_TLS={t} leaves out its CUDA transports \
                 (add cuda_copy, or unset UCX_TLS); or it is not built with CUDA (install a \
                 CUDA-enabled UCX, e.g. the libucx-cu12 wheel, and set WM_UCX_LIB)",
                self.describe()
            ),
            None => format!(
                "{} cannot reach CUDA memory (install a CUDA-enabled UCX, e.g. the libucx-cu12 \
                 wheel, and set WM_UCX_LIB)",
                self.describe()
            ),
        }
    }

    pub(crate) fn lib(&self) -> &sys::Lib {
        &self.lib
    }

    pub(crate) fn context(&self) -> *mut c_void {
        self.context
    }

    fn error(&self, what: &str, st: sys::Status) -> Error {
        Error::peer(format!("UCX: {what}: {}", self.lib.status_text(st)))
    }
}

/// Whether a `UCX_TLS` value selects no CUDA transport: a list naming
/// none (`tcp`, `rc,sm`), not `all`, and not a `^` list of exclusions
/// (which keeps every transport it does not name).
fn tls_leave_out_cuda(tls: &str) -> bool {
    let t = tls.trim();
    !t.starts_with('^')
        && !t
            .split(',')
            .any(|x| x.trim() == "all" || x.contains("cuda"))
}

#[cfg(test)]
mod tls_tests {
    #[test]
    fn a_tls_list_without_cuda_is_named() {
        for (tls, out) in [
            ("tcp", true),
            ("rc,sm,self", true),
            ("tcp,cuda_copy", false),
            ("all", false),
            ("^ib", false),
            ("^cuda_copy", false),
        ] {
            assert_eq!(super::tls_leave_out_cuda(tls), out, "{tls}");
        }
    }
}
