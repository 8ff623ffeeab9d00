//! Helpers shared by the integration tests: real safetensors files written
//! with the `safetensors` crate, deterministic tensor bytes.
#![allow(
    dead_code,
    reason = "each test crate uses only some helpers; an expect would go unfulfilled in those using them all"
)]

pub mod fake_cuda;
pub mod fanout_ranks;
pub mod gpu_parts;
pub mod hostile_windows;
pub mod peak;
pub mod quant;
pub mod sharded;
pub mod steps;
pub mod wm_bin;

pub use wm_bin::WM;

use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;
use weight_manager_core::DType;

pub fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::Bf16 => Dtype::BF16,
        DType::U8 => Dtype::U8,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::F8E4m3 => Dtype::F8_E4M3,
        other => panic!("test helper lacks {other:?}"),
    }
}

/// A tensor for tests: name, dtype, shape, bytes.
#[derive(Clone)]
pub struct T {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// Version `v` of a model of f32 params `p0`, `p1`, ... of `sizes` bytes:
/// every 8-byte word of param `p` holds `v << 48 | p << 40 | word index`,
/// so one word tells which version and place it comes from (a torn param
/// shows two versions).
pub fn word_tagged(v: u64, sizes: &[usize]) -> Vec<T> {
    sizes
        .iter()
        .enumerate()
        .map(|(p, &n)| T {
            name: format!("p{p}"),
            dtype: DType::F32,
            shape: vec![(n / 4) as u64],
            data: (0..n / 8)
                .flat_map(|w| (v << 48 | (p as u64) << 40 | w as u64).to_le_bytes())
                .collect(),
        })
        .collect()
}

/// Deterministic bytes: differ by name and seed.
pub fn tensor(name: &str, dtype: DType, shape: &[u64], seed: u8) -> T {
    let n = shape.iter().product::<u64>() as usize * dtype.size();
    let h = name.bytes().fold(seed as u32, |a, b| {
        a.wrapping_mul(31).wrapping_add(b as u32)
    });
    let data = (0..n)
        .map(|i| (h as usize).wrapping_add(i * 7) as u8)
        .collect();
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

pub fn write_safetensors(path: &Path, tensors: &[T]) {
    let views: BTreeMap<String, TensorView> = tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|d| *d as usize).collect();
            (
                t.name.clone(),
                TensorView::new(st_dtype(t.dtype), shape, &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

pub fn write_version(dir: &Path, step: &str) {
    std::fs::write(dir.join("version.yaml"), format!("step: {step}\n")).unwrap();
}

/// A small model: a few tensors of assorted dtypes.
pub fn model(seed: u8) -> Vec<T> {
    vec![
        tensor("embed.weight", DType::Bf16, &[64, 32], seed),
        tensor("layer0.attn.qkv", DType::F16, &[96, 32], seed),
        tensor("layer0.mlp.up", DType::F32, &[32, 48], seed),
        tensor("layer0.norm", DType::F32, &[32], seed),
        tensor("scale", DType::F8E4m3, &[7], seed),
        tensor("step_count", DType::I64, &[], seed),
    ]
}

/// Library-owned host params for `ts`, as (pointer, length).
pub fn register(m: &weight_manager_core::Manager, ts: &[T]) -> Vec<(*mut u8, usize)> {
    ts.iter()
        .map(|t| {
            m.allocate(&weight_manager_core::ParamSpec::host(
                &t.name, t.dtype, &t.shape,
            ))
            .unwrap()
        })
        .collect()
}

/// Every param holds its tensor's bytes.
pub fn assert_params(ptrs: &[(*mut u8, usize)], ts: &[T]) {
    for ((p, n), t) in ptrs.iter().zip(ts) {
        assert!(
            unsafe { std::slice::from_raw_parts(*p, *n) } == &t.data[..],
            "param {}",
            t.name
        );
    }
}

/// Publish every tensor of `ts` for every rank (`ts` outlives the serving).
pub fn add_all(p: &weight_manager_core::Publisher, ts: &[T]) {
    for t in ts {
        // SAFETY: the caller keeps `ts` alive while `p` serves.
        unsafe {
            p.add(weight_manager_core::TensorDesc::host(
                &t.name,
                t.dtype,
                &t.shape,
                t.data.as_ptr(),
                t.data.len(),
            ))
        }
        .unwrap();
    }
}

/// Update `m` from the publisher at `location` over `source` (30 s
/// timeout), killing the publisher's process `pid` with SIGKILL at the first
/// progress report; the update must fail, and notice within 5 s.
pub fn update_killing_publisher(
    m: &weight_manager_core::Manager,
    source: weight_manager_core::SourceKind,
    location: impl Into<std::path::PathBuf>,
    pid: u32,
) -> weight_manager_core::Error {
    let mut req = weight_manager_core::UpdateRequest::snapshot(location);
    req.source = source;
    req.timeout = std::time::Duration::from_secs(30);
    let mut killed = false;
    let mut kill_after_first = |_: &weight_manager_core::Progress| {
        if !killed {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            killed = true;
        }
        true
    };
    req.hooks.progress = Some(&mut kill_after_first);
    let start = std::time::Instant::now();
    let e = m.update(req).unwrap_err();
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "noticed only after {:?}",
        start.elapsed()
    );
    e
}

/// Shared-memory names (a control cell and its report) unlinked when the
/// test ends.
pub struct ShmNames(pub Vec<String>);

impl Drop for ShmNames {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = weight_manager_core::internals::signal::shm::unlink(n);
            let _ = weight_manager_core::internals::signal::shm::unlink(&format!("{n}.wm_report"));
        }
    }
}

/// Cut the last `by` bytes off `file` (a snapshot truncated under an engine).
pub fn shorten(file: &Path, by: u64) {
    let len = std::fs::metadata(file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(len - by)
        .unwrap();
}

/// A finished child's success and its stdout and stderr together.
pub fn output(c: std::process::Child) -> (bool, String) {
    let out = c.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Every `wm pull --check` engine (one per rank, in rank order) succeeded
/// and found its params equal to the snapshot.
pub fn expect_equal_to_snapshot(engines: Vec<std::process::Child>) {
    for (r, e) in engines.into_iter().enumerate() {
        let (ok, text) = output(e);
        assert!(
            ok && text.contains("equal to the snapshot"),
            "rank {r}: {text}"
        );
    }
}

/// A fake publisher's answer to a WANT that named a base (protocol 6): it
/// keeps no versions, so DELTAS says not kept and everything comes whole.
pub fn decline_base(
    conn: &mut weight_manager_core::internals::transport::conn::Conn,
    want: &weight_manager_core::internals::wire::Frame,
) -> weight_manager_core::Result<()> {
    use weight_manager_core::internals::wire::Frame;
    match want {
        Frame::Want { base: Some(_), .. } => conn.send(&Frame::Deltas {
            kept: false,
            runs: Vec::new(),
        }),
        _ => Ok(()),
    }
}

/// A hand-written engine peer of the publisher at `sock`: HELLO sent (rank
/// 0 of 1, any version), the MANIFEST taken before `deadline`.
pub fn engine_hello(
    sock: &Path,
    deadline: std::time::Instant,
) -> weight_manager_core::internals::transport::conn::Conn {
    use weight_manager_core::internals::transport::conn::Conn;
    use weight_manager_core::internals::wire::Frame;
    let stream = std::os::unix::net::UnixStream::connect(sock).unwrap();
    let mut conn = Conn::new(stream, "the publisher");
    conn.send(&Frame::Hello {
        rank: 0,
        world_size: 1,
        gpu_id: "0".into(),
        version: String::new(),
        base: String::new(),
    })
    .unwrap();
    let Frame::Manifest { .. } = conn.recv(deadline).unwrap() else {
        panic!("no MANIFEST")
    };
    conn
}
