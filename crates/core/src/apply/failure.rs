//! A failed update: the error, and what became of the engine's weights
//! (which decides the state the manager reports).

use crate::result::Error;

/// What a failed update left in the params.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// No param byte changed: the engine keeps its old weights.
    Intact,
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

    /// A failure after param bytes may have changed.
    pub fn after_writing(error: Error) -> ApplyFailure {
        ApplyFailure::new(error, true)
    }

    pub fn params_written(&self) -> bool {
        self.weights == Weights::Written
    }
}

/// Failures before any param byte changed.
impl From<Error> for ApplyFailure {
    fn from(error: Error) -> ApplyFailure {
        ApplyFailure::new(error, false)
    }
}
