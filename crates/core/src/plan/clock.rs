//! The update's deadline, as planning sees it: planning a hostile or huge
//! layout must stop at the deadline like every other wait, not finish late.
//! Checked every [`EVERY`] steps (a shard, a tensor, a piece), so the check
//! costs nothing measurable.

use std::time::Instant;

const EVERY: u32 = 4096;

#[derive(Debug, Default)]
pub(super) struct Clock {
    deadline: Option<Instant>,
    ticks: u32,
    expired: bool,
}

impl Clock {
    pub fn until(deadline: Option<Instant>) -> Clock {
        Clock {
            deadline,
            ..Clock::default()
        }
    }

    /// One step done; false once the deadline has passed.
    pub fn tick(&mut self) -> bool {
        self.ticks = self.ticks.wrapping_add(1);
        if !self.expired && self.ticks.is_multiple_of(EVERY) {
            self.expired = self.deadline.is_some_and(|d| Instant::now() >= d);
        }
        !self.expired
    }

    pub fn expired(&self) -> bool {
        self.expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passed_deadline_is_seen_within_one_period() {
        let mut c = Clock::until(Some(Instant::now()));
        let n = (0..2 * EVERY).take_while(|_| c.tick()).count();
        assert_eq!(n as u32, EVERY - 1);
        assert!(c.expired());
        let mut never = Clock::until(None);
        assert!((0..3 * EVERY).all(|_| never.tick()));
    }
}
