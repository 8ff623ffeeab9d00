//! The outcome of the last update or clear, beside the control cell.
//!
//! FastDeploy's cell holds one int32, which cannot say why an update failed.
//! Rank 0 therefore also writes `/dev/shm/<cell>.wm_report`: a sequence
//! number, the result code, the rank that failed, the version and a message.
//! The controller handle reads it to turn "the word went back to CLEARED"
//! into an error with a reason. It is a separate object, so a FastDeploy
//! controller that knows only the cell is not disturbed.
//!
//! Written as a seqlock: odd sequence while writing, even when done. A
//! reader waits at most [`SETTLE`] for a write to finish: a sequence that
//! stays odd (rank 0 died mid-write, or the file is corrupt) is an error
//! saying so, never a spin. The next report repairs it.
//!
//! The engine's rank 0 also records its pid (and pid namespace) when it
//! creates the report, so a controller whose request times out can tell a
//! dead engine from a slow one.

use super::shm::{OpenMode, SharedMapping};
use crate::result::{Error, Result};
use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// How long a reader waits for a report being written (a write takes
/// microseconds).
pub const SETTLE: Duration = Duration::from_millis(100);

const VERSION_LEN: usize = 256;
const MESSAGE_LEN: usize = 1024;

#[repr(C)]
struct Layout {
    seq: AtomicU64,
    code: AtomicU32,
    rank: AtomicU32,
    action: AtomicI32,
    /// The engine's rank 0, written once at creation.
    pid: AtomicU32,
    /// Its pid namespace (inode of /proc/self/ns/pid; 0 if unknown).
    pid_ns: AtomicU64,
    version: [AtomicU8; VERSION_LEN],
    message: [AtomicU8; MESSAGE_LEN],
}

/// One report: what was asked (UPDATING or CLEARING), how it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Increases by 2 per report; 0 means none yet.
    pub seq: u64,
    /// 0 (`WM_OK`) or the failing rank's result code.
    pub code: u32,
    pub rank: u32,
    pub action: i32,
    pub version: String,
    pub message: String,
}

pub struct ReportCell {
    name: String,
    map: SharedMapping,
}

/// Which process wrote the report's object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Engine {
    pub pid: u32,
    pub pid_ns: u64,
}

/// This process's pid namespace, 0 if unknown.
pub fn own_pid_ns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

pub fn report_name(cell: &str) -> String {
    format!("{cell}.wm_report")
}

fn write_text(dst: &[AtomicU8], s: &str) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(dst.len() - 1);
    for (d, b) in dst.iter().zip(bytes[..n].iter().chain(std::iter::once(&0))) {
        d.store(*b, Ordering::Relaxed);
    }
}

fn read_text(src: &[AtomicU8]) -> String {
    let bytes: Vec<u8> = src
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .take_while(|b| *b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl ReportCell {
    /// The engine's rank 0: open or create the report and sign it with this
    /// process's pid.
    pub fn open_or_create(cell: &str) -> Result<ReportCell> {
        let name = report_name(cell);
        let map =
            SharedMapping::open(&name, std::mem::size_of::<Layout>(), OpenMode::OpenOrCreate)?
                .expect("created");
        let r = ReportCell { name, map };
        r.layout().pid.store(std::process::id(), Ordering::Relaxed);
        r.layout().pid_ns.store(own_pid_ns(), Ordering::Relaxed);
        r.check()?;
        Ok(r)
    }

    /// The report object if the engine made one.
    pub fn open_existing(cell: &str) -> Result<Option<ReportCell>> {
        let name = report_name(cell);
        Ok(
            SharedMapping::open(&name, std::mem::size_of::<Layout>(), OpenMode::Existing)?
                .map(|map| ReportCell { name, map }),
        )
    }

    fn layout(&self) -> &Layout {
        // SAFETY: the mapping is at least size_of::<Layout>() bytes, page aligned.
        unsafe { &*(self.map.ptr() as *const Layout) }
    }

    fn check(&self) -> Result<()> {
        self.map.check(|| format!("report /dev/shm/{}", self.name))
    }

    /// The process that created the report (its rank 0).
    pub fn engine(&self) -> Result<Engine> {
        let l = self.layout();
        let e = Engine {
            pid: l.pid.load(Ordering::Acquire),
            pid_ns: l.pid_ns.load(Ordering::Acquire),
        };
        self.check()?;
        Ok(e)
    }

    /// Publish a report (rank 0, or a controller that found rank 0 dead).
    pub fn write(
        &self,
        code: u32,
        rank: u32,
        action: i32,
        version: &str,
        message: &str,
    ) -> Result<()> {
        let l = self.layout();
        let seq = l.seq.load(Ordering::Relaxed);
        let start = seq | 1;
        l.seq.store(start, Ordering::Relaxed);
        fence(Ordering::Release);
        l.code.store(code, Ordering::Relaxed);
        l.rank.store(rank, Ordering::Relaxed);
        l.action.store(action, Ordering::Relaxed);
        write_text(&l.version, version);
        write_text(&l.message, message);
        l.seq.store(start + 1, Ordering::SeqCst);
        self.check()
    }

    /// The raw sequence number: odd while (or if stuck) writing.
    pub fn seq(&self) -> Result<u64> {
        let s = self.layout().seq.load(Ordering::Acquire);
        self.check()?;
        Ok(s)
    }

    /// A consistent copy of the last report, waiting at most [`SETTLE`] for
    /// a write in progress.
    pub fn read(&self) -> Result<Report> {
        let r = self.read_settled();
        self.check()?;
        r
    }

    fn read_settled(&self) -> Result<Report> {
        let l = self.layout();
        let start = Instant::now();
        let mut tries = 0u32;
        loop {
            tries += 1;
            if tries.is_multiple_of(64) {
                if start.elapsed() >= SETTLE {
                    return Err(self.torn(l.seq.load(Ordering::Relaxed)));
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            let s1 = l.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let r = Report {
                seq: s1,
                code: l.code.load(Ordering::Relaxed),
                rank: l.rank.load(Ordering::Relaxed),
                action: l.action.load(Ordering::Relaxed),
                version: read_text(&l.version),
                message: read_text(&l.message),
            };
            fence(Ordering::Acquire);
            if l.seq.load(Ordering::Relaxed) == s1 {
                return Ok(r);
            }
        }
    }

    fn torn(&self, seq: u64) -> Error {
        Error::format(format!(
            "report /dev/shm/{} never settled: its sequence number {seq} stayed odd (being written) for {SETTLE:?}, so rank 0 died while writing it or the file is corrupt",
            self.name
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_round_trip() {
        let cell = format!("wm_test_report_{}", std::process::id());
        let w = ReportCell::open_or_create(&cell).unwrap();
        let r = ReportCell::open_existing(&cell).unwrap().unwrap();
        assert_eq!(r.read().unwrap().seq, 0);
        assert_eq!(r.engine().unwrap().pid, std::process::id());
        w.write(10, 3, 1, "v7", "rank 3: checksum mismatch")
            .unwrap();
        let got = r.read().unwrap();
        assert_eq!((got.seq, got.code, got.rank, got.action), (2, 10, 3, 1));
        assert_eq!(
            (got.version.as_str(), got.message.as_str()),
            ("v7", "rank 3: checksum mismatch")
        );
        super::super::shm::unlink(&report_name(&cell)).unwrap();
        assert!(ReportCell::open_existing(&cell).unwrap().is_none());
    }

    #[test]
    fn a_torn_report_is_an_error_not_a_spin() {
        let cell = format!("wm_test_torn_{}", std::process::id());
        let w = ReportCell::open_or_create(&cell).unwrap();
        w.layout().seq.store(5, Ordering::SeqCst);
        let e = w.read().unwrap_err();
        assert!(e.message.contains("never settled"), "{e}");
        assert!(e.message.contains("5"), "{e}");
        // The next write repairs it.
        w.write(0, 0, 1, "v", "ok").unwrap();
        assert_eq!(w.read().unwrap().seq, 6);
        super::super::shm::unlink(&report_name(&cell)).unwrap();
    }
}
