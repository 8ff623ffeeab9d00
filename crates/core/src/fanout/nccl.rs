//! NCCL, loaded at run time, and a communicator whose every wait is bounded.
//!
//! **Loading.** NCCL installs as `libnccl.so.2` (the pip wheel
//! `nvidia-nccl-cu12` too), a name cudarc's loader never tries, and cudarc
//! offers no way to give a path. So this module opens NCCL itself through
//! [`crate::dynlib`], like UCX: the config's `nccl_library` path alone when
//! set, else `WM_NCCL_LIB` alone when set, else `libnccl.so.2` and
//! `libnccl.so` through the dynamic linker. It declares only the entry
//! points it calls, with C `int` results: NCCL's ABI for them is stable
//! across 2.x, and a result code a newer NCCL adds stays a number (in a
//! Rust enum, as cudarc's bindings have it, it would be undefined
//! behaviour).
//!
//! **Bounded waits.** A blocking NCCL call waits forever for a peer that
//! died. Communicators here are non-blocking (NCCL 2.14 and later, checked
//! at load): initialization and every collective return at once, and
//! [`Comm`] polls them (`ncclCommGetAsyncError`, `cuStreamQuery`) until
//! they finish, the deadline passes, or a peer's process is gone; then it
//! aborts the communicator (`ncclCommAbort` stops its kernels) and reports
//! which. A communicator that failed once is never used again.

use crate::dynlib::{dynamic_api, open_first};
use crate::memory::cuda::{check, cuda, new_stream};
use crate::memory::device::DeviceAllocation;
use crate::result::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::time::{Duration, Instant};

/// An NCCL unique id (`ncclUniqueId`): passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; crate::signal::fanout::ID_BYTES],
}

/// The NCCL 2.14 prefix of `ncclConfig_t`. NCCL reads `size` bytes of it
/// and fills fields a config of an older version lacks with defaults.
#[repr(C)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;
const NCCL_INT8: c_int = 0;
const NCCL_INT32: c_int = 2;
const NCCL_MIN: c_int = 3;
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// Non-blocking communicators came with NCCL 2.14.
const MIN_VERSION: c_int = 21400;
/// How long a finished communicator may take to tear down before it is
/// aborted instead.
const TEARDOWN: Duration = Duration::from_secs(10);

dynamic_api! { "libnccl", Api {
    ncclGetVersion: fn(*mut c_int) -> c_int;
    ncclGetUniqueId: fn(*mut UniqueId) -> c_int;
    ncclGetErrorString: fn(c_int) -> *const c_char;
    ncclCommInitRankConfig: fn(*mut *mut c_void, c_int, UniqueId, c_int, *mut Config) -> c_int;
    ncclCommGetAsyncError: fn(*mut c_void, *mut c_int) -> c_int;
    ncclCommFinalize: fn(*mut c_void) -> c_int;
    ncclCommDestroy: fn(*mut c_void) -> c_int;
    ncclCommAbort: fn(*mut c_void) -> c_int;
    ncclBroadcast: fn(*const c_void, *mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;
    ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;
}}

/// The loaded library.
pub struct Nccl {
    api: Api,
}

/// Where NCCL is looked for (module docs).
fn candidates(explicit: Option<&Path>) -> Vec<String> {
    if let Some(p) = explicit {
        return vec![p.display().to_string()];
    }
    match std::env::var("WM_NCCL_LIB") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    }
}

const INSTALL_HINT: &str =
    "install NCCL 2.14 or later (e.g. `pip install nvidia-nccl-cu12`) and set \
     wm_fanout_config.nccl_library (or WM_NCCL_LIB) to its libnccl.so.2";

static LOADED: Mutex<Option<&'static Nccl>> = Mutex::new(None);

/// NCCL, loaded once per process (the first success is kept; a failure is
/// retried by the next call, which may name another path).
pub fn nccl(explicit: Option<&Path>) -> Result<&'static Nccl> {
    let mut loaded = LOADED.lock();
    if let Some(n) = *loaded {
        return Ok(n);
    }
    let (handle, path) = open_first(&candidates(explicit)).map_err(|tried| {
        Error::unsupported(format!(
            "NCCL is not available ({}); {INSTALL_HINT}",
            tried.join("; ")
        ))
    })?;
    // SAFETY: a live handle; each symbol is looked up by name.
    let api = unsafe { Api::resolve(handle) }
        .map_err(|why| Error::unsupported(format!("{path} is not a usable NCCL: {why}")))?;
    let mut version = 0;
    // SAFETY: one out-parameter.
    let r = unsafe { (api.ncclGetVersion)(&mut version) };
    if r != NCCL_SUCCESS || version < MIN_VERSION {
        return Err(Error::unsupported(format!(
            "{path} is NCCL {}: fan-out needs 2.14 or later (non-blocking communicators, so \
             that no wait is unbounded); {INSTALL_HINT}",
            version_text(version)
        )));
    }
    let n: &'static Nccl = Box::leak(Box::new(Nccl { api }));
    *loaded = Some(n);
    Ok(n)
}

fn io_error(message: String) -> Error {
    Error::new(crate::result::wm_result::WM_ERR_IO, message)
}

fn version_text(v: c_int) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

impl Nccl {
    fn error_text(&self, r: c_int) -> String {
        // SAFETY: returns a static string (or NULL).
        let p = unsafe { (self.api.ncclGetErrorString)(r) };
        if p.is_null() {
            format!("NCCL result {r}")
        } else {
            // SAFETY: NUL-terminated static text.
            let text = unsafe { CStr::from_ptr(p) }.to_string_lossy();
            format!("{text} (NCCL result {r})")
        }
    }

    fn check(&self, r: c_int, call: &str) -> Result<()> {
        if r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS {
            return Ok(());
        }
        Err(io_error(format!("{call}: {}", self.error_text(r))))
    }

    /// A new unique id (the root makes it; the others build from it).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId {
            internal: [0; crate::signal::fanout::ID_BYTES],
        };
        self.check(
            // SAFETY: one out-parameter.
            unsafe { (self.api.ncclGetUniqueId)(&mut id) },
            "ncclGetUniqueId",
        )?;
        Ok(id)
    }
}

/// Checked between polls: Err when a peer is known to be gone.
pub type Alive<'a> = &'a dyn Fn() -> Result<()>;

/// One rank's end of a non-blocking communicator on GPU `ordinal`, with
/// its own stream. Dropped: finalized and destroyed, or aborted if it
/// failed (or will not finish tearing down).
pub struct Comm {
    nccl: &'static Nccl,
    /// `ncclComm_t` and `CUstream`, kept as numbers: driver handles usable
    /// from any thread once the context is current (every call here makes
    /// it current first).
    raw: usize,
    stream: usize,
    ordinal: i32,
    /// This rank's index in the communicator.
    rank: usize,
    /// 256 bytes for votes and lengths.
    scratch: DeviceAllocation,
    failed: bool,
}

impl Comm {
    /// Join communicator `id` as `rank` of `ranks` on GPU `ordinal`;
    /// returns once every rank joined.
    pub fn join(
        nccl: &'static Nccl,
        id: UniqueId,
        ranks: usize,
        rank: usize,
        ordinal: i32,
        deadline: Instant,
        alive: Alive,
    ) -> Result<Comm> {
        let scratch = DeviceAllocation::new("fan-out scratch", ordinal, 256)?;
        // The allocation left GPU `ordinal`'s context current.
        let stream = new_stream()?;
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: NCCL_API_MAGIC,
            version: MIN_VERSION as u32,
            blocking: 0,
        };
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; NCCL uses the current context.
        let r = unsafe {
            (nccl.api.ncclCommInitRankConfig)(
                &mut raw,
                ranks as c_int,
                id,
                rank as c_int,
                &mut config,
            )
        };
        let mut comm = Comm {
            nccl,
            raw: raw as usize,
            stream: stream as usize,
            ordinal,
            rank,
            scratch,
            failed: false,
        };
        if let Err(e) = nccl.check(r, "ncclCommInitRankConfig") {
            comm.abort();
            return Err(e);
        }
        comm.settle("joining the fan-out communicator", deadline, alive)?;
        Ok(comm)
    }

    fn current(&self) -> Result<()> {
        cuda()?.make_current(self.ordinal)
    }

    /// The communicator's own state: Ok(true) once idle, Ok(false) while
    /// an operation is still being set up.
    fn state(&self) -> Result<bool> {
        let mut state = NCCL_SUCCESS;
        // SAFETY: our communicator; one out-parameter.
        let r =
            unsafe { (self.nccl.api.ncclCommGetAsyncError)(self.raw as *mut c_void, &mut state) };
        self.nccl.check(r, "ncclCommGetAsyncError")?;
        match state {
            NCCL_SUCCESS => Ok(true),
            NCCL_IN_PROGRESS => Ok(false),
            e => Err(io_error(format!(
                "the fan-out communicator failed: {}",
                self.nccl.error_text(e)
            ))),
        }
    }

    /// Poll until `done` says finished; on error, timeout or a dead peer,
    /// abort the communicator (its kernels stop) and fail naming `what`.
    fn poll(
        &mut self,
        what: &str,
        deadline: Instant,
        alive: Alive,
        done: impl Fn(&Comm) -> Result<bool>,
    ) -> Result<()> {
        let r = (|| loop {
            if done(self)? {
                return Ok(());
            }
            alive()?;
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "{what}: not finished by its deadline (a fan-out rank stalled?)"
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        })();
        r.map_err(|e| {
            self.abort();
            e.context(what)
        })
    }

    /// Wait until a non-blocking call has been set up.
    fn settle(&mut self, what: &str, deadline: Instant, alive: Alive) -> Result<()> {
        self.poll(what, deadline, alive, Comm::state)
    }

    /// Wait until everything queued on the stream has run.
    pub fn synchronize(&mut self, what: &str, deadline: Instant, alive: Alive) -> Result<()> {
        self.current()?;
        self.poll(what, deadline, alive, |c| {
            c.state()?;
            // SAFETY: our stream, in the current context.
            match unsafe { sys::cuStreamQuery(c.stream as sys::CUstream) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                other => Err(io_error(format!("cuStreamQuery: {other:?}"))),
            }
        })
    }

    fn usable(&self) -> Result<()> {
        if self.failed {
            return Err(Error::state("the fan-out communicator failed earlier"));
        }
        self.current()
    }

    /// Queue a broadcast of `len` bytes at device address `buf` from rank
    /// `root` (its bytes) to every other rank (written in place).
    ///
    /// # Safety
    /// `buf..buf+len` is device memory of this communicator's GPU that
    /// nothing else touches until the stream is synchronized.
    pub unsafe fn broadcast(
        &mut self,
        buf: u64,
        len: usize,
        root: usize,
        deadline: Instant,
        alive: Alive,
    ) -> Result<()> {
        self.usable()?;
        let p = buf as *mut c_void;
        let r = (self.nccl.api.ncclBroadcast)(
            p,
            p,
            len,
            NCCL_INT8,
            root as c_int,
            self.raw as *mut c_void,
            self.stream as *mut c_void,
        );
        let nccl = self.nccl;
        nccl.check(r, "ncclBroadcast")
            .inspect_err(|_| self.abort())?;
        self.settle("queueing a fan-out broadcast", deadline, alive)
    }

    /// The smallest of every rank's `value`.
    pub fn min(&mut self, value: i32, deadline: Instant, alive: Alive) -> Result<i32> {
        self.usable()?;
        let dev = self.scratch.ptr();
        let stream = self.stream as sys::CUstream;
        let mut out = value;
        // SAFETY: 4 bytes of our scratch; `out` outlives the synchronize below.
        unsafe {
            check(
                sys::cuMemcpyHtoDAsync_v2(dev, (&value as *const i32).cast(), 4, stream),
                "cuMemcpyHtoDAsync",
            )?;
            let r = (self.nccl.api.ncclAllReduce)(
                dev as *const c_void,
                dev as *mut c_void,
                1,
                NCCL_INT32,
                NCCL_MIN,
                self.raw as *mut c_void,
                self.stream as *mut c_void,
            );
            let nccl = self.nccl;
            nccl.check(r, "ncclAllReduce")
                .inspect_err(|_| self.abort())?;
            self.settle("queueing a fan-out vote", deadline, alive)?;
            check(
                sys::cuMemcpyDtoHAsync_v2((&mut out as *mut i32).cast(), dev, 4, stream),
                "cuMemcpyDtoHAsync",
            )?;
        }
        self.synchronize("a fan-out vote", deadline, alive)?;
        Ok(out)
    }

    /// Broadcast a message from `root`: its `bytes` arrive on every rank
    /// (what others pass is ignored).
    pub fn broadcast_message(
        &mut self,
        bytes: &[u8],
        root: usize,
        deadline: Instant,
        alive: Alive,
    ) -> Result<Vec<u8>> {
        self.usable()?;
        let stream = self.stream as sys::CUstream;
        let dev = self.scratch.ptr();
        let mut len = bytes.len() as u64;
        // SAFETY: 8 bytes of our scratch; `len` outlives the synchronize.
        unsafe {
            check(
                sys::cuMemcpyHtoDAsync_v2(dev, (&len as *const u64).cast(), 8, stream),
                "cuMemcpyHtoDAsync",
            )?;
            self.broadcast(dev, 8, root, deadline, alive)?;
            check(
                sys::cuMemcpyDtoHAsync_v2((&mut len as *mut u64).cast(), dev, 8, stream),
                "cuMemcpyDtoHAsync",
            )?;
        }
        self.synchronize("a fan-out message's length", deadline, alive)?;
        let len = usize::try_from(len).map_err(|_| Error::format("fan-out message too long"))?;
        if len > MAX_MESSAGE {
            self.abort();
            return Err(Error::format(format!(
                "a fan-out message of {len} bytes is over the {MAX_MESSAGE}-byte limit"
            )));
        }
        // The root sends its bytes up; the others read theirs back.
        let sending = self.rank == root;
        let mut out = if sending {
            bytes.to_vec()
        } else {
            vec![0u8; len]
        };
        let buf = DeviceAllocation::new("a fan-out message", self.ordinal, len)?;
        // SAFETY: `len` bytes of `buf` and of `out`, which outlive the
        // synchronize below.
        unsafe {
            if sending {
                check(
                    sys::cuMemcpyHtoDAsync_v2(buf.ptr(), out.as_ptr().cast(), len, stream),
                    "cuMemcpyHtoDAsync",
                )?;
            }
            self.broadcast(buf.ptr(), len, root, deadline, alive)?;
            if !sending {
                check(
                    sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), buf.ptr(), len, stream),
                    "cuMemcpyDtoHAsync",
                )?;
            }
        }
        self.synchronize("a fan-out message", deadline, alive)?;
        Ok(out)
    }

    /// Whether the communicator failed or was aborted (it is rebuilt at the
    /// next meeting).
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Stop the communicator for good (its kernels end, peers' operations
    /// fail).
    pub fn abort(&mut self) {
        if !self.failed && self.raw != 0 {
            // SAFETY: our communicator, aborted once.
            unsafe { (self.nccl.api.ncclCommAbort)(self.raw as *mut c_void) };
        }
        self.failed = true;
    }
}

/// The largest message (announcement) a fan-out root may send.
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

impl Drop for Comm {
    fn drop(&mut self) {
        let _ = self.current();
        if !self.failed && self.raw != 0 {
            // SAFETY: our communicator; finalize, then wait a bounded time.
            let r = unsafe { (self.nccl.api.ncclCommFinalize)(self.raw as *mut c_void) };
            let deadline = Instant::now() + TEARDOWN;
            let fine = self.nccl.check(r, "ncclCommFinalize").is_ok()
                && self
                    .poll(
                        "tearing down the fan-out communicator",
                        deadline,
                        &|| Ok(()),
                        Comm::state,
                    )
                    .is_ok();
            if fine {
                // SAFETY: finalized; destroyed once.
                unsafe { (self.nccl.api.ncclCommDestroy)(self.raw as *mut c_void) };
            }
        }
        if self.stream != 0 {
            // SAFETY: our stream; nothing is queued on it any more.
            unsafe { sys::cuStreamDestroy_v2(self.stream as sys::CUstream) };
        }
    }
}
