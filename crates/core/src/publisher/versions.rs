//! Published versions: copies of the trainer's tensors that sessions serve
//! by name, the last `keep_versions` kept, and the shared buffers of
//! dropped ones reused by the next `publish`.

use super::config::PublisherConfig;
use super::offer::{Content, Offer, Published, ServedTensor};
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::cuda_ipc::{self, ExportedDeviceBuffer};
use crate::memory::hashing::{copy_and_hash_all, hash_all};
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Default)]
pub(super) struct Versions {
    /// Oldest first.
    pub(super) published: Mutex<VecDeque<Arc<Offer>>>,
    /// Shared buffers of dropped versions, refilled by the next `publish`
    /// once no session serves them any more: an engine keeps its mappings
    /// of the buffers it read lately, so a reused buffer costs it nothing
    /// to map again (a fresh 4 GiB one costs about 0.3 s of page faults).
    retired: Mutex<VecDeque<Arc<SharedBuffer>>>,
    /// Buffers written with `pwrite` (by address) whose pages this
    /// process has not mapped yet: mapped on every core when reused.
    unmapped: Mutex<std::collections::HashSet<usize>>,
    /// How many retired buffers are kept: [`SPARES`], or as many as the
    /// trainer prepared.
    spares: AtomicUsize,
    /// Publishes running, and what [`Versions::to_serve`] needs to know
    /// when the list is empty; `published_now` wakes a serve waiting for
    /// a publish to end.
    publishing: Mutex<Publishing>,
    published_now: Condvar,
}

/// Publishes under way and before.
#[derive(Default)]
struct Publishing {
    running: usize,
    /// A publish of this publisher ever started: from then on, only
    /// published copies are served.
    started: bool,
    /// The last publish failed (its version's name), none succeeded since.
    failed: Option<String>,
}

/// A publish under way: counted from [`Versions::begin`] until dropped
/// (done or failed), which wakes the serves waiting for it.
struct Running<'v> {
    versions: &'v Versions,
    name: String,
    done: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.versions.publishing.lock();
        state.running -= 1;
        state.failed = (!self.done).then(|| self.name.clone());
        self.versions.published_now.notify_all();
    }
}

/// How often a serve waiting for a publish looks whether the publisher
/// is being destroyed.
const STOP_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Retired buffers kept by default: two cover a publisher alternating
/// versions.
const SPARES: usize = 2;

/// The most buffers one [`Versions::prepare`] makes: a bound on what a
/// caller's count can allocate (the memory itself is bounded by
/// /dev/shm, whose exhaustion is a clear error there).
pub(super) const MAX_PREPARED: usize = 64;

impl Versions {
    /// Keep `offer` as version `name`, its tensors copied now (onto the GPU
    /// of its first GPU tensor when `on_device`: an IPC publisher hands
    /// that buffer to engines by CUDA IPC; else into shared host memory).
    /// A version of the same name is replaced; the oldest beyond
    /// `keep_versions` is dropped.
    pub(super) fn publish(
        &self,
        mut offer: Offer,
        name: &str,
        on_device: bool,
        cfg: &PublisherConfig,
    ) -> Result<()> {
        let keep = cfg.keep_versions.max(1);
        let threads = cfg.pack_threads();
        let mut running = self.begin(name);
        if let Content::Tensors(ts) = &mut offer.content {
            self.make_room(name, keep);
            synchronize_gpus(ts, name)?;
            offer.published = Some(match ts.iter().find_map(|t| t.device) {
                Some(gpu) if on_device => {
                    Published::Device(Arc::new(copy_to_device(ts, gpu, name)?))
                }
                _ => Published::Host(Arc::new(self.copy_to_shared(
                    ts,
                    name,
                    (threads, cfg.checksums),
                )?)),
            });
            if cfg.checksums {
                hash_published(ts, threads)?;
            }
        }
        let mut published = self.published.lock();
        let (same, others): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut *published)
            .into_iter()
            .partition(|o| o.version.as_deref() == Some(name));
        *published = others;
        same.into_iter().for_each(|o| self.retire(o));
        published.push_back(Arc::new(offer));
        while published.len() > keep {
            if let Some(oldest) = published.pop_front() {
                self.retire(oldest);
            }
        }
        running.done = true;
        Ok(())
    }

    fn begin(&self, name: &str) -> Running<'_> {
        let mut state = self.publishing.lock();
        state.running += 1;
        state.started = true;
        Running {
            versions: self,
            name: name.to_string(),
            done: false,
        }
    }

    /// What a serve offers: every published version; None when nothing
    /// was ever published (the trainer serves its tensors as they are).
    /// Once a publish started, never the live tensors: while the list is
    /// empty because a publish dropped the only version it replaces
    /// (`keep_versions` 1: its buffer takes the new one), this waits for
    /// that publish until `until`. The live tensors under the new
    /// version's name were what such a serve offered before, while the
    /// trainer was free to change them (an engine took bytes of two steps
    /// as one version). Err: the publish failed, leaving nothing, or is
    /// still running at `until`.
    /// `stopped`: Err once the publisher is being destroyed, looked at
    /// every [`STOP_POLL`] of the wait.
    pub(super) fn to_serve(
        &self,
        until: Instant,
        stopped: &dyn Fn() -> Result<()>,
    ) -> Option<Result<Vec<Arc<Offer>>>> {
        let mut state = self.publishing.lock();
        let mut timed_out = false;
        loop {
            let published = self.published.lock();
            if !published.is_empty() {
                return Some(Ok(published.iter().cloned().collect()));
            }
            drop(published);
            if !state.started {
                return None;
            }
            if state.running == 0 {
                let failed = state.failed.as_deref().unwrap_or("?");
                return Some(Err(Error::no_version(format!(
                    "serve: no version is published: publishing '{failed}' failed (and with \
                     keep_versions 1 it had dropped the version before it); publish again"
                ))));
            }
            if timed_out {
                return Some(Err(Error::timeout(
                    "serve: no version is published yet (a first publish, or one that dropped \
                     the only version kept with keep_versions 1, was still copying its tensors \
                     when the accept timeout ran out)",
                )));
            }
            if let Err(e) = stopped() {
                return Some(Err(e));
            }
            // Looked at once more after the wait ends, whatever woke it.
            let slice = until.min(Instant::now() + STOP_POLL);
            self.published_now.wait_until(&mut state, slice);
            timed_out = Instant::now() >= until;
        }
    }

    /// The version a publish of `name` pushes out (when the list is full)
    /// is dropped before the copy, so its buffer can take the new one:
    /// steady publishing then cycles through keep_versions + 1 buffers. If
    /// the copy fails, that version is gone all the same.
    fn make_room(&self, name: &str, keep: usize) {
        let mut published = self.published.lock();
        let replaces = published.iter().any(|o| o.version.as_deref() == Some(name));
        if !replaces && published.len() >= keep {
            if let Some(oldest) = published.pop_front() {
                self.retire(oldest);
            }
        }
    }

    /// Make `count` shared buffers for versions of `ts` now, each with
    /// every page allocated and mapped in this process, and keep them as
    /// spares that the next publishes copy into: a publish that has to
    /// create its buffer pays for fresh shared pages (0.3-0.6 s per GiB on
    /// the 2-core test machine), one that reuses one copies at memory
    /// speed. Returns the bytes made. Buffers a publish cannot use (a
    /// version grown past them) are dropped as spares are.
    pub(super) fn prepare(&self, ts: &[ServedTensor], count: usize) -> Result<u64> {
        if count > MAX_PREPARED {
            return Err(Error::invalid_argument(format!(
                "prepare: {count} buffers asked for; at most {MAX_PREPARED}"
            )));
        }
        let (_, total) = packed_offsets(ts, "prepared")?;
        let total = total.max(crate::wire::ALIGN as usize);
        let mut made = Vec::with_capacity(count);
        for k in 0..count {
            let what = format!("prepared version buffer {} of {count}", k + 1);
            made.push(Arc::new(SharedBuffer::create(&what, total)?));
        }
        self.spares.fetch_max(count, Ordering::Relaxed);
        self.keep_spares(made);
        Ok(total as u64 * count as u64)
    }

    /// Keep `buffers` as spares for later publishes, the oldest dropped
    /// beyond the number kept.
    fn keep_spares(&self, buffers: impl IntoIterator<Item = Arc<SharedBuffer>>) {
        let mut retired = self.retired.lock();
        retired.extend(buffers);
        while retired.len() > self.spares.load(Ordering::Relaxed).max(SPARES) {
            retired.pop_front();
        }
    }

    /// Where the spare buffers are, for the tests.
    #[cfg(test)]
    pub(super) fn spare_ptrs(&self) -> Vec<*mut u8> {
        self.retired.lock().iter().map(|b| b.ptr()).collect()
    }

    /// Names of the published versions, oldest first.
    pub(super) fn names(&self) -> Vec<String> {
        self.published
            .lock()
            .iter()
            .filter_map(|o| o.version.clone())
            .collect()
    }

    /// Keep a dropped version's shared buffer for a later `publish` (it is
    /// reused once no session serves the version any more).
    fn retire(&self, offer: Arc<Offer>) {
        if let Some(shared) = offer.shared().cloned() {
            self.keep_spares([shared]);
        }
    }

    /// Copy `ts` into one shared buffer (256-byte aligned offsets, copied on
    /// `threads`; a retired buffer no session holds is reused) and point
    /// them at their copies.
    fn copy_to_shared(
        &self,
        ts: &mut [ServedTensor],
        version: &str,
        (threads, hash): (usize, bool),
    ) -> Result<SharedBuffer> {
        let (offsets, total) = packed_offsets(ts, version)?;
        // A memfd cannot be empty (fallocate refuses a zero length).
        let total = total.max(crate::wire::ALIGN as usize);
        let spare = {
            let mut retired = self.retired.lock();
            let free = retired
                .iter()
                .position(|b| Arc::strong_count(b) == 1 && b.len() >= total);
            free.and_then(|i| retired.remove(i))
                .and_then(|b| Arc::try_unwrap(b).ok())
        };
        let host_only = ts.iter().all(|t| t.device.is_none());
        let shared = match spare {
            Some(b) => {
                if self.unmapped.lock().remove(&(b.ptr() as usize)) {
                    b.reserve(&format!("version '{version}'"))?;
                }
                b
            }
            None if host_only => {
                let b = write_fresh(ts, &offsets, total, version)?;
                point_at_copies(ts, &offsets, &b);
                self.unmapped.lock().insert(b.ptr() as usize);
                return Ok(b);
            }
            None => SharedBuffer::create(&format!("version '{version}'"), total)?,
        };
        if hash && host_only && ts.len() >= 2 * threads.max(1) {
            let copies: Vec<(SendPtr, SendPtr, usize)> = ts
                .iter()
                .zip(&offsets)
                .map(|(t, &at)| (t.data, SendPtr(shared.ptr().wrapping_add(at)), t.len))
                .collect();
            // SAFETY: add's contract keeps each tensor valid and unchanged
            // for len bytes; the destinations are disjoint ranges of the
            // buffer.
            let sums = unsafe { copy_and_hash_all(&copies, threads) };
            point_at_copies(ts, &offsets, &shared);
            for (t, sum) in ts.iter_mut().zip(sums) {
                t.checksum = Some(sum);
            }
            return Ok(shared);
        }
        let jobs: Vec<CopyJob> = ts
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (t, &at))| CopyJob {
                src: tensor_source(t),
                dst: SendPtr(shared.ptr().wrapping_add(at)),
                len: t.len,
                tag: i,
            })
            .collect();
        // SAFETY: add's contract keeps each tensor valid for len bytes;
        // the destinations are disjoint ranges of the new buffer.
        unsafe { copy_all(&jobs, threads) }.map_err(|e| e.error)?;
        point_at_copies(ts, &offsets, &shared);
        Ok(shared)
    }
}

/// Point `ts` at their copies in `shared` (at `offsets`).
fn point_at_copies(ts: &mut [ServedTensor], offsets: &[usize], shared: &SharedBuffer) {
    for (t, &at) in ts.iter_mut().zip(offsets) {
        t.data = SendPtr(shared.ptr().wrapping_add(at));
        t.device = None;
    }
}

/// A new shared buffer of `total` bytes holding host tensors `ts` at
/// `offsets` and zeros between them, written with `pwrite`: a fresh page a
/// write fills is not zeroed first, so this is one pass over the bytes,
/// where faulting the buffer in and copying into it are two (measured on
/// the 2-core test machine, busy: 0.62 s per GiB against 1.04-1.18 s).
/// Writes to one memory file run one at a time in the kernel, so this is
/// one thread. Every page is written, so none is left for a reader's
/// fault to allocate. This process does not map the pages (0.2-0.6 s per
/// GiB of page-table work for 4 KiB shared pages) until a later publish
/// reuses the buffer and copies into it (`Versions::copy_to_shared`);
/// a publisher that never reuses it never pays that.
fn write_fresh(
    ts: &[ServedTensor],
    offsets: &[usize],
    total: usize,
    version: &str,
) -> Result<SharedBuffer> {
    let what = format!("version '{version}'");
    let shared = SharedBuffer::create_unreserved(&what, total)?;
    let zeros = [0u8; 4096];
    let mut end = 0;
    for (t, &at) in ts.iter().zip(offsets) {
        write_zeros(&shared, (end, at), &zeros, &what)?;
        // SAFETY: add's contract keeps a host tensor valid for len bytes.
        let bytes = unsafe { std::slice::from_raw_parts(t.data.0, t.len) };
        write_at(&shared, at, bytes, &what)?;
        end = at + t.len;
    }
    write_zeros(&shared, (end, total), &zeros, &what)?;
    shared.seal_writes(&what)?;
    Ok(shared)
}

fn write_zeros(
    shared: &SharedBuffer,
    (from, to): (usize, usize),
    zeros: &[u8],
    what: &str,
) -> Result<()> {
    let mut at = from;
    while at < to {
        let n = zeros.len().min(to - at);
        write_at(shared, at, &zeros[..n], what)?;
        at += n;
    }
    Ok(())
}

/// `pwrite` all of `bytes` at `offset` of `shared`'s file.
fn write_at(shared: &SharedBuffer, offset: usize, bytes: &[u8], what: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0;
    while done < bytes.len() {
        let rest = &bytes[done..];
        // SAFETY: `rest` is readable for its length; the descriptor is ours.
        let n = unsafe {
            libc::pwrite(
                shared.fd().as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                (offset + done) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(Error::out_of_memory(format!(
                    "{what}: no room for {} bytes of shared memory",
                    shared.len()
                )))
            }
            _ => {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::ENOSPC | libc::ENOMEM) => {
                        return Err(Error::out_of_memory(format!(
                            "{what}: no room for {} bytes of shared memory",
                            shared.len()
                        )))
                    }
                    _ => return Err(Error::io(format!("{what}: writing"), e)),
                }
            }
        }
    }
    Ok(())
}

/// Kernels still writing the trainer's GPU tensors finish first.
fn synchronize_gpus(ts: &[ServedTensor], name: &str) -> Result<()> {
    let mut gpus: Vec<i32> = ts.iter().filter_map(|t| t.device).collect();
    gpus.sort_unstable();
    gpus.dedup();
    for &g in &gpus {
        cuda_ipc::synchronize(g).map_err(|e| e.context(format!("publish '{name}'")))?;
    }
    Ok(())
}

/// Where each tensor of a version's copy starts (256-byte aligned, in
/// order) and the bytes the copy needs.
fn packed_offsets(ts: &[ServedTensor], version: &str) -> Result<(Vec<usize>, usize)> {
    crate::memory::aligned_offsets(ts.iter().map(|t| t.len as u64))
        .ok_or_else(|| Error::out_of_memory(format!("version '{version}' is too large")))
}

/// Where the copier reads tensor `t` (host memory, or GPU memory).
fn tensor_source(t: &ServedTensor) -> CopySource<'static> {
    match t.device {
        Some(ordinal) => CopySource::Device {
            ptr: t.data.0 as u64,
            ordinal,
        },
        None => CopySource::Memory(t.data),
    }
}

/// Copy `ts` into one new GPU buffer on GPU `gpu` (256-byte aligned
/// offsets; host tensors are uploaded, other GPUs' copied peer to peer)
/// and point them at their copies.
fn copy_to_device(
    ts: &mut [ServedTensor],
    gpu: i32,
    version: &str,
) -> Result<ExportedDeviceBuffer> {
    let (offsets, total) = packed_offsets(ts, version)?;
    let buf = ExportedDeviceBuffer::new(&format!("version '{version}'"), gpu, total)?;
    for (t, &at) in ts.iter().zip(&offsets) {
        // SAFETY: the tensor's memory is valid for len bytes (add's
        // contract); the range fits the buffer, which is sized for all.
        unsafe { buf.copy_in(at, t.data.0 as u64, t.len) }
            .map_err(|e| e.context(format!("publish '{version}': tensor '{}'", t.name)))?;
    }
    for (t, at) in ts.iter_mut().zip(offsets) {
        t.data = SendPtr((buf.ptr() + at as u64) as *mut u8);
        t.device = Some(gpu);
    }
    Ok(buf)
}

/// Checksums of a version's copies (GPU ones are read back to hash).
fn hash_published(ts: &mut [ServedTensor], threads: usize) -> Result<()> {
    // Tensors hashed while they were copied (`copy_and_hash_all`) are done.
    let unhashed = |t: &ServedTensor| t.checksum.is_none();
    let host: Vec<(SendPtr, usize)> = ts
        .iter()
        .filter(|t| t.device.is_none() && unhashed(t))
        .map(|t| (t.data, t.len))
        .collect();
    // SAFETY: our own copies, unchanged from here on.
    let mut sums = unsafe { hash_all(&host, threads) }.into_iter();
    let mut scratch: Vec<u8> = Vec::new();
    for t in ts.iter_mut().filter(|t| unhashed(t)) {
        t.checksum = Some(match t.device {
            None => sums.next().expect("one per host tensor"),
            Some(gpu) => {
                scratch.resize(t.len, 0);
                // SAFETY: the scratch holds len bytes; the copy is ours.
                unsafe { cuda_ipc::download(gpu, scratch.as_mut_ptr(), t.data.0 as u64, t.len) }?;
                crate::checksum::of(&scratch)
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn offer(name: &str) -> Arc<Offer> {
        Arc::new(Offer::new(Some(name.into()), Content::Tensors(Vec::new())))
    }

    /// Before any publish a serve offers the live tensors (None); while a
    /// publish has emptied the list it waits for that publish and offers
    /// its version, never the live tensors; a publish that failed leaving
    /// nothing is an error naming it, as is one still running at the end
    /// of the wait, and a publisher being destroyed ends the wait.
    #[test]
    fn a_serve_never_offers_live_tensors_once_a_publish_started() {
        let v = Versions::default();
        let soon = || Instant::now() + Duration::from_millis(50);
        let going = || Ok(());
        assert!(v.to_serve(soon(), &going).is_none());
        std::thread::scope(|s| {
            let mut running = v.begin("2");
            let serving = s.spawn(|| v.to_serve(Instant::now() + Duration::from_secs(30), &going));
            std::thread::sleep(Duration::from_millis(100));
            assert!(!serving.is_finished(), "the serve waits for the publish");
            v.published.lock().push_back(offer("2"));
            running.done = true;
            drop(running);
            let offers = serving.join().unwrap().unwrap().unwrap();
            assert_eq!(offers.len(), 1);
            assert_eq!(offers[0].version.as_deref(), Some("2"));
        });
        v.published.lock().clear();
        drop(v.begin("3"));
        let e = v.to_serve(soon(), &going).unwrap().unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_NO_VERSION);
        assert!(e.message.contains("publishing '3' failed"), "{e}");
        let _still = v.begin("4");
        let e = v.to_serve(soon(), &going).unwrap().unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_TIMEOUT);
        // A publisher being destroyed ends the wait at once.
        let stopped = || Err(Error::cancelled("stopped"));
        let long = Instant::now() + Duration::from_secs(30);
        let e = v.to_serve(long, &stopped).unwrap().unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_CANCELLED);
    }
}
