//! Registering params: only before the first update or clear, so a plan
//! never races a registration.

use super::Manager;
use crate::quant::Scheme;
use crate::registry::{ParamSpec, Registry};
use crate::result::{Error, Result};

impl Manager {
    /// `f` on the registry while registration is open; `what` names what
    /// the call registers or declares, for the error when it is closed.
    fn registering<T>(
        &self,
        what: impl FnOnce() -> String,
        f: impl FnOnce(&mut Registry) -> Result<T>,
    ) -> Result<T> {
        let r = (|| {
            let _op = self.op.try_lock().ok_or_else(|| self.busy())?;
            if !self.record.lock().registration_open {
                return Err(Error::state(format!(
                    "{}: params are registered and declared quantized only before the first \
                     update or clear",
                    what()
                )));
            }
            let mut reg = self.registry.write();
            let out = f(&mut reg)?;
            let mut rec = self.record.lock();
            rec.params = reg.len() as u64;
            rec.param_bytes = reg.total_bytes();
            rec.resident_bytes = reg.resident_bytes();
            Ok(out)
        })();
        self.recorded(r)
    }

    /// Register engine-owned memory (`len` bytes at `ptr`) as param `spec`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid and writable for the manager's life
    /// (or until the release hook hands it back).
    pub unsafe fn register(&self, spec: &ParamSpec, ptr: *mut u8, len: usize) -> Result<()> {
        let what = || format!("param '{}'", spec.name);
        self.registering(what, |r| r.register_engine(spec, ptr, len))
    }

    /// Allocate a library-owned param; returns its stable address and length.
    pub fn allocate(&self, spec: &ParamSpec) -> Result<(*mut u8, usize)> {
        let what = || format!("param '{}'", spec.name);
        self.registering(what, |r| r.allocate(spec))
    }

    /// Declare that registered param `weight` (F8_E4M3) holds its global
    /// tensors quantized with `scheme`, its scale_inv in registered param
    /// `scales` (see [`Registry::quantize`]). Like registering: only before
    /// the first update or clear.
    pub fn quantize(&self, weight: &str, scales: &str, scheme: Scheme) -> Result<()> {
        let what = || format!("param '{weight}' (quantized, its scales in '{scales}')");
        self.registering(what, |r| r.quantize(weight, scales, scheme))
    }
}
