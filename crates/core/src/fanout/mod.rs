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
//!    A member's bytes go through its applier like any source's
//!    (`member.rs`): in place straight into the params; atomic into a GPU
//!    landing buffer of one batch, from which the applier copies them into
//!    its staging and, once every byte arrived, commits them to the params.
//! 6. Every rank votes once more: whether it took the bytes (its whole
//!    update). The root reports a member that did not (`took`); a member
//!    failing on the last batch leaves no broadcast failed, so without
//!    this vote the root would report success with the group out of step.
//!
//! Files: `session.rs` (the communicator and one update's exchanges),
//! `transfer.rs` (the batch loop shared by root and members), `member.rs`
//! (where a member's bytes land), `nccl.rs` (NCCL itself). The manager's
//! side: `manager/fanout_root.rs` wraps the root's ordinary update in steps
//! 2, 3 and 5; `manager/fanout_member.rs` is a member's whole update, its
//! plan made from the announcement.
//!
//! **Staged** (`wm_stage`): step 5 comes before the root's commit, from
//! its staging (`transfer::FromStaged`, through a GPU bounce buffer):
//! members stage the bytes as they would take them, and every rank commits
//! at the same step through the signal's vote (`manager/fanout_root.rs`).
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

mod member;
#[cfg(test)]
mod member_tests;
pub mod nccl;
mod session;
pub mod transfer;

pub use member::{Bounce, MemberLanding};
pub use session::{FanoutLink, FanoutSession};

use crate::manifest::TensorMeta;
use crate::plan::{Plan, PlanEntry, Target};
use crate::registry::Registry;
use crate::result::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    /// The root stages (two-phase): its bytes come before any commit, so
    /// a member must stage too, or it would commit a version the ranks may
    /// yet drop.
    #[serde(default)]
    pub staged: bool,
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
            staged: false,
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

/// A member's plan: every announced tensor whole into its param
/// ([`match_announcement`]), sized by the param (not by the root's word).
/// No checksums: members trust the root's verification (module docs).
pub fn member_plan(a: &Announcement, registry: &Registry, ordinal: i32, rank: u32) -> Result<Plan> {
    let params = match_announcement(a, registry, ordinal, rank)?;
    let entries = params.into_iter().enumerate().map(|(k, i)| {
        let p = &registry.params()[i];
        let meta = TensorMeta {
            name: p.name.clone(),
            dtype: p.dtype,
            shape: p.shape.clone(),
            nbytes: p.nbytes as u64,
            checksum: None,
            placement: None,
        };
        PlanEntry::new(meta, k, Target::Param(i))
    });
    Ok(Plan::new(entries.collect()))
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
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_UNSUPPORTED);
        assert!(e.message.contains("tensor 'w'"), "{e}");
    }

    #[test]
    fn a_member_names_what_does_not_match_the_root() {
        let r = registry();
        let sent = |name: &str, dtype: DType, shape: &[u64]| Announcement {
            version: "v1".into(),
            staged: false,
            tensors: vec![Announced {
                name: name.into(),
                dtype: dtype as u32,
                shape: shape.to_vec(),
                nbytes: 16,
            }],
        };
        let e = match_announcement(&sent("x", DType::F32, &[4]), &r, 0, 3).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_NOT_FOUND);
        assert!(
            e.message.contains("rank 3") && e.message.contains("'x'"),
            "{e}"
        );
        let e = match_announcement(&sent("w", DType::F16, &[8]), &r, 0, 3).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_MISMATCH);
        assert!(e.message.contains("F32 [4] here, but F16 [8]"), "{e}");
        let e = match_announcement(&sent("w", DType::F32, &[4]), &r, 0, 3).unwrap_err();
        assert!(e.message.contains("host memory"), "{e}");
    }

    #[test]
    fn words_round_trip_as_json() {
        let w: Word<Announcement> = Word::Go(Announcement {
            version: "v".into(),
            tensors: vec![],
            staged: true,
        });
        let back: Word<Announcement> =
            serde_json::from_slice(&serde_json::to_vec(&w).unwrap()).unwrap();
        assert_eq!(back, w);
        let stop: Word<()> = Word::Stop("disk gone".into());
        let back: Word<()> = serde_json::from_slice(&serde_json::to_vec(&stop).unwrap()).unwrap();
        assert_eq!(back, stop);
    }
}
