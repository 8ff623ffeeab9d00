//! Helpers of the FP8 tests (tests/quantized.rs, tests/device_quant.rs):
//! the whole-tensor reference the updates are compared with, and four
//! publishers each serving 75 rows of a `[300, 256]` bf16 tensor (every
//! 128-row block split over two or three of them).

use super::{write_safetensors, write_version, T};
use std::path::Path;
use weight_manager_core::quant::{quantize, Scheme, Source};
use weight_manager_core::{DType, Placement, Publisher, PublisherConfig, SourceKind, TensorDesc};

/// The FP8 bytes and scales of a whole `[..., rows, cols]` tensor `t`
/// (leading dimensions a batch of matrices with 128x128 blocks; one scale
/// for all of it per tensor; MXFP8 rows of blocks of 32, its scales as
/// `2^e`: [`scale_bytes`] gives the param's bytes).
pub fn reference(t: &T, scheme: Scheme) -> (Vec<u8>, Vec<f32>) {
    let n = t.shape.len();
    let (rows, cols) = (t.shape[n - 2] as usize, t.shape[n - 1] as usize);
    let (batch, per) = match scheme {
        Scheme::Fp8Block128 => (t.shape[..n - 2].iter().product::<u64>() as usize, rows),
        Scheme::Fp8Tensor | Scheme::Mxfp8 => (1, t.shape[..n - 1].iter().product::<u64>() as usize),
    };
    let [sr, sc] = scheme.scales_shape(per, cols);
    let (mut q, mut s) = (vec![0u8; batch * per * cols], vec![0f32; batch * sr * sc]);
    let esize = t.dtype.size();
    for k in 0..batch {
        let src = Source {
            dtype: t.dtype,
            bytes: &t.data[k * per * cols * esize..(k + 1) * per * cols * esize],
            rows: per,
            cols,
        };
        let (qk, sk) = (
            &mut q[k * per * cols..(k + 1) * per * cols],
            &mut s[k * sr * sc..(k + 1) * sr * sc],
        );
        quantize(scheme, src, qk, sk).unwrap();
    }
    (q, s)
}

/// Four publishers (IPC sockets in `dir`, or the network with `secret`)
/// each serving rows `75 r .. 75 (r + 1)` of `g` (bf16 `[300, 256]`) from
/// host memory, version 1.
pub fn row_publishers(dir: &Path, via: SourceKind, g: &T, secret: &[u8]) -> Vec<Publisher> {
    let row = 256 * 2;
    (0..4u64)
        .map(|r| {
            let p = match via {
                SourceKind::Ipc => {
                    Publisher::bind(&dir.join(format!("p{r}.sock")), PublisherConfig::default())
                        .unwrap()
                }
                _ => Publisher::bind_net(
                    "127.0.0.1:0",
                    PublisherConfig {
                        secret: Some(secret.to_vec()),
                        ..Default::default()
                    },
                )
                .unwrap(),
            };
            let bytes = &g.data[(r * 75 * row) as usize..((r + 1) * 75 * row) as usize];
            let placement = Placement {
                global_shape: g.shape.clone(),
                offset: vec![r * 75, 0],
            };
            let desc = TensorDesc::host("g", DType::Bf16, &[75, 256], bytes.as_ptr(), bytes.len());
            // SAFETY: `g` outlives the serving.
            unsafe { p.add(desc.shard_of(placement)) }.unwrap();
            p.set_version(Some("1".into()));
            p
        })
        .collect()
}

/// Publish `g` as version `v` from four row publishers (75 rows each, so
/// every 128-row block is split between two of them), as published
/// copies: the bases deltas are taken against.
pub fn publish_rows(ps: &[Publisher], g: &T, v: &str) {
    let row = 256 * 2;
    for (r, p) in ps.iter().enumerate() {
        let bytes = &g.data[r * 75 * row..(r + 1) * 75 * row];
        let placement = Placement {
            global_shape: g.shape.clone(),
            offset: vec![r as u64 * 75, 0],
        };
        let desc = TensorDesc::host("g", DType::Bf16, &[75, 256], bytes.as_ptr(), bytes.len());
        p.clear_tensors();
        // SAFETY: `publish` copies the bytes before this returns.
        unsafe { p.add(desc.shard_of(placement)) }.unwrap();
        p.set_version(Some(v.into()));
        p.publish().unwrap();
    }
}

/// A scales param's bytes for the f32 scales [`reference`] gives: f32s,
/// or MXFP8's E8M0 bytes (the exponent field of `2^e`).
pub fn scale_bytes(scheme: Scheme, scales: &[f32]) -> Vec<u8> {
    match scheme {
        Scheme::Mxfp8 => scales.iter().map(|s| (s.to_bits() >> 23) as u8).collect(),
        _ => scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
    }
}

/// A param's f32 values from its little-endian bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `ts` as a one-file snapshot of version `step` in `dir`, with checksums.
pub fn write_snapshot(dir: &Path, ts: &[T], step: &str) {
    write_safetensors(&dir.join("model_state.tp0.0.safetensors"), ts);
    write_version(dir, step);
    weight_manager_core::checkpoint::checksums::write(dir, 1).unwrap();
}
