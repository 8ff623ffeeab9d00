//! Block sums: the xxh3-128 of every fixed-size block of a tensor's bytes,
//! so that a rank reading a slice of a tensor can check what it read
//! without reading the whole tensor (`wm manifest` writes them beside the
//! whole-tensor checksums).
//!
//! Block size: [`BLOCK_SIZE`] = 512 KiB, between two costs, both paid by
//! every rank at every update.
//! - Bytes read beyond a slice: a rank reads the blocks covering its
//!   segments, so an outer-dimension slice reads at most one block more at
//!   each end, and n ranks splitting a tensor read at most n - 1 blocks more
//!   than the tensor together (none when the split points fall on block
//!   multiples). Worked out for row splits of real layer shapes (bytes read
//!   by all ranks / tensor bytes, TP 2 / 4 / 8):
//!
//!   | shapes (bf16)                      | 256 KiB             | 512 KiB             | 1 MiB               | 4 MiB               |
//!   |------------------------------------|---------------------|---------------------|---------------------|---------------------|
//!   | DeepSeek-V3 layer (hidden 7168)    | 1.001 / 1.002 / 1.006 | 1.001 / 1.006 / 1.015 | 1.005 / 1.014 / 1.059 | 1.045 / 1.154 / 1.371 |
//!   | Qwen-7B layer (hidden 3584)        | 1.000 / 1.008 / 1.024 | 1.008 / 1.024 / 1.055 | 1.016 / 1.047 / 1.108 | 1.061 / 1.182 / 1.425 |
//!   | Llama-70B layer (hidden 8192)      | 1.000 / 1.000 / 1.000 | 1.000 / 1.000 / 1.000 | 1.000 / 1.000 / 1.000 | 1.000 / 1.000 / 1.020 |
//!
//! - The checksum file: 32 hex digits a block, parsed by every rank at
//!   every update and held decoded (16 bytes a block) while it runs. For a
//!   1T-parameter model in bf16 (2 TB): 233 MiB at 256 KiB, 116 MiB at
//!   512 KiB, 58 MiB at 1 MiB; half that in fp8.
//!
//! 512 KiB keeps large models within 1.5% at TP 8 for a file of 1/16384 of
//! the checkpoint; 1 MiB would read 6% more for DeepSeek-V3 shapes at TP 8,
//! which costs more (GB of extra reads per rank) than the 58 MiB more of
//! file it saves. Hashing is not the trade-off: xxh3-128 of 256 MiB ran at
//! 14.6, 16.4, 15.3, 18.9 and 17.0 GB/s in blocks of 4 KiB, 64 KiB,
//! 256 KiB, 1 MiB and 4 MiB (one core, the shared 2-core machine), far
//! above its page-cache pread rate (2-4 GB/s a core).

use crate::manifest::parse_checksum_hex;
use crate::result::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The block size `wm manifest` writes.
pub const BLOCK_SIZE: u64 = 512 << 10;
/// Block sizes a checksum file may name: powers of two in this range (the
/// largest must fit the snapshot source's read window).
pub const MIN_BLOCK_SIZE: u64 = 4 << 10;
pub const MAX_BLOCK_SIZE: u64 = 8 << 20;
/// Hex digits of one block's sum.
const HEX_PER_BLOCK: usize = 32;

/// One tensor's block sums: block `i` is bytes `[i * block, (i + 1) *
/// block)` of the tensor (the last one shorter).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSums {
    pub block: u64,
    pub sums: Vec<u128>,
}

/// A block size read from a checksum file, checked.
pub fn check_block_size(size: u64) -> std::result::Result<u64, String> {
    if size.is_power_of_two() && (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&size) {
        return Ok(size);
    }
    Err(format!(
        "block_size {size} is not a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}"
    ))
}

/// The number of blocks of `nbytes` bytes in blocks of `block`.
pub fn block_count(nbytes: u64, block: u64) -> u64 {
    nbytes.div_ceil(block)
}

impl BlockSums {
    /// Decode `hex` (the sums back to back, 32 hex digits each) for a
    /// tensor of `nbytes` bytes; the error says what is wrong with it.
    pub fn decode(hex: &str, block: u64, nbytes: u64) -> std::result::Result<BlockSums, String> {
        let want = block_count(nbytes, block);
        let have = hex.len() / HEX_PER_BLOCK;
        if !hex.len().is_multiple_of(HEX_PER_BLOCK) || have as u64 != want {
            return Err(format!(
                "{} hex digits hold {} block sums, but {nbytes} bytes in blocks of {block} \
                 are {want} blocks ({HEX_PER_BLOCK} digits each)",
                hex.len(),
                hex.len() as f64 / HEX_PER_BLOCK as f64
            ));
        }
        let sums = hex
            .as_bytes()
            .chunks(HEX_PER_BLOCK)
            .enumerate()
            .map(|(i, digits)| {
                std::str::from_utf8(digits)
                    .ok()
                    .and_then(parse_checksum_hex)
                    .ok_or_else(|| format!("the sum of block {i} is not 32 hex digits"))
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(BlockSums { block, sums })
    }

    /// The sums as written in the checksum file.
    pub fn encode(&self) -> String {
        self.sums
            .iter()
            .map(|s| crate::manifest::checksum_hex(*s))
            .collect()
    }

    /// Check `bytes`, the tensor's bytes from block `first` on (whole
    /// blocks, the last one possibly the tensor's short last block);
    /// `what` names the tensor and file in the error.
    pub fn check(&self, first: u64, bytes: &[u8], what: &dyn Fn() -> String) -> Result<()> {
        for (i, block) in bytes.chunks(self.block as usize).enumerate() {
            let index = first + i as u64;
            let want = self.sums.get(index as usize).copied();
            let got = crate::checksum::of(block);
            if want != Some(got) {
                let start = index * self.block;
                return Err(Error::checksum(format!(
                    "{}: block {index} (bytes {start}..{} of the tensor): checksum mismatch \
                     against its block sum (expected {}, got {})",
                    what(),
                    start + block.len() as u64,
                    want.map_or("none".into(), crate::manifest::checksum_hex),
                    crate::manifest::checksum_hex(got)
                )));
            }
        }
        Ok(())
    }
}

/// The xxh3-128 of `len` bytes of `file` at `offset`, and with `block`
/// the sums of its blocks, read through `buf` (a multiple of `block`
/// long) in one pass.
pub(crate) fn hash_range(
    file: &File,
    (offset, len): (u64, u64),
    block: Option<u64>,
    buf: &mut [u8],
) -> std::io::Result<(u128, Vec<u128>)> {
    let mut whole = crate::checksum::Checksum::default();
    let mut blocks = Vec::new();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], offset + done)?;
        whole.update(&buf[..n]);
        if let Some(b) = block {
            blocks.extend(buf[..n].chunks(b as usize).map(crate::checksum::of));
        }
        done += n as u64;
    }
    Ok((whole.digest(), blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_round_trip_and_counts_are_checked() {
        let s = BlockSums {
            block: 4096,
            sums: vec![1, u128::MAX, 7],
        };
        let hex = s.encode();
        assert_eq!(BlockSums::decode(&hex, 4096, 3 * 4096 - 5).unwrap(), s);
        let e = BlockSums::decode(&hex, 4096, 4 * 4096).unwrap_err();
        assert!(e.contains("are 4 blocks"), "{e}");
        let e = BlockSums::decode(&hex[1..], 4096, 3 * 4096).unwrap_err();
        assert!(e.contains("95 hex digits"), "{e}");
        let bad = format!("{}zz{}", &hex[..32], &hex[34..]);
        let e = BlockSums::decode(&bad, 4096, 3 * 4096).unwrap_err();
        assert!(e.contains("block 1"), "{e}");
    }

    #[test]
    fn block_sizes_are_bounded_powers_of_two() {
        assert_eq!(check_block_size(BLOCK_SIZE), Ok(BLOCK_SIZE));
        for bad in [0, 3, 1024, 3 << 20, 1 << 40, u64::MAX] {
            assert!(check_block_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_changed_byte_names_its_block() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let s = BlockSums {
            block: 4096,
            sums: data.chunks(4096).map(crate::checksum::of).collect(),
        };
        s.check(0, &data, &|| "t".into()).unwrap();
        s.check(1, &data[4096..], &|| "t".into()).unwrap();
        let mut bad = data.clone();
        bad[9000] ^= 1;
        let e = s.check(0, &bad, &|| "tensor 'w'".into()).unwrap_err();
        assert!(
            e.message.contains("tensor 'w': block 2 (bytes 8192..10000"),
            "{e}"
        );
    }
}
