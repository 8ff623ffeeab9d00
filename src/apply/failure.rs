//! A failed update: the error, and what became of the engine's weights
//! (which decides the state the manager reports).

use crate::result::Error;

/// What a failed update left in the params.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// No param byte changed: the engine keeps its old weights.
    Intact,
    /// No param byte changed, but params a clear had released were given
    /// their memory back first (the manager's doing, before the applier).
    Restored,
    /// Param bytes may have changed: the weights are half-written.
    Written,
}

/// Why an update failed, and the state of the weights after it.
#[derive(Debug)]
pub struct ApplyFailure {
    pub error: Error,
    pub weights: Weights,
}

impl ApplyFailure {
    /// `written`: whether any param byte may have changed.
    pub fn new(error: Error, written: bool) -> ApplyFailure {
        let weights = if written {
            Weights::Written
        } else {
            Weights::Intact
        };
        ApplyFailure { error, weights }
    }

    pub fn params_written(&self) -> bool {
        self.weights == Weights::Written
    }
}
