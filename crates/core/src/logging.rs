//! Per-manager logging: messages go to the engine's callback when it gave
//! one, else to stderr. There is no global logger on purpose: two managers in
//! one process (tests, a trainer and an engine) each keep their own sink.

use std::ffi::{c_char, c_void, CString};

/// Log levels; numbers are part of the ABI (`wm_config.log_level`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

impl LogLevel {
    pub fn from_raw(raw: u32) -> Option<LogLevel> {
        [
            LogLevel::Off,
            LogLevel::Error,
            LogLevel::Warn,
            LogLevel::Info,
            LogLevel::Debug,
        ]
        .get(raw as usize)
        .copied()
    }
}

/// C log sink: `(user_data, level, NUL-terminated message)`. Called from any
/// thread of the library; the message is valid only during the call.
pub type LogCallback = Option<unsafe extern "C" fn(*mut c_void, u32, *const c_char)>;

/// Where a manager's messages go.
#[derive(Clone)]
pub struct Logger {
    level: LogLevel,
    sink: Sink,
}

/// A Rust log sink.
type RustSink = std::sync::Arc<dyn Fn(LogLevel, &str) + Send + Sync>;

#[derive(Clone)]
enum Sink {
    Stderr,
    C {
        callback: unsafe extern "C" fn(*mut c_void, u32, *const c_char),
        user_data: usize,
    },
    Rust(RustSink),
}

impl Logger {
    pub fn stderr(level: LogLevel) -> Logger {
        Logger {
            level,
            sink: Sink::Stderr,
        }
    }

    /// A logger calling a C callback. The engine promised in `wm_config` that
    /// `user_data` stays valid and the callback is thread-safe.
    pub fn c_callback(level: LogLevel, callback: LogCallback, user_data: *mut c_void) -> Logger {
        match callback {
            Some(callback) => Logger {
                level,
                sink: Sink::C {
                    callback,
                    user_data: user_data as usize,
                },
            },
            None => Logger::stderr(level),
        }
    }

    /// A logger calling a Rust closure (tests, the `wm` tool).
    pub fn closure(level: LogLevel, f: impl Fn(LogLevel, &str) + Send + Sync + 'static) -> Logger {
        Logger {
            level,
            sink: Sink::Rust(std::sync::Arc::new(f)),
        }
    }

    pub fn enabled(&self, level: LogLevel) -> bool {
        level != LogLevel::Off && level <= self.level
    }

    pub fn log(&self, level: LogLevel, message: &str) {
        if !self.enabled(level) {
            return;
        }
        match &self.sink {
            Sink::Stderr => eprintln!("weight_manager {level:?}: {message}"),
            Sink::C {
                callback,
                user_data,
            } => {
                let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
                // SAFETY: the engine registered this callback and user data in
                // wm_config and promised both stay valid for the manager's life.
                unsafe { callback(*user_data as *mut c_void, level as u32, text.as_ptr()) };
            }
            Sink::Rust(f) => f(level, message),
        }
    }

    pub fn warn(&self, message: &str) {
        self.log(LogLevel::Warn, message)
    }

    pub fn info(&self, message: &str) {
        self.log(LogLevel::Info, message)
    }

    pub fn debug(&self, message: &str) {
        self.log(LogLevel::Debug, message)
    }
}

impl Default for Logger {
    fn default() -> Logger {
        Logger::stderr(LogLevel::Warn)
    }
}
