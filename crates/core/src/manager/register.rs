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
            let _turn = self.registrations.lock();
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

    /// Register each of `params` (a spec, and `len` bytes at `ptr`) as
    /// [`Manager::register`] would, or none: on the first refused, the ones
    /// registered before it in the batch are taken out again and the error
    /// names its place ("param 3 of the 10 registered together (none was
    /// registered): ..."; a batch of one reads as `register`).
    ///
    /// # Safety
    /// As [`Manager::register`], for every param.
    pub unsafe fn register_all(&self, params: &[(ParamSpec, *mut u8, usize)]) -> Result<()> {
        let what = || match params.first() {
            Some((spec, ..)) if params.len() == 1 => format!("param '{}'", spec.name),
            None => "an empty batch of params".to_string(),
            _ => format!("{} params registered together", params.len()),
        };
        self.registering(what, |r| {
            check_names_once(params)?;
            let before = r.len();
            for (k, (spec, ptr, len)) in params.iter().enumerate() {
                if let Err(e) = r.register_engine(spec, *ptr, *len) {
                    r.truncate(before);
                    return Err(ParamSpec::refused_among(e, k, params.len()));
                }
            }
            Ok(())
        })
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

/// A name twice in a batch is said so (the registry would say it is
/// "already registered", as if before the call).
fn check_names_once(params: &[(ParamSpec, *mut u8, usize)]) -> Result<()> {
    let mut first = std::collections::HashMap::with_capacity(params.len());
    for (k, (spec, ..)) in params.iter().enumerate() {
        if let Some(j) = first.insert(spec.name.as_str(), k) {
            let e = Error::invalid_argument(format!(
                "param '{}' is in the batch twice (at {j} and {k})",
                spec.name
            ));
            return Err(ParamSpec::refused_among(e, k, params.len()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::ManagerConfig;
    use crate::tensor::DType;

    /// A batch whose third param is refused (its memory overlaps the
    /// first's, or its name the second's) registers none of it, naming its
    /// place; what was registered before stays, and each param can be
    /// registered afterwards.
    #[test]
    fn registering_together_registers_every_param_or_none() {
        let m = Manager::new(ManagerConfig::default()).unwrap();
        let mut buf = vec![0u8; 64];
        let base = buf.as_mut_ptr();
        let at = |o: usize| base.wrapping_add(o);
        let f32s = |name: &str| ParamSpec::host(name, DType::F32, &[4]);
        // SAFETY: `buf` outlives `m`'s use of it (no update runs).
        unsafe { m.register(&f32s("kept"), at(48), 16) }.unwrap();
        for (third, off, why) in [
            ("c", 0, "overlaps param 'a'"),
            ("b", 32, "in the batch twice (at 1 and 2)"),
        ] {
            let batch = [
                (f32s("a"), at(0), 16),
                (f32s("b"), at(16), 16),
                (f32s(third), at(off), 16),
            ];
            // SAFETY: as above.
            let e = unsafe { m.register_all(&batch) }.unwrap_err();
            assert!(
                e.message
                    .starts_with("param 2 of the 3 registered together (none was registered)")
                    && e.message.contains(why),
                "{e}"
            );
            assert_eq!(m.status().params, 1);
            assert_eq!(m.registry.read().len(), 1);
        }
        let batch = [(f32s("a"), at(0), 16), (f32s("b"), at(16), 16)];
        // SAFETY: as above.
        unsafe { m.register_all(&batch) }.unwrap();
        // SAFETY: as above.
        unsafe { m.register(&f32s("c"), at(32), 16) }.unwrap();
        assert_eq!(m.status().params, 4);
        let one = ParamSpec::host("d", DType::F32, &[1]);
        // SAFETY: as above.
        let e = unsafe { m.register(&one, at(4), 4) }.unwrap_err();
        assert!(e.message.contains("overlaps param 'a'"), "{e}");
        // Registration closed: that is the error, whatever the batch holds.
        m.clear().unwrap();
        let twice = [(f32s("e"), at(32), 0), (f32s("e"), at(36), 0)];
        // SAFETY: as above.
        let e = unsafe { m.register_all(&twice) }.unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_STATE, "{e}");
    }
}

#[cfg(test)]
mod concurrent_tests {
    use super::*;
    use crate::manager::ManagerConfig;
    use crate::tensor::DType;

    /// Registrations on two threads take turns: neither is refused as
    /// busy (they used to find each other's lock taken).
    #[test]
    fn registrations_on_two_threads_both_go_through() {
        let m = Manager::new(ManagerConfig::default()).unwrap();
        let mut buf = vec![0u8; 2 * 2000 * 4];
        let base = buf.as_mut_ptr() as usize;
        std::thread::scope(|s| {
            for t in 0..2usize {
                let m = &m;
                s.spawn(move || {
                    for i in 0..2000usize {
                        let spec = ParamSpec::host(&format!("t{t}.p{i}"), DType::F32, &[1]);
                        let at = (base + (t * 2000 + i) * 4) as *mut u8;
                        // SAFETY: `buf` outlives `m`'s use of it (no update runs).
                        unsafe { m.register(&spec, at, 4) }.unwrap();
                    }
                });
            }
        });
        assert_eq!(m.status().params, 4000);
    }
}
