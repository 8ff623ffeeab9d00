//! Quantizing requests to FP8 while serving them (`wire/quant.rs`): for
//! each request WANT asked quantized, read its elements (in request order,
//! from memory or files), send each touched block's amax (AMAX), take the
//! blocks' agreed amax from the engine (SCALES), and quantize the elements
//! into an image of one E4M3 byte each, which the session then serves as a
//! tensor of its own (`Shard::add_image`): the request becomes all of that
//! image, so the buckets, slice sums and both transports carry it as any
//! other tensor.
//!
//! A NaN or an infinity fails the session naming the tensor and the
//! element (in the global tensor): a diverged trainer does not reach the
//! engine. Memory: while a session quantizes, each quantized request's
//! source bytes are held, then its image (one byte per element).

use super::shard::{fill, Shard};
use crate::manifest::TensorMeta;
use crate::quant::blocks::{global_index, touched, walk, Placed};
use crate::quant::{segment_amax, segment_quantize, Scheme};
use crate::result::{try_vec, Error, Result};
use crate::tensor::DType;
use crate::transport::conn::Conn;
use crate::wire::{BlockValues, BucketEntry, Frame, Request, WantRun};
use std::time::Instant;

/// One quantized request: its source elements and blocks.
struct Job {
    request: u32,
    scheme: Scheme,
    dtype: DType,
    tensor: usize,
    /// Its elements as the tensor holds them, in request order.
    wide: Vec<u8>,
    /// The blocks it touches (`quant::blocks::touched`), and their amax
    /// over its elements.
    blocks: Vec<u64>,
    amax: Vec<f32>,
}

/// Answer WANT's quantized requests `quant` of `want` (their runs count
/// elements): AMAX, then SCALES before `deadline`; each then becomes all
/// of its image. Returns the bytes read for them.
pub(super) fn serve(
    conn: &mut Conn,
    shard: &mut Shard,
    want: &mut [Request],
    quant: &[(u32, Scheme)],
    (threads, deadline): (usize, Instant),
) -> Result<u64> {
    let mut jobs = Vec::with_capacity(quant.len());
    for &(k, scheme) in quant {
        jobs.push(read(shard, &want[k as usize], (k, scheme), threads)?);
    }
    let values: BlockValues = jobs.iter().map(|j| (j.request, j.amax.clone())).collect();
    conn.send(&Frame::Amax { values })?;
    let agreed = match conn.recv(deadline)? {
        Frame::Scales { values } => values,
        other => {
            return Err(Error::peer(format!(
                "expected SCALES, got {}",
                other.name()
            )))
        }
    };
    check_agreed(&jobs, &agreed)?;
    let mut read_bytes = 0;
    for (job, (_, amax)) in jobs.into_iter().zip(agreed) {
        read_bytes += job.wide.len() as u64;
        let q = &want[job.request as usize];
        let image = quantized(shard, q, &job, &amax)?;
        let len = image.len() as u64;
        let sums = q.sums;
        let t = shard.add_image(image);
        want[job.request as usize] = Request::whole(t, len, sums);
    }
    Ok(read_bytes)
}

/// Where tensor `meta` lies in its global tensor.
fn placed(meta: &TensorMeta) -> Placed<'_> {
    match &meta.placement {
        Some(p) => Placed {
            shape: &meta.shape,
            offset: &p.offset,
            global: &p.global_shape,
        },
        None => Placed {
            shape: &meta.shape,
            offset: &ZEROS[..meta.shape.len()],
            global: &meta.shape,
        },
    }
}

const ZEROS: [u64; crate::tensor::MAX_NDIM] = [0; crate::tensor::MAX_NDIM];

/// Request `q` as (tensor element, count, request position) pieces.
fn pieces(q: &Request) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    q.extents(0, q.bytes()).map(|(src, at, len)| (src, len, at))
}

/// Check quantized request `k` of `q`'s tensor, read its elements, and
/// find its blocks' amax.
fn read(shard: &mut Shard, q: &Request, (k, scheme): (u32, Scheme), threads: usize) -> Result<Job> {
    let meta = &shard.manifest.tensors[q.tensor as usize];
    let dtype = meta.dtype;
    if !matches!(dtype, DType::Bf16 | DType::F16 | DType::F32) {
        return Err(Error::peer(format!(
            "WANT request #{k}: tensor '{}' is {dtype}: FP8 is made from bf16, f16 or f32",
            meta.name
        )));
    }
    let esize = dtype.size() as u64;
    // Its runs count elements: checked against the tensors' elements.
    let elements: Vec<u64> = (shard.manifest.tensors.iter())
        .map(|t| t.nbytes / t.dtype.size().max(1) as u64)
        .collect();
    q.check(k as usize, &elements)?;
    let elements = q.bytes();
    let mut wide: Vec<u8> = try_vec((elements * esize) as usize, "reading a quantized request")?;
    wide.resize((elements * esize) as usize, 0);
    let bytes = Request {
        tensor: q.tensor,
        sums: false,
        runs: q
            .runs
            .iter()
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
        len: elements * esize,
        buffer_offset: 0,
    };
    fill(
        shard,
        std::slice::from_ref(&bytes),
        &[all],
        wide.as_mut_ptr(),
        threads,
    )?;
    let meta = &shard.manifest.tensors[q.tensor as usize];
    let at = placed(meta);
    let blocks = touched(scheme, at, pieces(q));
    let mut amax = vec![0f32; blocks.len()];
    let mut bad = None;
    walk(scheme, at, pieces(q), |dst, n, src, block| {
        let xs = &wide[(dst * esize) as usize..((dst + n) * esize) as usize];
        match segment_amax(dtype, xs) {
            Ok(a) => {
                let i = blocks.binary_search(&block).expect("a touched block");
                amax[i] = amax[i].max(a);
            }
            Err(i) => {
                bad.get_or_insert(src + i as u64);
            }
        }
    });
    if let Some(e) = bad {
        return Err(Error::format(format!(
            "tensor '{}': element {:?} (of the global tensor) is not finite: FP8 quantization \
             refuses NaN and infinity, so a diverged trainer does not reach the engine",
            meta.name,
            global_index(at, e)
        )));
    }
    Ok(Job {
        request: k,
        scheme,
        dtype,
        tensor: q.tensor as usize,
        wide,
        blocks,
        amax,
    })
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

/// Job `job`'s elements quantized with the blocks' agreed `amax`.
fn quantized(shard: &Shard, q: &Request, job: &Job, amax: &[f32]) -> Result<Vec<u8>> {
    let meta = &shard.manifest.tensors[job.tensor];
    let esize = job.dtype.size() as u64;
    let mut image: Vec<u8> = try_vec(q.bytes() as usize, "a quantized request's image")?;
    image.resize(q.bytes() as usize, 0);
    walk(job.scheme, placed(meta), pieces(q), |dst, n, _, block| {
        let a = amax[job.blocks.binary_search(&block).expect("a touched block")];
        let xs = &job.wide[(dst * esize) as usize..((dst + n) * esize) as usize];
        segment_quantize(
            job.dtype,
            xs,
            a,
            &mut image[dst as usize..(dst + n) as usize],
        );
    });
    Ok(image)
}
