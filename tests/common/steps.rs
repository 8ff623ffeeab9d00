//! A small model and its training steps for the delta tests: each step
//! changes about 2% of the elements (deterministic in the step).

use super::{add_all, tensor, T};
use std::path::Path;
use weight_manager_core::{DType, Publisher, PublisherConfig, SourceKind};

/// A small model: bf16 weights of assorted sizes (one not a multiple of a
/// chunk), an f32 vector.
pub fn first() -> Vec<T> {
    vec![
        tensor("embed", DType::Bf16, &[512, 160], 1),
        tensor("layer.w", DType::Bf16, &[300, 257], 2),
        tensor("layer.b", DType::F32, &[33], 3),
        tensor("head", DType::Bf16, &[64, 64], 4),
    ]
}

/// The next training step: about 2% of elements get new bits
/// (deterministic in `step`).
pub fn next(ts: &[T], step: u64) -> Vec<T> {
    let mut x = step.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    ts.iter()
        .map(|t| {
            let mut t = t.clone();
            let e = t.dtype.size();
            for i in 0..t.data.len() / e {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if x.is_multiple_of(50) {
                    t.data[i * e] = t.data[i * e].wrapping_add(1 + (x >> 8) as u8 % 200);
                }
            }
            t
        })
        .collect()
}

/// A trainer's publisher for `via` (IPC: a socket in `dir`; the network:
/// a loopback port) and the location engines pull from.
pub fn bind_trainer(via: SourceKind, dir: &Path, cfg: PublisherConfig) -> (Publisher, String) {
    match via {
        SourceKind::Ipc => {
            let sock = dir.join("trainer.sock");
            let p = Publisher::bind(&sock, cfg).unwrap();
            (p, sock.display().to_string())
        }
        _ => {
            let p = Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
            let a = p.address();
            (p, a)
        }
    }
}

/// Publish `ts` as version `step-<v>` (a copy the publisher keeps).
pub fn publish_step(p: &Publisher, ts: &[T], v: u64) {
    p.clear_tensors();
    add_all(p, ts);
    p.set_version(Some(format!("step-{v}")));
    p.publish().unwrap();
}
