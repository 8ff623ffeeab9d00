//! A member's landing without a GPU: the same batch loop and applier as
//! over NCCL, with a mover that copies the root's bytes in host memory
//! (NCCL and the GPU are what tests/gpu.rs covers).

use super::member::{Bounce, MemberLanding};
use super::transfer::{move_batches, Mover};
use crate::apply::{
    Applier, ApplyOptions, AtomicStaging, Dest, Hooks, Mode, Progress, ProgressHook,
};
use crate::manifest::TensorMeta;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::plan::{Plan, PlanEntry, Target};
use crate::result::{Error, Result};
use crate::tensor::DType;
use std::time::{Duration, Instant};

const SIZES: [usize; 3] = [40, 24, 100];
/// Batches of SIZES: tensors 0 and 1, then tensor 2.
const LIMIT: usize = 64;

/// The root's side in host memory: broadcast `k` writes tensor `k`.
struct Loopback {
    root: Vec<Vec<u8>>,
    next: usize,
    /// The broadcast of this tensor fails (the root died).
    fail_at: Option<usize>,
    aborted: bool,
}

impl Loopback {
    fn new(fail_at: Option<usize>) -> Loopback {
        let root = SIZES
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 3 + k * 50 + 1) as u8).collect())
            .collect();
        Loopback {
            root,
            next: 0,
            fail_at,
            aborted: false,
        }
    }
}

impl Mover for Loopback {
    unsafe fn broadcast(&mut self, at: u64, len: usize, _: Instant) -> Result<()> {
        if self.fail_at == Some(self.next) {
            return Err(Error::peer("the root died"));
        }
        let src = &self.root[self.next];
        assert_eq!(src.len(), len);
        // SAFETY: the landing's memory, `len` bytes (the Mover contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at as *mut u8, len) };
        self.next += 1;
        Ok(())
    }

    fn wait(&mut self, _: Instant) -> Result<()> {
        Ok(())
    }

    fn abort(&mut self) {
        self.aborted = true;
    }
}

fn plan() -> Plan {
    let entries = SIZES.iter().enumerate().map(|(k, &n)| {
        let meta = TensorMeta::whole(&format!("p{k}"), DType::U8, &[n as u64]);
        PlanEntry::new(meta, k, Target::Param(k))
    });
    Plan::new(entries.collect())
}

/// Engine-owned host params holding old bytes (0xAA).
fn old_params() -> Vec<Vec<u8>> {
    SIZES.iter().map(|&n| vec![0xAA; n]).collect()
}

fn applier<'p, 'h>(
    plan: &'p Plan,
    params: &mut [Vec<u8>],
    mode: Mode,
    progress: ProgressHook<'h>,
    kept: &'p mut Option<HostRegion>,
) -> Applier<'p, 'h> {
    let dests = params
        .iter_mut()
        .map(|p| Some(Dest::Host(SendPtr(p.as_mut_ptr()))))
        .collect();
    let opts = ApplyOptions {
        mode,
        verify: false,
        threads: 2,
        timeout: Duration::from_secs(10),
        begun: std::time::Instant::now(),
        callback_staging_limit: crate::defaults::CALLBACK_STAGING_LIMIT,
    };
    let hooks = Hooks {
        progress: Some(progress),
        tensor: None,
    };
    let staging = AtomicStaging {
        keep: Some(kept),
        ..Default::default()
    };
    Applier::with_atomic_staging(plan, dests, opts, hooks, staging).unwrap()
}

fn host_bounce() -> Bounce {
    let n = Bounce::size_for(&SIZES, LIMIT).unwrap();
    Bounce::Host(HostRegion::new("test landing", n).unwrap())
}

/// The member's side of one broadcast from `root`, through `a`.
fn receive(a: &mut Applier, bounce: Option<&Bounce>, root: &mut Loopback) -> Result<()> {
    let mut landing = MemberLanding::new(a, &SIZES, bounce, "test");
    let timeout = Duration::from_secs(5);
    move_batches(&SIZES, LIMIT, timeout, root, &mut landing)
}

#[test]
fn in_place_the_bytes_land_in_the_params_and_progress_is_the_appliers() {
    let (plan, mut params, mut kept) = (plan(), old_params(), None);
    let mut seen = Vec::new();
    let mut progress = |p: &Progress| {
        seen.push((p.bytes_done, p.tensors_done, p.bytes_total, p.tensors_total));
        true
    };
    let mut a = applier(&plan, &mut params, Mode::InPlace, &mut progress, &mut kept);
    let mut root = Loopback::new(None);
    receive(&mut a, None, &mut root).unwrap();
    assert!(a.wrote_params());
    let applied = a.finish().map_err(|f| f.error).unwrap();
    assert_eq!((applied.tensors, applied.bytes), (3, 164));
    assert_eq!(params, root.root);
    assert_eq!(seen, vec![(64, 2, 164, 3), (164, 3, 164, 3)]);
}

#[test]
fn atomic_the_params_change_only_at_the_appliers_commit() {
    let (plan, mut params, mut kept) = (plan(), old_params(), None);
    let mut progress = |_: &Progress| true;
    let mut a = applier(&plan, &mut params, Mode::Atomic, &mut progress, &mut kept);
    let bounce = host_bounce();
    let mut root = Loopback::new(None);
    receive(&mut a, Some(&bounce), &mut root).unwrap();
    assert!(!a.wrote_params());
    assert_eq!(params, old_params());
    a.finish().map_err(|f| f.error).unwrap();
    assert_eq!(params, root.root);
    assert!(
        kept.is_some(),
        "the applier's staging is kept for the next update"
    );
}

#[test]
fn atomic_a_failure_midway_keeps_the_old_weights_and_stops_the_group() {
    for cancel in [false, true] {
        let (plan, mut params, mut kept) = (plan(), old_params(), None);
        let mut batches_seen = 0;
        // Cancelled by the progress hook after the first batch, or the
        // root dies during the second.
        let mut progress = |_: &Progress| {
            batches_seen += 1;
            !cancel
        };
        let mut a = applier(&plan, &mut params, Mode::Atomic, &mut progress, &mut kept);
        let bounce = host_bounce();
        let mut root = Loopback::new((!cancel).then_some(2));
        let e = receive(&mut a, Some(&bounce), &mut root).unwrap_err();
        assert!(root.aborted, "the other ranks must not wait for this one");
        let failure = a.failure(e);
        assert!(!failure.params_written(), "{}", failure.error);
        let want = if cancel { "cancelled" } else { "the root died" };
        assert!(failure.error.message.contains(want), "{}", failure.error);
        drop(a);
        assert_eq!(params, old_params());
        assert_eq!(batches_seen, 1);
        assert!(
            kept.is_some(),
            "the applier's arena went back when it ended"
        );
    }
}
