//! PyTorch beside the library in the benchmarks, in the same conditions:
//! a Python process kept running (started once, its data loaded once) that
//! times one job per command line, and runs alternating with ours (the
//! order flipping every pair, [`super::alternate`]), reported as the median
//! of the per-pair ratios. One mechanism for every bench that has a
//! PyTorch peer.

use super::process::Proc;
use std::process::Command;
use std::time::Duration;

pub struct TorchPeer(Proc);

impl TorchPeer {
    /// Start `script` (Python source) with `args`; it prints `ready` once
    /// set up, then one time in seconds per command line it reads.
    pub fn start(script: &str, args: &[String]) -> Result<TorchPeer, String> {
        let py = super::python();
        // Found first, quietly: a Python without them would print its
        // import traceback before the bench's one line saying so.
        let find = "import importlib.util as u, sys; \
                    sys.exit(0 if u.find_spec('torch') and u.find_spec('numpy') else 1)";
        let found = Command::new(&py)
            .args(["-c", find])
            .stderr(std::process::Stdio::null())
            .status();
        if !found.is_ok_and(|s| s.success()) {
            return Err(format!("{py} has no torch and numpy (set WM_PYTHON)"));
        }
        let mut c = Command::new(&py);
        c.args(["-c", script]).args(args);
        let mut p = Proc::spawn(c).map_err(|e| format!("{e} (set WM_PYTHON)"))?;
        match p.next_line() {
            Some(l) if l == "ready" => Ok(TorchPeer(p)),
            _ => Err(format!("{py} has no torch and numpy")),
        }
    }

    /// Close its stdin (the script ends its loop and stops what it
    /// started) and wait for it to exit.
    pub fn finish(self) -> Result<(), String> {
        self.0.finish().map(|_| ())
    }

    /// Time one job: `command` is the line the script reads.
    pub fn run(&mut self, command: &str) -> Result<Duration, String> {
        self.0.say(command)?;
        let line = self.0.next_line().unwrap_or_default();
        let secs: f64 = line
            .trim()
            .parse()
            .map_err(|_| format!("PyTorch printed no time for '{command}'"))?;
        Ok(Duration::from_secs_f64(secs))
    }
}
