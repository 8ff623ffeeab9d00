//! The outcome of the last update or clear, beside the control cell.
//!
//! FastDeploy's cell holds one int32, which cannot say why an update failed.
//! Rank 0 therefore also writes `/dev/shm/<cell>.wm_report`: a sequence
//! number, the result code, the rank that failed, the version and a message.
//! The controller handle reads it to turn "the word went back to CLEARED"
//! into an error with a reason. It is a separate object, so a FastDeploy
//! controller that knows only the cell is not disturbed.
//!
//! Written as a seqlock: odd sequence while writing, even when done.

use super::shm::{OpenMode, SharedMapping};
use crate::result::Result;
use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};

const VERSION_LEN: usize = 256;
const MESSAGE_LEN: usize = 1024;

#[repr(C)]
struct Layout {
    seq: AtomicU64,
    code: AtomicU32,
    rank: AtomicU32,
    action: AtomicI32,
    _pad: AtomicU32,
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
    map: SharedMapping,
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
    pub fn open_or_create(cell: &str) -> Result<ReportCell> {
        let map = SharedMapping::open(
            &report_name(cell),
            std::mem::size_of::<Layout>(),
            OpenMode::OpenOrCreate,
        )?
        .expect("created");
        Ok(ReportCell { map })
    }

    /// The report object if the engine made one.
    pub fn open_existing(cell: &str) -> Result<Option<ReportCell>> {
        Ok(SharedMapping::open(
            &report_name(cell),
            std::mem::size_of::<Layout>(),
            OpenMode::Existing,
        )?
        .map(|map| ReportCell { map }))
    }

    fn layout(&self) -> &Layout {
        // SAFETY: the mapping is at least size_of::<Layout>() bytes, page aligned.
        unsafe { &*(self.map.ptr() as *const Layout) }
    }

    /// Publish a report (only rank 0 writes).
    pub fn write(&self, code: u32, rank: u32, action: i32, version: &str, message: &str) {
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
        l.seq.store(start + 1, Ordering::Release);
    }

    /// A consistent copy of the last report.
    pub fn read(&self) -> Report {
        let l = self.layout();
        loop {
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
                return r;
            }
        }
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
        assert_eq!(r.read().seq, 0);
        w.write(10, 3, 1, "v7", "rank 3: checksum mismatch");
        let got = r.read();
        assert_eq!((got.seq, got.code, got.rank, got.action), (2, 10, 3, 1));
        assert_eq!(
            (got.version.as_str(), got.message.as_str()),
            ("v7", "rank 3: checksum mismatch")
        );
        super::super::shm::unlink(&report_name(&cell)).unwrap();
        assert!(ReportCell::open_existing(&cell).unwrap().is_none());
    }
}
