//! A benchmark's child process: this program run again as a trainer or a
//! rank (`wm bench <kind>-publisher ...`), or a Python peer; told lines on
//! its stdin, read line by line from its stdout. Killed if dropped before
//! [`Proc::finish`].

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

pub struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    finished: bool,
}

impl Proc {
    /// Start `wm <args>`.
    pub fn wm<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Result<Proc, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut c = Command::new(exe);
        c.args(args);
        Proc::spawn(c)
    }

    /// Start `c` with its stdin and stdout piped.
    pub fn spawn(mut c: Command) -> Result<Proc, String> {
        let what = c.get_program().to_string_lossy().into_owned();
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running {what}: {e}"))?;
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let stdin = child.stdin.take();
        Ok(Proc {
            child,
            stdin,
            lines,
            finished: false,
        })
    }

    /// Tell it one line.
    pub fn say(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}").map_err(|e| format!("a child process is gone: {e}"))
    }

    /// Its next line, if it said one.
    pub fn next_line(&mut self) -> Option<String> {
        self.lines.next().and_then(|l| l.ok())
    }

    /// The rest of the first line from now on that starts with `word`.
    pub fn line_after(&mut self, word: &str) -> Result<String, String> {
        for line in self.lines.by_ref().map_while(|l| l.ok()) {
            if let Some(rest) = line.strip_prefix(word) {
                return Ok(rest.to_string());
            }
        }
        Err(format!("a child process ended before saying '{word}'"))
    }

    /// The numbers on the first line from now on that starts with `word`.
    pub fn numbers_after(&mut self, word: &str) -> Result<Vec<u64>, String> {
        Ok(numbers(&self.line_after(word)?))
    }

    /// Close its stdin, read the rest of what it says, and wait for it to
    /// exit; the numbers of each `session <numbers>` line it said.
    pub fn finish(mut self) -> Result<Vec<Vec<u64>>, String> {
        drop(self.stdin.take());
        let sessions = self
            .lines
            .by_ref()
            .map_while(|l| l.ok())
            .filter_map(|l| l.strip_prefix("session ").map(numbers))
            .collect();
        let status = self.child.wait().map_err(|e| e.to_string())?;
        self.finished = true;
        match status.success() {
            true => Ok(sessions),
            false => Err(format!("a child process failed ({status})")),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The whole numbers in `line`.
fn numbers(line: &str) -> Vec<u64> {
    line.split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}
