//! A tensor shape in a JSON header, bounded while it is parsed: more
//! than `MAX_NDIM` dimensions are refused before they are collected.

use crate::tensor::MAX_NDIM;
use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// A shape, refused while parsing once it has more than `MAX_NDIM` dims.
pub(super) struct Shape(pub(super) Vec<u64>);

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Shape;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "a list of at most {MAX_NDIM} non-negative integers")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> std::result::Result<Shape, A::Error> {
                let mut dims = Vec::new();
                while let Some(d) = s.next_element::<u64>()? {
                    if dims.len() == MAX_NDIM {
                        return Err(serde::de::Error::custom(format!(
                            "shape has more than {MAX_NDIM} dimensions"
                        )));
                    }
                    dims.push(d);
                }
                Ok(Shape(dims))
            }
        }
        d.deserialize_seq(V)
    }
}
