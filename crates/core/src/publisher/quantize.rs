//! Quantizing requests to FP8 while serving them (`wire/quant.rs`): for
//! each request WANT asked quantized, read its elements (in request order,
//! from memory or files), send each touched block's amax (AMAX), take the
//! blocks' agreed amax from the engine (SCALES), and quantize the elements
//! into an image of one E4M3 byte each, which the session then serves as a
//! tensor of its own (`Shard::add_image`): the request becomes all of that
//! image, so the buckets, slice sums and both transports carry it as any
//! other tensor. Images in host memory are made behind the stream
//! (`quantize_behind.rs`): [`serve`] returns them to be made while the
//! buckets before them go out. A request of a published host copy whose
//! image an earlier session kept (`kept_images.rs`) is not read: AMAX
//! repeats the amax it was made with, and when the engines agree the same
//! the kept image is served as it is.
//!
//! A NaN or an infinity fails the session naming the tensor and the
//! element (in the global tensor) before AMAX goes out: a diverged trainer
//! does not reach the engine. Memory: while a session quantizes, each
//! quantized request's source bytes (read from files) are held, then its
//! image (one byte per element).

use super::buffers::ImagePool;
use super::kept_images::{ImageKey, KeptImage};
use super::offer::{Offer, Published};
use super::quantize_behind::ImageToMake;
use super::quantize_device;
use super::quantize_job::{index_of, parts, pieces, Elements, Job};
use super::shard::{fill, Shard};
use crate::manifest::TensorMeta;
use crate::memory::SendPtr;
use crate::quant::bands::{self, Wide};
use crate::quant::blocks::{global_index, touched, walk, Placed};
use crate::quant::{segment_amax, QuantError, Scheme};
use crate::result::{try_vec, Error, Result};
use crate::tensor::DType;
use crate::transport::conn::Conn;
use crate::wire::MAX_OVERLAP;
use crate::wire::{
    frames, values_per_frame, BlockValues, BucketEntry, Frame, Gathering, Request, WantRun,
};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// The quantized requests of a session, each with the name of its image
/// (what deltas against it are looked up by).
pub(super) type Images = Vec<(u32, ImageKey)>;

/// What [`serve`] did and left to do.
#[derive(Default)]
pub(super) struct Served {
    /// Source bytes of the quantized requests read and quantized (not those
    /// served a kept image).
    pub read_bytes: u64,
    pub images: Images,
    /// Whether each image (tensor `first_image + i` of the shard) is made.
    pub made: Vec<bool>,
    /// The images still to make, in request order, with their numbers:
    /// [`ImageToMake::make`] each (`quantize_behind.rs`).
    pub to_make: Vec<(usize, ImageToMake)>,
}

/// Answer WANT's quantized requests `quant` of `want` (their runs count
/// elements): AMAX, then SCALES before `deadline`; each then becomes all
/// of its image. Images on the GPU are made here; those in host memory are
/// returned to be made ([`Served::to_make`]).
pub(super) fn serve(
    conn: &mut Conn,
    (offer, shard, pool): (&Offer, &mut Shard, &ImagePool),
    want: &mut [Request],
    quant: &[(u32, Scheme)],
    (threads, deadline): (usize, &dyn Fn() -> Instant),
) -> Result<Served> {
    // Quantized runs count elements: checked against the tensors'.
    let elements: Vec<u64> = (shard.manifest.tensors.iter())
        .map(|t| t.nbytes / t.dtype.size().max(1) as u64)
        .collect();
    check_total(&elements, want, quant)?;
    // A published host copy keeps its images (`kept_images.rs`): a
    // request made by an earlier session of the version is not read again.
    let keeps = matches!(offer.published, Some(Published::Host(_)));
    let mut jobs = Vec::with_capacity(quant.len());
    let mut kept = Vec::with_capacity(quant.len());
    for &(k, scheme) in quant {
        let q = &want[k as usize];
        q.check(k as usize, &elements)?;
        let meta = &shard.manifest.tensors[q.tensor as usize];
        let key = image_key(shard.for_rank[q.tensor as usize], meta, scheme, q);
        let made = (keeps.then(|| offer.images.made(&key)).flatten())
            .filter(|m| m.image.len() as u64 == q.bytes());
        jobs.push(match &made {
            Some(m) => kept_job(shard, q, (k, scheme), m),
            None => read(shard, q, (k, scheme), threads)?,
        });
        kept.push((key, made));
    }
    let agreed = agree(conn, &jobs, deadline)?;
    let mut served = Served::default();
    for ((job, (_, amax)), made) in jobs.into_iter().zip(agreed).zip(kept) {
        let request = job.request;
        let q = want[request as usize].clone();
        let t = place(&mut served, (shard, pool, keeps), (job, &q), (amax, made))?;
        want[request as usize] = Request::whole(t, q.bytes(), q.sums);
    }
    Ok(served)
}

/// AMAX with `jobs`' amax, then SCALES before `deadline`: the blocks'
/// agreed amax, checked (each over as many frames as it takes).
fn agree(conn: &mut Conn, jobs: &[Job], deadline: &dyn Fn() -> Instant) -> Result<BlockValues> {
    let values: BlockValues = jobs.iter().map(|j| (j.request, j.amax.clone())).collect();
    for values in frames(values, values_per_frame()) {
        conn.send(&Frame::Amax { values })?;
    }
    // The engine answers once every publisher's AMAX came: the wait starts
    // now, not before this publisher's own reading.
    let expected = jobs.iter().map(|j| (j.request, j.amax.len())).collect();
    let mut agreed = Gathering::new(expected, "SCALES")?;
    // One deadline for all its frames, not one per frame.
    let until = deadline();
    while !agreed.complete() {
        match conn.recv(until)? {
            Frame::Scales { values } => agreed.take(values, "SCALES")?,
            other => {
                return Err(Error::peer(format!(
                    "expected SCALES, got {}",
                    other.name()
                )))
            }
        }
    }
    let agreed = agreed.into_values();
    check_agreed(jobs, &agreed)?;
    Ok(agreed)
}

/// Request `q`'s image (named `key`) with the blocks' agreed `amax`, added
/// to `shard` as a tensor (its number returned): the kept image `made` when
/// it was made with the same amax, quantized on the GPU for a GPU version,
/// else one to make behind the stream (in `served`, kept with the version
/// when `keeps`).
fn place(
    served: &mut Served,
    (shard, pool, keeps): (&mut Shard, &ImagePool, bool),
    (job, q): (Job, &Request),
    (amax, (key, made)): (Vec<f32>, (ImageKey, Option<KeptImage>)),
) -> Result<u32> {
    let meta = shard.manifest.tensors[job.tensor].clone();
    let number = served.made.len();
    served.images.push((job.request, key.clone()));
    let same = |a: &[f32]| a.iter().zip(&amax).all(|(x, y)| x.to_bits() == y.to_bits());
    if let Some(m) = made.filter(|m| same(&m.agreed)) {
        served.made.push(true);
        return Ok(shard.add_image(m.image));
    }
    served.read_bytes += q.bytes() * job.dtype.size() as u64;
    if let Some(gpu) = job.device {
        let image = quantize_device::image(shard, q, (job.scheme, gpu), &job.blocks, &amax)?;
        served.made.push(true);
        return Ok(shard.add_image(Arc::new(image)));
    }
    let image = Arc::new(pool.take(q.bytes() as usize)?);
    served.made.push(false);
    let to_make = ImageToMake {
        tensor: in_memory(shard, job.tensor).map(|b| SendPtr(b.as_ptr().cast_mut())),
        job,
        request: q.clone(),
        meta,
        agreed: amax,
        image: image.clone(),
        keep: keeps.then_some(key),
    };
    served.to_make.push((number, to_make));
    Ok(shard.add_image(image))
}

/// The name an image of request `q` of tensor `meta` (given to engine rank
/// `rank` alone, or to every rank) with `scheme` is kept by.
fn image_key(rank: Option<u32>, meta: &TensorMeta, scheme: Scheme, q: &Request) -> ImageKey {
    ImageKey {
        rank,
        name: meta.name.clone(),
        dtype: meta.dtype,
        offset: (meta.placement.as_ref()).map_or(Vec::new(), |p| p.offset.clone()),
        scheme,
        runs: q.runs.clone(),
    }
}

/// Request `k` (`q`, with `scheme`) of a version whose earlier session
/// made and kept its image (`made`): its blocks and this publisher's amax
/// of them as they were found then (a published copy does not change), no
/// element read.
fn kept_job(shard: &Shard, q: &Request, (k, scheme): (u32, Scheme), made: &KeptImage) -> Job {
    Job {
        request: k,
        scheme,
        dtype: shard.manifest.tensors[q.tensor as usize].dtype,
        tensor: q.tensor as usize,
        wide: None,
        blocks: made.blocks.clone(),
        amax: made.own.clone(),
        own: None,
        device: None,
    }
}

/// The quantized requests ask for at most [`MAX_OVERLAP`] times the
/// elements the shard holds (a whole copy beside TP pieces of it is two
/// requests, quantized apart): what a session reads and keeps for them
/// (source bytes, then an image of a byte per element) is bounded by the
/// shard, not by the engine's word.
fn check_total(elements: &[u64], want: &[Request], quant: &[(u32, Scheme)]) -> Result<()> {
    let held: u64 = elements.iter().sum();
    let asked = (quant.iter())
        .map(|&(k, _)| want[k as usize].bytes())
        .fold(0u64, u64::saturating_add);
    match asked <= held.saturating_mul(MAX_OVERLAP) {
        true => Ok(()),
        false => Err(Error::peer(format!(
            "WANT asks for {asked} quantized elements, more than {MAX_OVERLAP} times the \
             {held} this rank's tensors hold (the engine's quantized params read the same \
             elements more than {MAX_OVERLAP} times over)"
        ))),
    }
}

/// The elements of tensor `t` of `shard` when it is in memory.
fn in_memory(shard: &Shard, t: usize) -> Option<&[u8]> {
    let ptr = shard.in_memory()?[t];
    let n = shard.manifest.tensors[t].nbytes as usize;
    // SAFETY: the trainer keeps a served tensor's memory valid and
    // unchanged while it is served (`Publisher::add`'s contract).
    Some(unsafe { std::slice::from_raw_parts(ptr.0, n) })
}

/// Check quantized request `k` of `q`'s tensor, read its elements where
/// they are not in memory, and find its blocks' amax (on `threads`; in a
/// GPU version, on that GPU).
fn read(shard: &mut Shard, q: &Request, (k, scheme): (u32, Scheme), threads: usize) -> Result<Job> {
    let meta = &shard.manifest.tensors[q.tensor as usize];
    let dtype = meta.dtype;
    if !matches!(dtype, DType::Bf16 | DType::F16 | DType::F32) {
        return Err(Error::peer(format!(
            "WANT request #{k}: tensor '{}' is {dtype}: FP8 is made from bf16, f16 or f32",
            meta.name
        )));
    }
    let mut job = Job {
        request: k,
        scheme,
        dtype,
        tensor: q.tensor as usize,
        wide: None,
        blocks: Vec::new(),
        amax: Vec::new(),
        own: None,
        device: match &shard.published {
            Some(Published::Device(d)) => Some(d.ordinal()),
            _ => None,
        },
    };
    let esize = dtype.size() as u64;
    // A GPU version's elements stay on the GPU (never viewed as host memory).
    let wide = match job.device.is_none() && in_memory(shard, q.tensor as usize).is_none() {
        true => Some(gather(shard, q, esize, threads)?),
        false => None,
    };
    let meta = &shard.manifest.tensors[q.tensor as usize];
    let at = Placed::of(meta);
    let not_finite = |e: u64| {
        Error::format(format!(
            "tensor '{}': element {:?} (of the global tensor) is not finite: FP8 quantization \
             refuses NaN and infinity, so a diverged trainer's FP8 weights do not reach the engine",
            meta.name,
            global_index(at, e)
        ))
    };
    if let Some(gpu) = job.device {
        (job.blocks, job.amax) =
            quantize_device::amax(shard, q, scheme, gpu)?.map_err(not_finite)?;
        job.amax.iter_mut().for_each(|a| *a = scheme.wire_amax(*a));
        return Ok(job);
    }
    let elements = Elements {
        tensor: in_memory(shard, q.tensor as usize),
        wide: wide.as_deref(),
        esize,
    };
    if let Some(own) = own_blocks(q, scheme, at) {
        let (blocks, amax) =
            own_amax(q, (scheme, own), (dtype, elements), threads).map_err(|e| match e {
                Ok(error) => error,
                Err(element) => not_finite(element),
            })?;
        (job.blocks, job.amax, job.own) = (blocks, amax, Some(own));
    } else {
        job.blocks = touched(scheme, at, pieces(q, 0..q.bytes()));
        job.amax =
            amax(q, (scheme, dtype, at), elements, &job.blocks, threads).map_err(not_finite)?;
    }
    // As reported and agreed (MXFP8: the exponent alone, a byte on the wire).
    job.amax.iter_mut().for_each(|a| *a = scheme.wire_amax(*a));
    job.wide = wide;
    Ok(job)
}

/// Where request `q` holds the blocks it touches whole: all of the global
/// tensor's columns, rows from a multiple of the block's rows (128; 1 for
/// MXFP8) to a multiple of them (or the tensor's end), in one contiguous
/// run of a 2-D shard (an FSDP row shard at block edges, the common case).
/// Then no other source holds a byte of its blocks, the agreed amax is its
/// own, and its amax and its quantizing go a band of 128 rows at a time,
/// on as many threads. Returns (first global row, rows, columns).
fn own_blocks(q: &Request, scheme: Scheme, at: Placed) -> Option<(u64, u64, u64)> {
    let (b, _) = scheme.block_dims()?;
    let [run] = q.runs.as_slice() else {
        return None;
    };
    // 2-D only (checked before any index: a 1-D MXFP8 tensor has no
    // second dimension, and takes the walking path).
    if at.shape.len() != 2 || at.offset.len() != 2 || at.global.len() != 2 || run.rows != 1 {
        return None;
    }
    let cols = at.shape[1];
    let full_rows = cols > 0 && at.offset[1] == 0 && cols == at.global[1];
    if !full_rows || run.offset % cols != 0 || run.len % cols != 0 {
        return None;
    }
    let (first, rows) = (at.offset[0] + run.offset / cols, run.len / cols);
    let ends = (first + rows) % b == 0 || first + rows == at.global[0];
    (first % b == 0 && ends).then_some((first, rows, cols))
}

/// Request `q` ([`own_blocks`]: `(first, rows, cols)`) as bands of its
/// own: its blocks and their amax. Err: Ok(error), or Err(a non-finite
/// element of the tensor).
fn own_amax(
    q: &Request,
    (scheme, (first, rows, cols)): (Scheme, (u64, u64, u64)),
    (dtype, elements): (DType, Elements),
    threads: usize,
) -> std::result::Result<(Vec<u64>, Vec<f32>), std::result::Result<Error, u64>> {
    let wide = Wide {
        dtype,
        shape: &[rows, cols],
        bytes: elements.at(q.runs[0].offset, 0, q.bytes()),
    };
    let amax = bands::amax(scheme, wide, threads).map_err(|e| match e {
        QuantError::NonFinite { index, .. } => Err(q.runs[0].offset + index as u64),
        QuantError::Invalid(why) => Ok(Error::invalid_argument(why)),
        QuantError::Changed { row } => Ok(Error::format(format!(
            "the source changed while it was quantized (from row {row})"
        ))),
    })?;
    let (bh, bw) = scheme.block_dims().expect("own_blocks: a scheme of blocks");
    let (scols, band0) = (cols.div_ceil(bw), first / bh);
    let blocks = (band0 * scols..(band0 + rows.div_ceil(bh)) * scols).collect();
    Ok((blocks, amax))
}

/// Request `q`'s elements of a tensor read from files, in request order.
fn gather(shard: &mut Shard, q: &Request, esize: u64, threads: usize) -> Result<Vec<u8>> {
    let n = (q.bytes() * esize) as usize;
    let mut wide: Vec<u8> = try_vec(n, "reading a quantized request")?;
    wide.resize(n, 0);
    let bytes = Request {
        tensor: q.tensor,
        sums: false,
        runs: (q.runs.iter())
            .map(|r| WantRun {
                offset: r.offset * esize,
                len: r.len * esize,
                rows: r.rows,
                stride: r.stride * esize,
            })
            .collect(),
    };
    let all = BucketEntry {
        request: 0,
        offset: 0,
        len: n as u64,
        buffer_offset: 0,
    };
    fill(
        shard,
        std::slice::from_ref(&bytes),
        &[all],
        wide.as_mut_ptr(),
        threads,
    )?;
    Ok(wide)
}

/// Each of `blocks`' amax over request `q`'s elements, on `threads`; Err:
/// a non-finite element (of the tensor).
fn amax(
    q: &Request,
    (scheme, dtype, at): (Scheme, DType, Placed),
    elements: Elements,
    blocks: &[u64],
    threads: usize,
) -> std::result::Result<Vec<f32>, u64> {
    // Each part's amax over the blocks it touches alone (MXFP8 has a block
    // per 32 elements: a vector of all of them per thread was the
    // request's size again): `(first block index, amax from there)`.
    let one = |part: Range<u64>| {
        let (mut span, mut i) = (None::<(usize, usize)>, 0);
        walk(scheme, at, pieces(q, part.clone()), |_, _, _, block| {
            i = index_of(blocks, block, i);
            span = Some(span.map_or((i, i), |(lo, hi)| (lo.min(i), hi.max(i))));
        });
        let Some((lo, hi)) = span else {
            return Ok((0, Vec::new()));
        };
        let mut amax = vec![0f32; hi - lo + 1];
        let mut bad = None;
        walk(
            scheme,
            at,
            pieces(q, part),
            |dst, n, src, block| match segment_amax(dtype, elements.at(src, dst, n)) {
                Ok(a) => {
                    i = index_of(blocks, block, i);
                    amax[i - lo] = amax[i - lo].max(a);
                }
                Err(i) => {
                    bad.get_or_insert(src + i as u64);
                }
            },
        );
        bad.map_or(Ok((lo, amax)), Err)
    };
    let per_part: Vec<_> = std::thread::scope(|s| {
        let running: Vec<_> = (parts(q, threads).into_iter())
            .map(|part| s.spawn(move || one(part)))
            .collect();
        running
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    let mut amax = vec![0f32; blocks.len()];
    for part in per_part {
        let (lo, found) = part?;
        for (a, b) in amax[lo..].iter_mut().zip(found) {
            *a = a.max(b);
        }
    }
    Ok(amax)
}
/// SCALES names the requests AMAX did, a value per block, none below
/// this publisher's own amax (an agreed amax is the largest of all).
fn check_agreed(jobs: &[Job], agreed: &BlockValues) -> Result<()> {
    if agreed.len() != jobs.len() {
        return Err(Error::peer(format!(
            "SCALES names {} requests, AMAX {}",
            agreed.len(),
            jobs.len()
        )));
    }
    for (j, (k, v)) in jobs.iter().zip(agreed) {
        if *k != j.request || v.len() != j.amax.len() {
            return Err(Error::peer(format!(
                "SCALES: request #{k} with {} blocks, expected #{} with {}",
                v.len(),
                j.request,
                j.amax.len()
            )));
        }
        if v.iter().zip(&j.amax).any(|(a, own)| a < own) {
            return Err(Error::peer(format!(
                "SCALES: request #{k}: an agreed amax below this publisher's own"
            )));
        }
    }
    Ok(())
}
