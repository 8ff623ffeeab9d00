//! Decoding frames: one small reader per frame type. Every length, count
//! and offset is checked against limits before use (see `fields::In`).

use super::fields::In;
use super::{kind, BucketEntry, CudaBuffer, Frame, MAGIC, MAX_ADDRESS, MAX_BUFFERS, PROTOCOL};
use crate::manifest::{Placement, TensorMeta};
use crate::result::{Error, Result};
use crate::tensor::{byte_size, DType, MAX_NDIM};

/// WANT: its requests, base and quantized requests.
fn want(i: &mut In) -> Result<Frame> {
    let requests = super::want::decode(i)?;
    let base = super::deltas::decode_base(i, requests.len())?;
    let quant = super::quant::decode_quant(i, requests.len())?;
    Ok(Frame::Want {
        requests,
        base,
        quant,
    })
}

impl Frame {
    /// Decode the body of a frame (type byte and payload, without the length).
    pub fn decode(body: &[u8]) -> Result<Frame> {
        Frame::decode_within(body, usize::MAX)
    }

    /// [`Frame::decode`], refusing a MANIFEST of more than
    /// `manifest_tensors` tensors before any of them is decoded (a tensor
    /// costs several times its wire bytes once decoded).
    pub fn decode_within(body: &[u8], manifest_tensors: usize) -> Result<Frame> {
        let mut i = In(body);
        let frame = match i.u8()? {
            kind::HELLO => hello(&mut i)?,
            kind::MANIFEST => manifest(&mut i, manifest_tensors)?,
            kind::WANT => want(&mut i)?,
            kind::AMAX | kind::SCALES => super::quant::decode_frame(&mut i, body[0] == kind::AMAX)?,
            kind::DELTAS => {
                let (kept, runs) = super::deltas::decode_deltas(&mut i)?;
                Frame::Deltas { kept, runs }
            }
            kind::DELTA => Frame::Delta {
                request: i.u32()?,
                bytes: i.take(i.0.len())?.to_vec(),
            },
            kind::BUFFERS => {
                let n = buffer_count(&mut i, 8, "buffers")?;
                Frame::Buffers {
                    sizes: (0..n).map(|_| i.u64()).collect::<Result<_>>()?,
                }
            }
            kind::BUCKET => {
                let (seq, buffer, entries) = bucket(&mut i)?;
                Frame::Bucket {
                    seq,
                    buffer,
                    entries,
                }
            }
            kind::WINDOWS => {
                let (seq, buffer, entries) = bucket(&mut i)?;
                Frame::Windows {
                    seq,
                    buffer,
                    entries,
                }
            }
            kind::ACK => Frame::Ack { seq: i.u64()? },
            kind::END => Frame::End { buckets: i.u64()? },
            kind::ERROR => Frame::Error {
                code: i.u32()?,
                text: i.str()?,
            },
            kind::CHALLENGE => Frame::Challenge {
                nonce: i.take(32)?.try_into().expect("32"),
            },
            kind::PROOF => Frame::Proof {
                mac: i.take(32)?.try_into().expect("32"),
                nonce: i.take(32)?.try_into().expect("32"),
            },
            kind::READY => ready(&mut i)?,
            kind::DIGESTS => {
                let seq = i.u64()?;
                let n = i.count(32, "digests")?;
                let digests = (0..n)
                    .map(|_| Ok(i.take(32)?.try_into().expect("32 bytes")))
                    .collect::<Result<_>>()?;
                Frame::Digests { seq, digests }
            }
            kind::CUDA_BUFFERS => cuda_buffers(&mut i)?,
            kind::SUMS => {
                let seq = i.u64()?;
                let n = i.count(4 + 16, "sums")?;
                let sums = (0..n)
                    .map(|_| {
                        let k = i.u32()?;
                        Ok((k, u128::from_le_bytes(i.take(16)?.try_into().expect("16"))))
                    })
                    .collect::<Result<_>>()?;
                Frame::Sums { seq, sums }
            }
            t => return Err(Error::peer(format!("wire: unknown frame type {t}"))),
        };
        i.done()?;
        Ok(frame)
    }
}

fn hello(i: &mut In) -> Result<Frame> {
    if i.u32()? != MAGIC {
        return Err(Error::peer(
            "wire: the peer is not a weight_manager peer (bad magic)",
        ));
    }
    let protocol = i.u32()?;
    if protocol != PROTOCOL {
        // Only engines send HELLO: the publisher reads this, and sends it
        // back in an ERROR frame so that the engine learns it too.
        return Err(Error::peer(format!(
            "wire: the engine speaks protocol version {protocol} and the publisher \
             {PROTOCOL}: run the same weight_manager release on both sides"
        )));
    }
    Ok(Frame::Hello {
        rank: i.u32()?,
        world_size: i.u32()?,
        gpu_id: i.str()?,
        version: i.str()?,
        base: i.str()?,
    })
}

fn manifest(i: &mut In, most: usize) -> Result<Frame> {
    let version = i.str()?;
    let n = i.count(4 + 4 + 4 + 8 + 1 + 1, "tensors")?;
    if n > most {
        return Err(Error::out_of_memory(format!(
            "wire: MANIFEST announces {n} tensors, more than the {most} this engine takes \
             (65536, plus one per 4096 bytes it takes: its params, and what its per-tensor \
             callback may stage)"
        )));
    }
    let mut tensors = Vec::with_capacity(n);
    for _ in 0..n {
        tensors.push(tensor_meta(i)?);
    }
    Ok(Frame::Manifest {
        version,
        tensors,
        base_kept: flag(i.u8()?, "base kept")?,
    })
}

/// One manifest tensor, its byte size checked against its dtype and shape.
fn tensor_meta(i: &mut In) -> Result<TensorMeta> {
    let name = i.str()?;
    let raw = i.u32()?;
    let dtype = DType::from_raw(raw)
        .ok_or_else(|| Error::peer(format!("wire: tensor '{name}': dtype {raw} is unknown")))?;
    let ndim = i.u32()? as usize;
    if ndim > MAX_NDIM {
        return Err(Error::peer(format!(
            "wire: tensor '{name}': {ndim} dimensions"
        )));
    }
    let shape = (0..ndim).map(|_| i.u64()).collect::<Result<Vec<_>>>()?;
    let nbytes = i.u64()?;
    let need = byte_size(&format!("tensor '{name}'"), dtype, &shape)
        .map_err(|e| Error::peer(format!("wire: {}", e.message)))?;
    if need != nbytes {
        return Err(Error::peer(format!(
            "wire: tensor '{name}' claims {nbytes} bytes, its dtype and shape need {need}"
        )));
    }
    let checksum = match i.u8()? {
        0 => None,
        1 => Some(u128::from_le_bytes(i.take(16)?.try_into().expect("16"))),
        f => return Err(Error::peer(format!("wire: checksum flag {f}"))),
    };
    let placement = match i.u8()? {
        0 => None,
        1 => Some(placement(i, &name, dtype, &shape)?),
        f => {
            return Err(Error::peer(format!(
                "wire: tensor '{name}': placement flag {f}"
            )))
        }
    };
    Ok(TensorMeta {
        name,
        dtype,
        shape,
        nbytes,
        checksum,
        placement,
    })
}

/// A shard's placement: global shape and offset, one `u64` per dimension
/// of the shard each, the box inside the global shape and the global
/// tensor's byte size within `u64`.
fn placement(i: &mut In, name: &str, dtype: DType, shape: &[u64]) -> Result<Placement> {
    let mut dims = || {
        (0..shape.len())
            .map(|_| i.u64())
            .collect::<Result<Vec<_>>>()
    };
    let p = Placement {
        global_shape: dims()?,
        offset: dims()?,
    };
    p.check(name, shape)
        .and_then(|()| byte_size(&format!("tensor '{name}' (global)"), dtype, &p.global_shape))
        .map_err(|e| Error::peer(format!("wire: {}", e.message)))?;
    Ok(p)
}

/// BUCKET's and WINDOWS' payload: sequence, buffer, entries.
fn bucket(i: &mut In) -> Result<(u64, u32, Vec<BucketEntry>)> {
    let seq = i.u64()?;
    let buffer = i.u32()?;
    let n = i.count(28, "bucket entries")?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        entries.push(BucketEntry {
            request: i.u32()?,
            offset: i.u64()?,
            len: i.u64()?,
            buffer_offset: i.u64()?,
        });
    }
    Ok((seq, buffer, entries))
}

fn ready(i: &mut In) -> Result<Frame> {
    let n = i.u32()? as usize;
    if n == 0 || n > MAX_ADDRESS {
        return Err(Error::peer(format!(
            "wire: worker address of {n} bytes (1 to {MAX_ADDRESS} allowed)"
        )));
    }
    Ok(Frame::Ready {
        address: i.take(n)?.to_vec(),
        bucket_size: i.u64()?,
        depth: i.u32()?,
        direct: flag(i.u8()?, "direct")?,
        keyed: flag(i.u8()?, "keyed")?,
    })
}

fn cuda_buffers(i: &mut In) -> Result<Frame> {
    let n = buffer_count(i, 64 + 8, "GPU buffers")?;
    let mut buffers = Vec::with_capacity(n);
    for _ in 0..n {
        buffers.push(CudaBuffer {
            handle: i.take(64)?.try_into().expect("64"),
            size: i.u64()?,
        });
    }
    Ok(Frame::CudaBuffers { buffers })
}

/// A count of shared buffers: 1 to `MAX_BUFFERS`, each at least `min_item` bytes.
fn buffer_count(i: &mut In, min_item: usize, what: &str) -> Result<usize> {
    let n = i.count(min_item, what)?;
    if n == 0 || n > MAX_BUFFERS {
        return Err(Error::peer(format!(
            "wire: {n} {what} (1 to {MAX_BUFFERS} allowed)"
        )));
    }
    Ok(n)
}

/// A one-byte flag: 0 or 1.
fn flag(v: u8, what: &str) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        f => Err(Error::peer(format!("wire: {what} flag {f}"))),
    }
}
