//! Reading layout JSON with errors that name the field (`params[3].shape`)
//! and bounds on every number that sizes something.

use crate::result::{Error, Result};
use crate::tensor::{DType, MAX_NDIM};
use serde_json::{Map, Value};
use std::ops::Range;

/// One JSON object of a layout, with its path for messages.
pub(super) struct Obj<'a> {
    map: &'a Map<String, Value>,
    pub path: String,
}

pub(super) fn bad(path: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid_argument(format!("{path}: {why}"))
}

impl<'a> Obj<'a> {
    /// `v` must be an object with no keys but `allowed`.
    pub fn new(v: &'a Value, path: String, allowed: &[&str]) -> Result<Obj<'a>> {
        let map = v
            .as_object()
            .ok_or_else(|| bad(&path, "must be a JSON object"))?;
        if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(bad(
                &path,
                format!("unknown field '{k}' (known: {})", allowed.join(", ")),
            ));
        }
        Ok(Obj { map, path })
    }

    pub fn field(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    /// A whole number at most `max`.
    pub fn num(&self, key: &str, max: u64) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| bad(&self.field(key), "must be a whole number, 0 or more"))?;
        if n > max {
            return Err(bad(&self.field(key), format!("{n} is more than {max}")));
        }
        Ok(Some(n))
    }

    pub fn need_num(&self, key: &str, max: u64) -> Result<u64> {
        self.num(key, max)?
            .ok_or_else(|| bad(&self.field(key), "is missing"))
    }

    pub fn text(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| bad(&self.field(key), "must be a string")),
        }
    }

    pub fn need_text(&self, key: &str) -> Result<&'a str> {
        self.text(key)?
            .ok_or_else(|| bad(&self.field(key), "is missing"))
    }

    pub fn flag(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(&self.field(key), "must be true or false")),
        }
    }

    /// At most `MAX_NDIM` numbers (a shape, offsets, a place).
    pub fn dims(&self, key: &str) -> Result<Option<Vec<u64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let path = self.field(key);
        let items = v
            .as_array()
            .ok_or_else(|| bad(&path, "must be a list of whole numbers"))?;
        if items.len() > MAX_NDIM {
            return Err(bad(
                &path,
                format!("{} dimensions, at most {MAX_NDIM}", items.len()),
            ));
        }
        items
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| bad(&path, "must be a list of whole numbers"))
            })
            .collect::<Result<Vec<u64>>>()
            .map(Some)
    }

    /// `N` (0..N) or `[first, end]` (first..end), inside 0..`max`.
    pub fn range(&self, key: &str, max: u64) -> Result<Option<Range<u64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let path = self.field(key);
        let r = match (v.as_u64(), v.as_array().map(Vec::as_slice)) {
            (Some(n), _) => 0..n,
            (_, Some([a, b])) => match (a.as_u64(), b.as_u64()) {
                (Some(a), Some(b)) if a < b => a..b,
                _ => return Err(bad(&path, "[first, end] needs whole numbers, first < end")),
            },
            _ => return Err(bad(&path, "must be a count N or a range [first, end]")),
        };
        if r.end > max {
            return Err(bad(&path, format!("ends at {}, past {max}", r.end)));
        }
        Ok(Some(r))
    }

    /// A list of objects.
    pub fn list(&self, key: &str) -> Result<&'a [Value]> {
        match self.get(key) {
            None => Ok(&[]),
            Some(v) => v
                .as_array()
                .map(Vec::as_slice)
                .ok_or_else(|| bad(&self.field(key), "must be a list")),
        }
    }

    /// `dtype` here, else `default`.
    pub fn dtype(&self, default: Option<DType>) -> Result<DType> {
        match self.text("dtype")? {
            Some(s) => parse_dtype(s).ok_or_else(|| {
                bad(
                    &self.field("dtype"),
                    format!("'{s}' is not a dtype (bf16, f16, f32, f8e4m3, i32, ...)"),
                )
            }),
            None => {
                default.ok_or_else(|| bad(&self.field("dtype"), "is missing (no default dtype)"))
            }
        }
    }
}

/// `bf16` or `BF16` (the short or the safetensors name).
pub(super) fn parse_dtype(s: &str) -> Option<DType> {
    DType::ALL
        .iter()
        .copied()
        .find(|d| d.short_name() == s || d.safetensors_name() == s)
}

/// The text of a layout file, parsed; at most `max_bytes`, read no further.
pub(super) fn read_file(path: &std::path::Path, max_bytes: u64) -> Result<Value> {
    use std::io::Read;
    let name = path.display();
    // A FIFO or device would block the read: only regular files.
    let f = crate::checkpoint::regular_file::open_regular(path)
        .map_err(|e| e.context(format!("layout {name}")))?;
    let mut text = Vec::new();
    f.take(max_bytes + 1)
        .read_to_end(&mut text)
        .map_err(|e| Error::io(format!("layout {name}"), e))?;
    if text.len() as u64 > max_bytes {
        return Err(Error::invalid_argument(format!(
            "layout {name}: larger than {max_bytes} bytes"
        )));
    }
    serde_json::from_slice(&text)
        .map_err(|e| Error::invalid_argument(format!("layout {name}: not JSON: {e}")))
}

/// `template` with `{L}` and `{E}` replaced; a placeholder without its
/// number (or a number without its placeholder) is an error at `path`.
pub(super) fn expand(
    template: &str,
    layer: Option<u64>,
    expert: Option<u64>,
    path: &str,
) -> Result<String> {
    let mut s = template.to_string();
    for (tag, value, what) in [("{L}", layer, "layers"), ("{E}", expert, "experts")] {
        match (s.contains(tag), value) {
            (true, Some(v)) => s = s.replace(tag, &v.to_string()),
            (false, None) => {}
            (true, None) => {
                return Err(bad(
                    path,
                    format!("'{template}' uses {tag} but no {what} are given"),
                ))
            }
            (false, Some(_)) => {
                return Err(bad(
                    path,
                    format!("'{template}' needs {tag}: {what} are given"),
                ))
            }
        }
    }
    Ok(s)
}
