//! What an engine keeps of the IPC buffers publishers handed it: the
//! mappings of each publisher's last sessions ([`MappedBuffers`]), and a
//! bucket's memory, host or GPU ([`BucketMemory`], where CUDA IPC buffers
//! join host buffers).

use super::shared::{file_identity, SharedBuffer};
use crate::result::{Error, Result};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// The shared buffers an engine mapped in the last IPC sessions of each
/// publisher (as many as a publisher with the default `keep_versions`
/// rotates published versions through: `keep_versions + 1`, 3), kept for
/// the next ones.
///
/// A publisher reuses its buffers: its two bucket buffers from session to
/// session, and the shared buffers of published versions, which it
/// rotates through `keep_versions + 1` buffers. Kept for fewer sessions
/// than that, every update mapped (and faulted in) a buffer afresh: 1 GiB
/// copied at 7 GB/s instead of 18 here. Mapping 1 GiB of them costs
/// about 80 ms of page-table work (plus 25 ms to unmap) on the reference
/// VM, a fifth of a 4 GiB update. A descriptor received again for a file
/// already mapped (same device and inode, same length) reuses the mapping;
/// its seals cannot have been removed (`F_SEAL_SEAL`). Sessions are kept
/// per publisher (its address), so an update reading several publishers
/// at once keeps both alternating buffers of each: kept across the whole
/// manager instead, the other publishers' sessions pushed them out and
/// every update mapped and faulted in its buffers again. The last two
/// sessions of at most [`MappedBuffers::PUBLISHERS`] publishers are kept
/// (the least recently seen goes first), so a trainer that moved on (or
/// died) holds memory here until three more of its sessions, that many other
/// publishers' sessions, a failed update, `wm_clear`, or the manager's end.
#[derive(Default)]
pub struct MappedBuffers {
    /// Per publisher, its sessions' buffers, oldest first; publishers in
    /// order of their last session, the most recent last.
    kept: std::collections::VecDeque<(String, std::collections::VecDeque<Vec<Arc<SharedBuffer>>>)>,
}

impl MappedBuffers {
    const SESSIONS: usize = crate::defaults::KEEP_VERSIONS + 1;
    /// Publishers whose sessions are kept.
    pub const PUBLISHERS: usize = 32;

    /// Map `fd` read-only for `len` bytes, reusing a kept mapping of the same file.
    pub fn receive(&mut self, fd: OwnedFd, len: usize, what: &str) -> Result<Arc<SharedBuffer>> {
        let file = file_identity(&fd).map_err(|e| Error::io(format!("{what}: stat"), e))?;
        for session in self.kept.iter_mut().flat_map(|(_, s)| s.iter_mut()) {
            if let Some(i) = session
                .iter()
                .position(|b| b.file == file && b.len() == len)
            {
                return Ok(session.swap_remove(i));
            }
        }
        SharedBuffer::receive(fd, len, what).map(Arc::new)
    }

    /// Keep `buffers` (a finished session's with publisher `peer`),
    /// unmapping those of its older sessions, and of the least recently
    /// seen publisher beyond [`MappedBuffers::PUBLISHERS`].
    pub fn keep(&mut self, peer: &str, buffers: Vec<Arc<SharedBuffer>>) {
        let mut sessions = match self.kept.iter().position(|(p, _)| p == peer) {
            Some(i) => self.kept.remove(i).map(|(_, s)| s).unwrap_or_default(),
            None => Default::default(),
        };
        sessions.push_back(buffers);
        while sessions.len() > Self::SESSIONS {
            sessions.pop_front();
        }
        self.kept.push_back((peer.to_string(), sessions));
        while self.kept.len() > Self::PUBLISHERS {
            self.kept.pop_front();
        }
    }

    /// Unmap everything kept.
    pub fn forget(&mut self) {
        self.kept.clear();
    }

    /// Bytes mapped and kept.
    pub fn bytes(&self) -> usize {
        let sessions = self.kept.iter().flat_map(|(_, s)| s.iter());
        sessions.flatten().map(|b| b.len()).sum()
    }
}

/// Where a bucket's bytes are: a shared host buffer, or a trainer's GPU
/// buffer opened from its CUDA IPC handle.
pub enum BucketMemory {
    Host(Arc<SharedBuffer>),
    Device(crate::memory::cuda_ipc::ImportedDeviceBuffer),
}

impl BucketMemory {
    pub fn len(&self) -> usize {
        match self {
            BucketMemory::Host(b) => b.len(),
            BucketMemory::Device(d) => d.len(),
        }
    }

    /// Where byte `offset` is, for the copier (callers have checked the range).
    pub fn source(&self, offset: u64) -> crate::memory::copy::CopySource<'static> {
        use crate::memory::copy::CopySource;
        match self {
            BucketMemory::Host(b) => CopySource::Memory(crate::memory::SendPtr(
                b.ptr().wrapping_add(offset as usize),
            )),
            BucketMemory::Device(d) => CopySource::Device {
                ptr: d.ptr() + offset,
                ordinal: d.ordinal(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_received_again_reuses_its_mapping() {
        let mib = 1usize << 20;
        let files: Vec<SharedBuffer> = (0..3)
            .map(|i| SharedBuffer::create(&format!("f{i}"), mib).unwrap())
            .collect();
        let fd = |i: usize| files[i].fd().try_clone().unwrap();
        let mut cache = MappedBuffers::default();
        let a = cache.receive(fd(0), mib, "a").unwrap();
        let b = cache.receive(fd(1), mib, "b").unwrap();
        let (pa, pb) = (a.ptr(), b.ptr());
        cache.keep("p", vec![a]);
        cache.keep("p", vec![b]);
        assert_eq!(cache.bytes(), 2 * mib);
        // Same file, same length: the same mapping, whatever the descriptor,
        // from either of the last two sessions.
        let a = cache.receive(fd(0), mib, "a").unwrap();
        assert_eq!(a.ptr(), pa);
        // Another length is mapped anew.
        let short = cache.receive(fd(1), 4096, "b").unwrap();
        assert_ne!(short.ptr(), pb);
        cache.keep("p", vec![a, short]);
        // Three sessions are kept: b's old mapping (two sessions before)
        // still is.
        assert_eq!(MappedBuffers::SESSIONS, 3);
        assert_eq!(cache.bytes(), 2 * mib + 4096);
        let c = cache.receive(fd(2), mib, "c").unwrap();
        cache.keep("p", vec![c]);
        assert_eq!(cache.bytes(), 3 * mib + 4096);
        cache.keep("p", Vec::new());
        // The oldest session (b's mapping) is gone; the last three remain,
        // and b is mapped anew (a hit would have taken it out of the cache).
        assert_eq!(cache.bytes(), 2 * mib + 4096);
        let _b = cache.receive(fd(1), mib, "b").unwrap();
        assert_eq!(cache.bytes(), 2 * mib + 4096);
        cache.forget();
        assert_eq!(cache.bytes(), 0);
    }

    /// Two publishers read at once, each rotating its versions through
    /// three buffers (the default `keep_versions` + 1): every update finds
    /// all six mapped (kept per publisher). Beyond `PUBLISHERS`, the least
    /// recently seen publisher's are unmapped.
    #[test]
    fn each_publishers_last_sessions_are_kept() {
        let (mib, r) = (1usize << 20, MappedBuffers::SESSIONS);
        let files: Vec<SharedBuffer> = (0..2 * r)
            .map(|i| SharedBuffer::create(&format!("f{i}"), mib).unwrap())
            .collect();
        let fd = |i: usize| files[i].fd().try_clone().unwrap();
        let mut cache = MappedBuffers::default();
        let mut first = Vec::new();
        for update in 0..3 * r {
            for p in 0..2 {
                // Publisher p's version buffers are files r*p .. r*p + r.
                let i = r * p + update % r;
                let b = cache.receive(fd(i), mib, "v").unwrap();
                if update < r {
                    first.push(b.ptr());
                } else {
                    let k = 2 * (update % r) + p;
                    assert_eq!(b.ptr(), first[k], "update {update}, publisher {p}");
                }
                cache.keep(&format!("publisher {p}"), vec![b]);
            }
        }
        assert_eq!(cache.bytes(), 2 * r * mib);
        for p in 0..MappedBuffers::PUBLISHERS {
            cache.keep(&format!("other {p}"), Vec::new());
        }
        assert_eq!(
            cache.bytes(),
            0,
            "the two publishers seen least recently are gone"
        );
    }
}
