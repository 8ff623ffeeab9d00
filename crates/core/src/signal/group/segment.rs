//! The node's shared segment of a group: a header (ring of step values,
//! barrier words, the abort reason) followed by one slot per local rank.
//! Both the group and its fan-out meetings (`signal::fanout`) read it, so
//! the layout lives here, below both.

use crate::result::Result;
use crate::signal::shm::{OpenMode, SharedMapping};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};

// "WMGROUP3": 3 added the creator's start time and a second round in the
// finishing barrier (a group mixing releases is refused, not misread).
pub(super) const MAGIC: u64 = 0x574d_4752_4f55_5033;
/// Entries of the ring of step values.
pub(super) const RING: u64 = 64;

/// Bytes of an NCCL unique id (`ncclUniqueId`), as a slot carries it.
pub(crate) const ID_BYTES: usize = 128;

#[repr(C, align(64))]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) creator_pid: AtomicU32,
    pub(super) local_world: AtomicU32,
    /// Set by the leader once the whole group (all nodes) met.
    pub(super) ready: AtomicU32,
    _p0: u32,
    /// When the creator started (`shm::start_time`; 0: unknown): a pid
    /// reused by another process since does not pass for the creator.
    pub(super) creator_start: AtomicU64,
    _p0b: [u32; 8],
    /// `(step + 1) as u32` of the newest ring entry; futex word for readers.
    pub(super) published: AtomicU32,
    pub(super) pub_waiters: AtomicU32,
    _p1: [u32; 14],
    /// Local ranks (other than the leader) inside the current barrier.
    pub(super) arrived: AtomicU32,
    pub(super) arrive_waiters: AtomicU32,
    /// Last released barrier generation; futex word for members.
    pub(super) released: AtomicU32,
    pub(super) release_waiters: AtomicU32,
    _p2: [u32; 12],
    pub(super) ring: [AtomicU64; RING as usize],
    /// Set once when any rank gives up; every waiter then fails with `abort_msg`.
    pub(super) aborted: AtomicU32,
    pub(super) abort_msg: [AtomicU8; 252],
}

impl Header {
    /// The process that made the segment is alive, and is that process (not
    /// another given its pid since).
    fn creator_alive(&self) -> bool {
        let pid = self.creator_pid.load(Ordering::Relaxed);
        let start = self.creator_start.load(Ordering::Relaxed);
        crate::signal::shm::pid_alive(pid)
            && (start == 0 || crate::signal::shm::start_time(pid).is_none_or(|s| s == start))
    }
}

/// One local rank's place in the segment.
#[repr(C, align(64))]
pub(crate) struct Slot {
    pub(crate) pid: AtomicU32,
    pub(super) joined: AtomicU32,
    pub(crate) rank: AtomicU32,
    pub(super) result: AtomicI32,
    /// `step + 1` of the last step this rank read.
    pub(super) consumed: AtomicU64,
    /// Last barrier generation this rank entered.
    pub(super) barrier: AtomicU64,
    /// Fan-out group + 1 (0: none); written before `joined`.
    pub(crate) fanout: AtomicU32,
    /// Members: the meeting this rank waits for; the root's: the last
    /// meeting it decided (see `signal::fanout`).
    pub(crate) fan_seq: AtomicU64,
    /// Members: the communicator generation this rank holds (0: none).
    pub(crate) fan_have: AtomicU64,
    /// Root: the generation to use in meeting `fan_seq`, and its id.
    pub(crate) fan_gen: AtomicU64,
    pub(crate) fan_id: [AtomicU8; ID_BYTES],
}

/// A ring entry: the step (+1, truncated) above the value.
pub(super) fn pack(step: u64, value: i32) -> u64 {
    ((step + 1) as u32 as u64) << 32 | value as u32 as u64
}

/// The mapped segment of `local_world` slots.
pub(super) struct Segment {
    map: SharedMapping,
}

impl Segment {
    pub(super) fn size_for(local_world: u32) -> usize {
        std::mem::size_of::<Header>() + local_world as usize * std::mem::size_of::<Slot>()
    }

    /// The leader's new segment, stamped so members can tell it is live;
    /// None when one of that name is there (live or stale: `live` tells).
    pub(super) fn create_new(name: &str, local_world: u32) -> Result<Option<Segment>> {
        let size = Self::size_for(local_world);
        let Some(map) = SharedMapping::open(name, size, OpenMode::CreateNew)? else {
            return Ok(None);
        };
        let seg = Segment { map };
        let h = seg.header();
        let me = std::process::id();
        h.creator_pid.store(me, Ordering::Relaxed);
        let start = crate::signal::shm::start_time(me).unwrap_or(0);
        h.creator_start.store(start, Ordering::Relaxed);
        h.local_world.store(local_world, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(Some(seg))
    }

    /// A member's view of the leader's segment; None while there is none
    /// yet, or only a stale one (another size, or its creator is gone).
    pub(super) fn open_existing(name: &str, local_world: u32) -> Result<Option<Segment>> {
        let size = Self::size_for(local_world);
        let Some(map) = SharedMapping::open(name, size, OpenMode::Existing)? else {
            return Ok(None);
        };
        let seg = Segment { map };
        let h = seg.header();
        let fresh = h.magic.load(Ordering::Acquire) == MAGIC
            && h.local_world.load(Ordering::Relaxed) == local_world
            && h.creator_alive();
        Ok(fresh.then_some(seg))
    }

    /// The live segment `name`'s creator and the local world it was made
    /// for, if there is one (its creator alive, whatever its size): a
    /// leader still meeting its ranks, which a second local rank 0 must not
    /// replace and a member that cannot attach names in its error.
    pub(super) fn live(name: &str) -> Option<(u32, u32)> {
        let len = std::mem::size_of::<Header>();
        let map = SharedMapping::open(name, len, OpenMode::Existing).ok()??;
        let seg = Segment { map };
        let h = seg.header();
        let pid = h.creator_pid.load(Ordering::Relaxed);
        let live = h.magic.load(Ordering::Acquire) == MAGIC && h.creator_alive();
        live.then(|| (pid, h.local_world.load(Ordering::Relaxed)))
    }

    /// Whether the segment `name` carries a leader's stamp (live or not):
    /// an unstamped one may be a leader's of an instant ago.
    pub(super) fn stamped(name: &str) -> bool {
        let len = std::mem::size_of::<Header>();
        let Ok(Some(map)) = SharedMapping::open(name, len, OpenMode::Existing) else {
            return false;
        };
        let seg = Segment { map };
        seg.header().magic.load(Ordering::Acquire) == MAGIC
    }

    pub(super) fn header(&self) -> &Header {
        // SAFETY: the mapping holds a Header at offset 0 (size checked when mapped).
        unsafe { &*(self.map.ptr() as *const Header) }
    }

    pub(super) fn slot(&self, i: u32) -> &Slot {
        // SAFETY: slots follow the header; i < local_world_size (the mapped count).
        unsafe { &*((self.map.ptr() as *const Header).add(1) as *const Slot).add(i as usize) }
    }

    /// Fails when the segment shrank under us (see `memory::sigbus`).
    pub(super) fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        self.map.check(what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second leader finds the first's segment live; a segment whose
    /// creator is gone, or whose creator's pid now names another process
    /// (another start time), is stale.
    #[test]
    fn a_segment_is_live_only_while_its_own_creator_runs() {
        let name = format!("wmtest_segment_{}", std::process::id());
        let _ = crate::signal::shm::unlink(&name);
        let seg = Segment::create_new(&name, 2).unwrap().expect("created");
        assert!(Segment::create_new(&name, 2).unwrap().is_none());
        assert_eq!(Segment::live(&name), Some((std::process::id(), 2)));
        // The same pid, started at another time: another process.
        let h = seg.header();
        let start = h.creator_start.load(Ordering::Relaxed);
        assert_ne!(start, 0, "/proc gives this process's start time");
        h.creator_start.store(start + 1, Ordering::Relaxed);
        assert_eq!(Segment::live(&name), None);
        h.creator_start.store(start, Ordering::Relaxed);
        // A creator that exited.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        h.creator_pid.store(dead, Ordering::Relaxed);
        assert_eq!(Segment::live(&name), None);
        crate::signal::shm::unlink(&name).unwrap();
    }
}
