//! The controller's side of the control protocol: ask the engine for an update or a clear
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
//! with an error carrying the report's reason. If rank 0 itself died, the
//! controller finds that when its wait times out (the report names rank 0's
//! pid), moves the word to CLEARED and writes the report itself.

use super::cell::ControlCell;
use super::report::{self, Engine, ReportCell};
use super::shm;
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
/// How often a waiting request checks that the engine's rank 0 still runs.
const LIVENESS: Duration = Duration::from_millis(50);

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
        self.cell.store(state as i32)
    }

    /// Wait until the word holds `target`.
    pub fn wait_for(&self, target: State, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.get()? == target {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let held = self.cell.load()?;
                let held = State::from_raw(held).map_or(held.to_string(), |s| s.to_string());
                return Err(Error::timeout(format!(
                    "control cell {} did not reach {target} within {timeout:?} (it holds {held})",
                    self.cell.name(),
                )));
            }
            std::thread::sleep(POLL);
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
        // Held from here: an engine that fails and exits at once removes the
        // report's name, but this mapping still shows its last report. A
        // torn sequence counts as it is (the next report is newer anyway).
        let held = ReportCell::open_existing(self.cell.name())?;
        let seq_before = held.as_ref().map_or(Ok(0), ReportCell::seq)?;
        if self
            .cell
            .compare_exchange(from as i32, action as i32)?
            .is_err()
        {
            return Ok(RequestOutcome::Busy);
        }
        let deadline = Instant::now() + timeout;
        let mut next_liveness = Instant::now() + LIVENESS;
        loop {
            let now_state = self.get()?;
            let finished =
                now_state == done || (action == State::Updating && now_state == State::Cleared);
            if finished {
                return self.answer(now_state == done, held, seq_before, verb);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(action, verb, timeout, now_state));
            }
            if now >= next_liveness {
                next_liveness = now + LIVENESS;
                if let Some(e) = self.engine_gone(action, verb) {
                    return Err(e);
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// The engine moved the word: the report says whether it failed.
    fn answer(
        &self,
        reached: bool,
        held: Option<ReportCell>,
        seq_before: u64,
        verb: &str,
    ) -> Result<RequestOutcome> {
        let current = ReportCell::open_existing(self.cell.name())?;
        if let Some(r) = current.or(held) {
            let rep = r.read()?;
            if rep.seq > seq_before && rep.code != 0 {
                let code = wm_result::from_raw(rep.code).unwrap_or(wm_result::WM_ERR_PEER);
                return Err(Error::new(code, rep.message));
            }
        }
        if reached {
            return Ok(RequestOutcome::Done);
        }
        Err(Error::peer(format!(
            "the engine returned the cell to CLEARED without a report: the {verb} did not happen"
        )))
    }

    /// No answer in time: say what is known about the engine.
    fn timed_out(&self, action: State, verb: &str, timeout: Duration, now: State) -> Error {
        if let Some(e) = self.engine_gone(action, verb) {
            return e;
        }
        let name = self.cell.name();
        let waited = format!(
            "the engine did not finish the {verb} within {timeout:?} (control cell {name} holds {now})"
        );
        match ReportCell::open_existing(name) {
            Ok(Some(r)) => match r.read() {
                Ok(_) => Error::timeout(waited),
                Err(e) => Error::timeout(format!("{waited}; {}", e.message)),
            },
            Ok(None) => Error::timeout(format!(
                "{waited}; no engine has a report /dev/shm/{}, so none may be serving this cell",
                report::report_name(name)
            )),
            Err(e) => Error::timeout(format!("{waited}; {}", e.message)),
        }
    }

    /// If the engine's rank 0 (the report's creator) is known gone, nobody
    /// will ever answer: move the word from the request to CLEARED (by
    /// compare-and-swap), write a report saying so (with the engine's last
    /// failure, which names the rank that died) and return that error.
    fn engine_gone(&self, action: State, verb: &str) -> Option<Error> {
        let name = self.cell.name();
        let report = ReportCell::open_existing(name).ok().flatten()?;
        let engine = report.engine().ok()?;
        if !engine_dead(engine) {
            return None;
        }
        let (rank, last) = match report.read() {
            Ok(r) if r.code != 0 => (r.rank, format!("; its last report: {}", r.message)),
            Ok(_) => (0, String::new()),
            Err(e) => (0, format!("; {}", e.message)),
        };
        let msg = format!(
            "{verb} failed: rank 0 (pid {}) of the engine serving control cell {name} is gone (exited or died){last}; the controller moved the cell to CLEARED",
            engine.pid
        );
        let moved = self
            .cell
            .compare_exchange(action as i32, State::Cleared as i32);
        if matches!(moved, Ok(Ok(()))) {
            let _ = report.write(wm_result::WM_ERR_PEER as u32, rank, action as i32, "", &msg);
        }
        Some(Error::peer(msg))
    }
}

/// Whether the engine's rank 0 is known dead. Only a process in our own pid
/// namespace can be checked; anything else counts as alive.
fn engine_dead(e: Engine) -> bool {
    e.pid != 0 && e.pid_ns != 0 && e.pid_ns == report::own_pid_ns() && !shm::pid_alive(e.pid)
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
        // A wait that times out names the state the word holds.
        let e = c.wait_for(State::Normal, short).unwrap_err();
        assert!(e.message.ends_with("(it holds UPDATING)"), "{e}");
        assert!(c.set(State::Failed).is_err());
        super::super::shm::unlink(&name).unwrap();
    }
}
