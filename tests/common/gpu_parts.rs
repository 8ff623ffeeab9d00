//! Parts of a GPU version over CUDA IPC, the scenario shared by
//! tests/device_ipc.rs (under the fake driver) and tests/gpu.rs (on a real
//! GPU): a `wm serve --gpu 0` trainer process publishing whole tensors as
//! a GPU version, and an engine whose params cut them (a column split, a
//! row range off the 256-byte grid, the column half of a fused QKV), in
//! device or host memory, pulled atomic and in place, verified and not,
//! every byte checked.

use super::sharded::{expected, piece, Global};
use super::WM;
use cudarc::driver::sys;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weight_manager_core::internals::memory::cuda::cuda;
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::SourceKind;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

/// The `wm` program: this build's, or `WM_BIN` (scripts/gpu.sh).
fn wm() -> String {
    WM.to_string_lossy().into_owned()
}

/// The trainer's tensors. "big" rows are 4000 bytes: a row range starts
/// off the 256-byte grid.
pub fn model() -> Vec<Global> {
    vec![
        Global::new("w", &[64, 48], 3),
        Global::new("big", &[1536, 1000], 4),
        Global::new("q", &[32, 48], 5),
        Global::new("k", &[16, 48], 6),
        Global::new("v", &[16, 48], 7),
    ]
}

/// The engine's params, in device or host memory.
pub fn specs(device: bool) -> Vec<ParamSpec> {
    let spec = |name: &str, shape: &[u64], pieces| ParamSpec {
        pieces,
        memory: if device {
            MemoryKind::Device
        } else {
            MemoryKind::Host
        },
        device_ordinal: 0,
        ..ParamSpec::host(name, DType::F32, shape)
    };
    let qkv = |t: &str, rows: u64, at: u64| piece(t, &[0, 24], &[rows, 24], &[at, 0]);
    vec![
        // Columns 8..32 of "w": 64 blocks of 96 bytes, 192 apart.
        spec(
            "w_cols",
            &[64, 24],
            vec![piece("w", &[0, 8], &[64, 24], &[0, 0])],
        ),
        // Columns 100..356 of "big": 1536 blocks of 1024 bytes.
        spec(
            "big_cols",
            &[1536, 256],
            vec![piece("big", &[0, 100], &[1536, 256], &[0, 0])],
        ),
        // Rows 3..1403 of "big": 5.6 MB from byte 12000.
        spec(
            "big_rows",
            &[1400, 1000],
            vec![piece("big", &[3, 0], &[1400, 1000], &[0, 0])],
        ),
        // The column half of q, k and v stacked.
        spec(
            "qkv",
            &[64, 24],
            vec![qkv("q", 32, 0), qkv("k", 16, 32), qkv("v", 16, 48)],
        ),
    ]
}

/// `wm serve --gpu 0` of `globals` for `engines` sessions, in buckets of
/// 5 MiB; version "7" from the folder's version.yaml (no `--version`: a
/// GPU trainer names its version as any served folder does).
pub fn trainer(dir: &Path, globals: &[Global], engines: usize) -> (Child, PathBuf) {
    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    let ts: Vec<super::T> = globals
        .iter()
        .map(|g| super::T {
            name: g.name.into(),
            dtype: DType::F32,
            shape: g.shape.clone(),
            data: g.bytes.clone(),
        })
        .collect();
    super::write_safetensors(&model_dir.join("model.safetensors"), &ts);
    super::write_version(&model_dir, "7");
    let sock = dir.join("gpu.sock");
    let child = Command::new(wm())
        .args(["serve", "--ipc", sock.to_str().unwrap()])
        .arg(&model_dir)
        .args(["--gpu", "0", "--bucket-mib", "5"])
        .args(["--accept-timeout", "60"])
        .args(["--engines", &engines.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, sock)
}

/// Update `m` from the trainer at `sock`, waiting (bounded) for it to
/// listen; a trainer that died first is reported with what it printed.
pub fn pull(
    m: &Manager,
    (sock, trainer): (&Path, Option<&mut Child>),
    mode: Mode,
    verify: bool,
) -> weight_manager_core::Result<()> {
    let start = Instant::now();
    let mut trainer = trainer;
    loop {
        if let Some(t) = trainer.as_deref_mut() {
            if t.try_wait().unwrap().is_some() {
                panic!("the trainer ended: {}", output(t));
            }
        }
        let mut req = UpdateRequest::snapshot(sock);
        req.source = SourceKind::Ipc;
        req.mode = mode;
        req.verify = verify;
        req.timeout = Duration::from_secs(60);
        match m.update(req) {
            Err(e) if e.code == wm_result::WM_ERR_NOT_FOUND => {
                assert!(start.elapsed().as_secs() < 60, "no trainer listened: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other.map(|_| ()),
        }
    }
}

/// What trainer `t` printed, once it ended (killed after 10 s).
pub fn output(t: &mut Child) -> String {
    let start = Instant::now();
    while t.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(10) {
            let _ = t.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    use std::io::Read;
    let mut text = String::new();
    if let Some(mut o) = t.stdout.take() {
        o.read_to_string(&mut text).unwrap();
    }
    if let Some(mut e) = t.stderr.take() {
        e.read_to_string(&mut text).unwrap();
    }
    text
}

/// A param's bytes, from device or host memory.
pub fn read(device: bool, (ptr, len): (*mut u8, usize)) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if device {
        cuda().unwrap().make_current(0).unwrap();
        // SAFETY: a library-owned device param of `len` bytes.
        let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr as u64, len) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    } else {
        // SAFETY: a library-owned host param; nothing writes it now.
        out.copy_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
    }
    out
}

/// Zero every param (device or host), so each byte a case checks moved.
pub fn zero(device: bool, params: &[(*mut u8, usize)]) {
    for &(ptr, len) in params {
        if device {
            cuda().unwrap().make_current(0).unwrap();
            // SAFETY: a library-owned device param of `len` bytes.
            let r = unsafe { sys::cuMemsetD8_v2(ptr as u64, 0, len) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        } else {
            // SAFETY: a library-owned host param; nothing reads it now.
            unsafe { std::ptr::write_bytes(ptr, 0, len) };
        }
    }
}

pub fn engine(device: bool) -> (Manager, Vec<ParamSpec>, Vec<(*mut u8, usize)>) {
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap();
    let specs = specs(device);
    let params = specs.iter().map(|s| m.allocate(s).unwrap()).collect();
    (m, specs, params)
}

/// The modes and verification the scenario pulls with, in order.
pub const CASES: [(Mode, bool); 4] = [
    (Mode::InPlace, false),
    (Mode::InPlace, true),
    (Mode::Atomic, false),
    (Mode::Atomic, true),
];

/// Every case of [`CASES`] into device params, then into host params,
/// from `trainer` (serving at least 8 engines): the params zeroed first,
/// every byte checked after, the version 7. `around(what, pull)` runs each
/// case's pull (to look at the driver before and after).
pub fn pull_every_case(
    (trainer, sock): (&mut Child, &Path),
    globals: &[Global],
    mut around: impl FnMut(&str, &mut dyn FnMut()),
) {
    for device in [true, false] {
        let (m, specs, params) = engine(device);
        for (mode, verify) in CASES {
            let what = format!("device {device}, {mode:?}, verify {verify}");
            zero(device, &params);
            around(&what, &mut || {
                pull(&m, (sock, Some(&mut *trainer)), mode, verify)
                    .unwrap_or_else(|e| panic!("{what}: {e}\ntrainer: {}", output(trainer)))
            });
            for (spec, &p) in specs.iter().zip(&params) {
                assert!(
                    read(device, p) == expected(spec, globals),
                    "{what}: param '{}' differs",
                    spec.name
                );
            }
            assert_eq!(m.status().version.as_deref(), Some("7"), "{what}");
        }
    }
}
