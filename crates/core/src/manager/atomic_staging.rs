//! What an atomic update stages into besides fresh memory: the shadows
//! swapped into library-owned host params (and the next update's, faulted
//! in ahead: `shadows.rs`), the packed region kept from the last update,
//! and, with `swap_device_pages`, the library-owned device params whose
//! memory is swapped (`apply/device_swap.rs`); and after a staged commit,
//! what becomes of the pages it took out of the params.

use super::shadows::Shadows;
use super::Manager;
use crate::apply::AtomicStaging;
use crate::memory::device::DeviceRegion;
use crate::memory::host::HostRegion;
use crate::registry::{Param, ParamMemory, Registry};

impl Manager {
    /// What an atomic update's arena may use besides fresh memory: the
    /// library-owned regions it swaps into, the packed region kept in
    /// `keep`, and (atomic) the shadows faulted in since the last update.
    pub(super) fn atomic_staging<'a>(
        &self,
        registry: &'a Registry,
        keep: Option<&'a mut Option<HostRegion>>,
        atomic_mode: bool,
    ) -> AtomicStaging<'a> {
        let params = registry.params();
        AtomicStaging {
            swappable: params.iter().map(library_host_region).collect(),
            keep,
            ready: match atomic_mode {
                true => self.kept.next_shadows.lock().take(self.threads),
                false => Default::default(),
            },
            device: match self.config.swap_device_pages {
                true => params.iter().map(library_device_region).collect(),
                false => Vec::new(),
            },
            device_release_later: None,
            swapped_out: None,
        }
    }
}

/// A library-owned host param's region: an atomic update swaps its shadow
/// in instead of copying.
fn library_host_region(p: &Param) -> Option<&HostRegion> {
    match &p.memory {
        ParamMemory::Library(r) => Some(r),
        _ => None,
    }
}

/// A library-owned device param's region: with `swap_device_pages`, an
/// atomic update swaps fresh device memory in (`apply/device_swap.rs`).
fn library_device_region(p: &Param) -> Option<&DeviceRegion> {
    match &p.memory {
        ParamMemory::LibraryDevice(r) => Some(r),
        _ => None,
    }
}

/// (param number, bytes) of every library-owned host param.
pub(super) fn library_host_sizes(registry: &Registry) -> Vec<(usize, usize)> {
    let params = registry.params().iter().enumerate();
    params
        .filter_map(|(i, p)| library_host_region(p).map(|r| (i, r.len())))
        .collect()
}

impl Manager {
    /// After an update: the old pages a staged commit took out of
    /// library-owned params (`kept.swapped_out`) become the next update's
    /// shadows when `keep_next` (the manager keeps its staging, and the
    /// update went through), else a thread frees them off the pause. An
    /// update that moved none hands on nothing.
    pub(super) fn hand_on_old_pages(&self, registry: &Registry, keep_next: bool) {
        let old: Shadows = std::mem::take(&mut *self.kept.swapped_out.lock())
            .into_iter()
            .collect();
        match keep_next {
            true => (self.kept.next_shadows.lock()).prepare(library_host_sizes(registry), old),
            false => self.kept.host_release.later(old.into_values().collect()),
        }
    }
}
