//! The checksum of every tensor: XXH3-128 (seed 0), as `wm_checksums.json`
//! names it ("xxh3-128") and as publishers send it in manifests.
//!
//! twox-hash rather than xxhash-rust: it picks its AVX2 code at run time,
//! where xxhash-rust picks at compile time and so runs its SSE2 code in a
//! build for baseline x86-64. Hashing bytes still in cache is then about
//! twice as fast (13-21 against 32-46 GB/s on the 2-core CI machine), which
//! is what a verified network update does with every entry the moment it
//! lands. Same function, same digests (pinned by the tests below).

use twox_hash::XxHash3_128;

/// Bytes of a keyed digest.
pub(crate) const KEYED: usize = 32;

/// The keyed BLAKE3 digest of `bytes`: a MAC, unlike the XXH3 checksum
/// (which catches corruption, not forgery). The network paths use it, when
/// the engine asks, to authenticate every bucket entry's bytes with a key of
/// the session (`transport::auth`). One core hashes about 2-4 GB/s with it
/// where XXH3 does 13-21 (`wm bench net` prints both on the machine at hand).
pub fn keyed(key: &[u8; KEYED], bytes: &[u8]) -> [u8; KEYED] {
    blake3::keyed_hash(key, bytes).into()
}

/// `want` is the keyed digest of `bytes` (compared in constant time).
pub fn keyed_matches(key: &[u8; KEYED], bytes: &[u8], want: &[u8; KEYED]) -> bool {
    blake3::keyed_hash(key, bytes) == blake3::Hash::from(*want)
}

/// The checksum of `bytes` in one call.
pub fn of(bytes: &[u8]) -> u128 {
    XxHash3_128::oneshot(bytes)
}

/// A checksum fed piece by piece (a tensor arriving in chunks).
#[derive(Clone, Default)]
pub struct Checksum(XxHash3_128);

impl Checksum {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    pub fn digest(&self) -> u128 {
        self.0.finish_128()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: u32) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect()
    }

    /// XXH3-128 reference values (the first is the xxHash project's own),
    /// so files and peers hashed by earlier builds still verify.
    #[test]
    fn digests_match_xxh3_128() {
        assert_eq!(of(b""), 0x99aa06d3014798d86001c324468d497f);
        assert_eq!(of(b"weight_manager"), 0x80f74289a7a28ee8bbe9088fe9112cc2);
        assert_eq!(
            of(&pattern((1 << 20) + 13)),
            0xaac1ba13f1a1e2c71d4c47b1ecfd19a8
        );
    }

    #[test]
    fn keyed_digests_depend_on_key_and_every_byte() {
        let data = pattern(100_000);
        let (k1, k2) = ([1u8; KEYED], [2u8; KEYED]);
        let d = keyed(&k1, &data);
        assert!(keyed_matches(&k1, &data, &d));
        assert!(!keyed_matches(&k2, &data, &d));
        let mut flipped = data.clone();
        flipped[77_777] ^= 1;
        assert!(!keyed_matches(&k1, &flipped, &d));
    }

    #[test]
    fn pieces_give_the_one_call_digest() {
        let data = pattern(300_000);
        for step in [1usize, 17, 240, 4096, 65_536] {
            let mut c = Checksum::default();
            for piece in data.chunks(step) {
                c.update(piece);
            }
            assert_eq!(c.digest(), of(&data), "pieces of {step}");
        }
    }
}
