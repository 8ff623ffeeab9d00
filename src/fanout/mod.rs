//! NCCL fan-out inside an engine: one rank pulls an update from the source,
//! the other ranks of its fan-out group get the bytes from it over NCCL
//! (NVLink or PCIe) instead of each pulling them again over the network or
//! from disk.
//!
//! **Who.** Ranks of one node that set the same `fanout_group` in their
//! config and register the same device params (names, dtypes, shapes):
//! data-parallel replicas, or the ranks of a tensor-parallel group that
//! hold replicated weights. The one with the lowest local rank is the
//! root. Ranks on other nodes with the same number form their own group,
//! so each node pulls once. A group of one rank updates as usual.
//!
//! **An update, step by step** (every rank calls `wm_update` as usual; a
//! member's source and location are ignored):
//! 1. Meeting: the ranks agree on the communicator (`signal::fanout`); one
//!    is built on first use and kept until it fails.
//! 2. The root opens its source and plans as usual, then announces the
//!    version and the tensors it will send (or why it cannot start).
//! 3. Every rank checks the announcement against its registry and votes;
//!    a refusal stops the update on every rank before any byte moves (the
//!    refusing rank says why, the others name it).
//! 4. The root runs its update (checksums, atomicity: everything as
//!    without fan-out) and announces the outcome. A failed root update ends
//!    the members' updates with its reason; their weights stay as they were.
//! 5. The root broadcasts every announced tensor from its params, now
//!    verified and committed, in batches of at most the net bucket size.
//!    Members receive in place, or in atomic mode into a device arena that
//!    is copied to the params once every byte arrived.
//!
//! The manager's side: `manager/fanout_root.rs` wraps the root's ordinary
//! update in steps 2, 3 and 5; `manager/fanout_member.rs` is a member's
//! whole update.
//!
//! **Decisions.** Members receive after the root committed, not bucket by
//! bucket as the root receives: members only ever get bytes the root
//! verified, the root's atomicity is untouched, and NVLink moves bytes
//! several times faster than the network or disk the root read them from,
//! so the extra step is short. Members do not hash what they receive (no
//! GPU hash kernel yet): they trust NCCL's transport, which moves GPU
//! memory over NVLink or PCIe. Fan-out moves device params only (NCCL
//! moves GPU memory) and does not call per-tensor callbacks.
//!
//! **Failures.** Every wait is bounded (`nccl`); a dead rank of the group
//! is named. A broadcast that fails after bytes moved leaves in-place
//! members FAILED (atomic members keep their weights), and the root
//! reports the fan-out failure too (FAILED, though its own weights are
//! new): the next update brings the group back in step.

pub mod nccl;

use crate::plan::{Plan, Target};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::signal::fanout::FanoutMeeting;
use crate::signal::SignalPlane;
use nccl::{Comm, Nccl};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// How a rank takes part in fan-out.
#[derive(Clone, Debug)]
pub struct FanoutSettings {
    /// The fan-out group number (module docs).
    pub group: u32,
    /// NCCL's path; None: `WM_NCCL_LIB`, then `libnccl.so.2` (see [`nccl`]).
    pub nccl_library: Option<PathBuf>,
}

/// One tensor the root will send.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announced {
    pub name: String,
    /// A `wm_dtype` number.
    pub dtype: u32,
    pub shape: Vec<u64>,
    pub nbytes: u64,
}

/// What the root will send.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    pub version: String,
    pub tensors: Vec<Announced>,
}

/// The root's word at a step: go on (with what), or stop (why).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Word<T> {
    Go(T),
    Stop(String),
}

/// Fan-out moves params only: an update with a per-tensor callback is
/// refused, on the root and on members alike.
pub fn refuse_tensor_hook(has_tensor_hook: bool) -> Result<()> {
    if has_tensor_hook {
        return Err(Error::unsupported(
            "fan-out does not call per-tensor callbacks; update without a tensor callback",
        ));
    }
    Ok(())
}

/// Which params the root sends: every planned param, each of which must
/// be device memory of the root's GPU (and no tensor may be meant for a
/// callback). Returns the announcement and, per tensor, the param index.
pub fn announce(
    version: &str,
    plan: &Plan,
    registry: &Registry,
    ordinal: i32,
) -> Result<(Announcement, Vec<usize>)> {
    let mut tensors = Vec::new();
    let mut params = Vec::new();
    for e in &plan.entries {
        match e.target {
            Target::Param(i) => {
                device_param(registry, i, ordinal, "the fan-out root")?;
                tensors.push(Announced {
                    name: e.meta.name.clone(),
                    dtype: e.meta.dtype as u32,
                    shape: e.meta.shape.clone(),
                    nbytes: e.meta.nbytes,
                });
                params.push(i);
            }
            Target::Callback => {
                return Err(Error::unsupported(format!(
                    "fan-out does not call per-tensor callbacks, and tensor '{}' has no param",
                    e.meta.name
                )))
            }
            Target::Skip => {}
        }
    }
    Ok((
        Announcement {
            version: version.to_string(),
            tensors,
        },
        params,
    ))
}

/// A member's params for the announced tensors, in order: each must be a
/// registered device param of this rank's GPU with the same dtype and shape.
pub fn match_announcement(
    a: &Announcement,
    registry: &Registry,
    ordinal: i32,
    rank: u32,
) -> Result<Vec<usize>> {
    let who = format!("fan-out member rank {rank}");
    a.tensors
        .iter()
        .map(|t| {
            let i = registry.index_of(&t.name).ok_or_else(|| {
                Error::not_found(format!(
                    "{who}: the root sends tensor '{}', which is not a registered param here",
                    t.name
                ))
            })?;
            let p = &registry.params()[i];
            if p.dtype as u32 != t.dtype || p.shape != t.shape {
                return Err(Error::mismatch(format!(
                    "{who}: param '{}' is {} {:?} here, but {} {:?} on the root",
                    t.name,
                    p.dtype.safetensors_name(),
                    p.shape,
                    crate::tensor::DType::from_raw(t.dtype).map_or("?", |d| d.safetensors_name()),
                    t.shape
                )));
            }
            device_param(registry, i, ordinal, &who)?;
            Ok(i)
        })
        .collect()
}

fn device_param(registry: &Registry, i: usize, ordinal: i32, who: &str) -> Result<()> {
    let p = &registry.params()[i];
    match p.device {
        Some(o) if o == ordinal => Ok(()),
        Some(o) => Err(Error::invalid_argument(format!(
            "{who}: param '{}' is on GPU {o}, but fan-out runs on this rank's GPU {ordinal} (config device)",
            p.name
        ))),
        None => Err(Error::invalid_argument(format!(
            "{who}: param '{}' is host memory; fan-out moves device params only",
            p.name
        ))),
    }
}

/// Consecutive runs of `sizes` holding at most `limit` bytes each (a
/// larger tensor is a batch of its own): the broadcasts waited for together.
pub fn batches(sizes: &[usize], limit: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && bytes + n > limit {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// A rank's fan-out state, kept across updates: its communicator.
pub struct FanoutLink {
    pub settings: FanoutSettings,
    /// This rank's GPU.
    pub ordinal: i32,
    comm: Option<(u64, Comm)>,
}

impl FanoutLink {
    pub fn new(settings: FanoutSettings, ordinal: i32) -> FanoutLink {
        FanoutLink {
            settings,
            ordinal,
            comm: None,
        }
    }

    fn nccl(&self) -> Result<&'static Nccl> {
        nccl::nccl(self.settings.nccl_library.as_deref())
    }

    /// Meet the group and have a working communicator (module docs, step 1).
    pub fn start(
        &mut self,
        signal: &SignalPlane,
        rank: u32,
        deadline: Instant,
    ) -> Result<FanoutSession<'_>> {
        let nccl = self.nccl()?;
        if self.comm.as_ref().is_some_and(|(_, c)| c.failed()) {
            self.comm = None;
        }
        let have = self.comm.as_ref().map_or(0, |(g, _)| *g);
        let meeting = signal.fanout_meet(have, || Ok(nccl.unique_id()?.internal), deadline)?;
        if let Some(id) = meeting.id {
            // The group moved on from the old communicator: stop it (a
            // local, immediate call; finalizing would wait on peers that
            // already left it).
            if let Some((_, mut old)) = self.comm.take() {
                old.abort();
            }
            let alive = member_check(&meeting);
            let comm = Comm::join(
                nccl,
                nccl::UniqueId { internal: id },
                meeting.ranks.len(),
                meeting.index,
                self.ordinal,
                deadline,
                &alive,
            )
            .map_err(|e| e.context(format!("rank {rank}: building the fan-out communicator")))?;
            self.comm = Some((meeting.gen, comm));
        }
        let (_, comm) = self
            .comm
            .as_mut()
            .expect("a communicator after the meeting");
        Ok(FanoutSession {
            comm,
            meeting,
            rank,
        })
    }
}

/// Fails once a rank of the meeting is gone (this one is alive while it
/// asks).
fn member_check(meeting: &FanoutMeeting) -> impl Fn() -> Result<()> + '_ {
    move || match meeting.dead_rank() {
        Some((r, pid)) => Err(Error::peer(format!(
            "fan-out rank {r} (pid {pid}) died during the update"
        ))),
        None => Ok(()),
    }
}

/// One update's fan-out, after the meeting.
pub struct FanoutSession<'a> {
    comm: &'a mut Comm,
    meeting: FanoutMeeting,
    rank: u32,
}

impl FanoutSession<'_> {
    pub fn is_root(&self) -> bool {
        self.meeting.index == 0
    }

    pub fn root_rank(&self) -> u32 {
        self.meeting.ranks[0]
    }

    /// The other ranks of the group.
    pub fn members(&self) -> &[u32] {
        &self.meeting.ranks[1..]
    }

    /// The root says `word`; members hear it.
    pub fn word<T: Serialize + DeserializeOwned>(
        &mut self,
        word: Option<&Word<T>>,
        deadline: Instant,
    ) -> Result<Word<T>> {
        let bytes = match word {
            Some(w) if self.is_root() => serde_json::to_vec(w)
                .map_err(|e| Error::format(format!("encoding a fan-out message: {e}")))?,
            _ => Vec::new(),
        };
        let alive = member_check(&self.meeting);
        let got = self.comm.broadcast_message(&bytes, 0, deadline, &alive)?;
        serde_json::from_slice(&got).map_err(|e| {
            Error::format(format!(
                "a fan-out message from rank {} is not valid: {e}",
                self.root_rank()
            ))
        })
    }

    /// Every rank's vote: Ok(()) when all accept, else the error naming the
    /// lowest refusing rank (this rank's own error when it refused).
    pub fn vote(&mut self, mine: Result<()>, deadline: Instant) -> Result<()> {
        let value = if mine.is_ok() {
            i32::MAX
        } else {
            self.rank as i32
        };
        let alive = member_check(&self.meeting);
        let lowest = self.comm.min(value, deadline, &alive)?;
        mine?;
        if lowest == i32::MAX {
            return Ok(());
        }
        Err(Error::state(format!(
            "fan-out rank {lowest} refused the update (its wm_status has why); no bytes moved"
        )))
    }

    /// Broadcast `spans` (device address, bytes) from the root, batch by
    /// batch (`batches` of at most `limit` bytes), waiting for each (a
    /// bounded wait per batch); `done` is told the bytes moved so far.
    pub fn move_tensors(
        &mut self,
        spans: &[(u64, usize)],
        limit: usize,
        batch_timeout: std::time::Duration,
        mut done: impl FnMut(u64, usize) -> Result<()>,
    ) -> Result<()> {
        let sizes: Vec<usize> = spans.iter().map(|s| s.1).collect();
        let alive = member_check(&self.meeting);
        let mut moved = 0u64;
        for batch in batches(&sizes, limit) {
            let end = batch.end;
            let deadline = Instant::now() + batch_timeout;
            for &(ptr, len) in &spans[batch] {
                // SAFETY: the caller hands device memory of this rank's GPU
                // (params or the arena) that nothing else uses meanwhile.
                unsafe { self.comm.broadcast(ptr, len, 0, deadline, &alive)? };
                moved += len as u64;
            }
            self.comm
                .synchronize("a fan-out broadcast", deadline, &alive)?;
            if let Err(e) = done(moved, end) {
                // The others must not wait for bytes this rank stopped taking.
                self.comm.abort();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Copy device memory on the fan-out stream and wait (atomic commit).
    ///
    /// # Safety
    /// Every (dst, src, len) names device memory of this rank's GPU.
    pub unsafe fn commit(&mut self, copies: &[(u64, u64, usize)], deadline: Instant) -> Result<()> {
        for &(dst, src, len) in copies {
            self.comm.copy(dst, src, len)?;
        }
        let alive = || Ok(());
        self.comm
            .synchronize("copying the fan-out arena to the params", deadline, &alive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::TensorMeta;
    use crate::plan::PlanEntry;
    use crate::registry::ParamSpec;
    use crate::tensor::DType;

    fn registry() -> Registry {
        let mut r = Registry::default();
        r.allocate(&ParamSpec::host("w", DType::F32, &[4])).unwrap();
        r
    }

    #[test]
    fn batches_hold_at_most_the_limit_and_big_tensors_alone() {
        assert_eq!(batches(&[4, 4, 4, 4], 8), vec![0..2, 2..4]);
        assert_eq!(batches(&[10, 2, 3], 8), vec![0..1, 1..3]);
        assert_eq!(batches(&[2, 10, 2], 8), vec![0..1, 1..2, 2..3]);
        assert!(batches(&[], 8).is_empty());
    }

    #[test]
    fn the_root_refuses_host_params_and_callback_tensors() {
        let r = registry();
        let meta = TensorMeta {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![4],
            nbytes: 16,
            checksum: None,
            placement: None,
        };
        let plan = Plan::new(vec![PlanEntry::new(meta.clone(), 0, Target::Param(0))]);
        let e = announce("v1", &plan, &r, 0).unwrap_err();
        assert!(
            e.message.contains("param 'w' is host memory") && e.message.contains("fan-out root"),
            "{e}"
        );
        let plan = Plan::new(vec![PlanEntry::new(meta, 0, Target::Callback)]);
        let e = announce("v1", &plan, &r, 0).unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_UNSUPPORTED);
        assert!(e.message.contains("tensor 'w'"), "{e}");
    }

    #[test]
    fn a_member_names_what_does_not_match_the_root() {
        let r = registry();
        let sent = |name: &str, dtype: DType, shape: &[u64]| Announcement {
            version: "v1".into(),
            tensors: vec![Announced {
                name: name.into(),
                dtype: dtype as u32,
                shape: shape.to_vec(),
                nbytes: 16,
            }],
        };
        let e = match_announcement(&sent("x", DType::F32, &[4]), &r, 0, 3).unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_NOT_FOUND);
        assert!(
            e.message.contains("rank 3") && e.message.contains("'x'"),
            "{e}"
        );
        let e = match_announcement(&sent("w", DType::F16, &[8]), &r, 0, 3).unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_MISMATCH);
        assert!(e.message.contains("F32 [4] here, but F16 [8]"), "{e}");
        let e = match_announcement(&sent("w", DType::F32, &[4]), &r, 0, 3).unwrap_err();
        assert!(e.message.contains("host memory"), "{e}");
    }

    #[test]
    fn words_round_trip_as_json() {
        let w: Word<Announcement> = Word::Go(Announcement {
            version: "v".into(),
            tensors: vec![],
        });
        let back: Word<Announcement> =
            serde_json::from_slice(&serde_json::to_vec(&w).unwrap()).unwrap();
        assert_eq!(back, w);
        let stop: Word<()> = Word::Stop("disk gone".into());
        let back: Word<()> = serde_json::from_slice(&serde_json::to_vec(&stop).unwrap()).unwrap();
        assert_eq!(back, stop);
    }
}
