//! The locations an update request names. A trainer spread over many
//! ranks serves one version from many publishers (one socket or address
//! each); the request lists them, or names a file that does: `@PATH` reads
//! PATH, one location per line, blank lines and `#` comments skipped. The
//! file is the engine's own (it is read like a snapshot file: regular
//! files only, bounded in size), and the list is bounded in length.

use crate::checkpoint::regular_file::open_regular;
use crate::result::{Error, Result};
use std::io::Read;
use std::path::PathBuf;

/// Most sources one update reads from.
pub const MAX_SOURCES: usize = 4096;
/// Largest file of locations read.
const MAX_LIST_FILE: u64 = 1 << 20;

/// `locations` with every `@PATH` replaced by the locations PATH lists.
pub fn expand(locations: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for loc in locations {
        match loc.to_str().and_then(|s| s.strip_prefix('@')) {
            Some(list) => out.extend(read_list(list)?),
            None => out.push(loc.clone()),
        }
        if out.len() > MAX_SOURCES {
            return Err(Error::invalid_argument(format!(
                "the update names more than {MAX_SOURCES} sources"
            )));
        }
    }
    Ok(out)
}

/// The locations file `path` lists.
fn read_list(path: &str) -> Result<Vec<PathBuf>> {
    let file = open_regular(std::path::Path::new(path))?;
    let mut text = String::new();
    file.take(MAX_LIST_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::io(format!("reading the locations file {path}"), e))?;
    if text.len() as u64 > MAX_LIST_FILE {
        return Err(Error::invalid_argument(format!(
            "the locations file {path} is larger than {MAX_LIST_FILE} bytes"
        )));
    }
    let list: Vec<PathBuf> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(PathBuf::from)
        .collect();
    if list.is_empty() {
        return Err(Error::invalid_argument(format!(
            "the locations file {path} lists no location"
        )));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_of_locations_is_read_in_order_skipping_comments() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("sources");
        std::fs::write(&list, "# trainer ranks\n/tmp/a.sock\n\n  /tmp/b.sock  \n").unwrap();
        let named = vec![
            PathBuf::from("/tmp/first.sock"),
            PathBuf::from(format!("@{}", list.display())),
        ];
        let got = expand(&named).unwrap();
        assert_eq!(
            got,
            ["/tmp/first.sock", "/tmp/a.sock", "/tmp/b.sock"].map(PathBuf::from)
        );
    }

    #[test]
    fn an_empty_or_missing_list_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("empty");
        std::fs::write(&list, "# nothing\n").unwrap();
        let e = expand(&[PathBuf::from(format!("@{}", list.display()))]).unwrap_err();
        assert!(e.message.contains("lists no location"), "{e}");
        let e = expand(&[PathBuf::from("@/nonexistent/list")]).unwrap_err();
        assert!(e.message.contains("/nonexistent/list"), "{e}");
    }
}
