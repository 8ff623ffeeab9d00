//! The FP8 images a version's sessions made (`quantize.rs`), kept with the
//! version so that the next version can be sent as a delta against the
//! bytes an engine's FP8 params hold: those bytes are the image this
//! publisher made for the same request of the base version.
//!
//! An image is named by what made it: the tensor (the rank it is given to
//! alone, if any, its name, dtype and placement), the scheme and the
//! request's element runs. Engine ranks asking for the same runs of a
//! tensor every rank shares share its image. The agreed amax is not part of
//! the name: the engine's fingerprint decides whether its bytes are the
//! kept image's (a later session of the same request replaces it).
//!
//! A later session of the same version asking for the same request (an
//! engine replica, or a rank pulling again) is served the kept image when
//! the engines agree the same amax: this publisher's own amax of the
//! request is kept with it, so that session reads and quantizes nothing.
//!
//! Kept only for published host copies (the only versions deltas are taken
//! against), and at most one byte per element of the version in all (one
//! FP8 copy): engines whose requests overlap others' beyond that get their
//! images unkept, and their next update comes whole (verdict "no base
//! image"), never a larger memory bill.

use crate::memory::host::HostRegion;
use crate::quant::Scheme;
use crate::tensor::DType;
use crate::wire::WantRun;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// What an image was made from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct ImageKey {
    /// The engine rank the tensor is given to alone (None: every rank's;
    /// tensors given to one rank each may share a name), and the tensor's
    /// name and dtype.
    pub rank: Option<u32>,
    pub name: String,
    pub dtype: DType,
    /// The shard's offset in its global tensor (empty: whole).
    pub offset: Vec<u64>,
    pub scheme: Scheme,
    /// The request's runs, in elements.
    pub runs: Vec<WantRun>,
}

/// A version's kept images, and the bytes they may take.
#[derive(Debug, Default)]
pub(crate) struct KeptImages {
    inner: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    images: HashMap<ImageKey, KeptImage>,
    bytes: u64,
}

/// A kept image and what it was made with.
#[derive(Clone, Debug)]
pub(super) struct KeptImage {
    pub image: Arc<HostRegion>,
    /// The blocks the request touches, this publisher's amax of each over
    /// its elements (what its AMAX said), and the agreed amax the image
    /// was quantized with.
    pub blocks: Vec<u64>,
    pub own: Vec<f32>,
    pub agreed: Vec<f32>,
}

impl KeptImages {
    /// Keep `image` as `key`'s (replacing an earlier one), unless the kept
    /// bytes would pass `limit`. Returns whether it is kept.
    pub(super) fn keep(&self, key: ImageKey, image: KeptImage, limit: u64) -> bool {
        let mut k = self.inner.lock();
        let old = k.images.get(&key).map_or(0, |i| i.image.len() as u64);
        let bytes = k.bytes - old + image.image.len() as u64;
        if bytes > limit {
            return false;
        }
        k.bytes = bytes;
        k.images.insert(key, image);
        true
    }

    /// The image kept as `key`'s.
    pub(super) fn get(&self, key: &ImageKey) -> Option<Arc<HostRegion>> {
        self.inner.lock().images.get(key).map(|i| i.image.clone())
    }

    /// The image kept as `key`'s, with what it was made with.
    pub(super) fn made(&self, key: &ImageKey) -> Option<KeptImage> {
        self.inner.lock().images.get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ImageKey {
        ImageKey {
            rank: None,
            name: name.into(),
            dtype: DType::Bf16,
            offset: vec![],
            scheme: Scheme::Fp8Block128,
            runs: vec![WantRun {
                offset: 0,
                len: 4096,
                rows: 1,
                stride: 0,
            }],
        }
    }

    #[test]
    fn images_are_kept_up_to_the_limit_and_replaced_by_key() {
        let kept = KeptImages::default();
        let region = |n| Arc::new(HostRegion::new("test", n).unwrap());
        let (a, b, c) = (region(4096), region(4096), region(8192));
        let made = |image: &Arc<HostRegion>| KeptImage {
            image: image.clone(),
            blocks: vec![0],
            own: vec![1.5],
            agreed: vec![2.0],
        };
        assert!(kept.keep(key("a"), made(&a), 8192));
        assert!(kept.keep(key("b"), made(&b), 8192));
        assert!(!kept.keep(key("c"), made(&c), 8192), "over the limit");
        assert!(kept.get(&key("c")).is_none());
        // Replacing counts the old image's bytes out.
        assert!(kept.keep(key("a"), made(&b), 8192));
        assert_eq!(kept.get(&key("a")).unwrap().ptr(), b.ptr());
        let again = kept.made(&key("a")).unwrap();
        assert_eq!((again.own, again.agreed), (vec![1.5], vec![2.0]));
    }
}
