//! One shard checked alone, before it is grouped with others: its byte
//! size against its dtype and shape, and its box inside its global shape.

use super::region::Span;
use crate::manifest::TensorMeta;
use crate::tensor::{byte_size, shape_text};

/// A tensor whose byte size or placement is wrong.
pub(super) fn shard_problem(t: &TensorMeta) -> Option<String> {
    // The name is only formatted for an error (this runs for every shard).
    match byte_size("", t.dtype, &t.shape) {
        Ok(n) if n == t.nbytes => {}
        Ok(n) => {
            return Some(format!(
                "tensor '{}': {} bytes but {} {} needs {n}",
                t.name,
                t.nbytes,
                t.dtype,
                shape_text(&t.shape)
            ))
        }
        Err(_) => {
            let what = format!("tensor '{}'", t.name);
            return byte_size(&what, t.dtype, &t.shape).err().map(|e| e.message);
        }
    }
    let p = t.placement.as_ref()?;
    let inside = p.offset.len() == t.shape.len()
        && p.global_shape.len() == t.shape.len()
        && (0..t.shape.len()).all(|d| {
            p.offset[d]
                .checked_add(t.shape[d])
                .is_some_and(|end| end <= p.global_shape[d])
        });
    (!inside).then(|| {
        format!(
            "tensor '{}': shard {} is not a box of its global shape {}",
            t.name,
            Span::of_shard(t),
            shape_text(&p.global_shape)
        )
    })
}
