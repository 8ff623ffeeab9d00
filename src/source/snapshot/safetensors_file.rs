//! Strict reading of a safetensors header.
//!
//! The `safetensors` crate accepts duplicate tensor names (the last one wins)
//! and does not check alignment, so headers are parsed here: the JSON object
//! is read entry by entry, and a duplicate name, an overlapping or
//! out-of-file range, a size that disagrees with dtype and shape, or a tensor
//! whose first byte is not a multiple of its element size is an error naming
//! the file and the tensor. Only the header is read; tensor bytes are read
//! later straight into their destination.

use crate::result::{Error, Result};
use crate::tensor::{byte_size, shape_text, DType};
use serde::de::{Deserializer, MapAccess, Visitor};
use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Largest header accepted (the safetensors format's own limit).
const MAX_HEADER: u64 = 100_000_000;

#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's first byte in the file.
    pub offset: u64,
    pub nbytes: u64,
}

#[derive(Clone, Debug)]
pub struct SafetensorsHeader {
    /// In file order (ascending offset).
    pub tensors: Vec<TensorEntry>,
    pub file_len: u64,
}

struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(kv) = m.next_entry::<String, serde_json::Value>()? {
                    v.push(kv);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn read_exact_at(file: &File, buf: &mut [u8], offset: u64, path: &Path) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::format(format!(
                "{}: file too short for its safetensors header",
                path.display()
            ))
        } else {
            Error::io(format!("reading {}", path.display()), e)
        }
    })
}

/// Read and check the header of an open safetensors file.
pub fn read_header(file: &File, path: &Path) -> Result<SafetensorsHeader> {
    let p = path.display();
    let file_len = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {p}"), e))?
        .len();
    let mut n8 = [0u8; 8];
    read_exact_at(file, &mut n8, 0, path)?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > file_len.saturating_sub(8) {
        return Err(Error::format(format!(
            "{p}: not a safetensors file (header length {n} does not fit a {file_len}-byte file)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    read_exact_at(file, &mut header, 8, path)?;
    let entries: Entries = serde_json::from_slice(&header)
        .map_err(|e| Error::format(format!("{p}: safetensors header is not a JSON object: {e}")))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut seen = HashSet::new();
    let mut tensors = Vec::new();
    for (name, value) in entries.0 {
        if name == "__metadata__" {
            continue;
        }
        if !seen.insert(name.clone()) {
            return Err(Error::format(format!(
                "{p}: tensor '{name}' appears twice in the header"
            )));
        }
        let bad = |why: &str| Error::format(format!("{p}: tensor '{name}': {why}"));
        let obj = value
            .as_object()
            .ok_or_else(|| bad("entry is not an object"))?;
        let dtype_name = obj
            .get("dtype")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad("no dtype"))?;
        let dtype = DType::from_safetensors_name(dtype_name)
            .ok_or_else(|| bad(&format!("dtype '{dtype_name}' is not supported")))?;
        let shape: Vec<u64> = obj
            .get("shape")
            .and_then(|v| v.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .ok_or_else(|| bad("shape is not a list of non-negative integers"))?;
        let offsets: Vec<u64> = obj
            .get("data_offsets")
            .and_then(|v| v.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .filter(|v: &Vec<u64>| v.len() == 2)
            .ok_or_else(|| bad("data_offsets is not [begin, end]"))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if end < begin || end > data_len {
            return Err(bad(&format!(
                "data_offsets [{begin}, {end}] fall outside the {data_len} data bytes of the file"
            )));
        }
        let nbytes = byte_size(&format!("tensor '{name}'"), dtype, &shape)
            .map_err(|e| Error::format(format!("{p}: {}", e.message)))?;
        if end - begin != nbytes {
            return Err(bad(&format!(
                "holds {} bytes but {dtype} {} needs {nbytes}",
                end - begin,
                shape_text(&shape)
            )));
        }
        let offset = data_start + begin;
        if offset % dtype.size() as u64 != 0 {
            return Err(bad(&format!(
                "starts at byte {offset}, not a multiple of its {}-byte element size (misaligned data)",
                dtype.size()
            )));
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape,
            offset,
            nbytes,
        });
    }
    tensors.sort_by_key(|t| (t.offset, t.nbytes));
    for w in tensors.windows(2) {
        if w[1].offset < w[0].offset + w[0].nbytes {
            return Err(Error::format(format!(
                "{p}: tensors '{}' and '{}' overlap",
                w[0].name, w[1].name
            )));
        }
    }
    Ok(SafetensorsHeader { tensors, file_len })
}

/// Open `path` and read its header.
pub fn open(path: &Path) -> Result<(File, SafetensorsHeader)> {
    let file = File::open(path).map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            crate::wm_result::WM_ERR_NOT_FOUND
        } else {
            crate::wm_result::WM_ERR_IO
        };
        Error::new(code, format!("opening {}: {e}", path.display()))
    })?;
    let header = read_header(&file, path)?;
    Ok((file, header))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, header: &str, data: usize) -> std::path::PathBuf {
        let path = dir.join("t.safetensors");
        let mut h = header.as_bytes().to_vec();
        while (8 + h.len()) % 8 != 0 {
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
        let (_, h) = open(&p).unwrap();
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
            (r#"[1,2]"#, "not a JSON object"),
        ];
        for (header, want) in cases {
            let p = write(d.path(), header, 8);
            let e = open(&p).unwrap_err();
            assert_eq!(e.code, crate::wm_result::WM_ERR_FORMAT, "{header}");
            assert!(e.message.contains(want), "{header}: {e}");
        }
        std::fs::write(d.path().join("junk"), b"hello").unwrap();
        let e = open(&d.path().join("junk")).unwrap_err();
        assert!(
            e.message.contains("short") || e.message.contains("not a safetensors"),
            "{e}"
        );
    }
}
