//! Parts of a GPU version over CUDA IPC, without a GPU: each test runs
//! again in a child process under the test-only driver
//! (`tests/fake_cuda.c`, `common::fake_cuda`), whose linear memory is a
//! memory file that another process opens from its CUDA IPC handle. The
//! trainer is a real `wm serve --gpu 0` process (the snapshot read into
//! its fake GPU memory, published as a GPU version, served over a Unix
//! socket); the engine is this child's `Manager`. The engine's params cut
//! the trainer's tensors: a column split (strided), a row range starting
//! off the 256-byte grid (larger than the trainer's 4 MiB staging for
//! slice sums), the column half of a fused QKV. Every byte is checked, in
//! device params and in host params, atomic and in place, verified (the
//! trainer hashes each part read back from its GPU) and not; the blocks of
//! a strided part are copied with one 2D copy per run, never one copy per
//! block. A failed 2D copy keeps the old weights (atomic) or leaves the
//! manager FAILED (in place); a hostile window into the GPU buffer is
//! refused before any byte moves. The same on a real GPU: tests/gpu.rs.

mod common;

use common::fake_cuda::{under_fake_driver, Fake};
use common::gpu_parts::{engine, model, pull, pull_every_case, read, trainer};
use common::sharded::{expected, piece};
use std::path::Path;
use weight_manager_core::internals::memory::cuda_ipc::ExportedDeviceBuffer;
use weight_manager_core::internals::wire::{BucketEntry, CudaBuffer, Frame};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::State;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

/// Copies by kind so far: (2D copies, copies of one block).
fn copies(f: &Fake) -> (u64, u64) {
    let two_d = f.calls("cuMemcpy2D") + f.calls("cuMemcpy2DAsync");
    (two_d, f.calls("cuMemcpyAsync") + f.calls("cuMemcpyDtoH"))
}

#[test]
fn parts_of_a_gpu_version_into_device_and_host_params() {
    let name = "parts_of_a_gpu_version_into_device_and_host_params";
    if !under_fake_driver(name, false) {
        return;
    }
    let f = Fake::open();
    let dir = tempfile::tempdir().unwrap();
    let globals = model();
    let (mut trainer, sock) = trainer(dir.path(), &globals, 8);
    pull_every_case((&mut trainer, &sock), &globals, |what, pull| {
        let before = copies(&f);
        pull();
        let after = copies(&f);
        // One 2D copy per strided part (w_cols, big_cols, qkv's three)
        // at most, and far fewer single copies than the 1600 blocks.
        assert!(after.0 > before.0, "{what}: no 2D copy");
        assert!(
            after.1 - before.1 < 64,
            "{what}: {} copies of one block",
            after.1 - before.1
        );
    });
    let (ok, text) = common::output(trainer);
    assert!(ok, "trainer: {text}");
}

/// A 2D copy the driver fails: atomic (to the host), the params keep
/// their old bytes and the update fails naming the copy. In place, device
/// to device, a refused 2D copy is done row by row (the driver may refuse
/// pitches it did not choose); when a row's copy fails too, the manager is
/// FAILED until the next update, which restores every byte.
#[test]
fn a_failed_2d_copy_keeps_the_old_weights_or_fails_the_manager() {
    let name = "a_failed_2d_copy_keeps_the_old_weights_or_fails_the_manager";
    if !under_fake_driver(name, false) {
        return;
    }
    let f = Fake::open();
    let dir = tempfile::tempdir().unwrap();
    let globals = model();
    let (mut trainer, sock) = trainer(dir.path(), &globals, 4);
    let (m, specs, params) = engine(true);
    let state = m.status().state;
    let check_all = |what: &str| {
        for (spec, &p) in specs.iter().zip(&params) {
            let got = read(true, p);
            assert!(
                got == expected(spec, &globals),
                "{what}: param '{}' differs",
                spec.name
            );
        }
    };
    // Atomic: the second 2D copy to the host fails.
    f.fail("cuMemcpy2D", 1);
    let e = pull(&m, (&sock, Some(&mut trainer)), Mode::Atomic, false).unwrap_err();
    assert!(e.message.contains("cuMemcpy2D"), "{e}");
    assert_eq!(m.status().state, state);
    assert_eq!(m.status().version, None);
    for &p in &params {
        assert!(
            read(true, p).iter().all(|b| *b == 0),
            "atomic: a param was written"
        );
    }
    // In place: the first 2D copy is refused; its rows go one by one.
    let rows = f.calls("cuMemcpyAsync");
    f.fail("cuMemcpy2DAsync", 0);
    pull(&m, (&sock, Some(&mut trainer)), Mode::InPlace, false).unwrap();
    assert!(f.calls("cuMemcpyAsync") > rows, "no row copied alone");
    check_all("row by row");
    // In place: a 2D copy is refused and its first row fails.
    f.fail("cuMemcpy2DAsync", 0);
    f.fail("cuMemcpyAsync", 0);
    let e = pull(&m, (&sock, Some(&mut trainer)), Mode::InPlace, false).unwrap_err();
    assert!(e.message.contains("cuMemcpyAsync (a row"), "{e}");
    assert_eq!(m.status().state, State::Failed);
    pull(&m, (&sock, Some(&mut trainer)), Mode::InPlace, false).unwrap();
    assert_eq!(m.status().state, State::Normal);
    check_all("after the failures");
    // The trainer's failed sessions are its errors to report; it served
    // its engines and is gone.
    trainer.wait_with_output().unwrap();
}

/// A hostile publisher whose one buffer is a GPU buffer of 4096 bytes
/// (CUDA_BUFFERS), then a WINDOWS bucket of `entries`.
fn hostile(sock: &Path, entries: Vec<BucketEntry>) -> std::thread::JoinHandle<()> {
    common::hostile_windows::serve(sock, entries, |conn| {
        let gpu = ExportedDeviceBuffer::new("hostile", 0, 4096).unwrap();
        let fill = vec![0xeeu8; 4096];
        // SAFETY: host bytes of the buffer's length.
        unsafe { gpu.copy_in(0, fill.as_ptr() as u64, 4096) }.unwrap();
        let buffers = Frame::CudaBuffers {
            buffers: vec![CudaBuffer {
                handle: gpu.handle(),
                size: 4096,
            }],
        };
        conn.send(&buffers).ok().map(|()| gpu)
    })
}

/// The engine takes columns 0..32 of "w" [64, 64] into a device param (a
/// strided request of 64 blocks of 32 bytes, device to device in place).
/// A window into the GPU buffer whose blocks run past it, or which covers
/// more than its request, is refused naming the entry and the buffer
/// before any byte moves: the weights and version stay.
#[test]
fn hostile_windows_into_a_gpu_buffer_are_refused() {
    let name = "hostile_windows_into_a_gpu_buffer_are_refused";
    if !under_fake_driver(name, false) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, full) = common::hostile_windows::first_version(dir.path());
    let m = Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap();
    let spec = ParamSpec {
        pieces: vec![piece("w", &[0, 0], &[64, 32], &[0, 0])],
        memory: MemoryKind::Device,
        device_ordinal: 0,
        ..ParamSpec::host("w", DType::U8, &[64, 32])
    };
    let param = m.allocate(&spec).unwrap();
    m.update(UpdateRequest::snapshot(&model_dir)).unwrap();
    let before: Vec<u8> = (0..64)
        .flat_map(|r| full.data[r * 64..r * 64 + 32].to_vec())
        .collect();
    assert!(read(true, param) == before);
    for (k, (entry, want)) in common::hostile_windows::cases().into_iter().enumerate() {
        for mode in [Mode::Atomic, Mode::InPlace] {
            let sock = dir.path().join(format!("h{k}-{mode:?}.sock"));
            let publisher = hostile(&sock, vec![entry]);
            let e = pull(&m, (&sock, None), mode, false).unwrap_err();
            publisher.join().unwrap();
            assert_eq!(e.code, wm_result::WM_ERR_PEER, "{mode:?}: {e}");
            for part in ["GPU buffer 0", "bucket 0: entry 0: ", want] {
                assert!(e.message.contains(part), "{mode:?}: {part}: {e}");
            }
            assert!(
                read(true, param) == before,
                "{mode:?}: the weights were touched"
            );
            assert_eq!(m.status().version.as_deref(), Some("v1"), "{mode:?}");
        }
    }
}
