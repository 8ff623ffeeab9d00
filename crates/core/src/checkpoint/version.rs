//! Versions: the rule for a version's name ([`check_version`], which the
//! engine, the publisher and the fan-out all apply), and the version a
//! snapshot names: `version.yaml`'s `step` field, as a string.
//!
//! The file is read only when an update names no version. It is untrusted:
//! at most `MAX_VERSION_FILE_BYTES`, a regular file only, and parsed as a
//! stream of YAML events (never built into a document tree) so that aliases,
//! the way a few hundred bytes expand into gigabytes, are refused rather than
//! expanded, and the update's deadline is checked as the events come.

use super::regular_file::read_bounded;
use crate::result::Error;
use std::path::Path;
use std::time::Instant;
use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;
use yaml_rust2::Yaml;

pub const VERSION_FILE: &str = "version.yaml";

/// Largest `version.yaml` read: it holds one short mapping.
pub(crate) const MAX_VERSION_FILE_BYTES: u64 = 64 << 10;

/// Events parsed between deadline checks.
const EVENTS_PER_CHECK: usize = 1024;

/// `Ok(step)` or `Err(why there is none)`: a missing, oversized or
/// non-regular file, bad YAML (aliases included), a document that is not a
/// mapping, or no scalar `step` key all mean "no version": the request must
/// then name one, else the update fails. Every reason names the file.
pub fn read_version_yaml(dir: &Path, deadline: Instant) -> Result<String, String> {
    let path = dir.join(VERSION_FILE);
    let text = match read_bounded(&path, MAX_VERSION_FILE_BYTES, deadline) {
        Ok(Some(t)) => t,
        Ok(None) => return Err(format!("{} does not exist", path.display())),
        Err(e) => {
            return Err(format!(
                "{} could not be read ({})",
                path.display(),
                e.message
            ))
        }
    };
    let text = std::str::from_utf8(&text)
        .map_err(|e| format!("{} is not valid UTF-8 ({e})", path.display()))?;
    parse_version_yaml(text, deadline).map_err(|why| format!("{} {why}", path.display()))
}

/// The `step` of a `version.yaml` text, or why there is none (a phrase that
/// follows the file's name). Public so that it can be exercised (fuzzed)
/// without files.
pub fn parse_version_yaml(text: &str, deadline: Instant) -> Result<String, String> {
    let mut events = Vec::new();
    let mut parser = Parser::new_from_str(text);
    loop {
        if events.len() % EVENTS_PER_CHECK == 0 && Instant::now() > deadline {
            return Err("took longer to parse than the update's deadline allows".into());
        }
        let (ev, _) = parser
            .next_token()
            .map_err(|e| format!("is not valid YAML ({e})"))?;
        match ev {
            Event::StreamEnd => break,
            Event::Alias(_) => {
                return Err("uses a YAML alias (aliases are not accepted)".into());
            }
            ev => events.push(ev),
        }
    }
    step_of(&events)
}

/// The first document's top-level `step` scalar.
fn step_of(events: &[Event]) -> Result<String, String> {
    let mut it = events
        .iter()
        .skip_while(|e| matches!(e, Event::StreamStart | Event::DocumentStart));
    match it.next() {
        None => return Err("is empty".into()),
        Some(Event::MappingStart(..)) => {}
        Some(_) => return Err("is not a mapping".into()),
    }
    // The top-level mapping's nodes alternate key, value; `depth` counts
    // the collections open inside it. Duplicate keys: the last one wins.
    let mut depth = 0usize;
    let mut nodes = 0usize;
    let mut step_next = false;
    let mut step = None;
    for ev in it {
        let opens = matches!(ev, Event::MappingStart(..) | Event::SequenceStart(..));
        let closes = matches!(ev, Event::MappingEnd | Event::SequenceEnd);
        if depth == 0 {
            if closes {
                break;
            }
            if nodes.is_multiple_of(2) {
                step_next = matches!(ev, Event::Scalar(k, ..) if k == "step");
            } else if step_next {
                step = Some(ev);
            }
            nodes += 1;
        }
        if opens {
            depth += 1;
        } else if closes {
            depth -= 1;
        }
    }
    match step {
        None => Err("has no 'step' key".into()),
        Some(Event::Scalar(v, style, _, tag)) => scalar_text(v, *style, tag.is_some()),
        Some(_) => Err("has a 'step' that is not a number or string".into()),
    }
}

/// A scalar's text as YAML would type it: plain scalars resolve (`12345`
/// is a number, `~` is null); quoted or tagged ones are strings.
fn scalar_text(v: &str, style: TScalarStyle, tagged: bool) -> Result<String, String> {
    let not = || Err("has a 'step' that is not a number or string".to_string());
    if style != TScalarStyle::Plain || tagged {
        return if v.is_empty() {
            not()
        } else {
            Ok(v.to_string())
        };
    }
    match Yaml::from_str(v) {
        Yaml::Integer(i) => Ok(i.to_string()),
        Yaml::String(s) | Yaml::Real(s) if !s.is_empty() => Ok(s),
        _ => not(),
    }
}

/// Longest version string accepted (bytes).
pub const MAX_VERSION_LEN: usize = 255;

/// A version name engines accept: 1 to [`MAX_VERSION_LEN`] bytes (the
/// publisher checks its versions with this too, so it never announces one
/// every engine refuses).
pub fn check_version(v: &str) -> crate::result::Result<()> {
    if v.is_empty() || v.len() > MAX_VERSION_LEN {
        let shown: String = v.chars().take(40).collect();
        let more = if shown.len() < v.len() { "..." } else { "" };
        return Err(Error::invalid_argument(format!(
            "version '{shown}{more}' is {} bytes; a version must be 1 to {MAX_VERSION_LEN} bytes",
            v.len()
        )));
    }
    // C callers read versions as NUL-terminated strings: one inside would
    // cut the name short (and make two versions look alike).
    if v.contains('\0') {
        return Err(Error::invalid_argument(format!(
            "version {:?} holds a NUL byte; a version must not",
            v
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn step_cases() {
        let d = tempfile::tempdir().unwrap();
        let w = |s: &str| std::fs::write(d.path().join(VERSION_FILE), s).unwrap();
        let read = || read_version_yaml(d.path(), later());
        assert!(read().unwrap_err().contains("does not exist"));
        w("step: 12345\n");
        assert_eq!(read().unwrap(), "12345");
        w("step: run-7\nother: 1\n");
        assert_eq!(read().unwrap(), "run-7");
        w("a: {step: 1}\nb: [x, {c: d}]\nstep: '9'\n");
        assert_eq!(read().unwrap(), "9");
        w("---\nstep: 1.5\n...\n");
        assert_eq!(read().unwrap(), "1.5");
        for (text, why) in [
            ("- 1\n- 2\n", "not a mapping"),
            ("", "empty"),
            ("foo: 1\n", "no 'step'"),
            ("step: [1]\nx: 2\n", "not a number or string"),
            ("step: ~\n", "not a number or string"),
            ("step: [unclosed\n", "not valid YAML"),
            ("a: &x 1\nstep: *x\n", "alias"),
        ] {
            w(text);
            let e = read().unwrap_err();
            assert!(e.contains(why) && e.contains(VERSION_FILE), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_version_holding_a_nul_is_refused() {
        assert!(check_version("a").is_ok());
        let e = check_version("a\0b").unwrap_err();
        assert!(e.message.contains("NUL"), "{e}");
    }

    #[test]
    fn oversized_file_is_named_not_read() {
        let d = tempfile::tempdir().unwrap();
        let mut text = "step: 5\n".to_string();
        text.push_str(&"# padding\n".repeat(MAX_VERSION_FILE_BYTES as usize / 10 + 1));
        std::fs::write(d.path().join(VERSION_FILE), text).unwrap();
        let e = read_version_yaml(d.path(), later()).unwrap_err();
        assert!(e.contains("limit") && e.contains(VERSION_FILE), "{e}");
    }
}
