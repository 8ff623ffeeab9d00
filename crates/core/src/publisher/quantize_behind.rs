//! FP8 images made behind the stream. Once the engine has agreed every
//! block's amax (SCALES), a session's images in host memory are quantized
//! in request order on a thread of their own while the streamer sends the
//! buckets that are ready: quantizing overlaps the wire instead of
//! preceding it (before, every image was made before the first byte left,
//! and an FP8 update over a fast link took longer than the bf16 one).
//!
//! The streamer waits for the images a bucket holds before it packs or
//! sends it ([`Behind::wait_for`], bounded by the bucket timeout); a
//! failed or stopped maker fails the wait with its reason. Making one
//! image is [`ImageToMake::make`]: the request's elements quantized with
//! the agreed amax, a band of 128 rows at a time where it holds its blocks
//! whole, else block by block as its runs cross them.

use super::kept_images::{ImageKey, KeptImage};
use super::offer::Offer;
use super::quantize_job::{index_of, parts, pieces, Elements, Job};
use crate::manifest::TensorMeta;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::quant::bands::{self, Wide};
use crate::quant::blocks::{walk, Placed};
use crate::quant::SegmentCaster;
use crate::result::{Error, Result};
use crate::wire::Request;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which of a session's images are made, shared by their maker and the
/// streamer.
pub(super) struct Behind {
    state: Mutex<State>,
    changed: Condvar,
    /// The tensor number of image 0 (images follow the manifest's tensors).
    first_image: usize,
}

struct State {
    /// By image: made (images made before the stream starts are).
    made: Vec<bool>,
    /// Why the images stopped: a maker's error, or the session giving up
    /// ([`Behind::stop`]); the maker makes no image after it.
    failed: Option<Error>,
    /// How long the streamer waited for images.
    waited: Duration,
}

impl Behind {
    /// Images numbered from tensor `first_image`, `made` saying which are.
    pub(super) fn new(first_image: usize, made: Vec<bool>) -> Behind {
        Behind {
            state: Mutex::new(State {
                made,
                failed: None,
                waited: Duration::ZERO,
            }),
            changed: Condvar::new(),
            first_image,
        }
    }

    /// Make `work`'s images in order (`make` each; the image number with
    /// it), marking each made as it is done, until one fails or the
    /// session stops. A panic in `make` fails the session like an error,
    /// with its message (the session ends with an ERROR to the engine,
    /// not a panic of its thread).
    pub(super) fn run<T>(&self, work: Vec<(usize, T)>, make: impl Fn(T) -> Result<()>) {
        for (image, item) in work {
            if self.state.lock().failed.is_some() {
                break;
            }
            let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(item)));
            let failed = match made {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(panic) => Some(Error::state(format!(
                    "quantizing an FP8 image panicked: {}",
                    panic_message(&*panic)
                ))),
            };
            if let Some(e) = failed {
                self.fail(e);
                break;
            }
            self.state.lock().made[image] = true;
            self.changed.notify_all();
        }
    }

    /// Wait until `deadline` for every image among `tensors` (tensor
    /// numbers; those below the first image are the version's own).
    pub(super) fn wait_for(
        &self,
        tensors: impl Iterator<Item = usize>,
        deadline: Instant,
    ) -> Result<()> {
        let images: Vec<usize> = tensors
            .filter_map(|t| t.checked_sub(self.first_image))
            .collect();
        let start = Instant::now();
        let mut s = self.state.lock();
        let r = loop {
            if let Some(e) = &s.failed {
                break Err(e.clone());
            }
            if images
                .iter()
                .all(|&i| s.made.get(i).copied().unwrap_or(true))
            {
                break Ok(());
            }
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                break Err(Error::timeout(
                    "the session's FP8 images were not made within the bucket timeout",
                ));
            }
        };
        s.waited += start.elapsed();
        r
    }

    /// The session gave up: no more images are made (and nobody waits
    /// for them).
    pub(super) fn stop(&self) {
        self.fail(Error::cancelled("the session stopped"));
    }

    /// How long the streamer waited for images.
    pub(super) fn waited(&self) -> Duration {
        self.state.lock().waited
    }

    fn fail(&self, e: Error) {
        self.state.lock().failed.get_or_insert(e);
        self.changed.notify_all();
    }
}

/// An image in host memory to make once the agreed amax is known; owns
/// what it reads but the tensor in memory (which the trainer keeps
/// unchanged while it is served).
pub(super) struct ImageToMake {
    pub(super) job: Job,
    pub(super) request: Request,
    pub(super) meta: TensorMeta,
    pub(super) tensor: Option<SendPtr>,
    pub(super) agreed: Vec<f32>,
    pub(super) image: Arc<HostRegion>,
    /// Kept with the offer once made, as the base of the next version's
    /// deltas and for later sessions of the same request
    /// (`kept_images.rs`).
    pub(super) keep: Option<ImageKey>,
}

impl ImageToMake {
    /// Quantize the request's elements with the blocks' agreed amax into
    /// its image, on `threads`; then keep the image with `offer` when it
    /// is the base of later deltas.
    pub(super) fn make(self, offer: &Offer, threads: usize) -> Result<()> {
        let job = &self.job;
        let q = &self.request;
        let n = q.bytes() as usize;
        // SAFETY: the image is this session's, `n` bytes (its length),
        // written only here; the streamer reads it once it is marked made.
        let image = unsafe { std::slice::from_raw_parts_mut(self.image.ptr(), n) };
        let tensor = self.tensor.map(|p| {
            // SAFETY: the trainer keeps a served tensor's memory valid and
            // unchanged while it is served (`Publisher::add`'s contract).
            unsafe { std::slice::from_raw_parts(p.0, self.meta.nbytes as usize) }
        });
        let elements = Elements {
            tensor,
            wide: job.wide.as_deref(),
            esize: job.dtype.size() as u64,
        };
        match job.own {
            Some((_, rows, cols)) => {
                let wide = Wide {
                    dtype: job.dtype,
                    shape: &[rows, cols],
                    bytes: elements.at(q.runs[0].offset, 0, q.bytes()),
                };
                // The trainer's own memory (`Publisher::add`'s contract).
                bands::write(job.scheme, wide, &self.agreed, image, (threads, false)).map_err(
                    |e| Error::invalid_argument(format!("tensor '{}': {e:?}", self.meta.name)),
                )?;
            }
            None => walk_quantize(
                q,
                job,
                (Placed::of(&self.meta), elements),
                &self.agreed,
                image,
                threads,
            ),
        }
        if let Some(key) = self.keep {
            let made = KeptImage {
                image: self.image.clone(),
                blocks: self.job.blocks.clone(),
                own: self.job.amax.clone(),
                agreed: self.agreed.clone(),
            };
            offer.images.keep(key, made, offer.elements);
        }
        Ok(())
    }
}

/// Job `job`'s elements (of `at`) quantized with the blocks' agreed
/// `amax` into `image`, on `threads`: block by block as the request's
/// runs cross them.
fn walk_quantize(
    q: &Request,
    job: &Job,
    (at, elements): (Placed, Elements),
    amax: &[f32],
    image: &mut [u8],
    threads: usize,
) {
    let parts = parts(q, threads);
    std::thread::scope(|s| {
        let mut rest = &mut image[..];
        for part in parts {
            let (mine, more) = rest.split_at_mut((part.end - part.start) as usize);
            rest = more;
            s.spawn(move || {
                let mut i = 0;
                let mut caster = SegmentCaster::new(job.scheme, job.dtype);
                walk(
                    job.scheme,
                    at,
                    pieces(q, part.clone()),
                    |dst, n, src, block| {
                        i = index_of(&job.blocks, block, i);
                        let a = amax[i];
                        let out =
                            &mut mine[(dst - part.start) as usize..(dst - part.start + n) as usize];
                        let xs = elements.at(src, dst, n);
                        caster.quantize((job.scheme, job.dtype), (i, a), xs, out);
                    },
                );
            });
        }
    });
}

/// What a panic said, when it said it with a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s,
        (_, Some(s)) => s,
        _ => "(no message)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_the_images_a_bucket_holds_and_no_others() {
        let behind = Behind::new(3, vec![true, false, false]);
        let soon = || Instant::now() + Duration::from_millis(20);
        // Tensors of the version, and a made image: no wait.
        assert!(behind.wait_for([0, 2, 3].into_iter(), soon()).is_ok());
        let late = behind.wait_for([4].into_iter(), soon()).unwrap_err();
        assert!(late.message.contains("not made"), "{}", late.message);
        std::thread::scope(|s| {
            s.spawn(|| {
                behind.run(vec![(1, 10), (2, 20)], |ms| {
                    std::thread::sleep(Duration::from_millis(ms));
                    Ok(())
                })
            });
            let deadline = Instant::now() + Duration::from_secs(10);
            assert!(behind.wait_for([5].into_iter(), deadline).is_ok());
        });
        assert!(behind.waited() >= Duration::from_millis(20));
    }

    #[test]
    fn a_failed_or_panicking_maker_fails_the_wait_at_once() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let behind = Behind::new(0, vec![false, false]);
        behind.run(vec![(0, ()), (1, ())], |()| Err(Error::format("bad")));
        let e = behind.wait_for([1].into_iter(), deadline).unwrap_err();
        assert_eq!(e.message, "bad");
        let behind = Behind::new(0, vec![false]);
        behind.run(vec![(0, ())], |()| panic!("in make"));
        let e = behind.wait_for([0].into_iter(), deadline).unwrap_err();
        assert!(e.message.contains("panicked: in make"), "{}", e.message);
        assert!(Instant::now() < deadline);
    }

    #[test]
    fn a_stopped_session_makes_no_more_images() {
        let behind = Behind::new(0, vec![false, false]);
        let made = std::sync::atomic::AtomicUsize::new(0);
        behind.run(vec![(0, ()), (1, ())], |()| {
            made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            behind.stop();
            Ok(())
        });
        assert_eq!(made.into_inner(), 1);
    }
}
