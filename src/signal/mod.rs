//! The control signal: the state every rank should be in this step.
//!
//! Rank 0 reads the control cell (a shared-memory int32 that a controller
//! sets); with one rank that value is the signal. Several ranks need the
//! broadcast and barrier of the control-plane work, which this build does not
//! have yet: `broadcast` refuses them with `WM_ERR_UNSUPPORTED`.

pub mod cell;

use crate::result::{Error, Result};
use crate::state::State;
pub use cell::ControlCell;

/// The signal for this step. `cell` is the manager's control cell, if any;
/// without one nothing ever asks for a change and the signal is NORMAL.
pub fn broadcast(world_size: u32, cell: Option<&ControlCell>) -> Result<State> {
    if world_size > 1 {
        return Err(Error::unsupported(format!(
            "wm_broadcast_signal with world_size {world_size} needs the multi-rank control plane, \
             which this build does not include yet (world_size 1 works)"
        )));
    }
    match cell {
        None => Ok(State::Normal),
        Some(c) => c.read_state(),
    }
}
