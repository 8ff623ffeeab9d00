//! `wm signal`: the controller's side on the command line.
//!
//! - `wm signal get <cell>`: print the control word.
//! - `wm signal set <cell> <STATE>`: store a value (NORMAL, UPDATING, CLEARING, CLEARED).
//! - `wm signal wait <cell> <STATE> [--timeout S]`: wait until the word holds it.
//! - `wm signal request <cell> update|clear [--timeout S]`: the controller's
//!   request, answered as `signal::controller` describes.

use crate::Args;
use std::time::Duration;
use weight_manager_core::signal::controller::Controller;
use weight_manager_core::state::State;

const USAGE: &str =
    "usage: wm signal get|set|wait|request <cell> [STATE|update|clear] [--timeout SECONDS]";

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
    let [_, verb, cell, rest @ ..] = a.positional.as_slice() else {
        return Err(USAGE.into());
    };
    let c = Controller::open(cell).map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs_f64(a.number("timeout", 60.0)?);
    match (verb.as_str(), rest) {
        ("get", []) => println!("{}", c.get().map_err(|e| e.to_string())?),
        ("set", [s]) => c.set(parse_state(s)?).map_err(|e| e.to_string())?,
        ("wait", [s]) => c
            .wait_for(parse_state(s)?, timeout)
            .map_err(|e| e.to_string())?,
        ("request", [what]) => {
            let action = match what.as_str() {
                "update" => State::Updating,
                "clear" => State::Clearing,
                _ => return Err(USAGE.into()),
            };
            let outcome = c.request(action, timeout).map_err(|e| e.to_string())?;
            println!("{what}: {outcome:?}");
        }
        _ => return Err(USAGE.into()),
    }
    Ok(())
}
