//! Encoding frames: `[length u32 LE][type u8][payload]`, one small writer
//! per frame type (the layouts are in `docs/wire.md`).

use super::fields::Out;
use super::{kind, BucketEntry, CudaBuffer, Frame, MAGIC, PROTOCOL};
use crate::manifest::TensorMeta;

impl Frame {
    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Out(vec![0; 4]);
        o.u8(self.kind());
        match self {
            Frame::Hello { .. } => hello(&mut o, self),
            Frame::Manifest {
                version,
                tensors,
                base_kept,
            } => {
                manifest(&mut o, version, tensors);
                o.u8(*base_kept as u8);
            }
            Frame::Want {
                requests,
                base,
                quant,
            } => {
                super::want::encode(&mut o, requests);
                super::deltas::encode_base(&mut o, base);
                super::quant::encode_quant(&mut o, quant);
            }
            Frame::Amax { values } | Frame::Scales { values } => {
                super::quant::encode_values(&mut o, values)
            }
            Frame::Deltas { kept, runs } => super::deltas::encode_deltas(&mut o, *kept, runs),
            Frame::Delta { request, bytes } => {
                o.u32(*request);
                o.0.extend_from_slice(bytes);
            }
            Frame::Buffers { sizes } => {
                o.u32(sizes.len() as u32);
                sizes.iter().for_each(|s| o.u64(*s));
            }
            Frame::Bucket {
                seq,
                buffer,
                entries,
            }
            | Frame::Windows {
                seq,
                buffer,
                entries,
            } => bucket(&mut o, *seq, *buffer, entries),
            Frame::Ack { seq } => o.u64(*seq),
            Frame::End { buckets } => o.u64(*buckets),
            Frame::Error { code, text } => {
                o.u32(*code);
                o.str(text);
            }
            Frame::Challenge { nonce } => o.0.extend_from_slice(nonce),
            Frame::Proof { mac, nonce } => {
                o.0.extend_from_slice(mac);
                o.0.extend_from_slice(nonce);
            }
            Frame::Ready { .. } => ready(&mut o, self),
            Frame::Digests { seq, digests } => {
                o.u64(*seq);
                o.u32(digests.len() as u32);
                digests.iter().for_each(|d| o.0.extend_from_slice(d));
            }
            Frame::CudaBuffers { buffers } => cuda_buffers(&mut o, buffers),
            Frame::Sums { seq, sums } => {
                o.u64(*seq);
                o.u32(sums.len() as u32);
                for (k, sum) in sums {
                    o.u32(*k);
                    o.0.extend_from_slice(&sum.to_le_bytes());
                }
            }
        }
        let len = (o.0.len() - 4) as u32;
        o.0[..4].copy_from_slice(&len.to_le_bytes());
        o.0
    }

    /// The type byte that follows the length.
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => kind::HELLO,
            Frame::Manifest { .. } => kind::MANIFEST,
            Frame::Want { .. } => kind::WANT,
            Frame::Amax { .. } => kind::AMAX,
            Frame::Scales { .. } => kind::SCALES,
            Frame::Deltas { .. } => kind::DELTAS,
            Frame::Delta { .. } => kind::DELTA,
            Frame::Buffers { .. } => kind::BUFFERS,
            Frame::Bucket { .. } => kind::BUCKET,
            Frame::Windows { .. } => kind::WINDOWS,
            Frame::Ack { .. } => kind::ACK,
            Frame::End { .. } => kind::END,
            Frame::Error { .. } => kind::ERROR,
            Frame::Challenge { .. } => kind::CHALLENGE,
            Frame::Proof { .. } => kind::PROOF,
            Frame::Ready { .. } => kind::READY,
            Frame::CudaBuffers { .. } => kind::CUDA_BUFFERS,
            Frame::Digests { .. } => kind::DIGESTS,
            Frame::Sums { .. } => kind::SUMS,
        }
    }
}

fn manifest(o: &mut Out, version: &str, tensors: &[TensorMeta]) {
    o.str(version);
    o.u32(tensors.len() as u32);
    for t in tensors {
        o.str(&t.name);
        o.u32(t.dtype as u32);
        o.u32(t.shape.len() as u32);
        t.shape.iter().for_each(|d| o.u64(*d));
        o.u64(t.nbytes);
        match t.checksum {
            Some(c) => {
                o.u8(1);
                o.0.extend_from_slice(&c.to_le_bytes());
            }
            None => o.u8(0),
        }
        match &t.placement {
            Some(p) => {
                o.u8(1);
                p.global_shape.iter().for_each(|d| o.u64(*d));
                p.offset.iter().for_each(|d| o.u64(*d));
            }
            None => o.u8(0),
        }
    }
}

fn hello(o: &mut Out, f: &Frame) {
    if let Frame::Hello {
        rank,
        world_size,
        gpu_id,
        version,
        base,
    } = f
    {
        o.u32(MAGIC);
        o.u32(PROTOCOL);
        o.u32(*rank);
        o.u32(*world_size);
        o.str(gpu_id);
        o.str(version);
        o.str(base);
    }
}

fn ready(o: &mut Out, f: &Frame) {
    if let Frame::Ready {
        address,
        bucket_size,
        depth,
        direct,
        keyed,
    } = f
    {
        o.u32(address.len() as u32);
        o.0.extend_from_slice(address);
        o.u64(*bucket_size);
        o.u32(*depth);
        o.u8(*direct as u8);
        o.u8(*keyed as u8);
    }
}

fn bucket(o: &mut Out, seq: u64, buffer: u32, entries: &[BucketEntry]) {
    o.u64(seq);
    o.u32(buffer);
    o.u32(entries.len() as u32);
    for e in entries {
        o.u32(e.request);
        o.u64(e.offset);
        o.u64(e.len);
        o.u64(e.buffer_offset);
    }
}

fn cuda_buffers(o: &mut Out, buffers: &[CudaBuffer]) {
    o.u32(buffers.len() as u32);
    for b in buffers {
        o.0.extend_from_slice(&b.handle);
        o.u64(b.size);
    }
}
