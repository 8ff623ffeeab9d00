//! Progress of an update, counted as chunks are accepted and tensors
//! complete, and reported to the progress hook after every batch.

use super::Applier;
use crate::result::{Error, Result};

/// Progress of an update, reported after every batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: u64,
    pub tensors_total: u64,
}

impl Applier<'_, '_> {
    /// Tell the progress hook where the update stands; it may cancel it.
    pub(super) fn report_progress(&mut self) -> Result<()> {
        let Some(progress) = self.hooks.progress.as_mut() else {
            return Ok(());
        };
        if progress(&self.progress) {
            return Ok(());
        }
        Err(Error::cancelled(format!(
            "update cancelled by the progress callback after {} of {} bytes",
            self.progress.bytes_done, self.progress.bytes_total
        )))
    }
}
