//! Which version an update takes deltas against, and what its deltas did.
//!
//! An update over the network (rdma, gdr) names the version the params
//! hold as its base when the update before it succeeded (NORMAL): after a
//! clear or a failed update the params hold no version. An IPC update does
//! only when asked ([`DeltaMode::On`]): on one node the whole copy runs at
//! memory speed, and a delta's passes (the publisher reading both
//! versions, the engine hashing its base and patching) cost more than the
//! bytes they save. The base is only a claim: each request carries the
//! fingerprint of the param bytes it would patch, and the publisher sends
//! a delta only where they are the base's (`source::deltas`). Snapshots,
//! fan-out members and device params always move whole.

use super::UpdateRequest;
use crate::apply::Applied;
use crate::plan::Plan;
use crate::source::SourceKind;
use crate::state::State;

/// Whether an update's runs may come as deltas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeltaMode {
    /// Over the network (rdma, gdr) yes; over IPC no.
    #[default]
    Auto,
    /// On every path that can (IPC too): `WM_UPDATE_DELTAS`.
    On,
    /// Never: `WM_UPDATE_WHOLE`.
    Off,
}

/// Why runs of an update came whole (`wm_delta_fallback`; numbers are ABI).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeltaFallback {
    /// Deltas were asked for every run with a base; each came as a delta
    /// unless that would not have been under half its bytes.
    #[default]
    None = 0,
    /// The params held no version: the first update, or one after a clear
    /// or after an update that failed having written params (FAILED; an
    /// atomic update that failed leaves the version held).
    NoBase = 1,
    /// The request asked for a whole update (`WM_UPDATE_WHOLE`).
    Refused = 2,
    /// A publisher no longer keeps the base version (or holds it where it
    /// cannot diff it: GPU memory, a directory; or, for an FP8 param, keeps
    /// no FP8 image of the base's run).
    NotKept = 3,
    /// Some params' bytes were not the base's (written since by something
    /// else): those runs came whole.
    Differs = 4,
    /// The source sends whole (a snapshot, a fan-out; the network when
    /// the engine asks for keyed digests, which do not cover deltas), or
    /// no param has a base here (a tensor callback; device params whose GPU cannot run
    /// the delta kernels, without NVRTC; GPU params an entry lands in as
    /// several runs).
    NotApplicable = 5,
    /// An IPC update that did not ask for deltas (`WM_UPDATE_DELTAS`).
    NotAsked = 6,
}

/// What an update's deltas did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaStats {
    /// The version the params held that the update named to its
    /// publishers as the base of deltas, also when they came whole
    /// (`NotKept`, `Differs`); "" when it named none (`Refused`, `NoBase`,
    /// `NotAsked`, and `NotApplicable` for a snapshot, keyed digests or a
    /// tensor callback).
    pub base_version: String,
    pub fallback: DeltaFallback,
    /// Runs (a plan entry's bytes from its source) sent as deltas, and whole.
    pub runs_delta: u64,
    pub runs_whole: u64,
    /// Bytes the sources sent: the runs sent whole plus the deltas.
    pub wire_bytes: u64,
    /// Bytes the deltas rewrote in the params (every byte of a chunk the
    /// delta carried whole).
    pub rewritten_bytes: u64,
}

/// The base an update of `req` names when the params hold `version` and
/// the state before it was `prev`, or why it names none.
/// `keyed`: the engine asks for keyed digests (`NetSettings::keyed_digests`),
/// which authenticate bucket bytes, not deltas: its rdma updates take
/// every run whole, so every byte it takes is authenticated.
pub(super) fn base_of(
    prev: State,
    req: &UpdateRequest,
    version: Option<String>,
    keyed: bool,
) -> Result<String, DeltaFallback> {
    // A tensor callback takes every tensor instead of the params: nothing
    // is patched, whatever the params hold.
    let callback = req.hooks.tensor.is_some();
    match (req.deltas, req.source) {
        (DeltaMode::Off, _) => return Err(DeltaFallback::Refused),
        (_, SourceKind::Snapshot) => return Err(DeltaFallback::NotApplicable),
        _ if callback => return Err(DeltaFallback::NotApplicable),
        (_, SourceKind::Rdma | SourceKind::Gdr) if keyed => {
            return Err(DeltaFallback::NotApplicable)
        }
        (DeltaMode::Auto, SourceKind::Ipc) => return Err(DeltaFallback::NotAsked),
        _ => {}
    }
    match (prev, version) {
        (State::Normal, Some(v)) => Ok(v),
        _ => Err(DeltaFallback::NoBase),
    }
}

/// The delta statistics of an update of `plan` that named `base`.
pub(super) fn stats_of(
    base: &Result<String, DeltaFallback>,
    plan: &Plan,
    applied: &Applied,
) -> DeltaStats {
    let d = &applied.deltas;
    let fallback = match base {
        Err(why) => *why,
        Ok(_) if d.base_not_kept => DeltaFallback::NotKept,
        Ok(_) if d.base_differs > 0 => DeltaFallback::Differs,
        Ok(_) if d.asked == 0 => DeltaFallback::NotApplicable,
        Ok(_) => DeltaFallback::None,
    };
    DeltaStats {
        base_version: base.clone().unwrap_or_default(),
        fallback,
        runs_delta: d.runs_delta,
        runs_whole: (plan.tensors as u64).saturating_sub(d.runs_delta),
        wire_bytes: plan.bytes - d.covered_bytes + d.delta_bytes,
        rewritten_bytes: d.rewritten_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor callback's update names no base over any source, whatever
    /// the params hold, unless refused first; without one the engine's
    /// version is named where the source takes deltas.
    #[test]
    fn a_tensor_callback_names_no_base() {
        let mut sink = |_: &crate::apply::TensorView| Ok(());
        for source in [SourceKind::Ipc, SourceKind::Rdma, SourceKind::Snapshot] {
            let mut req = UpdateRequest::snapshot("x");
            (req.source, req.deltas) = (source, DeltaMode::On);
            let held = || Some("7".to_string());
            let named = base_of(State::Normal, &req, held(), false);
            let want = match source {
                SourceKind::Snapshot => Err(DeltaFallback::NotApplicable),
                _ => Ok("7".to_string()),
            };
            assert_eq!(named, want, "{source:?}");
            req.hooks.tensor = Some(&mut sink);
            for prev in [State::Normal, State::Cleared] {
                let named = base_of(prev, &req, held(), false);
                assert_eq!(named, Err(DeltaFallback::NotApplicable), "{source:?}");
            }
            req.deltas = DeltaMode::Off;
            let named = base_of(State::Normal, &req, held(), false);
            assert_eq!(named, Err(DeltaFallback::Refused), "{source:?}");
        }
    }
}
