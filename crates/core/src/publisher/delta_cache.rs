//! Deltas a version's sessions share: engine ranks that take the same runs
//! (replicas of one model, ranks pulling again) get the delta the first of
//! them had encoded, instead of each reading both versions again. Kept
//! with the new version's offer, dropped with it; a session asking for a
//! run another session is encoding waits for it.
//!
//! A run is named by the base version's offer, where both versions' tensor
//! lies (published copies: they do not change while kept), its element size
//! and its runs. The cache holds a weak reference to each base offer it
//! names, so that no other offer can take that address while an entry
//! names it. (It holds them as `dyn Any`: the offer holds the cache, and
//! the cache need not know what an offer is.)

use crate::wire::WantRun;
use parking_lot::Mutex;
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};

/// What encoding one run against its base gave.
pub(super) struct Encoded {
    /// The base's bytes of the run hashed (None: known from its checksum,
    /// or not read to the end).
    pub base_sum: Option<u128>,
    /// The new bytes' xxh3-128 and the delta; None: not under half the
    /// run's bytes.
    pub delta: Option<(u128, Arc<Vec<u8>>)>,
}

/// A run of one tensor against its base.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct RunKey {
    pub base: usize,
    pub old: usize,
    pub new: usize,
    pub esize: usize,
    pub runs: Vec<WantRun>,
}

#[derive(Default)]
pub(crate) struct DeltaCache {
    runs: Mutex<HashMap<RunKey, Arc<OnceLock<Encoded>>>>,
    bases: Mutex<Vec<Weak<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for DeltaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "DeltaCache({} runs)", self.runs.lock().len())
    }
}

impl DeltaCache {
    /// The encoding of `key` against `base`: this session's (`encode`), or
    /// another's, waited for. The flag says whether it was another's.
    pub(super) fn get_or_encode<B: Any + Send + Sync>(
        &self,
        base: &Arc<B>,
        key: RunKey,
        encode: impl FnOnce() -> Encoded,
    ) -> (Arc<OnceLock<Encoded>>, bool) {
        {
            let mut bases = self.bases.lock();
            if !bases
                .iter()
                .any(|b| std::ptr::addr_eq(b.as_ptr(), Arc::as_ptr(base)))
            {
                bases.push(Arc::downgrade(base) as Weak<dyn Any + Send + Sync>);
            }
        }
        let cell = self.runs.lock().entry(key).or_default().clone();
        let mut mine = false;
        cell.get_or_init(|| {
            mine = true;
            encode()
        });
        (cell, !mine)
    }
}

/// The key of a run: `base`'s offer, the tensors' addresses, its element
/// size and runs.
pub(super) fn key<B>(
    base: &Arc<B>,
    (old, new): (usize, usize),
    esize: usize,
    runs: &[WantRun],
) -> RunKey {
    RunKey {
        base: Arc::as_ptr(base) as usize,
        old,
        new,
        esize,
        runs: runs.to_vec(),
    }
}
