//! The controller's side (SPEC.md): ask the engine for an update or a clear
//! through the control cell, and wait (bounded) for the answer.
//!
//! - update: NORMAL: already up to date; UPDATING: busy; CLEARING: cannot
//!   update now; CLEARED: set UPDATING and wait for NORMAL.
//! - clear: CLEARED: already cleared; CLEARING: busy; UPDATING: cannot clear
//!   now; NORMAL: set CLEARING and wait for CLEARED.
//!
//! The request is a compare-and-swap from the value just read, so two
//! controllers cannot both believe they started one. When the engine fails,
//! rank 0 moves the word to CLEARED and writes a report; the wait then ends
//! with an error carrying the report's reason.

use super::cell::ControlCell;
use super::report::ReportCell;
use crate::result::{wm_result, Error, Result};
use crate::state::State;
use std::time::{Duration, Instant};

/// How a request ended (when it did not fail).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The engine did it.
    Done = 0,
    /// Nothing to do: already up to date (update) or already cleared (clear).
    AlreadyDone = 1,
    /// The same action is already running.
    Busy = 2,
    /// The opposite action is running: cannot do this now.
    Refused = 3,
}

pub struct Controller {
    cell: ControlCell,
}

const POLL: Duration = Duration::from_micros(500);

impl Controller {
    pub fn open(cell: &str) -> Result<Controller> {
        Ok(Controller {
            cell: ControlCell::open_or_create(cell)?,
        })
    }

    pub fn cell(&self) -> &ControlCell {
        &self.cell
    }

    pub fn get(&self) -> Result<State> {
        self.cell.read_state()
    }

    /// Store a state unconditionally (tools; FastDeploy's own engine resets).
    pub fn set(&self, state: State) -> Result<()> {
        if !state.is_signal() {
            return Err(Error::invalid_argument(format!(
                "{state} is not a control-word value"
            )));
        }
        self.cell.store(state as i32);
        Ok(())
    }

    /// Wait until the word holds `target`.
    pub fn wait_for(&self, target: State, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.get()? == target {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "control cell {} did not reach {target} within {timeout:?} (it holds {})",
                    self.cell.name(),
                    self.cell.load()
                )));
            }
            std::thread::sleep(POLL);
        }
    }

    fn report_seq(&self) -> u64 {
        match ReportCell::open_existing(self.cell.name()) {
            Ok(Some(r)) => r.read().seq,
            _ => 0,
        }
    }

    /// Ask for `action` (UPDATING or CLEARING) and wait up to `timeout`.
    pub fn request(&self, action: State, timeout: Duration) -> Result<RequestOutcome> {
        let (from, done, verb) = match action {
            State::Updating => (State::Cleared, State::Normal, "update"),
            State::Clearing => (State::Normal, State::Cleared, "clear"),
            other => return Err(Error::invalid_argument(format!("cannot request {other}"))),
        };
        let current = self.get()?;
        if current != from {
            return Ok(match current {
                s if s == done => RequestOutcome::AlreadyDone,
                s if s == action => RequestOutcome::Busy,
                _ => RequestOutcome::Refused,
            });
        }
        let seq_before = self.report_seq();
        if self
            .cell
            .compare_exchange(from as i32, action as i32)
            .is_err()
        {
            return Ok(RequestOutcome::Busy);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let now_state = self.get()?;
            let finished =
                now_state == done || (action == State::Updating && now_state == State::Cleared);
            if finished {
                if let Some(r) = ReportCell::open_existing(self.cell.name())? {
                    let rep = r.read();
                    if rep.seq > seq_before && rep.code != 0 {
                        let code = wm_result::from_raw(rep.code).unwrap_or(wm_result::WM_ERR_PEER);
                        return Err(Error::new(code, rep.message));
                    }
                }
                if now_state == done {
                    return Ok(RequestOutcome::Done);
                }
                return Err(Error::peer(format!("the engine returned the cell to CLEARED without a report: the {verb} did not happen")));
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "the engine did not finish the {verb} within {timeout:?} (control cell {} holds {now_state})",
                    self.cell.name()
                )));
            }
            std::thread::sleep(POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_answers_without_an_engine() {
        let name = format!("wm_test_ctl_{}", std::process::id());
        let c = Controller::open(&name).unwrap();
        let short = Duration::from_millis(20);
        assert_eq!(
            c.request(State::Updating, short).unwrap(),
            RequestOutcome::AlreadyDone
        );
        c.set(State::Updating).unwrap();
        assert_eq!(
            c.request(State::Updating, short).unwrap(),
            RequestOutcome::Busy
        );
        assert_eq!(
            c.request(State::Clearing, short).unwrap(),
            RequestOutcome::Refused
        );
        c.set(State::Cleared).unwrap();
        assert_eq!(
            c.request(State::Clearing, short).unwrap(),
            RequestOutcome::AlreadyDone
        );
        // Nobody serves the request: bounded wait, and the word says UPDATING.
        let e = c.request(State::Updating, short).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT);
        assert_eq!(c.get().unwrap(), State::Updating);
        assert!(c.set(State::Failed).is_err());
        super::super::shm::unlink(&name).unwrap();
    }
}
