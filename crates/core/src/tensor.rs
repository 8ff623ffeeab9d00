//! Element types and shapes, and the byte arithmetic on them.
//!
//! All size math is checked: a shape whose byte size overflows `u64` (or
//! `usize`) is an error naming the tensor, never a wrapped number.

use crate::result::{Error, Result};

/// Most dimensions a param or tensor may have. Real models use at most 5.
pub const MAX_NDIM: usize = 8;

/// Element type of a param or tensor. Numbers are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    F8E4m3 = 3,
    F8E5m2 = 4,
    I8 = 5,
    U8 = 6,
    I32 = 7,
    I64 = 8,
    Bool = 9,
    F64 = 10,
    I16 = 11,
    U16 = 12,
    U32 = 13,
    U64 = 14,
}

impl DType {
    pub(crate) const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F8E4m3,
        DType::F8E5m2,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::F64,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// The dtype for a raw number from C, if it is one.
    pub fn from_raw(raw: u32) -> Option<DType> {
        Self::ALL.get(raw as usize).copied()
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F8E4m3 | DType::F8E5m2 | DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::Bf16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The dtype's name as written in safetensors headers (`BF16`, `F8_E4M3`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::F8E4m3 => "F8_E4M3",
            DType::F8E5m2 => "F8_E5M2",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::Bool => "BOOL",
            DType::F64 => "F64",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::U32 => "U32",
            DType::U64 => "U64",
        }
    }

    /// Parse a safetensors dtype name.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        Self::ALL
            .iter()
            .copied()
            .find(|d| d.safetensors_name() == name)
    }

    /// Short lower-case name for messages and tables (`bf16`).
    pub fn short_name(self) -> String {
        self.safetensors_name()
            .to_ascii_lowercase()
            .replace('_', "")
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.short_name())
    }
}

/// Byte size of a tensor, checked. `what` names the tensor in the error.
pub fn byte_size(what: &str, dtype: DType, shape: &[u64]) -> Result<u64> {
    if shape.len() > MAX_NDIM {
        return Err(Error::invalid_argument(format!(
            "{what}: {} dimensions, at most {MAX_NDIM} are supported",
            shape.len()
        )));
    }
    let mut n: u64 = dtype.size() as u64;
    for &d in shape {
        n = n.checked_mul(d).ok_or_else(|| {
            Error::invalid_argument(format!(
                "{what}: shape {} overflows a 64-bit byte size",
                shape_text(shape)
            ))
        })?;
    }
    if usize::try_from(n).is_err() {
        return Err(Error::invalid_argument(format!(
            "{what}: {n} bytes do not fit this machine's address space"
        )));
    }
    Ok(n)
}

/// `[4096, 11008]`
pub fn shape_text(shape: &[u64]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// Check the name of a `what` ("param", "tensor"): non-empty, at most 1024
/// bytes (NUL is refused where C text is read).
pub fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_argument(format!("{what} name is empty")));
    }
    if name.len() > 1024 {
        return Err(Error::invalid_argument(format!(
            "{what} name '{}...' is {} bytes, at most 1024 are allowed",
            &name[..name.char_indices().nth(32).map_or(name.len(), |(i, _)| i)],
            name.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_numbers_and_names_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as u32, i as u32);
            assert_eq!(DType::from_raw(i as u32), Some(*d));
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(*d));
        }
        assert_eq!(DType::from_raw(99), None);
        assert_eq!(DType::Bf16.short_name(), "bf16");
        assert_eq!(DType::F8E4m3.short_name(), "f8e4m3");
    }

    #[test]
    fn byte_size_is_checked() {
        assert_eq!(byte_size("w", DType::Bf16, &[4, 8]).unwrap(), 64);
        assert_eq!(byte_size("s", DType::F32, &[]).unwrap(), 4);
        assert_eq!(byte_size("z", DType::F32, &[0, 5]).unwrap(), 0);
        let e = byte_size("huge", DType::F64, &[u64::MAX, 2]).unwrap_err();
        assert!(e.message.contains("huge") && e.message.contains("overflows"));
        let e = byte_size("deep", DType::U8, &[1; 9]).unwrap_err();
        assert!(e.message.contains("9 dimensions"));
    }
}
