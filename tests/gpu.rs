//! The GPU suite: device params on a real GPU. Every test prints why it is
//! skipped and passes when this process sees no usable GPU (CI), so the
//! suite compiles and runs everywhere; on a GPU machine it is the check.
//!
//! Covered: engine-owned device params through the snapshot path in atomic
//! and in-place mode (pinned staging, asynchronous uploads; bytes read back
//! with cuMemcpyDtoH and compared with the files); CUDA IPC between two
//! processes (a `wm serve --gpu` trainer publishing GPU tensors, this
//! process's device params written device to device, through the host when
//! verified or atomic, and device pointers handed to the zero-copy
//! callback), and parts of a GPU version (strided, unaligned, fused;
//! slice sums) into device and host params; library-owned device params (CUDA VMM) cleared and restored
//! at identical addresses with the memory really returned (the driver's
//! free-memory query); the device page swap (`swap_device_pages`): atomic
//! updates of library-owned device params mapped in at the same
//! addresses, the old memory given back, a failed update keeping the old
//! bytes and freeing its shadows, clear and restore after a swap; and bad
//! device pointers, lengths and ordinals refused with errors naming the
//! param. (The swap's failure ordering, without a GPU: tests/device_swap.rs.)

mod common;

use common::*;
use cudarc::driver::sys;
use weight_manager_core::internals::memory::cuda::{cuda, Cuda};
use weight_manager_core::wm_result;
use weight_manager_core::Mode;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

fn gpu() -> Option<&'static Cuda> {
    match cuda() {
        Ok(c) => Some(c),
        Err(e) => {
            println!("skipped: no usable GPU here: {e}");
            None
        }
    }
}

/// Device memory on GPU 0, freed on drop.
struct DeviceBuffer {
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    fn new(c: &Cuda, len: usize) -> DeviceBuffer {
        c.make_current(0).unwrap();
        let mut ptr = 0;
        assert_eq!(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) },
            sys::CUresult::CUDA_SUCCESS
        );
        DeviceBuffer { ptr, len }
    }

    fn read(&self, c: &Cuda) -> Vec<u8> {
        read_device(c, self.ptr, self.len)
    }

    fn zero(&self, c: &Cuda) {
        c.make_current(0).unwrap();
        let r = unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.len) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Engine-owned GPU memory for every tensor of `ts`, registered with `m`.
fn register_on_gpu(c: &Cuda, m: &Manager, ts: &[T]) -> Vec<DeviceBuffer> {
    ts.iter()
        .map(|t| {
            let b = DeviceBuffer::new(c, t.data.len());
            unsafe { m.register(&device_spec(t), b.ptr as *mut u8, b.len) }.unwrap();
            b
        })
        .collect()
}

/// A snapshot directory holding `model(seed)` as version `seed`.
fn snapshot_of(seed: u8) -> (tempfile::TempDir, Vec<T>) {
    let dir = tempfile::tempdir().unwrap();
    let v = model(seed);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(dir.path(), &seed.to_string());
    (dir, v)
}

fn device_spec(t: &T) -> ParamSpec {
    let mut spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
    spec.memory = MemoryKind::Device;
    spec.device_ordinal = 0;
    spec
}

#[test]
fn snapshot_into_device_params_atomic_and_in_place() {
    let Some(c) = gpu() else { return };
    let (dir, v1) = snapshot_of(1);
    // Checksums, so that the update can verify the bytes it wrote.
    let manifest = std::process::Command::new(wm())
        .arg("manifest")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(manifest.status.success(), "{manifest:?}");
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let bufs = register_on_gpu(c, &m, &v1);
    for mode in [Mode::Atomic, Mode::InPlace] {
        bufs.iter().for_each(|b| b.zero(c));
        let mut req = UpdateRequest::snapshot(dir.path());
        req.mode = mode;
        req.verify = true;
        let st = m.update(req).unwrap();
        assert_eq!(st.tensors, v1.len() as u64);
        for (t, b) in v1.iter().zip(&bufs) {
            assert!(
                b.read(c) == t.data,
                "{mode:?}: '{}' differs on the GPU",
                t.name
            );
        }
    }
}

#[test]
fn bad_device_pointers_lengths_and_ordinals_are_refused() {
    let Some(c) = gpu() else { return };
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let t = tensor("w", weight_manager_core::DType::F32, &[256], 1);
    let buf = DeviceBuffer::new(c, t.data.len());
    let mut host = vec![0u8; t.data.len()];
    let e = unsafe { m.register(&device_spec(&t), host.as_mut_ptr(), host.len()) }.unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT);
    assert!(
        e.message.contains("param 'w'") && e.message.contains("not CUDA device memory"),
        "{e}"
    );

    let mut spec = device_spec(&t);
    spec.device_ordinal = c.device_count();
    let e = unsafe { m.register(&spec, buf.ptr as *mut u8, buf.len) }.unwrap_err();
    assert!(e.message.contains("out of range"), "{e}");

    // A param whose bytes run past the end of the allocation.
    let big = tensor("w", weight_manager_core::DType::F32, &[512], 1);
    let e = unsafe { m.register(&device_spec(&big), (buf.ptr) as *mut u8, big.data.len()) }
        .unwrap_err();
    assert!(e.message.contains("past the end of its allocation"), "{e}");

    // The right pointer still registers.
    unsafe { m.register(&device_spec(&t), buf.ptr as *mut u8, buf.len) }.unwrap();
}

/// Bytes at device address `ptr` on GPU 0.
fn read_device(c: &Cuda, ptr: u64, len: usize) -> Vec<u8> {
    c.make_current(0).unwrap();
    let mut out = vec![0u8; len];
    let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, len) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    out
}

#[test]
fn library_device_params_clear_and_restore_at_the_same_addresses() {
    let Some(c) = gpu() else { return };
    use weight_manager_core::internals::memory::device::memory_info;
    let (dir, v1) = snapshot_of(1);
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let ptrs: Vec<u64> = v1
        .iter()
        .map(|t| m.allocate(&device_spec(t)).unwrap().0 as u64)
        .collect();
    let total: u64 = v1.iter().map(|t| t.data.len() as u64).sum();
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    for (t, &p) in v1.iter().zip(&ptrs) {
        assert!(read_device(c, p, t.data.len()) == t.data, "'{}'", t.name);
    }
    let (free_before, _) = memory_info(0).unwrap();
    let cleared = m.clear().unwrap();
    let (free_after, _) = memory_info(0).unwrap();
    assert!(
        cleared.device_bytes_freed >= total && free_after >= free_before + total as usize,
        "clear freed {} bytes by its count, {} by the driver's; params hold {total}",
        cleared.device_bytes_freed,
        free_after.saturating_sub(free_before)
    );
    assert_eq!(m.status().device_bytes_freed, cleared.device_bytes_freed);
    assert_eq!(m.status().resident_bytes, 0);
    // The next update maps fresh memory at the very same addresses.
    let v2 = model(2);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v2);
    write_version(dir.path(), "2");
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    let (free_restored, _) = memory_info(0).unwrap();
    assert!(free_restored + total as usize <= free_after);
    assert!(m.status().device_bytes_restored >= total);
    for (t, &p) in v2.iter().zip(&ptrs) {
        let again = m.status();
        assert_eq!(again.resident_bytes, total);
        assert!(
            read_device(c, p, t.data.len()) == t.data,
            "'{}' after restore",
            t.name
        );
    }
}

/// The `wm` program: this build's, or `WM_BIN` (scripts/gpu.sh).
fn wm() -> String {
    WM.to_string_lossy().into_owned()
}

/// `wm serve --ipc sock` of `dir` from GPU 0, version 7, for three
/// engine sessions.
fn serve_from_gpu(sock: &std::path::Path, dir: &std::path::Path) -> std::process::Child {
    use std::process::{Command, Stdio};
    Command::new(wm())
        .args([
            "serve",
            "--ipc",
            sock.to_str().unwrap(),
            dir.to_str().unwrap(),
        ])
        .args([
            "--gpu",
            "0",
            "--version",
            "7",
            "--engines",
            "3",
            "--bucket-mib",
            "1",
            "--accept-timeout",
            "60",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn cuda_ipc_from_a_trainer_process_into_device_params() {
    use weight_manager_core::SourceKind;
    let Some(c) = gpu() else { return };
    let (dir, v1) = snapshot_of(7);
    let sock = dir.path().join("gpu.sock");
    // Three sessions: in place (device to device), atomic and verified
    // (through the host), zero-copy callback (device pointers).
    let trainer = serve_from_gpu(&sock, dir.path());
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let bufs = register_on_gpu(c, &m, &v1);
    let ipc = |mode: Mode, verify: bool| {
        let mut req = UpdateRequest::snapshot(&sock);
        req.source = SourceKind::Ipc;
        req.mode = mode;
        req.verify = verify;
        req
    };
    let start = std::time::Instant::now();
    let first = loop {
        match m.update(ipc(Mode::InPlace, false)) {
            Err(e) if e.code == wm_result::WM_ERR_NOT_FOUND => {
                assert!(
                    start.elapsed().as_secs() < 60,
                    "the trainer never listened: {e}"
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => break other,
        }
    };
    assert_eq!(first.unwrap().version, "7");
    for (t, b) in v1.iter().zip(&bufs) {
        assert!(b.read(c) == t.data, "in place: '{}' differs", t.name);
    }
    bufs.iter().for_each(|b| b.zero(c));
    m.update(ipc(Mode::Atomic, true)).unwrap();
    for (t, b) in v1.iter().zip(&bufs) {
        assert!(
            b.read(c) == t.data,
            "atomic, verified: '{}' differs",
            t.name
        );
    }
    // Zero copy: the callback gets device pointers into the trainer's buffer.
    let engine = Manager::new(ManagerConfig::default()).unwrap();
    let mut seen = Vec::new();
    let mut cb = |view: &weight_manager_core::TensorView| {
        let d = view.device.ok_or("a host view")?;
        seen.push((view.name.to_string(), read_device(c, d.ptr, d.len)));
        Ok(())
    };
    let mut req = ipc(Mode::InPlace, false);
    req.hooks.tensor = Some(&mut cb);
    engine.update(req).unwrap();
    assert_eq!(seen.len(), v1.len());
    for (name, bytes) in &seen {
        let t = v1.iter().find(|t| &t.name == name).unwrap();
        assert!(bytes == &t.data, "zero copy: '{name}' differs");
    }
    let out = trainer.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "trainer: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Parts of a GPU version (a column split, an unaligned row range, a
/// fused QKV's column half) into device and host params, atomic and in
/// place, verified (slice sums hashed from the trainer's GPU) and not:
/// the scenario tests/device_ipc.rs runs under the fake driver, here on
/// the GPU itself.
#[test]
fn cuda_ipc_parts_of_a_gpu_version() {
    use common::gpu_parts::{model, pull_every_case, trainer};
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let globals = model();
    let (mut trainer, sock) = trainer(dir.path(), &globals, 8);
    pull_every_case((&mut trainer, &sock), &globals, |_, pull| pull());
    let (ok, text) = output(trainer);
    assert!(ok, "trainer: {text}");
}

/// Device params through rdma (pinned staging behind the network path),
/// when UCX is here.
#[test]
fn rdma_into_device_params() {
    use weight_manager_core::SourceKind;
    use weight_manager_core::{Publisher, PublisherConfig};
    let Some(c) = gpu() else { return };
    if let Err(e) = weight_manager_core::internals::transport::ucx::ucx() {
        println!("skipped: no UCX here: {e}");
        return;
    }
    let v = model(9);
    let cfg = PublisherConfig {
        secret: Some(b"gpu-suite-secret-0123".to_vec()),
        bucket_size: 1 << 20,
        ..Default::default()
    };
    let p = Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
    add_all(&p, &v);
    p.set_version(Some("9".into()));
    p.publish().unwrap();
    // Direct (the default) and staged receive, each in place and atomic;
    // gdr lands straight in the device params when this UCX reaches CUDA
    // memory, and is refused, saying why, otherwise.
    let ucx = weight_manager_core::internals::transport::ucx::ucx().unwrap();
    for staged in [false, true] {
        let m = Manager::new(ManagerConfig {
            net: weight_manager_core::NetSettings {
                secret: Some(b"gpu-suite-secret-0123".to_vec()),
                staged,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        let bufs = register_on_gpu(c, &m, &v);
        let mut runs = vec![
            (SourceKind::Rdma, Mode::InPlace),
            (SourceKind::Rdma, Mode::Atomic),
        ];
        if !staged && ucx.supports_cuda() {
            runs.push((SourceKind::Gdr, Mode::InPlace));
        } else if !staged {
            let mut req = UpdateRequest::snapshot(p.address());
            req.source = SourceKind::Gdr;
            let e = m.update(req).unwrap_err();
            assert!(e.message.contains("cannot reach CUDA memory"), "{e}");
            println!("gdr not run: {e}");
        }
        std::thread::scope(|s| {
            let serving = s.spawn(|| p.serve(runs.len(), std::time::Duration::from_secs(30)));
            for &(source, mode) in &runs {
                let mut req = UpdateRequest::snapshot(p.address());
                req.source = source;
                req.mode = mode;
                m.update(req).unwrap();
                for (t, b) in v.iter().zip(&bufs) {
                    assert!(
                        b.read(c) == t.data,
                        "{source:?} {mode:?} (staged: {staged}): '{}' differs",
                        t.name
                    );
                    b.zero(c);
                }
            }
            serving.join().unwrap().unwrap();
        });
    }
}

/// UCX, or why not; with `WM_REQUIRE_GDR=1` (scripts/gpu.sh, when its
/// kit carries a CUDA-capable UCX) a missing UCX or one that cannot reach
/// CUDA memory fails the test instead of skipping it.
fn cuda_ucx() -> Option<&'static weight_manager_core::internals::transport::ucx::Ucx> {
    let required = std::env::var("WM_REQUIRE_GDR").is_ok_and(|v| v == "1");
    let why = match weight_manager_core::internals::transport::ucx::ucx() {
        Ok(u) if u.supports_cuda() => return Some(u),
        Ok(u) => u.no_cuda_reason(),
        Err(e) => format!("no UCX here: {e}"),
    };
    assert!(!required, "WM_REQUIRE_GDR=1 but {why}");
    println!("skipped: {why}");
    None
}

/// rdma and gdr from a `wm serve --net --gpu` trainer process (its tensors
/// read into GPU 0, published from there) into this engine's device
/// params on the same machine, in place and atomic; every byte read back
/// from the device and compared with the files.
#[test]
fn rdma_and_gdr_from_a_gpu_trainer_process() {
    use weight_manager_core::SourceKind;
    let Some(c) = gpu() else { return };
    if cuda_ucx().is_none() {
        return;
    }
    let (dir, v) = snapshot_of(11);
    let runs = [
        (SourceKind::Gdr, Mode::InPlace),
        (SourceKind::Gdr, Mode::Atomic),
        (SourceKind::Rdma, Mode::InPlace),
        (SourceKind::Rdma, Mode::Atomic),
    ];
    let (trainer, mut out, addr) = serve_net(dir.path(), &["--gpu", "0"], runs.len());
    let m = net_engine();
    let bufs = register_on_gpu(c, &m, &v);
    for (source, mode) in runs {
        let mut req = UpdateRequest::snapshot(&addr);
        req.source = source;
        req.mode = mode;
        let stats = m.update(req).unwrap();
        assert_eq!(stats.version, "11");
        for (t, b) in v.iter().zip(&bufs) {
            assert!(
                b.read(c) == t.data,
                "{source:?} {mode:?}: '{}' differs",
                t.name
            );
            b.zero(c);
        }
        println!(
            "{source:?} {mode:?}: {} bytes checked on the device",
            stats.bytes
        );
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let done = trainer.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "trainer: {rest}{}",
        String::from_utf8_lossy(&done.stderr)
    );
}

/// An engine that takes network updates with the suite's secret.
fn net_engine() -> Manager {
    Manager::new(ManagerConfig {
        net: weight_manager_core::NetSettings {
            secret: Some(SECRET.to_vec()),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

/// The shared secret of the suite's network publishers and engines.
const SECRET: &[u8] = b"gpu-suite-secret-0123";

/// `wm serve --net` of `dir` in a process of its own for `engines`
/// sessions (1 MiB buckets, the suite's secret, `extra` arguments): the
/// process, its stdout after the listening line, and its address.
fn serve_net(
    dir: &std::path::Path,
    extra: &[&str],
    engines: usize,
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    String,
) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut trainer = Command::new(wm())
        .args(["serve", "--net", "127.0.0.1:0", dir.to_str().unwrap()])
        .args(extra)
        .args(["--bucket-mib", "1", "--accept-timeout", "60"])
        .args(["--engines", &engines.to_string()])
        .env("WM_NET_SECRET", std::str::from_utf8(SECRET).unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(trainer.stdout.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "wm serve exited before listening"
        );
        if let Some(rest) = line.trim().strip_prefix("wm serve: listening on ") {
            break rest.split(',').next().unwrap().to_string();
        }
    };
    (trainer, out, addr)
}

/// A publisher that corrupts a tensor after hashing it (`wm serve
/// --corrupt`, a test build's hook) is caught naming the tensor: in place
/// gdr lands in the params and is hashed on the GPU; atomic lands in the
/// host staging (hashed there) and keeps the old weights.
#[test]
fn gdr_catches_corrupted_bytes_on_the_device() {
    use weight_manager_core::{wm_result, SourceKind};
    let Some(c) = gpu() else { return };
    if cuda_ucx().is_none() {
        return;
    }
    let (dir, v) = snapshot_of(12);
    let bad = v[0].name.clone();
    let m = net_engine();
    let bufs = register_on_gpu(c, &m, &v);
    for mode in [Mode::InPlace, Mode::Atomic] {
        bufs.iter().for_each(|b| b.zero(c));
        let (trainer, _out, addr) = serve_net(dir.path(), &["--corrupt", &bad], 1);
        let mut req = UpdateRequest::snapshot(&addr);
        req.source = SourceKind::Gdr;
        req.mode = mode;
        let e = m.update(req).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "{mode:?}: {e}");
        assert!(e.message.contains(&format!("'{bad}'")), "{mode:?}: {e}");
        if mode == Mode::Atomic {
            for b in &bufs {
                assert!(b.read(c).iter().all(|&x| x == 0), "atomic wrote a param");
            }
        }
        let _ = trainer.wait_with_output();
        println!("gdr {mode:?}: {e}");
    }
}

/// The NCCL loader and a communicator on this GPU with the image's NCCL
/// (`WM_NCCL_LIB` or `libnccl.so.2`): one rank, since NCCL allows one rank
/// per GPU (the two-rank broadcast is `fanout_between_two_gpus`). Joins,
/// votes, broadcasts a device buffer (its own root) and synchronizes, each
/// within a deadline. `WM_REQUIRE_NCCL=1` (scripts/gpu.sh, when it found
/// the image's NCCL) makes a missing NCCL a failure.
#[test]
fn nccl_loader_and_a_one_rank_communicator() {
    use std::time::{Duration, Instant};
    use weight_manager_core::internals::fanout::nccl::{nccl, Comm};
    let Some(c) = gpu() else { return };
    let n = match nccl(None) {
        Ok(n) => n,
        Err(e) => {
            assert!(
                std::env::var("WM_REQUIRE_NCCL").map_or(true, |v| v != "1"),
                "WM_REQUIRE_NCCL=1 but {e}"
            );
            println!("skipped: {e}");
            return;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let alive = || Ok(());
    let mut comm = Comm::join(n, n.unique_id().unwrap(), 1, 0, 0, deadline, &alive).unwrap();
    assert_eq!(comm.min(42, deadline, &alive).unwrap(), 42);
    let buf = DeviceBuffer::new(c, 1 << 20);
    buf.zero(c);
    unsafe { comm.broadcast(buf.ptr, buf.len, 0, deadline, &alive) }.unwrap();
    comm.synchronize("the broadcast", deadline, &alive).unwrap();
    assert!(buf.read(c).iter().all(|&b| b == 0));
    assert!(!comm.failed());
}

/// NCCL fan-out between two `wm worker` ranks on GPUs 0 and 1
/// (`common::fanout_ranks`). Needs two GPUs (NCCL allows one rank per GPU)
/// and NCCL (`WM_NCCL_LIB` or `libnccl.so.2`); the same run on the fake
/// driver and NCCL is in `tests/fanout.rs`.
#[test]
fn fanout_between_two_gpus() {
    use common::fanout_ranks::{fan_out_twice, Ranks};
    let Some(c) = gpu() else { return };
    if c.device_count() < 2 {
        println!(
            "skipped: fan-out needs two GPUs (NCCL takes one rank per GPU); this machine has {}",
            c.device_count()
        );
        return;
    }
    if let Err(e) = weight_manager_core::internals::fanout::nccl::nccl(None) {
        println!("skipped: {e}");
        return;
    }
    for two_phase in [false, true] {
        fan_out_twice(Ranks {
            devices: [0, 1],
            nccl: None,
            two_phase,
        });
    }
}

/// Library-owned device params of `ts` on GPU 0 in a manager with the
/// device page swap: the manager and the params' addresses.
fn swapping_engine(ts: &[T]) -> (Manager, Vec<u64>) {
    let m = Manager::new(ManagerConfig {
        swap_device_pages: true,
        ..Default::default()
    })
    .unwrap();
    let ptrs = ts
        .iter()
        .map(|t| m.allocate(&device_spec(t)).unwrap().0 as u64)
        .collect();
    (m, ptrs)
}

fn assert_on_gpu(c: &Cuda, ptrs: &[u64], ts: &[T], what: &str) {
    for (t, &p) in ts.iter().zip(ptrs) {
        assert!(
            read_device(c, p, t.data.len()) == t.data,
            "{what}: '{}'",
            t.name
        );
    }
}

/// What a leak of the old memory (or of the shadows) would show at the
/// least: every param takes at least one granule (2 MiB on current GPUs).
const SWAP_SLACK: usize = 1 << 20;

#[test]
fn device_page_swap_keeps_addresses_and_gives_the_old_memory_back() {
    let Some(c) = gpu() else { return };
    use weight_manager_core::internals::memory::device::memory_info;
    let (dir, v1) = snapshot_of(1);
    let (m, ptrs) = swapping_engine(&v1);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_on_gpu(c, &ptrs, &v1, "version 1");
    let (free_before, _) = memory_info(0).unwrap();
    let v2 = model(2);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v2);
    write_version(dir.path(), "2");
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    // The same addresses hold the new bytes, still device memory of GPU 0.
    assert_on_gpu(c, &ptrs, &v2, "swapped in");
    for (t, &p) in v2.iter().zip(&ptrs) {
        c.check_device_range(0, p, t.data.len(), &t.name).unwrap();
    }
    let (free_after, _) = memory_info(0).unwrap();
    assert!(
        free_after + SWAP_SLACK >= free_before,
        "the swap kept {} bytes of GPU memory",
        free_before - free_after
    );
    // A failing update (a truncated file) keeps the old bytes and frees
    // its shadows.
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &model(3));
    write_version(dir.path(), "3");
    shorten(&dir.path().join("model_state.tp0.0.safetensors"), 100);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_eq!(m.status().version.as_deref(), Some("2"));
    assert_on_gpu(c, &ptrs, &v2, "after the failed update");
    let (free_failed, _) = memory_info(0).unwrap();
    assert!(
        free_failed + SWAP_SLACK >= free_before,
        "the failed update kept {} bytes of GPU memory",
        free_before - free_failed
    );
}

#[test]
fn clear_and_restore_after_a_device_page_swap() {
    let Some(c) = gpu() else { return };
    use weight_manager_core::internals::memory::device::memory_info;
    let (dir, v1) = snapshot_of(1);
    let (m, ptrs) = swapping_engine(&v1);
    let total: u64 = v1.iter().map(|t| t.data.len() as u64).sum();
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    let (free_before, _) = memory_info(0).unwrap();
    // The regions own the memory swapped in: the clear gives it back.
    let cleared = m.clear().unwrap();
    let (free_after, _) = memory_info(0).unwrap();
    assert!(
        cleared.device_bytes_freed >= total && free_after >= free_before + total as usize,
        "clear freed {} bytes by its count, {} by the driver's; params hold {total}",
        cleared.device_bytes_freed,
        free_after.saturating_sub(free_before)
    );
    let v2 = model(2);
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v2);
    write_version(dir.path(), "2");
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_on_gpu(c, &ptrs, &v2, "after clear and restore");
    assert!(m.status().device_bytes_restored >= total);
}
