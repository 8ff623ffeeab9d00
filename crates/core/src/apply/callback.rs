//! Handing whole tensors to the engine's per-tensor callback.

use super::{Applier, DeviceBytes, TensorView};
use crate::result::{Error, Result};

impl Applier<'_, '_> {
    /// Hand entry `t`'s bytes, in host memory, to the callback.
    pub(super) fn deliver(&mut self, t: usize, data: &[u8]) -> Result<()> {
        self.deliver_view(t, data, None)
    }

    /// [`Applier::deliver`] while the bytes stream in (not at an atomic
    /// commit, which hands every tensor over once begun): a deadline that
    /// passed while the callback ran fails the update when it returns, not
    /// at the end of the batch (up to 256 MiB of tensors later).
    pub(super) fn deliver_streaming(&mut self, t: usize, data: &[u8]) -> Result<()> {
        self.deliver(t, data)?;
        self.check_deadline()
    }

    /// Hand entry `t` to the callback: `data` in host memory, or `device`
    /// bytes in GPU memory (then `data` is empty).
    pub(super) fn deliver_view(
        &mut self,
        t: usize,
        data: &[u8],
        device: Option<DeviceBytes>,
    ) -> Result<()> {
        self.tally.delivered(t);
        // The callback writes the engine's own weights: from here a failure
        // leaves them half-written, as a param write does (FAILED in place).
        self.landing.writes_params();
        let meta = &self.plan.entries[t].meta;
        let Some(hook) = self.hooks.tensor.as_mut() else {
            return Err(Error::callback(format!(
                "tensor '{}' is meant for the per-tensor callback but none is set",
                meta.name
            )));
        };
        let zeros = vec![0; meta.shape.len()];
        let view = TensorView {
            name: &meta.name,
            dtype: meta.dtype,
            shape: &meta.shape,
            data,
            device,
            global_shape: meta.global_shape(),
            offset: meta.placement.as_ref().map_or(&zeros, |p| &p.offset),
        };
        hook(&view).map_err(|why| {
            Error::callback(format!(
                "per-tensor callback failed for tensor '{}': {why}",
                meta.name
            ))
        })
    }
}
