//! `wm signal`: the controller's side on the command line.
//!
//! - `wm signal get <cell>`: print the control word.
//! - `wm signal set <cell> <STATE>`: store a value (NORMAL, UPDATING, CLEARING, CLEARED).
//! - `wm signal wait <cell> <STATE> [--timeout S]`: wait until the word holds it.
//! - `wm signal request <cell> update|clear [--timeout S]`: the controller's
//!   request (the word moved from the state just read, then waited on),
//!   printing how it ended.

use std::time::Duration;
use weight_manager_core::Controller;
use weight_manager_core::State;

/// `wm signal` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    verb: Verb,
    /// Seconds to wait (wait, request)
    #[arg(long, global = true, default_value_t = 60.0, value_name = "SECONDS", value_parser = crate::seconds)]
    timeout: f64,
}

#[derive(clap::Subcommand, Debug)]
enum Verb {
    /// Print the control word
    Get {
        /// The control cell's name in /dev/shm (the engines' `control_cell`)
        #[arg(value_name = "CELL")]
        cell: String,
    },
    /// Store a state: NORMAL, UPDATING, CLEARING or CLEARED
    Set {
        /// The control cell's name in /dev/shm (the engines' `control_cell`)
        #[arg(value_name = "CELL")]
        cell: String,
        #[arg(value_name = "STATE")]
        state: String,
    },
    /// Wait until the word holds a state
    Wait {
        /// The control cell's name in /dev/shm (the engines' `control_cell`)
        #[arg(value_name = "CELL")]
        cell: String,
        #[arg(value_name = "STATE")]
        state: String,
    },
    /// Ask the engines for an update (from CLEARED: UPDATING, then wait
    /// for NORMAL) or a clear (from NORMAL: CLEARING, then wait for
    /// CLEARED), and print how it ended: Done, AlreadyDone (nothing to
    /// do), Busy (the same already runs) or Refused (the other one runs);
    /// a failed engine's report is the error
    Request {
        /// The control cell's name in /dev/shm (the engines' `control_cell`)
        #[arg(value_name = "CELL")]
        cell: String,
        #[arg(value_name = "update|clear")]
        action: String,
    },
}

fn parse_state(s: &str) -> Result<State, String> {
    match s.to_ascii_uppercase().as_str() {
        "NORMAL" => Ok(State::Normal),
        "UPDATING" => Ok(State::Updating),
        "CLEARING" => Ok(State::Clearing),
        "CLEARED" => Ok(State::Cleared),
        _ => Err(format!(
            "'{s}' is not NORMAL, UPDATING, CLEARING or CLEARED"
        )),
    }
}

pub fn run(a: &Args) -> Result<(), String> {
    let cell = match &a.verb {
        Verb::Get { cell } | Verb::Set { cell, .. } => cell,
        Verb::Wait { cell, .. } | Verb::Request { cell, .. } => cell,
    };
    let c = Controller::open(cell).map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs_f64(a.timeout);
    match &a.verb {
        Verb::Get { .. } => println!("{}", c.get().map_err(|e| e.to_string())?),
        Verb::Set { state, .. } => c.set(parse_state(state)?).map_err(|e| e.to_string())?,
        Verb::Wait { state, .. } => c
            .wait_for(parse_state(state)?, timeout)
            .map_err(|e| e.to_string())?,
        Verb::Request { action: what, .. } => {
            let action = match what.as_str() {
                "update" => State::Updating,
                "clear" => State::Clearing,
                _ => return Err(format!("'{what}' is not update or clear")),
            };
            let outcome = c.request(action, timeout).map_err(|e| e.to_string())?;
            println!("{what}: {outcome:?}");
        }
    }
    Ok(())
}
