//! A clear: release weight memory; the next update brings it back.

use super::{ClearStats, Manager};
use crate::result::Result;
use crate::state::State;

impl Manager {
    /// Release weight memory; the next update brings it back.
    pub fn clear(&self) -> Result<ClearStats> {
        // A staged version is dropped: a cleared engine holds no weights.
        // Refused because another call runs: this call finishes nothing
        // the signal asked for (the running one does).
        let op = (self.abort_staged("a clear"))
            .and_then(|()| self.op.try_lock().ok_or_else(|| self.busy()));
        let r = match op {
            Ok(op) => self.try_clear(op),
            Err(busy) => return self.refused(State::Clearing, busy),
        };
        let r = self.finish_action(State::Clearing, r, |_| String::new());
        self.recorded(r)
    }

    /// The clear, holding the manager's `_op`.
    fn try_clear(&self, _op: parking_lot::MutexGuard<'_, ()>) -> Result<ClearStats> {
        let _running = self.running_as(State::Clearing);
        {
            let mut rec = self.record.lock();
            rec.registration_open = false;
            if rec.state == State::Cleared {
                return Ok(ClearStats::default());
            }
            rec.state = State::Clearing;
        }
        self.kept.release();
        let mut registry = self.registry.write();
        let result = self.release(&mut registry);
        let mut rec = self.record.lock();
        rec.state = if result.is_ok() {
            State::Cleared
        } else {
            State::Failed
        };
        rec.version = None;
        rec.resident_bytes = registry.resident_bytes();
        if let Ok(stats) = &result {
            rec.device_bytes_freed = stats.device_bytes_freed;
        }
        result
    }
}
