//! Number formatting and a terminal progress line.

use std::io::Write;
use std::time::Duration;
use weight_manager_core::Progress;

pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Decimal GB/s, as bandwidths are usually quoted.
pub fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-9) / 1e9
}

pub fn ms(t: Duration) -> String {
    format!("{:.1} ms", t.as_secs_f64() * 1e3)
}

pub fn stderr_is_terminal() -> bool {
    // SAFETY: isatty on a standard descriptor.
    unsafe { libc::isatty(2) == 1 }
}

/// A progress callback that redraws one line on stderr when it is a terminal.
pub fn progress_line(label: &str) -> impl FnMut(&Progress) -> bool + '_ {
    let tty = stderr_is_terminal();
    move |p: &Progress| {
        if tty {
            let frac = p.bytes_done as f64 / p.bytes_total.max(1) as f64;
            let filled = (frac * 30.0) as usize;
            eprint!(
                "\r{label} [{}{}] {:>3.0}% {} / {}",
                "#".repeat(filled),
                " ".repeat(30 - filled.min(30)),
                frac * 100.0,
                bytes(p.bytes_done),
                bytes(p.bytes_total)
            );
            if p.bytes_done >= p.bytes_total {
                eprint!("\r{}\r", " ".repeat(80));
            }
            let _ = std::io::stderr().flush();
        }
        true
    }
}
