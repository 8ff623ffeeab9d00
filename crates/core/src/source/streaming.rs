//! Driving the sources of one update together: each is started (asked for
//! its bytes), then stepped in turn until all are done, so bytes from
//! every source flow at once and a slow source holds up only its own.
//! The first failure ends the update: every other source is told why, and
//! the error names the source it came from.

use super::{Source, Step};
use crate::apply::Applier;
use crate::plan::Plan;
use crate::result::{Error, Result};
use std::time::Duration;

/// How long one source alone may block in a step: long enough not to spin,
/// short enough that the deadline and cancellation are seen promptly.
const ALONE: Duration = Duration::from_millis(50);
/// How long a source may block when others may have bytes waiting.
const SHARED: Duration = Duration::from_millis(1);

/// Stream every planned byte of `sources` (source `i` is plan source `i`)
/// through `applier`. On failure every source is told why, and with
/// several sources the error names the one it came from.
pub fn stream_all(
    sources: &mut [Box<dyn Source>],
    plan: &Plan,
    applier: &mut Applier,
) -> Result<()> {
    let r = drive(sources, plan, applier);
    if let Err(e) = &r {
        for s in sources.iter_mut() {
            s.abort(e);
        }
    }
    r
}

/// Start, then step, every source until all are done.
fn drive(sources: &mut [Box<dyn Source>], plan: &Plan, applier: &mut Applier) -> Result<()> {
    let single = sources.len() == 1;
    // A single source's errors already name it, and read as they always did.
    let named = |i: usize, s: &dyn Source, e: Error| match single {
        true => e,
        false => e.context(format!("source {i} ({})", s.describe())),
    };
    for (i, s) in sources.iter_mut().enumerate() {
        s.start(plan, i, applier).map_err(|e| named(i, &**s, e))?;
    }
    // Every WANT is out before any AMAX is waited for, and every SCALES
    // before any DELTAS: the publishers read and quantize at once.
    for (i, s) in sources.iter_mut().enumerate() {
        s.collect(applier).map_err(|e| named(i, &**s, e))?;
    }
    for (i, s) in sources.iter_mut().enumerate() {
        s.answer(applier).map_err(|e| named(i, &**s, e))?;
    }
    for (i, s) in sources.iter_mut().enumerate() {
        (s.start_streaming(plan, i, applier)).map_err(|e| named(i, &**s, e))?;
    }
    let mut done = vec![false; sources.len()];
    let wait = if single { ALONE } else { SHARED };
    while done.iter().any(|d| !d) {
        applier
            .check_deadline()
            .map_err(|e| owed_by(e, sources, &done))?;
        for (i, s) in sources.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match s.step(plan, i, applier, wait) {
                Ok(Step::Done) => done[i] = true,
                Ok(Step::Moved | Step::Waiting) => {}
                Err(e) => return Err(named(i, &**s, e)),
            }
        }
    }
    Ok(())
}

/// The update's deadline `e`, naming the sources that still owe bytes (a
/// stop, also reported by the deadline check, is the caller's: as it is).
fn owed_by(e: Error, sources: &[Box<dyn Source>], done: &[bool]) -> Error {
    if e.code != crate::result::wm_result::WM_ERR_TIMEOUT {
        return e;
    }
    let owing: Vec<String> = (sources.iter().zip(done))
        .filter(|(_, &d)| !d)
        .map(|(s, _)| s.describe())
        .collect();
    e.context(format!("waiting for {}", owing.join(", ")))
}
