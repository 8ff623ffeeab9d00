//! Made-up models for the demo and the benchmarks, written as real
//! safetensors files.

use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;
use weight_manager_core::DType;

pub struct FakeTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        _ => Dtype::U8,
    }
}

/// Fill `buf` with bytes that depend on `seed` (xorshift, 8 bytes at a time).
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for b in chunks.into_remainder() {
        *b = x as u8;
    }
}

pub fn tensor(name: String, dtype: DType, shape: &[u64], seed: u64) -> FakeTensor {
    let n = shape.iter().product::<u64>() as usize * dtype.size();
    let mut data = vec![0u8; n];
    let name_seed = name
        .bytes()
        .fold(seed, |a, b| a.wrapping_mul(131).wrapping_add(b as u64));
    fill(&mut data, name_seed);
    FakeTensor {
        name,
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// A small transformer-shaped model (about 50 MiB).
pub fn demo_model(seed: u64) -> Vec<FakeTensor> {
    let mut ts = vec![tensor(
        "embed.weight".into(),
        DType::Bf16,
        &[8000, 512],
        seed,
    )];
    for l in 0..8 {
        let p = format!("layers.{l}");
        ts.push(tensor(
            format!("{p}.attn.qkv"),
            DType::Bf16,
            &[1536, 512],
            seed,
        ));
        ts.push(tensor(
            format!("{p}.attn.o"),
            DType::Bf16,
            &[512, 512],
            seed,
        ));
        ts.push(tensor(
            format!("{p}.mlp.up"),
            DType::Bf16,
            &[2048, 512],
            seed,
        ));
        ts.push(tensor(
            format!("{p}.mlp.down"),
            DType::Bf16,
            &[512, 2048],
            seed,
        ));
        ts.push(tensor(format!("{p}.norm"), DType::F32, &[512], seed));
    }
    ts
}

pub fn write(path: &Path, tensors: &[FakeTensor]) -> Result<(), String> {
    let views: BTreeMap<String, TensorView> = tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|d| *d as usize).collect();
            let v =
                TensorView::new(st_dtype(t.dtype), shape, &t.data).map_err(|e| e.to_string())?;
            Ok((t.name.clone(), v))
        })
        .collect::<Result<_, String>>()?;
    safetensors::serialize_to_file(views, &None, path)
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

pub fn write_version(dir: &Path, step: u64) -> Result<(), String> {
    std::fs::write(dir.join("version.yaml"), format!("step: {step}\n")).map_err(|e| e.to_string())
}
