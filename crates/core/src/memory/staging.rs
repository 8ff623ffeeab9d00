//! Pinned host staging and asynchronous host-to-device copies.
//!
//! A copy from pageable host memory into the GPU goes through the driver's
//! own small bounce buffers and blocks the calling thread until it is done;
//! the DMA engine sits idle while the next bytes are read. Instead, bytes
//! bound for device params land in (or are copied into) page-locked host
//! buffers allocated with `cuMemHostAlloc` (portable, not write-combined:
//! the CPU reads them back to hash), and goes to the GPU with
//! `cuMemcpyAsync` on a stream of its own per GPU. The source reads
//! the next chunk while the DMA runs. An event recorded after each copy says
//! when its buffer may be refilled.
//!
//! Which bytes go where (the applier asks [`lands_in_own_pinned_buffer`]):
//! - a tensor of 8 to 256 MiB, in place, lands in a pinned buffer of its own
//!   and that buffer is uploaded whole ([`DeviceStaging::upload_buffer`]);
//! - smaller tensors, larger ones (in 256 MiB pieces) and atomic updates'
//!   staged bytes are copied into a pinned "filling" buffer of 64 MiB that
//!   many of them share, each piece's DMA queued as soon as it is copied
//!   ([`DeviceStaging::upload_bytes`]);
//! - when the caller already holds every buffer (a batch of many tensors
//!   landing at once), a tensor lands in ordinary memory and goes up the
//!   second way, rather than waiting for a buffer that cannot come back.
//!
//! The buffers are allocated once and kept for the next update (the
//! manager owns one [`DeviceStaging`]); free, in flight, held and filling
//! together they pin at most [`PINNED_BYTES`] per GPU (one buffer more when
//! the caller holds them all, so that it progresses). A clear frees them (a
//! cleared engine holds no weight memory of the library's).
//!
//! Why a budget of bytes and its size: a snapshot batch (256 MiB) holds
//! every buffer it lands in until its DMA is queued, so a budget of one
//! batch (what a count of 4 buffers gave for 64 MiB tensors) made the next
//! batch wait for the last one's copies: reading and the DMA took turns
//! (on an H200, snapshot into device params at 0.45-0.53 of pinned HtoD).
//! Two batches' worth lets one fill while the other's DMA runs.
//!
//! Every wait polls with the update's deadline: a wedged GPU is a timeout
//! error, never a hang. Dropping the staging waits (bounded) for copies in
//! flight before freeing their buffers; if they never finish, the buffers
//! are leaked rather than freed under a running DMA.

use super::cuda::{check, copy_2d, cuda, new_stream, CopyTo};
use super::pinned::PinnedBuffer;
use super::strided::Strided;
use crate::memory::copy::{copy_all, CopyJob, CopySource};
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Pinned bytes per GPU (module docs): two snapshot batches, one filled
/// while the other's DMA runs.
pub(crate) const PINNED_BYTES: usize = 2 * (256 << 20);
/// In place, tensors above [`SMALL_TENSOR`] and up to this size land in a
/// pinned buffer of their own; larger ones land in ordinary memory and go
/// up in pieces of this size.
pub(crate) const PINNED_TENSOR_MAX: usize = 256 << 20;
/// Pinned buffers are sized in steps of this, so a few sizes serve all.
const SIZE_STEP: usize = 2 << 20;
/// Tensors up to this size are not given a pinned buffer of their own:
/// they land in ordinary memory and are packed, many to a buffer, into a
/// pinned buffer of [`FILL_SIZE`] on their way up.
const SMALL_TENSOR: usize = 8 << 20;
const FILL_SIZE: usize = 64 << 20;

/// The landing policy for a device param's tensor of `n` bytes received in
/// place: true when it lands in a pinned buffer of its own (taken with
/// [`DeviceStaging::take`], uploaded whole with
/// [`DeviceStaging::upload_buffer`]); false when it lands in ordinary memory
/// and goes up with [`DeviceStaging::upload_bytes`] (small ones packed many
/// to a buffer, large ones in pieces).
pub(crate) fn lands_in_own_pinned_buffer(n: usize) -> bool {
    (SMALL_TENSOR + 1..=PINNED_TENSOR_MAX).contains(&n)
}
/// How long dropping the staging waits for copies still in flight.
const DROP_WAIT: Duration = Duration::from_secs(60);

/// The index of the smallest capacity in `caps` that holds `n` bytes.
fn best_fit(caps: impl Iterator<Item = usize>, n: usize) -> Option<usize> {
    caps.enumerate()
        .filter(|&(_, c)| c >= n)
        .min_by_key(|&(_, c)| c)
        .map(|(i, _)| i)
}

/// What a buffer for `n` bytes is allocated as.
fn rounded(n: usize) -> usize {
    n.max(1).next_multiple_of(SIZE_STEP)
}

/// One GPU's stream and buffers.
struct Lane {
    ordinal: i32,
    stream: sys::CUstream,
    free: Vec<PinnedBuffer>,
    /// Copies queued, oldest first: the event that completes after each,
    /// and the pinned buffer it reads (None: a device-to-device copy).
    busy: VecDeque<(sys::CUevent, Option<PinnedBuffer>)>,
    /// Events whose copies completed, for reuse.
    events: Vec<sys::CUevent>,
    /// The buffer small uploads are packed into, and how much of it is used;
    /// its copies are queued as they come and it joins `busy` when full or
    /// when the update waits.
    filling: Option<(PinnedBuffer, usize)>,
    /// The bytes of buffers handed out by `take` and not sent or given
    /// back yet.
    outstanding_bytes: usize,
}

// SAFETY: the stream and events are driver handles usable from any thread
// once the context is current (every call here makes it current first).
unsafe impl Send for Lane {}

impl Lane {
    fn new(ordinal: i32) -> Result<Lane> {
        let c = cuda()?;
        c.make_current(ordinal)?;
        let stream = new_stream()?;
        Ok(Lane {
            ordinal,
            stream,
            free: Vec::new(),
            busy: VecDeque::new(),
            events: Vec::new(),
            filling: None,
            outstanding_bytes: 0,
        })
    }

    /// Move buffers whose copies are done to `free`; with `block`, wait
    /// for the oldest one (until `deadline`) first.
    fn reap(&mut self, block: Option<Instant>) -> Result<()> {
        cuda()?.make_current(self.ordinal)?;
        let mut first = true;
        while let Some((event, _)) = self.busy.front() {
            // SAFETY: an event recorded on this lane's stream.
            match unsafe { sys::cuEventQuery(*event) } {
                CUresult::CUDA_SUCCESS => {
                    let (event, buf) = self.busy.pop_front().expect("front exists");
                    self.events.push(event);
                    self.free.extend(buf);
                    first = false;
                }
                CUresult::CUDA_ERROR_NOT_READY => match block {
                    Some(deadline) if first => {
                        if Instant::now() > deadline {
                            return Err(Error::timeout(format!(
                                "GPU {}: a host-to-device copy did not finish in time",
                                self.ordinal
                            )));
                        }
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    _ => return Ok(()),
                },
                other => return check(other, "cuEventQuery (host-to-device copy)"),
            }
        }
        Ok(())
    }

    /// A buffer of at least `n` bytes: a free one, or a new one while the
    /// budget has room (free ones too small are traded in when that makes
    /// room); else wait for copies in flight; None when none is in flight
    /// (the caller holds the budget), so the caller uses ordinary memory
    /// instead of waiting forever.
    fn take(&mut self, n: usize, deadline: Instant) -> Result<Option<PinnedBuffer>> {
        self.reap(None)?;
        loop {
            if let Some(i) = best_fit(self.free.iter().map(|b| b.cap()), n) {
                let buf = self.free.swap_remove(i);
                return Ok(Some(self.hand_out(buf)));
            }
            if self.pinned_bytes() + rounded(n) <= PINNED_BYTES {
                let buf = PinnedBuffer::new(self.ordinal, rounded(n))?;
                return Ok(Some(self.hand_out(buf)));
            }
            let free: usize = self.free.iter().map(|b| b.cap()).sum();
            if !self.free.is_empty() && self.pinned_bytes() - free + rounded(n) <= PINNED_BYTES {
                // Every free buffer is too small, and freeing them makes
                // room: trade the smallest in.
                let i = best_fit(self.free.iter().map(|b| b.cap()), 0).expect("not empty");
                drop(self.free.swap_remove(i));
                continue;
            }
            if !self.busy.iter().any(|(_, b)| b.is_some()) {
                return Ok(None);
            }
            self.reap(Some(deadline))?;
        }
    }

    fn hand_out(&mut self, buf: PinnedBuffer) -> PinnedBuffer {
        self.outstanding_bytes += buf.cap();
        buf
    }

    /// A buffer handed out came back (queued or given back).
    fn returned(&mut self, cap: usize) {
        self.outstanding_bytes = self.outstanding_bytes.saturating_sub(cap);
    }

    /// Every byte this lane keeps pinned: free, in flight, handed out,
    /// filling.
    fn pinned_bytes(&self) -> usize {
        let free: usize = self.free.iter().map(|b| b.cap()).sum();
        let busy: usize = self
            .busy
            .iter()
            .filter_map(|(_, b)| b.as_ref())
            .map(|b| b.cap())
            .sum();
        let filling = self.filling.as_ref().map_or(0, |(b, _)| b.cap());
        free + busy + filling + self.outstanding_bytes
    }

    /// Copy `src` to device address `dst` through the filling buffer: the
    /// bytes are copied into pinned memory now and the DMA is queued; many
    /// small tensors share one buffer (and one event).
    fn upload_piece(
        &mut self,
        dst: u64,
        src: &[u8],
        threads: usize,
        deadline: Instant,
    ) -> Result<()> {
        let len = src.len();
        if self
            .filling
            .as_ref()
            .is_some_and(|(b, used)| b.cap() - used < len)
        {
            self.close_filling()?;
        }
        if self.filling.is_none() {
            let want = len.max(FILL_SIZE);
            let buf = match self.take(want, deadline)? {
                Some(b) => {
                    self.returned(b.cap());
                    b
                }
                // The caller holds every buffer: one more, for progress.
                None => PinnedBuffer::new(self.ordinal, rounded(want))?,
            };
            self.filling = Some((buf, 0));
        }
        let (buf, used) = self.filling.as_mut().expect("filling");
        let at = buf.ptr().wrapping_add(*used);
        let job = CopyJob {
            src: CopySource::Memory(SendPtr(src.as_ptr().cast_mut())),
            dst: SendPtr(at),
            len,
            tag: 0,
        };
        // SAFETY: the filling buffer has `len` bytes free at `used`.
        unsafe { copy_all(&[job], threads) }.map_err(|e| e.error)?;
        *used = (*used + len).next_multiple_of(256);
        cuda()?.make_current(self.ordinal)?;
        check(
            // SAFETY: the pinned bytes stay put until the buffer's event (recorded
            // after this copy on the same stream) completes; dst is device memory.
            unsafe { sys::cuMemcpyAsync(dst, at as u64, len, self.stream) },
            "cuMemcpyAsync",
        )
        .inspect_err(|_| {
            // The filling buffer may have queued copies: let it retire.
            let _ = self.close_filling();
        })
    }

    /// Retire the filling buffer: an event after its copies, then `busy`.
    fn close_filling(&mut self) -> Result<()> {
        let Some((buf, _)) = self.filling.take() else {
            return Ok(());
        };
        // SAFETY: the buffer's copies were queued on this stream; the event
        // completes after them.
        unsafe { self.queue_event(Some(buf)) }
    }

    /// An event to record after a queued copy.
    fn event(&mut self) -> Result<sys::CUevent> {
        if let Some(e) = self.events.pop() {
            return Ok(e);
        }
        let mut e: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: a valid out-pointer; no timing, so the event is cheap.
            unsafe {
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(e)
    }

    /// Queue the copy of `len` bytes from `src` (host or device address) to
    /// device address `dst`; `buf`, the pinned buffer `src` lies in, comes
    /// back to `free` once the copy is done.
    ///
    /// # Safety
    /// `src..src+len` stays readable and unchanged until the copy is done
    /// (`buf` guarantees it for pinned memory; device sources are the
    /// caller's); `dst..dst+len` is device memory.
    unsafe fn queue(
        &mut self,
        src: u64,
        buf: Option<PinnedBuffer>,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        cuda()?.make_current(self.ordinal)?;
        // Unified addressing: cuMemcpyAsync finds out where both ends are.
        if let Err(e) = check(
            sys::cuMemcpyAsync(dst, src, len, self.stream),
            "cuMemcpyAsync",
        ) {
            self.free.extend(buf);
            return Err(e);
        }
        self.queue_event(buf)
    }

    /// Record an event after the copies queued so far; `buf` (the pinned
    /// memory they read) comes back to `free` once it completes.
    ///
    /// # Safety
    /// As for `queue`.
    unsafe fn queue_event(&mut self, buf: Option<PinnedBuffer>) -> Result<()> {
        cuda()?.make_current(self.ordinal)?;
        let event = self.event()?;
        match check(sys::cuEventRecord(event, self.stream), "cuEventRecord") {
            Ok(()) => {
                self.busy.push_back((event, buf));
                Ok(())
            }
            Err(e) => {
                // Copies may be queued: wait for the stream before the
                // buffer can be reused or freed.
                sys::cuStreamSynchronize(self.stream);
                self.events.push(event);
                self.free.extend(buf);
                Err(e)
            }
        }
    }

    fn wait_idle(&mut self, deadline: Instant) -> Result<()> {
        self.close_filling()?;
        while !self.busy.is_empty() {
            self.reap(Some(deadline))?;
        }
        Ok(())
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let in_flight = self.wait_idle(Instant::now() + DROP_WAIT).is_err();
        if in_flight {
            // Never free memory a DMA may still read.
            for (_, buf) in self.busy.drain(..) {
                std::mem::forget(buf);
            }
        }
        // SAFETY: handles created by this lane; nothing uses them after this.
        unsafe {
            for &e in &self.events {
                sys::cuEventDestroy_v2(e);
            }
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// Pinned staging buffers and an upload stream per GPU, kept across updates.
#[derive(Default)]
pub struct DeviceStaging {
    lanes: HashMap<i32, Lane>,
}

impl DeviceStaging {
    fn lane(&mut self, ordinal: i32) -> Result<&mut Lane> {
        Ok(match self.lanes.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Lane::new(ordinal)?),
        })
    }

    /// A pinned buffer of at least `n` bytes to fill with bytes for GPU
    /// `ordinal`; hand it to [`DeviceStaging::upload_buffer`] or
    /// [`DeviceStaging::give_back`]. Waits (until `deadline`) for copies in
    /// flight while the byte budget leaves no room; None when nothing in
    /// flight would make room (the caller holds the budget: land the bytes
    /// in ordinary memory and [`DeviceStaging::upload_bytes`]).
    pub fn take(
        &mut self,
        ordinal: i32,
        n: usize,
        deadline: Instant,
    ) -> Result<Option<PinnedBuffer>> {
        self.lane(ordinal)?.take(n, deadline)
    }

    /// Queue the copy of the first `len` bytes of `buf` to device address
    /// `dst` of GPU `ordinal`; returns at once.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory of that GPU that nothing else writes
    /// until [`DeviceStaging::wait`] returns.
    pub unsafe fn upload_buffer(
        &mut self,
        ordinal: i32,
        buf: PinnedBuffer,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        let (src, len) = (buf.ptr() as u64, len.min(buf.cap()));
        let lane = self.lane(ordinal)?;
        lane.returned(buf.cap());
        lane.queue(src, Some(buf), dst, len)
    }

    /// Queue a device-to-device copy of `run`'s rows (one block, or equally
    /// spaced blocks copied with one 2D copy: `memory::strided`) to a
    /// param of GPU `ordinal`, on that GPU's upload stream.
    ///
    /// # Safety
    /// The source rows are device memory that stays unchanged until
    /// [`DeviceStaging::wait`] returns; the destination rows as `dst` for
    /// [`DeviceStaging::upload_buffer`], not overlapping.
    pub unsafe fn copy_device(&mut self, ordinal: i32, run: &Strided) -> Result<()> {
        if run.bytes() == 0 {
            return Ok(());
        }
        let lane = self.lane(ordinal)?;
        if run.height == 1 {
            return lane.queue(run.src, None, run.dst, run.width);
        }
        cuda()?.make_current(ordinal)?;
        copy_2d(run, CopyTo::Device, Some(lane.stream))?;
        lane.queue_event(None)
    }

    /// Return a buffer that was taken and not sent.
    pub fn give_back(&mut self, ordinal: i32, buf: PinnedBuffer) {
        if let Some(lane) = self.lanes.get_mut(&ordinal) {
            lane.returned(buf.cap());
            lane.free.push(buf);
        }
    }

    /// Copy `src` to device address `dst` of GPU `ordinal` through pinned
    /// buffers, piece by piece (small sources share a buffer): copying the
    /// next piece into pinned memory overlaps the DMA of the last. Returns
    /// once the last piece is queued; `src` may be reused at once.
    ///
    /// # Safety
    /// As for [`DeviceStaging::upload_buffer`].
    pub unsafe fn upload_bytes(
        &mut self,
        ordinal: i32,
        dst: u64,
        src: &[u8],
        threads: usize,
        deadline: Instant,
    ) -> Result<()> {
        let lane = self.lane(ordinal)?;
        for (i, piece) in src.chunks(PINNED_TENSOR_MAX).enumerate() {
            lane.upload_piece(
                dst + (i * PINNED_TENSOR_MAX) as u64,
                piece,
                threads,
                deadline,
            )?;
        }
        Ok(())
    }

    /// Wait (until `deadline`) for every queued copy: after this the bytes
    /// are on the GPUs.
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        for lane in self.lanes.values_mut() {
            lane.wait_idle(deadline)?;
        }
        Ok(())
    }

    /// Free every buffer and stream (after waiting for their copies).
    pub fn release(&mut self) {
        self.lanes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_buffer_that_fits_is_taken() {
        let caps = [8usize << 20, 2 << 20, 4 << 20];
        assert_eq!(best_fit(caps.iter().copied(), 3 << 20), Some(2));
        assert_eq!(best_fit(caps.iter().copied(), 2 << 20), Some(1));
        assert_eq!(best_fit(caps.iter().copied(), 9 << 20), None);
        assert_eq!(best_fit(std::iter::empty(), 1), None);
    }

    #[test]
    fn buffers_are_sized_in_steps() {
        assert_eq!(rounded(0), SIZE_STEP);
        assert_eq!(rounded(1), SIZE_STEP);
        assert_eq!(rounded(SIZE_STEP), SIZE_STEP);
        assert_eq!(rounded(SIZE_STEP + 1), 2 * SIZE_STEP);
        assert!(rounded(PINNED_TENSOR_MAX) == PINNED_TENSOR_MAX);
    }
}
