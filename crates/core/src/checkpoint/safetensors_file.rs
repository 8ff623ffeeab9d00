//! Strict reading of a safetensors header.
//!
//! The `safetensors` crate accepts duplicate tensor names (the last one wins)
//! and does not check alignment, so headers are parsed here: the JSON object
//! is read entry by entry, and a duplicate name, a name holding a NUL byte
//! (C callers would see it cut short), an overlapping or out-of-file range, a
//! size that disagrees with dtype and shape, or a tensor whose first byte is
//! not a multiple of its element size is an error naming the file and the
//! tensor. Only the header is read; tensor bytes are read later straight into
//! their destination.
//!
//! Memory: a header is at most `MAX_HEADER_BYTES`, checked before anything
//! is allocated for it, and entries are parsed straight into
//! [`TensorEntry`] (no generic JSON tree), so a header costs a small multiple
//! of its size.

use super::json_shape::Shape;
use super::regular_file::{check_deadline, open_regular, read_exact_at_until};
use super::shard_meta::{self, ShardOf, SHARD_KEY};
use crate::result::{Error, Result};
use crate::tensor::{byte_size, shape_text, DType};
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::time::Instant;

/// Largest header accepted: room for hundreds of thousands of tensors in one
/// file, a bound on the memory a hostile header can cost.
pub(crate) const MAX_HEADER_BYTES: u64 = 32 << 20;

#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's first byte in the file.
    pub offset: u64,
    pub nbytes: u64,
    /// The global tensor this one is a shard of (`shard_meta`); None: whole.
    pub shard: Option<ShardOf>,
}

#[derive(Clone, Debug)]
pub struct SafetensorsHeader {
    /// In file order (ascending offset).
    pub tensors: Vec<TensorEntry>,
    pub file_len: u64,
}

/// One tensor's entry as written; unknown keys are ignored.
#[derive(Deserialize)]
struct RawEntry<'a> {
    #[serde(borrow)]
    dtype: Cow<'a, str>,
    shape: Shape,
    data_offsets: (u64, u64),
}

/// The header's entries in file order, and the `__metadata__` entries
/// that place shards (stored name, JSON value; see `shard_meta`).
struct Entries<'a>(
    Vec<(Cow<'a, str>, RawEntry<'a>)>,
    Vec<(Cow<'a, str>, Cow<'a, str>)>,
);

/// The shard entries of `__metadata__`; its other values, whatever their
/// type, are skipped unread.
struct ShardKeys<'a>(Vec<(Cow<'a, str>, Cow<'a, str>)>);

impl<'de> Deserialize<'de> for ShardKeys<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ShardKeys<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of strings")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<ShardKeys<'de>, A::Error> {
                let mut v = Vec::new();
                while let Some(key) = m.next_key::<Cow<'de, str>>()? {
                    match key.strip_prefix(SHARD_KEY) {
                        Some(stored) => {
                            let stored = Cow::Owned(stored.to_string());
                            v.push((stored, m.next_value::<Cow<'de, str>>()?));
                        }
                        None => {
                            m.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(ShardKeys(v))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries<'de>, A::Error> {
                let (mut v, mut shards) = (Vec::new(), Vec::new());
                while let Some(name) = m.next_key::<Cow<'de, str>>()? {
                    if name == "__metadata__" {
                        shards.extend(m.next_value::<ShardKeys>()?.0);
                        continue;
                    }
                    let entry = m.next_value::<RawEntry>().map_err(|e| {
                        serde::de::Error::custom(format!("tensor '{}': {e}", name.escape_debug()))
                    })?;
                    v.push((name, entry));
                }
                Ok(Entries(v, shards))
            }
        }
        d.deserialize_map(V)
    }
}

/// Check one parsed entry against the file (`data_start`, `data_len`).
fn check_entry(
    p: &str,
    name: Cow<str>,
    raw: RawEntry,
    data_start: u64,
    data_len: u64,
) -> Result<TensorEntry> {
    let shown = name.escape_debug().to_string();
    let bad = |why: &str| Error::format(format!("{p}: tensor '{shown}': {why}"));
    if name.contains('\0') {
        return Err(bad("the name holds a NUL byte"));
    }
    let dtype = DType::from_safetensors_name(&raw.dtype).ok_or_else(|| {
        bad(&format!(
            "dtype '{}' is not supported",
            raw.dtype.escape_debug()
        ))
    })?;
    let shape = raw.shape.0;
    let (begin, end) = raw.data_offsets;
    if end < begin || end > data_len {
        return Err(bad(&format!(
            "data_offsets [{begin}, {end}] fall outside the {data_len} data bytes of the file"
        )));
    }
    let nbytes = byte_size(&format!("tensor '{shown}'"), dtype, &shape)
        .map_err(|e| Error::format(format!("{p}: {}", e.message)))?;
    if end - begin != nbytes {
        return Err(bad(&format!(
            "holds {} bytes but {dtype} {} needs {nbytes}",
            end - begin,
            shape_text(&shape)
        )));
    }
    let offset = data_start + begin;
    if !offset.is_multiple_of(dtype.size() as u64) {
        return Err(bad(&format!(
            "starts at byte {offset}, not a multiple of its {}-byte element size (misaligned data)",
            dtype.size()
        )));
    }
    Ok(TensorEntry {
        name: name.into_owned(),
        dtype,
        shape,
        offset,
        nbytes,
        shard: None,
    })
}

/// Parse and check the JSON header `json` of a safetensors file of
/// `file_len` bytes at `path` (named in errors). `json` is the header as
/// stored, after its 8-byte length; the data starts right after it. Public
/// so that the parser can be exercised (fuzzed) without files.
pub fn parse_header(json: &[u8], file_len: u64, path: &Path) -> Result<SafetensorsHeader> {
    let p = path.display().to_string();
    let data_start = 8 + json.len() as u64;
    if json.len() as u64 > MAX_HEADER_BYTES || data_start > file_len {
        return Err(Error::format(format!(
            "{p}: a {}-byte header does not fit a {file_len}-byte file within the \
             {MAX_HEADER_BYTES}-byte header limit",
            json.len()
        )));
    }
    let entries: Entries = serde_json::from_slice(json)
        .map_err(|e| Error::format(format!("{p}: safetensors header is not valid: {e}")))?;
    let data_len = file_len - data_start;
    let mut tensors = Vec::with_capacity(entries.0.len());
    for (name, raw) in entries.0 {
        tensors.push(check_entry(&p, name, raw, data_start, data_len)?);
    }
    attach_shards(&p, entries.1, &mut tensors)?;
    let mut by_name: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    by_name.sort_unstable();
    if let Some(w) = by_name.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::format(format!(
            "{p}: tensor '{}' appears twice in the header",
            w[0].escape_debug()
        )));
    }
    drop(by_name);
    tensors.sort_by_key(|t| (t.offset, t.nbytes));
    for w in tensors.windows(2) {
        if w[1].offset < w[0].offset + w[0].nbytes {
            return Err(Error::format(format!(
                "{p}: tensors '{}' and '{}' overlap",
                w[0].name.escape_debug(),
                w[1].name.escape_debug()
            )));
        }
    }
    Ok(SafetensorsHeader { tensors, file_len })
}

/// Read and check the header of an open safetensors file, before `deadline`.
pub fn read_header(file: &File, path: &Path, deadline: Instant) -> Result<SafetensorsHeader> {
    let p = path.display();
    let file_len = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {p}"), e))?
        .len();
    let short = || Error::format(format!("{p}: file too short for its safetensors header"));
    let mut n8 = [0u8; 8];
    if !read_exact_at_until(file, &mut n8, 0, deadline, path)? {
        return Err(short());
    }
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_BYTES {
        return Err(Error::format(format!(
            "{p}: safetensors header of {n} bytes is over the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    if n > file_len.saturating_sub(8) {
        return Err(Error::format(format!(
            "{p}: not a safetensors file (header length {n} does not fit a {file_len}-byte file)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    if !read_exact_at_until(file, &mut header, 8, deadline, path)? {
        return Err(short());
    }
    let parsed = parse_header(&header, file_len, path)?;
    check_deadline(deadline, path, "parsing the header of")?;
    Ok(parsed)
}

/// Open `path` (a regular file only) and read its header before `deadline`.
pub fn open(path: &Path, deadline: Instant) -> Result<(File, SafetensorsHeader)> {
    let file = open_regular(path)?;
    let header = read_header(&file, path, deadline)?;
    Ok((file, header))
}

/// Attach the placements of `keys` (stored name, JSON value; the
/// `__metadata__` entries whose key starts with [`SHARD_KEY`]) to the
/// tensors of the file at `p` (named in errors).
fn attach_shards(
    p: &str,
    keys: Vec<(Cow<str>, Cow<str>)>,
    tensors: &mut [TensorEntry],
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let index: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut found: Vec<(usize, ShardOf)> = Vec::with_capacity(keys.len());
    let mut seen = vec![false; tensors.len()];
    for (stored, value) in keys {
        let shown = stored.escape_debug().to_string();
        let bad =
            |why: String| Error::format(format!("{p}: __metadata__ {SHARD_KEY}{shown}: {why}"));
        let &i = index
            .get(stored.as_ref())
            .ok_or_else(|| bad("names no tensor of this file".into()))?;
        if std::mem::replace(&mut seen[i], true) {
            return Err(bad("given twice".into()));
        }
        let t = &tensors[i];
        found.push((
            i,
            shard_meta::parse(&value, &t.shape, t.dtype).map_err(bad)?,
        ));
    }
    for (i, shard) in found {
        tensors[i].shard = Some(shard);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    fn write(dir: &Path, header: &str, data: usize) -> std::path::PathBuf {
        let path = dir.join("t.safetensors");
        let mut h = header.as_bytes().to_vec();
        while !(8 + h.len()).is_multiple_of(8) {
            h.push(b' ');
        }
        let mut f = File::create(&path).unwrap();
        f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
        f.write_all(&h).unwrap();
        f.write_all(&vec![0u8; data]).unwrap();
        path
    }

    #[test]
    fn reads_a_good_header() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            r#"{"__metadata__":{"a":"b"},"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}"#,
            16,
        );
        let (_, h) = open(&p, later()).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "s");
        assert_eq!(h.tensors[1].nbytes, 8);
    }

    #[test]
    fn rejects_duplicates_misalignment_overlap_and_bad_sizes() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                "appears twice",
            ),
            (
                r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}"#,
                "misaligned",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                "overlap",
            ),
            (
                r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                "needs 12",
            ),
            (
                r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                "fall outside",
            ),
            (
                r#"{"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#,
                "not supported",
            ),
            (r#"[1,2]"#, "a JSON object"),
            (
                r#"{"a\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                "NUL",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}"#,
                "more than 8 dimensions",
            ),
        ];
        for (header, want) in cases {
            let p = write(d.path(), header, 8);
            let e = open(&p, later()).unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_FORMAT, "{header}");
            assert!(e.message.contains(want), "{header}: {e}");
        }
        std::fs::write(d.path().join("junk"), b"hello").unwrap();
        let e = open(&d.path().join("junk"), later()).unwrap_err();
        assert!(
            e.message.contains("short") || e.message.contains("not a safetensors"),
            "{e}"
        );
    }
}
