//! Little-endian field writer and reader, shared by every framed protocol here.

use super::MAX_STRING;
use crate::result::{Error, Result};

/// Little-endian field writer, shared by every framed protocol here.
pub(crate) struct Out(pub(crate) Vec<u8>);

impl Out {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
}

/// Little-endian field reader: every read is bounds-checked, every count
/// checked against what is left, before anything is allocated.
pub(crate) struct In<'a>(pub(crate) &'a [u8]);

impl<'a> In<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::peer("wire: frame ends early"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub(crate) fn str(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return Err(Error::peer(format!(
                "wire: string of {n} bytes is over the {MAX_STRING} limit"
            )));
        }
        let bytes = self.take(n)?;
        // Names and versions end up in C strings (callbacks, error text):
        // a NUL would cut them there, so no wire string may hold one.
        if bytes.contains(&0) {
            return Err(Error::peer("wire: string holds a NUL byte"));
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::peer("wire: string is not UTF-8"))
    }
    /// A count of items of at least `min_item` bytes each, checked against what is left.
    pub(crate) fn count(&mut self, min_item: usize, what: &str) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.0.len() {
            return Err(Error::peer(format!(
                "wire: {n} {what} cannot fit in the rest of the frame"
            )));
        }
        Ok(n)
    }
    pub(crate) fn done(&self) -> Result<()> {
        if !self.0.is_empty() {
            return Err(Error::peer(format!(
                "wire: {} unexpected bytes at the end of a frame",
                self.0.len()
            )));
        }
        Ok(())
    }
}
