//! What the manager keeps from one update to the next, in one place: each
//! spares a later update a cost it would pay again (planning, mapping a
//! trainer's buffers, pinning and faulting in staging, meeting the
//! fan-out group). A clear drops what holds memory ([`Kept::release`]);
//! a failed update forgets its plan (`plans.forget`).

use super::plan_cache::PlanCache;
use super::shadows::NextShadows;
use crate::fanout::FanoutLink;
use crate::memory::deferred::DeferredRelease;
use crate::memory::host::HostRegion;
use crate::memory::kept_mappings::MappedBuffers;
use crate::memory::staging::DeviceStaging;
use parking_lot::Mutex;
use std::sync::Arc;

pub(super) struct Kept {
    /// The last plan, reused while the layouts do not change.
    pub plans: PlanCache,
    /// The last IPC session's shared buffers, mapped (see `MappedBuffers`).
    pub ipc_buffers: Arc<Mutex<MappedBuffers>>,
    /// Pinned host buffers and upload streams for device params.
    pub staging: Mutex<DeviceStaging>,
    /// Atomic mode's packed staging (engine-owned and device params,
    /// callback tensors), kept when `keep_atomic_staging` says so.
    pub atomic_staging: Mutex<Option<HostRegion>>,
    /// With `keep_atomic_staging`: the next atomic update's shadows for
    /// library-owned host params, faulted in between updates.
    pub next_shadows: Mutex<NextShadows>,
    /// In place, with `keep_atomic_staging`: each quantized param's
    /// landing buffer (its source dtype's bytes), by param index.
    pub quant_landing: Mutex<Vec<(usize, HostRegion)>>,
    /// Device memory staged commits took out of params, being freed.
    pub device_release: DeferredRelease,
    /// Host pages staged commits took out of library-owned params, being
    /// freed.
    pub host_release: DeferredRelease,
    /// The old pages a staged commit took out of library-owned params, by
    /// param number, until the update hands them on (the next shadows, or
    /// `host_release`).
    pub swapped_out: Mutex<Vec<(usize, HostRegion)>>,
    /// NCCL fan-out: the communicator.
    pub fanout: Option<Mutex<FanoutLink>>,
}

impl Kept {
    /// Nothing kept yet; `fanout`: the link when the config asks for one.
    pub fn new(fanout: Option<FanoutLink>) -> Kept {
        Kept {
            plans: PlanCache::default(),
            ipc_buffers: Arc::default(),
            staging: Mutex::default(),
            atomic_staging: Mutex::default(),
            next_shadows: Mutex::default(),
            quant_landing: Mutex::default(),
            device_release: DeferredRelease::new("wm-device-free"),
            host_release: DeferredRelease::new("wm-host-free"),
            swapped_out: Mutex::default(),
            fanout: fanout.map(Mutex::new),
        }
    }

    /// A clear: a cleared engine holds no trainer memory, nor pinned or
    /// atomic staging. The plan and the fan-out link hold none and stay.
    pub fn release(&self) {
        self.ipc_buffers.lock().forget();
        self.staging.lock().release();
        self.atomic_staging.lock().take();
        self.next_shadows.lock().discard();
        self.quant_landing.lock().clear();
        self.swapped_out.lock().clear();
        self.wait_released();
    }

    /// Wait until what staged commits took out of params is freed.
    pub fn wait_released(&self) {
        self.device_release.wait();
        self.host_release.wait();
    }
}
