//! The manager's states. The first four are the control word's values
//! (FastDeploy's: NORMAL 0, UPDATING 1, CLEARING -1, CLEARED -2); FAILED
//! and COMMIT are the library's own and never appear in a control word.

#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// Serving with complete weights (or, before the first update, whatever
    /// the engine loaded itself).
    Normal = 0,
    /// An update is running.
    Updating = 1,
    /// A clear is running.
    Clearing = -1,
    /// Weight memory released; the next update brings it back.
    Cleared = -2,
    /// An in-place update failed after bytes moved: params are half-written.
    /// Only a later successful update returns to NORMAL.
    Failed = -3,
    /// A signal only (`broadcast_signal`), never a state: every rank staged
    /// the same version (two-phase updates); commit it now, before the
    /// next step.
    Commit = 2,
}

impl State {
    pub fn from_raw(raw: i32) -> Option<State> {
        match raw {
            0 => Some(State::Normal),
            1 => Some(State::Updating),
            -1 => Some(State::Clearing),
            -2 => Some(State::Cleared),
            -3 => Some(State::Failed),
            2 => Some(State::Commit),
            _ => None,
        }
    }

    /// True for the four values a control word may hold.
    pub fn is_signal(self) -> bool {
        !matches!(self, State::Failed | State::Commit)
    }

    /// The state's name as a C string ("NORMAL").
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            State::Normal => c"NORMAL",
            State::Updating => c"UPDATING",
            State::Clearing => c"CLEARING",
            State::Cleared => c"CLEARED",
            State::Failed => c"FAILED",
            State::Commit => c"COMMIT",
        }
    }

    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("?")
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
