//! Reading a checksum file's JSON straight into [`FileSums`]: the entries
//! of the wanted files and tensors only (the others are skipped as the
//! parser meets them, `IgnoredAny`, never held), each tensor's sum decoded
//! from its hex as it is read (no string kept for it). What the derived `Deserialize`
//! of [`super::FileJson`] accepts, field for field: unknown fields are
//! ignored, a missing one is named.
//!
//! Measured (a 250 MB file, one 16-byte tensor in the snapshot): 3.1
//! million entries of files the snapshot does not have took 3.4 GiB kept
//! and 12 s, 5.7 million of tensors its one file does not hold 1.8 GiB
//! and 9.4 s; each now costs the text (254 MiB) and 0.65 s.

use super::{FileSums, Wanted};
use crate::manifest::parse_checksum_hex;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// A checksum file as read.
pub(super) struct Read {
    pub format: String,
    pub algorithm: String,
    pub block_size: Option<serde_json::Number>,
    pub files: HashMap<String, FileSums>,
}

/// The whole file; `wanted`: the files and tensors kept (None: all).
pub(super) struct Reading<'w> {
    pub wanted: Option<&'w Wanted>,
}

impl<'de> DeserializeSeed<'de> for Reading<'_> {
    type Value = Read;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Read, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Reading<'_> {
    type Value = Read;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a checksum file's object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Read, A::Error> {
        let (mut format, mut algorithm, mut block_size, mut files) = (None, None, None, None);
        while let Some(key) = m.next_key::<String>()? {
            match key.as_str() {
                "format" => format = Some(m.next_value()?),
                "algorithm" => algorithm = Some(m.next_value()?),
                "block_size" => block_size = m.next_value()?,
                "files" => files = Some(m.next_value_seed(Files(self.wanted))?),
                _ => {
                    m.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Read {
            format: format.ok_or_else(|| de::Error::missing_field("format"))?,
            algorithm: algorithm.ok_or_else(|| de::Error::missing_field("algorithm"))?,
            block_size,
            files: files.ok_or_else(|| de::Error::missing_field("files"))?,
        })
    }
}

/// The `files` object: the wanted entries.
struct Files<'w>(Option<&'w Wanted>);

impl<'de> DeserializeSeed<'de> for Files<'_> {
    type Value = HashMap<String, FileSums>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Files<'_> {
    type Value = HashMap<String, FileSums>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of files")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut files = HashMap::new();
        while let Some(name) = m.next_key::<String>()? {
            let keep = match self.0 {
                None => Some(None),
                Some(w) => w.get(&name).map(Some),
            };
            match keep {
                Some(tensors) => {
                    let sums = m.next_value_seed(Entry(&name, tensors))?;
                    files.insert(name, sums);
                }
                None => {
                    m.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(files)
    }
}

/// One file's entry (its name, for errors, and the tensors kept: None,
/// all).
struct Entry<'n>(&'n str, Option<&'n HashSet<String>>);

impl<'de> DeserializeSeed<'de> for Entry<'_> {
    type Value = FileSums;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<FileSums, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Entry<'_> {
    type Value = FileSums;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "the entry of {}", self.0.escape_debug())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<FileSums, A::Error> {
        let (mut size, mut tensors, mut blocks) = (None, None, None);
        while let Some(key) = m.next_key::<String>()? {
            match key.as_str() {
                "size" => size = Some(m.next_value()?),
                "tensors" => {
                    tensors = Some(m.next_value_seed(Kept {
                        keep: self.1,
                        what: "an object of tensors' checksums",
                        make: |tensor: &str, hex: &str| {
                            parse_checksum_hex(hex).ok_or_else(|| {
                                format!(
                                    "checksum of '{}' in {} is not 32 hex digits",
                                    tensor.escape_debug(),
                                    self.0.escape_debug()
                                )
                            })
                        },
                    })?)
                }
                "blocks" => {
                    blocks = Some(m.next_value_seed(Kept {
                        keep: self.1,
                        what: "an object of block sums",
                        make: |_: &str, sums: &str| Ok(sums.to_string()),
                    })?)
                }
                _ => {
                    m.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(FileSums {
            size: size.ok_or_else(|| de::Error::missing_field("size"))?,
            tensors: tensors.ok_or_else(|| de::Error::missing_field("tensors"))?,
            blocks: blocks.unwrap_or_default(),
        })
    }
}

/// An object of a file's entry (`tensors`, `blocks`): the entries whose
/// key `keep` holds (None: all), each string value made into a `V` by
/// `make` (Err: why, refused), the others skipped unread.
struct Kept<'n, F> {
    keep: Option<&'n HashSet<String>>,
    what: &'n str,
    make: F,
}

impl<'de, V, F: Fn(&str, &str) -> Result<V, String>> DeserializeSeed<'de> for Kept<'_, F> {
    type Value = HashMap<String, V>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, V, F: Fn(&str, &str) -> Result<V, String>> Visitor<'de> for Kept<'_, F> {
    type Value = HashMap<String, V>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut kept = HashMap::new();
        while let Some(key) = m.next_key::<String>()? {
            if self.keep.is_some_and(|keep| !keep.contains(&key)) {
                m.next_value::<IgnoredAny>()?;
                continue;
            }
            let text: std::borrow::Cow<'de, str> = m.next_value()?;
            let value = (self.make)(&key, &text).map_err(de::Error::custom)?;
            kept.insert(key, value);
        }
        Ok(kept)
    }
}
