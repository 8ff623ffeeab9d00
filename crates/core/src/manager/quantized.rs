//! What an update needs for its quantized params: where each one's FP8
//! bytes and scales go, and, quantized here in place, a buffer its bytes
//! land in (in their source's dtype, until they are quantized at the end of
//! the update). Atomic updates need no buffer: the bytes land in the
//! arena's shadow. Params the publishers quantize take their FP8 bytes
//! like any param's.

use crate::apply::{Dest, Mode, QuantTarget};
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::plan::{Plan, Target};
use crate::quant::params::QuantRole;
use crate::registry::Registry;
use crate::result::Result;
use parking_lot::Mutex;

/// The update's quantized params, with their landing buffers (in place).
pub(super) struct Quantized<'k> {
    pub targets: Vec<QuantTarget>,
    /// Per target in place, its buffer by param index: given back to
    /// `keep` when the update ends (freed without one).
    buffers: Vec<(usize, HostRegion)>,
    keep: Option<&'k Mutex<Vec<(usize, HostRegion)>>>,
}

impl Drop for Quantized<'_> {
    fn drop(&mut self) {
        if let Some(keep) = self.keep {
            keep.lock().append(&mut self.buffers);
        }
    }
}

impl<'k> Quantized<'k> {
    /// The quantized params `plan` fills, for an update in `mode`. In
    /// place, each gets a buffer of its elements in its source's dtype:
    /// the one an earlier update left in `keep` for that param, else a new
    /// one (faulted in where the bytes land); with `keep`, they go back
    /// there when the update ends.
    pub fn of(
        registry: &Registry,
        plan: &Plan,
        mode: Mode,
        keep: Option<&'k Mutex<Vec<(usize, HostRegion)>>>,
    ) -> Result<Quantized<'k>> {
        let params = registry.params();
        let mut spare = keep
            .map(|k| std::mem::take(&mut *k.lock()))
            .unwrap_or_default();
        let mut out = Quantized {
            targets: Vec::new(),
            buffers: Vec::new(),
            keep,
        };
        for q in &plan.quantized {
            let (i, dtype) = (q.param, q.source);
            let (p, QuantRole::Weight { scheme, scales }) = (&params[i], params[i].quant) else {
                continue;
            };
            let s = &params[scales];
            let wide = match mode {
                _ if q.on_wire => None,
                Mode::Atomic => None,
                Mode::InPlace => {
                    let len = p.nbytes * dtype.size();
                    let kept = spare.iter().position(|(k, r)| *k == i && r.len() == len);
                    let r = match kept {
                        Some(k) => spare.swap_remove(k).1,
                        None => {
                            let what =
                                format!("param '{}': its {dtype} bytes before quantizing", p.name);
                            let r = HostRegion::new(&what, len)?;
                            // Huge pages: faulting 4 KiB pages in cost more
                            // than quantizing their bytes.
                            r.advise_huge(true);
                            r
                        }
                    };
                    let at = SendPtr(r.ptr());
                    out.buffers.push((i, r));
                    Some(at)
                }
            };
            out.targets.push(QuantTarget {
                param: i,
                name: p.name.clone(),
                scheme,
                shape: p.shape.clone(),
                pieces: p.pieces.clone(),
                fp8: SendPtr(p.ptr()),
                scales: (SendPtr(s.ptr()), s.nbytes / scheme.scale_dtype().size()),
                wide,
                on_wire: q.on_wire,
                device: p.device,
            });
        }
        Ok(out)
    }

    /// Where the bytes of an entry into param `i` land: its buffer in
    /// place; atomic, nowhere outside the arena (a null address nothing
    /// writes: the landing sends a quantized param's bytes to its shadow).
    /// None when `i` is not quantized.
    pub fn dest(&self, i: usize) -> Option<Dest> {
        // Targets are in param order (the plan's): a search, not a scan
        // per entry (a rank of a large model has 100,000s of entries).
        let k = self.targets.binary_search_by_key(&i, |t| t.param).ok()?;
        let t = Some(&self.targets[k]).filter(|t| !t.on_wire)?;
        Some(Dest::Host(t.wide.unwrap_or(SendPtr(std::ptr::null_mut()))))
    }

    /// The destination of every plan entry, quantized params' included.
    pub fn dests(&self, plan: &Plan, registry: &Registry) -> Vec<Option<Dest>> {
        plan.entries
            .iter()
            .map(|e| match e.target {
                Target::Param(i) => self.dest(i).or_else(|| Some(registry.params()[i].dest())),
                _ => None,
            })
            .collect()
    }
}
