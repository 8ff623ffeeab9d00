//! PyTorch beside the library in the benchmarks, in the same conditions:
//! a Python process kept running (started once, its data loaded once) that
//! times one job per command line, and runs alternating with ours (the
//! order flipping every pair), reported as the median of the per-pair
//! ratios. One mechanism for every bench that has a PyTorch peer.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

pub(crate) struct TorchPeer {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl TorchPeer {
    /// Start `script` (Python source) with `args`; it prints `ready` once
    /// set up, then one time in seconds per command line it reads.
    pub(crate) fn start(script: &str, args: &[String]) -> Result<TorchPeer, String> {
        let py = crate::bench_atomic::python();
        let mut child = Command::new(&py)
            .args(["-c", script])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running {py}: {e} (set WM_PYTHON)"))?;
        let stdin = child.stdin.take().expect("piped");
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        match lines.next() {
            Some(Ok(l)) if l == "ready" => Ok(TorchPeer {
                child,
                stdin,
                lines,
            }),
            _ => Err(format!("{py} has no torch and numpy")),
        }
    }

    /// Time one job: `command` is the line the script reads.
    pub(crate) fn run(&mut self, command: &str) -> Result<Duration, String> {
        writeln!(self.stdin, "{command}").map_err(|e| e.to_string())?;
        let line = self.lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let secs: f64 = line
            .trim()
            .parse()
            .map_err(|_| format!("PyTorch printed no time for '{command}'"))?;
        Ok(Duration::from_secs_f64(secs))
    }
}

impl Drop for TorchPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ours and theirs `pairs` times, the order flipping each pair: the
/// median of theirs / ours (above 1: ours is faster) and each side's best.
pub(crate) fn alternate(
    pairs: usize,
    mut ours: impl FnMut() -> Result<Duration, String>,
    mut theirs: impl FnMut() -> Result<Duration, String>,
) -> Result<(f64, Duration, Duration), String> {
    let (mut ratios, mut best_o, mut best_t) = (Vec::new(), Duration::MAX, Duration::MAX);
    for k in 0..pairs.max(1) {
        let (o, t) = match k % 2 {
            0 => (ours()?, theirs()?),
            _ => {
                let t = theirs()?;
                (ours()?, t)
            }
        };
        ratios.push(t.as_secs_f64() / o.as_secs_f64());
        (best_o, best_t) = (best_o.min(o), best_t.min(t));
    }
    Ok((median(ratios), best_o, best_t))
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
