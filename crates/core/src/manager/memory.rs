//! Releasing param memory (a clear) and bringing it back (the next update),
//! with the GPU memory the driver reports freed and taken back.

use super::{ClearStats, Manager};
use crate::memory::SendPtr;
use crate::registry::{ParamMemory, Registry};
use crate::result::{Error, Result};

impl Manager {
    /// Bring released memory back before writing: library regions are faulted
    /// in (host ones only when `swaps_host` is false: an atomic update swaps
    /// fresh pages in, and faulting in zeros first would double the cost);
    /// engine-owned params go through the acquire hook.
    /// Returns the GPU memory taken back, as the driver reports it.
    pub(super) fn restore(&self, registry: &mut Registry, swaps_host: bool) -> Result<u64> {
        let before = device_free(registry)?;
        for p in registry.params_mut() {
            if p.resident {
                continue;
            }
            match &mut p.memory {
                ParamMemory::Library(_) if swaps_host => {}
                ParamMemory::Library(r) => r
                    .restore()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::LibraryDevice(r) => r
                    .restore()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::Engine { ptr } => {
                    if let Some(acquire) = &self.config.acquire_hook {
                        let new = acquire(&p.name, ptr.0, p.nbytes)
                            .filter(|n| !n.is_null() || p.nbytes == 0);
                        *ptr = SendPtr(new.ok_or_else(|| {
                            Error::callback(format!(
                                "acquire callback gave no memory for param '{}'",
                                p.name
                            ))
                        })?);
                        // A destroy from inside the callback: stop here.
                        self.check_cancelled()?;
                        if let Some(ordinal) = p.device {
                            // New device memory gets the registration's checks.
                            crate::registry::check_device_memory(
                                ordinal,
                                ptr.0,
                                p.nbytes,
                                &format!("param '{}' (from the acquire callback)", p.name),
                            )?;
                        }
                    }
                }
            }
            p.resident = true;
        }
        let after = device_free(registry)?;
        Ok(free_change(&before, &after))
    }

    pub(super) fn release(&self, registry: &mut Registry) -> Result<ClearStats> {
        let mut stats = ClearStats::default();
        let before = device_free(registry)?;
        for p in registry.params_mut() {
            if !p.resident {
                continue;
            }
            match &p.memory {
                ParamMemory::Library(r) => {
                    r.release()
                        .map_err(|e| e.context(format!("param '{}'", p.name)))?;
                    let left = r.resident_bytes()?;
                    if left != 0 {
                        return Err(Error::out_of_memory(format!(
                            "param '{}' still holds {left} bytes after release (locked memory?)",
                            p.name
                        )));
                    }
                }
                ParamMemory::LibraryDevice(r) => r
                    .release()
                    .map_err(|e| e.context(format!("param '{}'", p.name)))?,
                ParamMemory::Engine { ptr } => {
                    if let Some(release) = &self.config.release_hook {
                        release(&p.name, ptr.0, p.nbytes);
                    }
                }
            }
            p.resident = false;
            stats.params += 1;
            stats.bytes_released += p.nbytes as u64;
        }
        stats.device_bytes_freed = free_change(&device_free(registry)?, &before);
        Ok(stats)
    }
}

/// Free memory of each GPU that holds library-owned device params (none:
/// empty, and no driver call).
fn device_free(registry: &Registry) -> Result<Vec<(i32, u64)>> {
    let mut ordinals: Vec<i32> = registry
        .params()
        .iter()
        .filter_map(|p| match &p.memory {
            ParamMemory::LibraryDevice(r) => Some(r.ordinal()),
            _ => None,
        })
        .collect();
    ordinals.sort_unstable();
    ordinals.dedup();
    ordinals
        .into_iter()
        .map(|o| Ok((o, crate::memory::device::memory_info(o)?.0 as u64)))
        .collect()
}

/// How much more free memory `more` reports than `less`, over all GPUs.
fn free_change(more: &[(i32, u64)], less: &[(i32, u64)]) -> u64 {
    more.iter()
        .zip(less)
        .map(|(a, b)| a.1.saturating_sub(b.1))
        .sum()
}

/// A device page swap that failed and could not map the old memory back
/// leaves its param without memory: not resident, so the next update maps
/// fresh memory there (`restore`), as after a clear.
pub(super) fn note_unmapped(registry: &mut Registry) {
    for p in registry.params_mut() {
        if let ParamMemory::LibraryDevice(r) = &p.memory {
            p.resident &= r.is_mapped();
        }
    }
}
