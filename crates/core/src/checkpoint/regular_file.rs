//! Opening and reading snapshot files without trusting what sits at a path.
//!
//! Anything in a model directory may be something other than a regular file:
//! a FIFO named like a part file would block `open()` until a writer comes,
//! a character device would never end. So every snapshot file is opened with
//! `O_NONBLOCK` (which makes opening a FIFO return at once), checked with
//! `fstat` to be a regular file, and only then read. Small side files
//! (`version.yaml`, `wm_checksums.json`, the HuggingFace index) are read with
//! a size bound the engine controls, in chunks, checking the update's deadline
//! between them, so neither a huge file nor a slow disk holds an update past
//! its timeout.

use crate::result::wm_result;
use crate::result::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

/// Bytes read between deadline checks.
const CHUNK: usize = 4 << 20;

fn kind_of(ft: std::fs::FileType) -> &'static str {
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Open `path` for reading if it is a regular file (symlinks followed).
/// A missing file is `WM_ERR_NOT_FOUND`; anything else that is not a regular
/// file is `WM_ERR_FORMAT`, naming the path and what it is. Never blocks.
pub fn open_regular(path: &Path) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                wm_result::WM_ERR_NOT_FOUND
            } else {
                wm_result::WM_ERR_IO
            };
            Error::new(code, format!("opening {}: {e}", path.display()))
        })?;
    let ft = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?
        .file_type();
    if !ft.is_file() {
        return Err(Error::format(format!(
            "{} is {}, not a regular file (files read here must be regular files)",
            path.display(),
            kind_of(ft)
        )));
    }
    Ok(file)
}

/// Fail with `WM_ERR_TIMEOUT` naming `path` when `deadline` has passed.
pub fn check_deadline(deadline: Instant, path: &Path, doing: &str) -> Result<()> {
    if Instant::now() > deadline {
        return Err(Error::timeout(format!(
            "{doing} {} ran past the update's deadline",
            path.display()
        )));
    }
    Ok(())
}

/// Fill `buf` from `file` at `offset`, in chunks, checking `deadline` between
/// them. `Ok(false)`: the file ended first.
pub fn read_exact_at_until(
    file: &File,
    buf: &mut [u8],
    offset: u64,
    deadline: Instant,
    path: &Path,
) -> Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut done = 0usize;
    while done < buf.len() {
        check_deadline(deadline, path, "reading")?;
        let end = (done + CHUNK).min(buf.len());
        match file.read_at(&mut buf[done..end], offset + done as u64) {
            Ok(0) => return Ok(false),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        }
    }
    Ok(true)
}

/// The whole of the regular file at `path`, at most `max` bytes, read before
/// `deadline`. `Ok(None)`: there is no such file. A larger file is
/// `WM_ERR_FORMAT` naming it and the limit (checked before anything is
/// allocated for it, and again while reading, in case it grows).
pub fn read_bounded(path: &Path, max: u64, deadline: Instant) -> Result<Option<Vec<u8>>> {
    let file = match open_regular(path) {
        Ok(f) => f,
        Err(e) if e.code == wm_result::WM_ERR_NOT_FOUND => return Ok(None),
        Err(e) => return Err(e),
    };
    let too_big = || {
        Error::format(format!(
            "{} is larger than the {max}-byte limit for this file",
            path.display()
        ))
    };
    let len = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?
        .len();
    if len > max {
        return Err(too_big());
    }
    let mut out = Vec::with_capacity(len as usize);
    let mut reader = (&file).take(max + 1);
    let mut chunk = vec![0u8; CHUNK.min(max as usize + 1).max(1)];
    loop {
        check_deadline(deadline, path, "reading")?;
        let n = match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        out.extend_from_slice(&chunk[..n]);
        if out.len() as u64 > max {
            return Err(too_big());
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    /// A rewrite of the same length that puts the modification time back
    /// (found by an audit: it committed torn weights unverified) still
    /// changes the stamp, through the status-change time.
    #[test]
    fn a_rewrite_that_restores_the_modification_time_is_seen() {
        use std::io::Write;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        let f = open_regular(&p).unwrap();
        let before = FileStamp::of(&f, &p).unwrap();
        let mtime = f.metadata().unwrap().modified().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut w = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        w.write_all(b"abcdefghij").unwrap();
        w.set_modified(mtime).unwrap();
        let now = FileStamp::of(&f, &p).unwrap();
        assert_eq!(f.metadata().unwrap().modified().unwrap(), mtime);
        let e = before.check(&now, &p, "since it was planned").unwrap_err();
        assert!(e.message.contains("rewritten"), "{e}");
    }

    /// A file renamed over (or hard-linked) while it is read keeps its
    /// contents: its status-change time moves with its link count, and
    /// that is no change of contents (found in review: the ctime check
    /// failed such updates).
    #[test]
    fn a_link_count_change_alone_is_no_rewrite() {
        let d = tempfile::tempdir().unwrap();
        let (p, q) = (d.path().join("f"), d.path().join("g"));
        std::fs::write(&p, b"0123456789").unwrap();
        std::fs::write(&q, b"abcdefghij").unwrap();
        let f = open_regular(&p).unwrap();
        let before = FileStamp::of(&f, &p).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        std::fs::rename(&q, &p).unwrap();
        let after = FileStamp::of(&f, &p).unwrap();
        before.check(&after, &p, "renamed over").unwrap();
        // The file read now: hard-linked elsewhere.
        let f = open_regular(&p).unwrap();
        let before = FileStamp::of(&f, &p).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        std::fs::hard_link(&p, d.path().join("h")).unwrap();
        before
            .check(&FileStamp::of(&f, &p).unwrap(), &p, "linked")
            .unwrap();
    }

    #[test]
    fn refuses_what_is_not_a_regular_file() {
        let d = tempfile::tempdir().unwrap();
        let e = open_regular(d.path()).unwrap_err();
        assert!(e.message.contains("a directory"), "{e}");
        let e = read_bounded(&d.path().join("none"), 10, later());
        assert!(e.unwrap().is_none());
        let e = open_regular(Path::new("/dev/zero")).unwrap_err();
        assert!(e.message.contains("character device"), "{e}");
    }

    #[test]
    fn bounds_size_and_time() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(
            read_bounded(&p, 10, later()).unwrap().unwrap(),
            b"0123456789"
        );
        let e = read_bounded(&p, 9, later()).unwrap_err();
        assert!(e.message.contains("9-byte limit"), "{e}");
        let past = Instant::now() - Duration::from_millis(1);
        let e = read_bounded(&p, 10, past).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_TIMEOUT, "{e}");
        let f = open_regular(&p).unwrap();
        let mut buf = [0u8; 4];
        assert!(read_exact_at_until(&f, &mut buf, 6, later(), &p).unwrap());
        assert_eq!(&buf, b"6789");
        assert!(!read_exact_at_until(&f, &mut buf, 8, later(), &p).unwrap());
    }
}

/// What tells a file's contents apart cheaply: its length, its inode (a
/// file replaced by a rename is another one), its modification time (a
/// file rewritten in place) and its status-change time, which no writer
/// can set back (a rewrite that restores the modification time with
/// `utime` still moves it; so does a chmod, which then fails the update
/// too, erring on the safe side), as `fstat` gives them. A change of its
/// link count also moves the status-change time: the file renamed over or
/// removed while it is read (its contents unchanged, read whole from the
/// file opened), or hard-linked elsewhere. So the status-change time counts
/// only while the link count stays as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    pub len: u64,
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    nlink: u64,
}

impl FileStamp {
    /// The stamp of the open `file` (`path` named in errors).
    pub fn of(file: &File, path: &Path) -> Result<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = file
            .metadata()
            .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
        Ok(FileStamp {
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            nlink: m.nlink(),
        })
    }

    /// Whether `now` says the same contents as this stamp (see the type).
    fn same_contents(&self, now: &FileStamp) -> bool {
        let plain = |s: &FileStamp| (s.len, s.dev, s.ino, s.mtime_ns);
        plain(self) == plain(now) && (self.ctime_ns == now.ctime_ns || self.nlink != now.nlink)
    }

    /// Err naming `path` when `now` is not this stamp: the file changed
    /// since (`when` says since what).
    pub fn check(&self, now: &FileStamp, path: &Path, when: &str) -> Result<()> {
        if self.same_contents(now) {
            return Ok(());
        }
        let how = match (
            now.len != self.len,
            (now.dev, now.ino) != (self.dev, self.ino),
        ) {
            (true, _) => format!("was {} bytes, now {}", self.len, now.len),
            (_, true) => "replaced by another file".to_string(),
            _ => "rewritten".to_string(),
        };
        Err(Error::format(format!(
            "{} changed {when} ({how}): its bytes may be another version's",
            path.display()
        )))
    }
}
