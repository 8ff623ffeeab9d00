//! A control cell: one little-endian int32 in a POSIX shared-memory object,
//! laid out exactly like FastDeploy's `model_weights_status.<suffix>`
//! so an existing controller drives it unchanged: name the cell
//! `model_weights_status.<port>` and the library reads and writes that very
//! object.
//!
//! The object is opened if it exists and created zeroed (NORMAL) with mode
//! 0600 otherwise. Writes are compare-and-swap from an expected value: nobody
//! writes back a value read earlier.

use super::shm::{self, OpenMode, SharedMapping};
use crate::result::{Error, Result};
use crate::state::State;
use std::sync::atomic::{AtomicI32, Ordering};

pub struct ControlCell {
    name: String,
    map: SharedMapping,
}

pub use super::shm::check_name;

impl ControlCell {
    pub fn open_or_create(name: &str) -> Result<ControlCell> {
        let map = SharedMapping::open(name, 4, OpenMode::OpenOrCreate)?.expect("created");
        Ok(ControlCell {
            name: name.to_string(),
            map,
        })
    }

    fn word(&self) -> &AtomicI32 {
        // SAFETY: the mapping is at least 4 bytes, page aligned, alive as long as self.
        unsafe { &*(self.map.ptr() as *const AtomicI32) }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the object is still whole: checked after every access (a
    /// process-local flag, no syscall; see [`super::sigbus`]).
    fn check(&self) -> Result<()> {
        self.map
            .check(|| format!("control cell /dev/shm/{}", self.name))
    }

    /// The raw word. The Acquire load keeps the check after it.
    pub fn load(&self) -> Result<i32> {
        let raw = self.word().load(Ordering::Acquire);
        self.check()?;
        Ok(raw)
    }

    /// The cell's value as a state; anything but NORMAL, UPDATING, CLEARING
    /// and CLEARED is an error.
    pub fn read_state(&self) -> Result<State> {
        let raw = self.load()?;
        State::from_raw(raw).filter(|s| s.is_signal()).ok_or_else(|| {
            Error::format(format!(
                "control cell /dev/shm/{} holds {raw}, which is not NORMAL(0), UPDATING(1), CLEARING(-1) or CLEARED(-2)",
                self.name
            ))
        })
    }

    /// Set the cell from `expected` to `new`; the inner `Err` is the value
    /// found when it was not `expected`.
    pub fn compare_exchange(
        &self,
        expected: i32,
        new: i32,
    ) -> Result<std::result::Result<(), i32>> {
        let r = self
            .word()
            .compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ());
        self.check()?;
        Ok(r)
    }

    /// Unconditional store, for tools and tests that set a value by hand.
    pub fn store(&self, value: i32) -> Result<()> {
        self.word().store(value, Ordering::SeqCst);
        self.check()
    }

    /// Remove the shared-memory object's name (mappings stay valid).
    pub fn unlink(name: &str) -> Result<()> {
        shm::unlink(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_round_trip_and_bad_values() {
        let name = format!("wm_test_cell_{}", std::process::id());
        let a = ControlCell::open_or_create(&name).unwrap();
        let b = ControlCell::open_or_create(&name).unwrap();
        assert_eq!(a.read_state().unwrap(), State::Normal);
        a.compare_exchange(0, 1).unwrap().unwrap();
        assert_eq!(b.read_state().unwrap(), State::Updating);
        assert_eq!(b.compare_exchange(0, -1).unwrap(), Err(1));
        b.compare_exchange(1, 7).unwrap().unwrap();
        assert!(a.read_state().unwrap_err().message.contains("holds 7"));
        ControlCell::unlink(&name).unwrap();
        assert!(check_name("a/b").is_err());
    }
}
