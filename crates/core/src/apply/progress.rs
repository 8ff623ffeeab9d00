//! Progress of an update: what each entry received so far (so a source
//! can never make the applier write a byte twice or past a tensor), which
//! callback tensors were handed out, the counts the progress hook sees
//! after every batch, and the update's clock.

use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use std::time::{Duration, Instant};

/// Progress of an update, reported after every batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: u64,
    pub tensors_total: u64,
}

/// The applier's counters and clock.
pub(super) struct Tally {
    /// Per plan entry: the bytes received, from its first on.
    received: Vec<u64>,
    /// Per plan entry: handed to the per-tensor callback.
    delivered: Vec<bool>,
    pub now: Progress,
    pub started: Instant,
    /// A staged update: how long receiving took, taken when it was
    /// staged (the wait for the commit is not receiving).
    pub received_in: Option<Duration>,
    pub deadline: Instant,
    timeout: Duration,
}

impl Tally {
    /// `timeout` counts from `begun` (the update's start).
    pub fn new(plan: &Plan, begun: Instant, timeout: Duration) -> Tally {
        let started = Instant::now();
        Tally {
            received: vec![0; plan.entries.len()],
            delivered: vec![false; plan.entries.len()],
            now: Progress {
                bytes_total: plan.bytes,
                tensors_total: plan.tensors as u64,
                ..Default::default()
            },
            started,
            received_in: None,
            deadline: begun + timeout,
            timeout,
        }
    }

    /// Fail with a timeout if the update's deadline has passed.
    pub fn check_deadline(&self) -> Result<()> {
        if Instant::now() > self.deadline {
            return Err(Error::timeout(format!(
                "update did not finish within {:?} ({} of {} bytes received)",
                self.timeout, self.now.bytes_done, self.now.bytes_total
            )));
        }
        Ok(())
    }

    /// Bytes `[offset, offset + len)` of entry `t` (`n` bytes, named
    /// `name`) arrive: they must follow on from what it received and fit
    /// it. Returns where they end.
    pub fn accept(
        &mut self,
        origin: &str,
        (t, name, n): (usize, &str, u64),
        offset: u64,
        len: usize,
    ) -> Result<u64> {
        if offset != self.received[t] {
            return Err(Error::format(format!(
                "{origin}: chunk of tensor '{name}' starts at byte {offset} but byte {} was expected next",
                self.received[t]
            )));
        }
        let end = offset
            .checked_add(len as u64)
            .filter(|e| *e <= n)
            .ok_or_else(|| {
                Error::format(format!(
                    "{origin}: chunk of tensor '{name}' covers {len} bytes from byte {offset}, past its {n} bytes"
                ))
            })?;
        self.received[t] = end;
        Ok(end)
    }

    /// Entry `t` was handed to the callback.
    pub fn delivered(&mut self, t: usize) {
        self.delivered[t] = true;
    }

    pub fn was_delivered(&self, t: usize) -> bool {
        self.delivered[t]
    }

    /// Every planned tensor arrived whole.
    pub fn check_complete(&self, plan: &Plan) -> Result<()> {
        self.check_complete_from(plan, None)
    }

    /// Every planned tensor of source `from` (every source: None) arrived
    /// whole; the error names it (`(index, name)`) when given.
    pub fn check_complete_from(&self, plan: &Plan, from: Option<(usize, &str)>) -> Result<()> {
        let incomplete: Vec<String> = plan
            .entries
            .iter()
            .zip(&self.received)
            .filter(|(e, _)| from.is_none_or(|(i, _)| e.source == i))
            .filter(|(e, r)| e.target != Target::Skip && **r < e.bytes)
            .map(|(e, r)| format!("'{}' ({r} of {} bytes)", e.meta.name, e.bytes))
            .collect();
        if incomplete.is_empty() {
            return Ok(());
        }
        let who = from.map_or("the source".to_string(), |(_, name)| name.to_string());
        Err(Error::format(format!(
            "{who} ended before {} tensor(s) were complete: {}",
            incomplete.len(),
            incomplete
                .into_iter()
                .take(5)
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    /// Tell the progress hook where the update stands; it may cancel it.
    pub fn report(&self, hook: Option<&mut (dyn FnMut(&Progress) -> bool + '_)>) -> Result<()> {
        let Some(progress) = hook else {
            return Ok(());
        };
        if progress(&self.now) {
            return Ok(());
        }
        Err(Error::cancelled(format!(
            "update cancelled after {} of {} bytes (the progress callback said stop, or the engine \
             stopped it: a destroy, or a clear of the version it staged)",
            self.now.bytes_done, self.now.bytes_total
        )))
    }
}
