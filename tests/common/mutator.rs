//! A small seeded mutation fuzzer for the parsers (no cargo-fuzz: that needs
//! nightly).
//!
//! Each target starts from valid inputs built by the test, mutates them (bit
//! flips, byte and token inserts, deletes, interesting integers, splices,
//! duplicated ranges, truncation) and runs the target on each result for a
//! time budget. Inputs the target accepts join the corpus, so mutations
//! build on inputs that get deep into the parser. A target fails on a panic
//! or on one input running past `SLOW`; the input is printed escaped and in
//! hex with the seed that reproduces the run.
//!
//! `WM_FUZZ_SECONDS` (default 2) sets each target's budget, `WM_FUZZ_SEED`
//! the seed (default: from the clock; always printed).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// One input taking longer than this is a failure (generous: the machine
/// may be loaded).
const SLOW: Duration = Duration::from_secs(5);
/// Accepted inputs kept for further mutation.
const MAX_CORPUS: usize = 512;
/// Peak resident memory of the whole fuzz process allowed.
const MAX_RSS: u64 = 1 << 30;

const INTERESTING: [u64; 18] = [
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

/// SplitMix64: small, seedable, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What one fuzz target is fed and how.
pub struct Target<'a> {
    pub name: &'a str,
    /// Valid inputs: each must be accepted.
    pub seeds: Vec<Vec<u8>>,
    /// Tokens worth inserting whole (syntax of the format).
    pub tokens: &'a [&'a [u8]],
    /// Inputs are cut to this length.
    pub max_len: usize,
}

fn env_seed() -> u64 {
    match std::env::var("WM_FUZZ_SEED") {
        Ok(s) => s.trim().parse().expect("WM_FUZZ_SEED is a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    }
}

fn env_budget() -> Duration {
    let secs = std::env::var("WM_FUZZ_SECONDS")
        .ok()
        .map(|s| {
            s.trim()
                .parse::<f64>()
                .expect("WM_FUZZ_SECONDS is a number")
        })
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

fn range(rng: &mut Rng, len: usize) -> (usize, usize) {
    let a = rng.below(len + 1);
    let b = a + rng.below(len - a + 1).min(64);
    (a, b)
}

/// Apply one random mutation to `buf`.
fn mutate_once(rng: &mut Rng, buf: &mut Vec<u8>, corpus: &[Vec<u8>], tokens: &[&[u8]]) {
    let at = rng.below(buf.len() + 1);
    match rng.below(8) {
        0 if !buf.is_empty() => {
            let i = rng.below(buf.len());
            buf[i] ^= 1 << rng.below(8);
        }
        1 => buf.insert(at, rng.next() as u8),
        2 if !tokens.is_empty() => {
            let t = tokens[rng.below(tokens.len())];
            buf.splice(at..at, t.iter().copied());
        }
        3 => {
            let (a, b) = range(rng, buf.len());
            buf.drain(a..b);
        }
        4 => {
            let v = INTERESTING[rng.below(INTERESTING.len())];
            let width = [1, 2, 4, 8][rng.below(4)];
            let bytes = &v.to_le_bytes()[..width];
            let end = (at + width).min(buf.len());
            buf.splice(at..end, bytes.iter().copied());
        }
        5 => {
            let other = &corpus[rng.below(corpus.len())];
            let (a, b) = range(rng, other.len());
            let (c, d) = range(rng, buf.len());
            buf.splice(c..d, other[a..b].iter().copied());
        }
        6 => {
            let (a, b) = range(rng, buf.len());
            let copy = buf[a..b].to_vec();
            for _ in 0..1 + rng.below(8) {
                buf.splice(b..b, copy.iter().copied());
            }
        }
        _ => buf.truncate(at),
    }
}

/// Peak resident memory of this process, in bytes.
pub fn peak_rss() -> u64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as u64 * 1024
}

fn report(t: &Target, seed: u64, n: u64, input: &[u8], why: &str) -> ! {
    let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
    panic!(
        "fuzz {}: input #{n} {why} (WM_FUZZ_SEED={seed} reproduces)\n\
         escaped: b\"{}\"\nhex: {hex}",
        t.name,
        input.escape_ascii()
    );
}

/// Fuzz `check` (true: the input was accepted) for the time budget.
pub fn fuzz(t: Target, check: impl Fn(&[u8]) -> bool) {
    let seed = env_seed();
    let budget = env_budget();
    eprintln!("fuzz {}: WM_FUZZ_SEED={seed}, {budget:?}", t.name);
    let salt = t
        .name
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31) ^ b as u64);
    let mut rng = Rng::new(seed ^ salt);
    let run = |n: u64, input: &[u8]| {
        let start = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| check(input))) {
            Err(_) => report(&t, seed, n, input, "panicked"),
            Ok(_) if start.elapsed() > SLOW => {
                report(&t, seed, n, input, &format!("took {:?}", start.elapsed()))
            }
            Ok(accepted) => accepted,
        }
    };
    for (i, s) in t.seeds.iter().enumerate() {
        if !run(i as u64, s) {
            report(&t, seed, i as u64, s, "is a seed the target refused");
        }
    }
    // Half the inputs start from a seed, so that the corpus, which fills
    // with whatever was accepted, cannot drift into trivial inputs.
    let mut corpus = t.seeds.clone();
    let (start, mut n, mut accepted) = (Instant::now(), 0u64, 0u64);
    while start.elapsed() < budget {
        let from = if rng.below(2) == 0 { &t.seeds } else { &corpus };
        let mut input = from[rng.below(from.len())].clone();
        for _ in 0..1 + rng.below(4) {
            mutate_once(&mut rng, &mut input, &corpus, t.tokens);
        }
        input.truncate(t.max_len);
        n += 1;
        if run(n, &input) {
            accepted += 1;
            if corpus.len() < MAX_CORPUS {
                corpus.push(input);
            } else {
                let i = t.seeds.len() + rng.below(MAX_CORPUS - t.seeds.len());
                corpus[i] = input;
            }
        }
    }
    eprintln!("fuzz {}: {n} inputs, {accepted} accepted", t.name);
    assert!(n > 0, "fuzz {}: no input ran", t.name);
    let rss = peak_rss();
    assert!(rss < MAX_RSS, "fuzz {}: peak RSS {rss} bytes", t.name);
}
