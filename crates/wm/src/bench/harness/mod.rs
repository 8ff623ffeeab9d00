//! What every benchmark shares: timing (best of runs, median, runs
//! alternating with a peer or between floor runs), verdicts, the host
//! floors and their loops ([`floors`]), scratch folders, the Python to
//! compare with, and child processes ([`process`], [`torch`]).

pub mod floors;
pub mod process;
pub mod torch;

use crate::leftovers::Listed;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Runs per figure where a bench does not say otherwise (the best is kept).
pub const RUNS: usize = 3;

/// The fastest of [`RUNS`] timings.
pub fn best(f: impl FnMut() -> Result<Duration, String>) -> Result<Duration, String> {
    best_of(RUNS, f)
}

/// The fastest of `runs` timings (at least one).
pub fn best_of(
    runs: usize,
    mut f: impl FnMut() -> Result<Duration, String>,
) -> Result<Duration, String> {
    let mut best = Duration::MAX;
    for _ in 0..runs.max(1) {
        best = best.min(f()?);
    }
    Ok(best)
}

/// The fastest of `runs` timings of `f` (at least one).
pub fn best_timed(
    runs: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<Duration, String> {
    best_of(runs, || {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed())
    })
}

/// The middle value; of an even count, the mean of the two middle ones
/// (the upper one alone would lean our way: every ratio here is higher
/// when the library is faster).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// PASS when a figure meets its target, else MISS.
pub fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

/// GB/s of passes done one after the other at these GB/s each: each
/// costs its time per byte.
pub fn per_byte(passes: &[f64]) -> f64 {
    1.0 / passes.iter().map(|g| 1.0 / g).sum::<f64>()
}

/// Ours and theirs `pairs` times, the order flipping each pair: the
/// median of theirs / ours (above 1: ours is faster) and each side's best.
pub fn alternate(
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

/// One run between two floor runs: what it gave, and the floors just
/// before and just after it.
pub struct Around<T, F> {
    pub run: T,
    pub before: F,
    pub after: F,
}

/// `runs` runs, each between two floor runs (the floor after one run is
/// the floor before the next), so that a machine whose speed wanders moves
/// both sides alike: compare each run with the floors around it.
pub fn around_floors<T, F: Clone>(
    runs: usize,
    mut floor: impl FnMut() -> Result<F, String>,
    mut run: impl FnMut() -> Result<T, String>,
) -> Result<Vec<Around<T, F>>, String> {
    let mut before = floor()?;
    let mut out = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let r = run()?;
        let after = floor()?;
        out.push(Around {
            run: r,
            before: std::mem::replace(&mut before, after.clone()),
            after,
        });
    }
    Ok(out)
}

/// The best run of one configuration, and the median over its runs of the
/// ratio to the floors around each.
pub struct Measured<T> {
    pub best: T,
    pub median_ratio: f64,
}

/// The host floors a bench measures in its run, in GB/s, on the same
/// threads as the library's copier ([`Floors::measure`]).
#[derive(Clone, Copy)]
pub struct Floors {
    /// memcpy, host buffer to host buffer.
    pub memcpy: f64,
    /// Faulting in fresh memory ([`floors::fresh_memory_floor`]).
    pub fresh: f64,
}

impl Floors {
    /// memcpy from `src` to `dst`, and faulting in as many fresh bytes,
    /// each the best of [`RUNS`].
    pub fn measure(src: &[u8], dst: &mut [u8], threads: usize) -> Result<Floors, String> {
        let bytes = src.len() as u64;
        let memcpy = best(|| floors::memcpy_floor(src, dst, threads))?;
        let fresh = best(|| floors::fresh_memory_floor(src.len(), threads))?;
        Ok(Floors {
            memcpy: crate::fmt::gbps(bytes, memcpy),
            fresh: crate::fmt::gbps(bytes, fresh),
        })
    }
}

/// A folder of a bench's own, removed when dropped.
pub struct Scratch(
    pub PathBuf,
    #[expect(
        dead_code,
        reason = "held for its drop: listed while the folder exists"
    )]
    Listed,
);

impl Scratch {
    /// `<base>/<name>-<pid>`, created (removed on a stopping signal too).
    pub fn new(base: &Path, name: &str) -> Result<Scratch, String> {
        let dir = base.join(format!("{name}-{}", std::process::id()));
        let listed = Listed::new(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(Scratch(dir, listed))
    }

    /// [`Scratch::new`] in the system's temporary folder.
    pub fn temp(name: &str) -> Result<Scratch, String> {
        Scratch::new(&std::env::temp_dir(), name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A buffer with every page already touched (filled with 1s).
pub fn buffer(n: usize) -> Vec<u8> {
    vec![1u8; n]
}

/// Python for the PyTorch peers and baselines: `WM_PYTHON`, else
/// `.venv/bin/python`, else `python3`.
pub fn python() -> String {
    std::env::var("WM_PYTHON").unwrap_or_else(|_| {
        if Path::new(".venv/bin/python").exists() {
            ".venv/bin/python".into()
        } else {
            "python3".into()
        }
    })
}
