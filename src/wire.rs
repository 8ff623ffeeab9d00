//! The wire format shared by the IPC path and the network paths (rdma, gdr).
//! Documented for implementers in `docs/wire.md`.
//!
//! A frame is `[length u32 LE][type u8][payload]`, `length` counting type and
//! payload. Every length, count and offset is checked against limits before
//! use: nothing a peer sends can make the reader allocate without bound, read
//! past a frame, or (through the plan and the applier) write outside a param.

use crate::manifest::TensorMeta;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, DType, MAX_NDIM};

pub(crate) const MAGIC: u32 = 0x574d_4950; // "WMIP"
pub(crate) const PROTOCOL: u32 = 1;
/// Largest frame accepted (a manifest of ~500k tensors).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// Bucket offsets are multiples of this (SPEC.md).
pub(crate) const ALIGN: u64 = 256;
/// Most shared buffers a session may use.
pub(crate) const MAX_BUFFERS: usize = 8;
/// Largest UCX worker address accepted.
pub(crate) const MAX_ADDRESS: usize = 64 << 10;
/// Longest name or version string.
pub(crate) const MAX_STRING: usize = 4096;

/// One bucket entry: `len` bytes of tensor `tensor` starting at its byte
/// `tensor_offset`, found at `buffer_offset` in the bucket's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    pub tensor: u32,
    pub tensor_offset: u64,
    pub len: u64,
    pub buffer_offset: u64,
}

/// One GPU buffer of a CUDA_BUFFERS frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaBuffer {
    pub handle: [u8; 64],
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Engine to publisher: who asks, for which version ("" = latest).
    Hello {
        rank: u32,
        world_size: u32,
        gpu_id: String,
        version: String,
    },
    /// Publisher to engine: the tensors this rank gets, and their version.
    Manifest {
        version: String,
        tensors: Vec<TensorMeta>,
    },
    /// Engine to publisher: indices of the manifest tensors it wants.
    Want { tensors: Vec<u32> },
    /// Publisher to engine: sizes of the shared buffers whose descriptors
    /// travel with this frame (SCM_RIGHTS).
    Buffers { sizes: Vec<u64> },
    /// Publisher to engine: GPU buffers shared by CUDA IPC (64-byte
    /// `cuIpcGetMemHandle` handles) and their sizes, used like BUFFERS'.
    CudaBuffers { buffers: Vec<CudaBuffer> },
    /// Publisher to engine: bucket `seq` is ready in buffer `buffer`.
    Bucket {
        seq: u64,
        buffer: u32,
        entries: Vec<BucketEntry>,
    },
    /// Engine to publisher: bucket `seq` is applied; its buffer may be reused.
    Ack { seq: u64 },
    /// Publisher to engine: every bucket was sent.
    End { buckets: u64 },
    /// Either way: giving up, with the reason and its `wm_result` code (so a
    /// missing version reads as NOT_FOUND, a wrong secret as AUTH).
    Error { code: u32, text: String },
    /// Network, publisher to engine, after HELLO: prove you hold the secret.
    Challenge { nonce: [u8; 32] },
    /// Network, both ways: an HMAC answer (`transport::auth`); the engine's
    /// carries its own nonce for the publisher to answer, the publisher's a
    /// zero nonce.
    Proof { mac: [u8; 32], nonce: [u8; 32] },
    /// Network, engine to publisher after WANT: where to send the bytes (the
    /// engine's UCX worker address), the largest bucket it takes, how many
    /// buckets may be in flight, and whether each bucket entry comes as its
    /// own message (`direct`: received straight into param memory, gdr).
    Ready {
        address: Vec<u8>,
        bucket_size: u64,
        depth: u32,
        direct: bool,
        /// Asks for a DIGESTS frame after each BUCKET.
        keyed: bool,
    },
    /// Network, publisher to engine, right after BUCKET `seq` when READY
    /// asked for it: the keyed BLAKE3 digest of each entry's bytes, in
    /// entry order (`checksum::keyed`, key from the session).
    Digests { seq: u64, digests: Vec<[u8; 32]> },
}

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

impl Frame {
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "HELLO",
            Frame::Manifest { .. } => "MANIFEST",
            Frame::Want { .. } => "WANT",
            Frame::Buffers { .. } => "BUFFERS",
            Frame::Bucket { .. } => "BUCKET",
            Frame::Ack { .. } => "ACK",
            Frame::End { .. } => "END",
            Frame::Error { .. } => "ERROR",
            Frame::Challenge { .. } => "CHALLENGE",
            Frame::Proof { .. } => "PROOF",
            Frame::Ready { .. } => "READY",
            Frame::CudaBuffers { .. } => "CUDA_BUFFERS",
            Frame::Digests { .. } => "DIGESTS",
        }
    }

    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Out(vec![0; 4]);
        match self {
            Frame::Hello {
                rank,
                world_size,
                gpu_id,
                version,
            } => {
                o.u8(1);
                o.u32(MAGIC);
                o.u32(PROTOCOL);
                o.u32(*rank);
                o.u32(*world_size);
                o.str(gpu_id);
                o.str(version);
            }
            Frame::Manifest { version, tensors } => {
                o.u8(2);
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
                }
            }
            Frame::Want { tensors } => {
                o.u8(3);
                o.u32(tensors.len() as u32);
                tensors.iter().for_each(|t| o.u32(*t));
            }
            Frame::Buffers { sizes } => {
                o.u8(4);
                o.u32(sizes.len() as u32);
                sizes.iter().for_each(|s| o.u64(*s));
            }
            Frame::Bucket {
                seq,
                buffer,
                entries,
            } => {
                o.u8(5);
                o.u64(*seq);
                o.u32(*buffer);
                o.u32(entries.len() as u32);
                for e in entries {
                    o.u32(e.tensor);
                    o.u64(e.tensor_offset);
                    o.u64(e.len);
                    o.u64(e.buffer_offset);
                }
            }
            Frame::Ack { seq } => {
                o.u8(6);
                o.u64(*seq);
            }
            Frame::End { buckets } => {
                o.u8(7);
                o.u64(*buckets);
            }
            Frame::Error { code, text } => {
                o.u8(8);
                o.u32(*code);
                o.str(text);
            }
            Frame::Challenge { nonce } => {
                o.u8(9);
                o.0.extend_from_slice(nonce);
            }
            Frame::Proof { mac, nonce } => {
                o.u8(10);
                o.0.extend_from_slice(mac);
                o.0.extend_from_slice(nonce);
            }
            Frame::Ready {
                address,
                bucket_size,
                depth,
                direct,
                keyed,
            } => {
                o.u8(11);
                o.u32(address.len() as u32);
                o.0.extend_from_slice(address);
                o.u64(*bucket_size);
                o.u32(*depth);
                o.u8(*direct as u8);
                o.u8(*keyed as u8);
            }
            Frame::Digests { seq, digests } => {
                o.u8(13);
                o.u64(*seq);
                o.u32(digests.len() as u32);
                digests.iter().for_each(|d| o.0.extend_from_slice(d));
            }
            Frame::CudaBuffers { buffers } => {
                o.u8(12);
                o.u32(buffers.len() as u32);
                for b in buffers {
                    o.0.extend_from_slice(&b.handle);
                    o.u64(b.size);
                }
            }
        }
        let len = (o.0.len() - 4) as u32;
        o.0[..4].copy_from_slice(&len.to_le_bytes());
        o.0
    }

    /// Decode the body of a frame (type byte and payload, without the length).
    pub fn decode(body: &[u8]) -> Result<Frame> {
        let mut i = In(body);
        let frame = match i.u8()? {
            1 => {
                if i.u32()? != MAGIC {
                    return Err(Error::peer(
                        "wire: the peer is not a weight_manager peer (bad magic)",
                    ));
                }
                let protocol = i.u32()?;
                if protocol != PROTOCOL {
                    return Err(Error::peer(format!(
                        "wire: the peer speaks protocol version {protocol}; this library speaks {PROTOCOL}"
                    )));
                }
                Frame::Hello {
                    rank: i.u32()?,
                    world_size: i.u32()?,
                    gpu_id: i.str()?,
                    version: i.str()?,
                }
            }
            2 => {
                let version = i.str()?;
                let n = i.count(4 + 4 + 4 + 8 + 1, "tensors")?;
                let mut tensors = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = i.str()?;
                    let raw = i.u32()?;
                    let dtype = DType::from_raw(raw).ok_or_else(|| {
                        Error::peer(format!("wire: tensor '{name}': dtype {raw} is unknown"))
                    })?;
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
                    tensors.push(TensorMeta {
                        name,
                        dtype,
                        shape,
                        nbytes,
                        checksum,
                    });
                }
                Frame::Manifest { version, tensors }
            }
            3 => {
                let n = i.count(4, "tensor indices")?;
                Frame::Want {
                    tensors: (0..n).map(|_| i.u32()).collect::<Result<_>>()?,
                }
            }
            4 => {
                let n = i.count(8, "buffers")?;
                if n == 0 || n > MAX_BUFFERS {
                    return Err(Error::peer(format!(
                        "wire: {n} buffers (1 to {MAX_BUFFERS} allowed)"
                    )));
                }
                Frame::Buffers {
                    sizes: (0..n).map(|_| i.u64()).collect::<Result<_>>()?,
                }
            }
            5 => {
                let seq = i.u64()?;
                let buffer = i.u32()?;
                let n = i.count(28, "bucket entries")?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push(BucketEntry {
                        tensor: i.u32()?,
                        tensor_offset: i.u64()?,
                        len: i.u64()?,
                        buffer_offset: i.u64()?,
                    });
                }
                Frame::Bucket {
                    seq,
                    buffer,
                    entries,
                }
            }
            6 => Frame::Ack { seq: i.u64()? },
            7 => Frame::End { buckets: i.u64()? },
            8 => Frame::Error {
                code: i.u32()?,
                text: i.str()?,
            },
            9 => Frame::Challenge {
                nonce: i.take(32)?.try_into().expect("32"),
            },
            10 => Frame::Proof {
                mac: i.take(32)?.try_into().expect("32"),
                nonce: i.take(32)?.try_into().expect("32"),
            },
            11 => {
                let n = i.u32()? as usize;
                if n == 0 || n > MAX_ADDRESS {
                    return Err(Error::peer(format!(
                        "wire: worker address of {n} bytes (1 to {MAX_ADDRESS} allowed)"
                    )));
                }
                Frame::Ready {
                    address: i.take(n)?.to_vec(),
                    bucket_size: i.u64()?,
                    depth: i.u32()?,
                    direct: flag(i.u8()?, "direct")?,
                    keyed: flag(i.u8()?, "keyed")?,
                }
            }
            13 => {
                let seq = i.u64()?;
                let n = i.count(32, "digests")?;
                let digests = (0..n)
                    .map(|_| Ok(i.take(32)?.try_into().expect("32 bytes")))
                    .collect::<Result<_>>()?;
                Frame::Digests { seq, digests }
            }
            12 => {
                let n = i.count(64 + 8, "GPU buffers")?;
                if n == 0 || n > MAX_BUFFERS {
                    return Err(Error::peer(format!(
                        "wire: {n} GPU buffers (1 to {MAX_BUFFERS} allowed)"
                    )));
                }
                let mut buffers = Vec::with_capacity(n);
                for _ in 0..n {
                    buffers.push(CudaBuffer {
                        handle: i.take(64)?.try_into().expect("64"),
                        size: i.u64()?,
                    });
                }
                Frame::CudaBuffers { buffers }
            }
            t => return Err(Error::peer(format!("wire: unknown frame type {t}"))),
        };
        i.done()?;
        Ok(frame)
    }
}

/// Largest UCX message of a network session: a bucket's entries are split
/// to at most this length, and each travels as its own message. Small enough
/// that the engine verifies (and, staged, copies) each one while its bytes
/// are still in cache, right after they land, instead of reading them back
/// from memory: on the 2-core CI machine, verified direct updates ran at
/// 0.81-1.01 of the raw UCX floor with 1 MiB messages against 0.69-0.78 with
/// 4 MiB (`wm bench net`, the floor using the same message size). Large
/// enough that a message's own cost (tens of microseconds) stays small.
/// Only publishers split; engines take entries of any length.
pub(crate) const NET_MESSAGE: u64 = 1 << 20;

/// The UCX tag of entry `k` of bucket `seq` in a network session:
/// `seq << 32 | (k + 1)`. Publisher and engine both name messages by it.
pub(crate) fn net_tag(seq: u64, k: usize) -> u64 {
    (seq << 32) | (k as u64 + 1)
}

/// [`NET_MESSAGE`], for benchmarks that mirror a session's messages.
pub fn net_message_bytes() -> usize {
    NET_MESSAGE as usize
}

/// Split entries longer than [`NET_MESSAGE`] into consecutive entries of at
/// most that length (a network bucket: one message per entry).
pub fn split_entries(entries: &[BucketEntry]) -> Vec<BucketEntry> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let mut done = 0;
        loop {
            let len = (e.len - done).min(NET_MESSAGE);
            out.push(BucketEntry {
                tensor: e.tensor,
                tensor_offset: e.tensor_offset + done,
                len,
                buffer_offset: e.buffer_offset + done,
            });
            done += len;
            if done >= e.len {
                break;
            }
        }
    }
    out
}

/// Check a bucket's entries against its buffer before any byte is read: each
/// range inside the buffer, 256-byte aligned, entries not overlapping.
pub fn check_bucket(
    seq: u64,
    entries: &[BucketEntry],
    buffer_len: u64,
    tensors: usize,
) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(entries.len());
    for e in entries {
        let bad = |why: String| Err(Error::peer(format!("bucket {seq}: {why}")));
        if e.tensor as usize >= tensors {
            return bad(format!("entry names tensor #{} of {tensors}", e.tensor));
        }
        if e.buffer_offset % ALIGN != 0 {
            return bad(format!(
                "offset {} is not {ALIGN}-byte aligned",
                e.buffer_offset
            ));
        }
        match e.buffer_offset.checked_add(e.len) {
            Some(end) if end <= buffer_len => ranges.push((e.buffer_offset, end)),
            _ => {
                return bad(format!(
                    "{} bytes at {} run past the {buffer_len}-byte buffer",
                    e.len, e.buffer_offset
                ))
            }
        }
    }
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(Error::peer(format!(
            "bucket {seq}: entries overlap in the buffer"
        )));
    }
    Ok(())
}

/// A one-byte flag: 0 or 1.
fn flag(v: u8, what: &str) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        f => Err(Error::peer(format!("wire: {what} flag {f}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(f: Frame) {
        let bytes = f.encode();
        let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(len, bytes.len() - 4);
        assert_eq!(Frame::decode(&bytes[4..]).unwrap(), f);
    }

    #[test]
    fn frames_round_trip() {
        round_trip(Frame::Hello {
            rank: 3,
            world_size: 8,
            gpu_id: "5".into(),
            version: "latest".into(),
        });
        round_trip(Frame::Manifest {
            version: "12".into(),
            tensors: vec![TensorMeta {
                name: "w".into(),
                dtype: DType::Bf16,
                shape: vec![2, 3],
                nbytes: 12,
                checksum: Some(0xabcdef),
            }],
        });
        round_trip(Frame::Want {
            tensors: vec![0, 2],
        });
        round_trip(Frame::Buffers {
            sizes: vec![1 << 20, 1 << 20],
        });
        let mut handle = [0u8; 64];
        handle
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 ^ 0xa5);
        round_trip(Frame::CudaBuffers {
            buffers: vec![CudaBuffer {
                handle,
                size: 3 << 30,
            }],
        });
        round_trip(Frame::Bucket {
            seq: 1,
            buffer: 1,
            entries: vec![BucketEntry {
                tensor: 0,
                tensor_offset: 0,
                len: 12,
                buffer_offset: 256,
            }],
        });
        round_trip(Frame::Ack { seq: 9 });
        round_trip(Frame::End { buckets: 4 });
        round_trip(Frame::Error {
            code: 6,
            text: "boom".into(),
        });
        round_trip(Frame::Challenge { nonce: [7; 32] });
        round_trip(Frame::Proof {
            mac: [1; 32],
            nonce: [2; 32],
        });
        round_trip(Frame::Ready {
            address: vec![1, 2, 3],
            bucket_size: 1 << 29,
            depth: 2,
            direct: true,
            keyed: true,
        });
        round_trip(Frame::Digests {
            seq: 3,
            digests: vec![[7; 32], [9; 32]],
        });
    }

    #[test]
    fn hostile_frames_are_refused() {
        let mut hello = Frame::Hello {
            rank: 0,
            world_size: 1,
            gpu_id: "0".into(),
            version: String::new(),
        }
        .encode();
        hello[9] = 99; // protocol version
        assert!(Frame::decode(&hello[4..])
            .unwrap_err()
            .message
            .contains("protocol version 99"));
        // A count far larger than the frame: refused before allocating.
        let mut want = vec![3u8];
        want.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Frame::decode(&want)
            .unwrap_err()
            .message
            .contains("cannot fit"));
        // A manifest whose byte size disagrees with its shape.
        let mut m = Frame::Manifest {
            version: "1".into(),
            tensors: vec![TensorMeta {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![4],
                nbytes: 16,
                checksum: None,
            }],
        }
        .encode();
        // A tensor name holding a NUL (it would be cut in a C string).
        let nul = Frame::Manifest {
            version: "1".into(),
            tensors: vec![TensorMeta {
                name: "w\0x".into(),
                dtype: DType::F32,
                shape: vec![4],
                nbytes: 16,
                checksum: None,
            }],
        }
        .encode();
        assert!(Frame::decode(&nul[4..])
            .unwrap_err()
            .message
            .contains("NUL"));
        let at = m.len() - 9; // nbytes field
        m[at] = 17;
        assert!(Frame::decode(&m[4..])
            .unwrap_err()
            .message
            .contains("claims 17 bytes"));
        let mut ready = vec![11u8];
        ready.extend_from_slice(&(MAX_ADDRESS as u32 + 1).to_le_bytes());
        assert!(Frame::decode(&ready)
            .unwrap_err()
            .message
            .contains("worker address"));
        assert!(Frame::decode(&[9, 1, 2])
            .unwrap_err()
            .message
            .contains("ends early"));
        assert!(Frame::decode(&[42])
            .unwrap_err()
            .message
            .contains("unknown frame type"));
        // GPU buffers: none, or more than the limit.
        let mut none = vec![12u8];
        none.extend_from_slice(&0u32.to_le_bytes());
        assert!(Frame::decode(&none)
            .unwrap_err()
            .message
            .contains("0 GPU buffers"));
        let many = Frame::CudaBuffers {
            buffers: vec![
                CudaBuffer {
                    handle: [0; 64],
                    size: 1
                };
                MAX_BUFFERS + 1
            ],
        }
        .encode();
        assert!(Frame::decode(&many[4..])
            .unwrap_err()
            .message
            .contains("GPU buffers (1 to"));
        let e = |off, len| BucketEntry {
            tensor: 0,
            tensor_offset: 0,
            len,
            buffer_offset: off,
        };
        assert!(check_bucket(0, &[e(0, 100)], 1024, 1).is_ok());
        assert!(check_bucket(0, &[e(10, 100)], 1024, 1)
            .unwrap_err()
            .message
            .contains("aligned"));
        assert!(check_bucket(0, &[e(768, 512)], 1024, 1)
            .unwrap_err()
            .message
            .contains("run past"));
        assert!(check_bucket(0, &[e(0, 512), e(256, 10)], 1024, 1)
            .unwrap_err()
            .message
            .contains("overlap"));
        assert!(check_bucket(0, &[e(0, 1)], 1024, 0)
            .unwrap_err()
            .message
            .contains("#0"));
    }

    #[test]
    fn network_entries_split_at_the_message_size() {
        let m = NET_MESSAGE;
        let e = |tensor, off, len| BucketEntry {
            tensor,
            tensor_offset: 0,
            len,
            buffer_offset: off,
        };
        let split = split_entries(&[e(0, 0, m), e(1, m, m + m / 2)]);
        let got: Vec<(u32, u64, u64, u64)> = split
            .iter()
            .map(|x| (x.tensor, x.tensor_offset, x.len, x.buffer_offset))
            .collect();
        assert_eq!(got, vec![(0, 0, m, 0), (1, 0, m, m), (1, m, m / 2, 2 * m)]);
        // A zero-length entry stays one entry.
        assert_eq!(split_entries(&[e(3, 0, 0)]).len(), 1);
    }
}
