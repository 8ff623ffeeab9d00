//! Shard placement in safetensors files.
//!
//! A file may hold shards of global tensors: its `__metadata__` map (string
//! to string, as the safetensors format has it) then holds, per shard, the
//! key `wm.shard.<stored tensor name>` with a JSON value
//!
//! ```text
//! {"tensor": "<global tensor name>", "global_shape": [..], "offset": [..]}
//! ```
//!
//! The stored tensor is the shard's box, row-major; the manifest names it
//! by its global name with that placement. Stored names are free, so one
//! file may hold several shards of one global tensor. A tensor without such
//! a key is whole, as in any safetensors file. `wm shard` writes these.
//!
//! Trust: the value is parsed with the header's bounds (its dimensions
//! refused past `MAX_NDIM` while parsing), the box checked inside the
//! global shape, the global tensor's byte size checked to fit a `u64`, and
//! a key naming no tensor of the file, a key given twice, or a global name
//! holding a NUL are errors naming the file and the tensor.

use super::safetensors_file::{Shape, TensorEntry};
use crate::manifest::Placement;
use crate::result::{Error, Result};
use crate::tensor::byte_size;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::HashMap;

/// The `__metadata__` key prefix of a shard's placement.
pub const SHARD_KEY: &str = "wm.shard.";

/// A stored tensor's global tensor and its place there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardOf {
    /// The global tensor's name.
    pub tensor: String,
    pub placement: Placement,
}

/// The JSON value; unknown fields are ignored, as in tensor entries.
#[derive(Deserialize)]
struct ShardJson {
    tensor: String,
    global_shape: Shape,
    offset: Shape,
}

/// The JSON value of a shard's key (what `wm shard` writes).
pub fn shard_json(global: &str, placement: &Placement) -> String {
    serde_json::json!({
        "tensor": global,
        "global_shape": placement.global_shape,
        "offset": placement.offset,
    })
    .to_string()
}

/// Attach the placements of `keys` (stored name, JSON value; the
/// `__metadata__` entries whose key starts with [`SHARD_KEY`]) to the
/// tensors of the file at `p` (named in errors).
pub(super) fn attach(
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
        let raw: ShardJson = serde_json::from_str(&value).map_err(|e| bad(format!("{e}")))?;
        found.push((i, check(&raw, &tensors[i]).map_err(bad)?));
    }
    for (i, shard) in found {
        tensors[i].shard = Some(shard);
    }
    Ok(())
}

/// A parsed placement checked against its stored tensor.
fn check(raw: &ShardJson, t: &TensorEntry) -> std::result::Result<ShardOf, String> {
    let global = &raw.tensor;
    if global.is_empty() || global.contains('\0') {
        return Err("the global tensor name is empty or holds a NUL byte".into());
    }
    let placement = Placement {
        global_shape: raw.global_shape.0.clone(),
        offset: raw.offset.0.clone(),
    };
    placement
        .check(global, &t.shape)
        .and_then(|()| {
            byte_size(
                &format!("tensor '{global}' (global)"),
                t.dtype,
                &placement.global_shape,
            )
        })
        .map_err(|e| e.message)?;
    Ok(ShardOf {
        tensor: global.clone(),
        placement,
    })
}

#[cfg(test)]
mod tests {
    use super::super::safetensors_file::parse_header;
    use std::path::Path;

    fn parse(metadata: &str) -> crate::Result<super::super::safetensors_file::SafetensorsHeader> {
        let json = format!(
            r#"{{"__metadata__":{{{metadata}}},"a":{{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}}}}"#
        );
        parse_header(
            json.as_bytes(),
            8 + json.len() as u64 + 4,
            Path::new("f.safetensors"),
        )
    }

    #[test]
    fn placements_are_read_and_checked() {
        let place = r#""{\"tensor\":\"w\",\"global_shape\":[4,2],\"offset\":[2,0],\"x\":1}""#;
        let h = parse(&format!(
            r#""format":"pt","other":[1,{{}}],"wm.shard.a":{place}"#
        ))
        .unwrap();
        let shard = h.tensors[0].shard.as_ref().unwrap();
        assert_eq!(shard.tensor, "w");
        assert_eq!(shard.placement.offset, vec![2, 0]);
        let e = parse(&format!(r#""wm.shard.a":{place},"wm.shard.a":{place}"#)).unwrap_err();
        assert!(e.message.contains("wm.shard.a: given twice"), "{e}");
        let e = parse(r#""wm.shard.a":7"#).unwrap_err();
        assert!(e.message.contains("not valid"), "{e}");
    }
}
