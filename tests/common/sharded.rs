//! Global f32 tensors split by rows over trainer ranks, for the tests of
//! sharded transfer (several publishers, engine params as pieces).

use std::time::Duration;
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::Placement;
use weight_manager_core::TensorBox;
use weight_manager_core::{Publisher, ServeStats, TensorDesc};

pub const F32: u64 = 4;

/// Tests of one binary share UCX (one environment per process) and bind
/// sockets: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A global f32 tensor: its name, shape and bytes (different per name and
/// per `seed`, so a byte from the wrong tensor or version shows).
pub struct Global {
    pub name: &'static str,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

impl Global {
    pub fn new(name: &'static str, shape: &[u64], seed: u8) -> Global {
        let n = shape.iter().product::<u64>() * F32;
        let salt = name
            .bytes()
            .fold(seed, |a, b| a.wrapping_mul(31).wrapping_add(b));
        let bytes = (0..n)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(salt) ^ (i >> 7) as u8)
            .collect();
        Global {
            name,
            shape: shape.to_vec(),
            bytes,
        }
    }

    /// Bytes of one index of dimension 0.
    pub fn row(&self) -> u64 {
        self.shape[1..].iter().product::<u64>() * F32
    }

    /// Rows `from..to` of dimension 0, as bytes.
    pub fn rows(&self, from: u64, to: u64) -> &[u8] {
        &self.bytes[(from * self.row()) as usize..(to * self.row()) as usize]
    }

    /// The row half `r` (of 2) along dimension 0: its box.
    pub fn half(&self, r: u64) -> TensorBox {
        let mut b = TensorBox::whole(&self.shape);
        b.len[0] /= 2;
        b.offset[0] = r * b.len[0];
        b
    }

    /// Add row half `r` (of 2) to `p` as a shard placed in this tensor.
    ///
    /// # Safety
    /// `self` outlives `p`'s use of the bytes (its serving, or a publish,
    /// which copies them).
    pub unsafe fn add_half_to(&self, p: &Publisher, r: u64) {
        let b = self.half(r);
        let bytes = self.rows(b.offset[0], b.offset[0] + b.len[0]);
        let placement = Placement {
            global_shape: self.shape.clone(),
            offset: b.offset.clone(),
        };
        p.add(
            TensorDesc::host(self.name, DType::F32, &b.len, bytes.as_ptr(), bytes.len())
                .shard_of(placement),
        )
        .unwrap();
    }
}

/// A piece: box `offset`/`len` of global `tensor`, at `at` in its param.
pub fn piece(tensor: &str, offset: &[u64], len: &[u64], at: &[u64]) -> Piece {
    Piece {
        tensor: tensor.into(),
        global: TensorBox {
            offset: offset.to_vec(),
            len: len.to_vec(),
        },
        at: at.to_vec(),
    }
}

/// An engine for the sharded tests: host params, no fallback directory,
/// the network with `secret` and small buckets, UCX over TCP.
pub fn net_engine(secret: &str) -> weight_manager_core::Manager {
    use weight_manager_core::{Manager, ManagerConfig, NetSettings};
    std::env::set_var("UCX_TLS", "tcp");
    Manager::new(ManagerConfig {
        fallback_dir: None,
        net: NetSettings {
            secret: Some(secret.as_bytes().to_vec()),
            bucket_size: 4096,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

/// Run `update` while each publisher serves one engine; the publishers'
/// results come back with the update's.
pub fn serving<T>(
    ps: &[Publisher],
    update: impl FnOnce() -> T,
) -> (T, Vec<weight_manager_core::Result<ServeStats>>) {
    std::thread::scope(|s| {
        let serves: Vec<_> = ps
            .iter()
            .map(|p| s.spawn(move || p.serve(1, Duration::from_secs(30))))
            .collect();
        let out = update();
        (out, serves.into_iter().map(|h| h.join().unwrap()).collect())
    })
}

/// What param `spec` must hold of `globals`, element by element.
pub fn expected(spec: &ParamSpec, globals: &[Global]) -> Vec<u8> {
    let n: u64 = spec.shape.iter().product();
    let mut out = vec![0u8; (n * F32) as usize];
    for p in &spec.pieces {
        let g = globals.iter().find(|g| g.name == p.tensor).unwrap();
        let len = &p.global.len;
        let linear =
            |shape: &[u64], at: &[u64]| at.iter().zip(shape).fold(0, |a, (i, d)| a * d + i);
        let count: u64 = len.iter().product();
        for flat in 0..count {
            let mut idx = vec![0u64; len.len()];
            let mut rest = flat;
            for d in (0..len.len()).rev() {
                (idx[d], rest) = (rest % len[d], rest / len[d]);
            }
            let from: Vec<u64> = idx
                .iter()
                .zip(&p.global.offset)
                .map(|(i, o)| i + o)
                .collect();
            let to: Vec<u64> = idx.iter().zip(&p.at).map(|(i, o)| i + o).collect();
            let (s, d) = (
                linear(&g.shape, &from) * F32,
                linear(&spec.shape, &to) * F32,
            );
            out[d as usize..(d + F32) as usize]
                .copy_from_slice(&g.bytes[s as usize..(s + F32) as usize]);
        }
    }
    out
}

/// What rank `rank` of `world_size` asks a publisher for when a test
/// opens a source itself: the latest version, whole, unbounded manifest,
/// 10 s a frame.
pub fn pull(rank: u32, world_size: u32) -> weight_manager_core::internals::source::PullOptions {
    weight_manager_core::internals::source::PullOptions {
        rank,
        world_size,
        gpu_id: "0".into(),
        version: None,
        base: None,
        manifest_tensors: usize::MAX,
        bucket_timeout: Duration::from_secs(10),
        stop: None,
    }
}
