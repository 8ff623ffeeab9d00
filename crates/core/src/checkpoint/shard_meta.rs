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

use super::json_shape::Shape;
use crate::manifest::Placement;
use crate::tensor::{byte_size, DType};
use serde::Deserialize;

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

/// The placement in a shard key's JSON `value`, checked against its stored
/// tensor (`stored_shape`, `dtype`).
pub(super) fn parse(value: &str, stored_shape: &[u64], dtype: DType) -> Result<ShardOf, String> {
    let raw: ShardJson = serde_json::from_str(value).map_err(|e| format!("{e}"))?;
    let global = &raw.tensor;
    if global.is_empty() || global.contains('\0') {
        return Err("the global tensor name is empty or holds a NUL byte".into());
    }
    let placement = Placement {
        global_shape: raw.global_shape.0.clone(),
        offset: raw.offset.0.clone(),
    };
    placement
        .check(global, stored_shape)
        .and_then(|()| {
            byte_size(
                &format!("tensor '{global}' (global)"),
                dtype,
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

    fn parse(
        metadata: &str,
    ) -> crate::result::Result<super::super::safetensors_file::SafetensorsHeader> {
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
