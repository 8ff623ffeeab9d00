//! The device page swap (`ManagerConfig::swap_device_pages`) without a
//! GPU: each test runs again in a child process that loads a test-only
//! driver (`tests/fake_cuda.c`, built here with the system C compiler and
//! found first through LD_LIBRARY_PATH), whose device memory is host
//! memory mapped and unmapped for real by the VMM calls. The library's own
//! code runs unchanged: the manager, the snapshot source, the applier, the
//! pinned staging and `DeviceRegion`. What the fake adds: which allocation
//! is mapped at an address, the bytes alive, and calls made to fail, to
//! check the order of a swap and what each failure leaves. The same checks
//! on a real GPU are in tests/gpu.rs.

mod common;

use common::fake_cuda::{under_fake_driver, Fake};
use common::*;
use cudarc::driver::sys;
use std::path::Path;
use weight_manager_core::wm_result;
use weight_manager_core::State;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};
use weight_manager_core::{MemoryKind, ParamSpec};

/// The fake's allocation granularity: every param here takes one granule.
const GRANULE: u64 = 2 << 20;

fn device_spec(t: &T) -> ParamSpec {
    let mut spec = ParamSpec::host(&t.name, t.dtype, &t.shape);
    spec.memory = MemoryKind::Device;
    spec.device_ordinal = 0;
    spec
}

/// `model(seed)` as the snapshot in `dir`, version `seed`.
fn write_model(dir: &Path, seed: u8) -> Vec<T> {
    let v = model(seed);
    write_safetensors(&dir.join("model_state.tp0.0.safetensors"), &v);
    write_version(dir, &seed.to_string());
    v
}

/// A manager with library-owned device params for `model`, updated to
/// version 1: the manager, the params' addresses, the snapshot directory.
fn engine(swap: bool) -> (Manager, Vec<u64>, tempfile::TempDir) {
    let m = Manager::new(ManagerConfig {
        swap_device_pages: swap,
        ..Default::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let v1 = write_model(dir.path(), 1);
    let ptrs: Vec<u64> = v1
        .iter()
        .map(|t| m.allocate(&device_spec(t)).unwrap().0 as u64)
        .collect();
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v1, "version 1");
    (m, ptrs, dir)
}

fn assert_holds(ptrs: &[u64], ts: &[T], what: &str) {
    for (t, &p) in ts.iter().zip(ptrs) {
        let mut out = vec![0u8; t.data.len()];
        // SAFETY: p is a device param of t's size.
        let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p, out.len()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        assert!(out == t.data, "{what}: '{}' differs", t.name);
    }
}

fn assert_kept_version_1(m: &Manager) {
    let st = m.status();
    assert_eq!(st.state, State::Normal);
    assert_eq!(st.version.as_deref(), Some("1"));
}

#[test]
fn a_swap_keeps_the_addresses_and_frees_the_old_memory() {
    if !under_fake_driver("a_swap_keeps_the_addresses_and_frees_the_old_memory", false) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let params = ptrs.len() as u64 * GRANULE;
    let before = f.handles(&ptrs);
    assert!(before.iter().all(|&h| h != 0));
    f.reset_peak();
    let v2 = write_model(dir.path(), 2);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v2, "swapped in");
    let after = f.handles(&ptrs);
    for (b, a) in before.iter().zip(&after) {
        assert!(
            *a != 0 && a != b,
            "the param's memory was written, not swapped"
        );
    }
    assert_eq!(f.used(), params, "old memory or shadows left alive");
    assert_eq!(
        f.peak(),
        2 * params,
        "one shadow per param during the update"
    );
    assert_eq!(m.status().version.as_deref(), Some("2"));

    // In place, nothing is swapped: the bytes go into the params.
    let v3 = write_model(dir.path(), 3);
    let mut req = UpdateRequest::snapshot(dir.path());
    req.mode = weight_manager_core::Mode::InPlace;
    m.update(req).unwrap();
    assert_holds(&ptrs, &v3, "in place");
    assert_eq!(f.handles(&ptrs), after);

    // Off (the default), an atomic update uploads into the params: no
    // device memory besides them, exactly as before the swap existed.
    drop(m);
    let (m, ptrs, dir) = engine(false);
    let before = f.handles(&ptrs);
    f.reset_peak();
    let v2 = write_model(dir.path(), 2);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v2, "uploaded");
    assert_eq!(f.handles(&ptrs), before);
    assert_eq!(f.peak(), params);
}

#[test]
fn a_failed_swap_puts_every_param_back() {
    if !under_fake_driver("a_failed_swap_puts_every_param_back", false) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let (before, used) = (f.handles(&ptrs), f.used());
    let v2 = write_model(dir.path(), 2);
    // The update maps a shadow per param, then swaps in param order: the
    // second param's swap cannot map its new memory.
    f.fail("cuMemMap", ptrs.len() as i32 + 1);
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert!(
        e.message.contains(&format!("param '{}'", v2[1].name))
            && e.message.contains("the old memory is mapped again"),
        "{e}"
    );
    assert_kept_version_1(&m);
    assert_holds(&ptrs, &model(1), "after the failed swap");
    assert_eq!(
        f.handles(&ptrs),
        before,
        "the first param was not swapped back"
    );
    assert_eq!(f.used(), used, "shadows left alive");
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v2, "the next update");
}

#[test]
fn a_param_left_without_memory_is_failed_and_restored_by_the_next_update() {
    let name = "a_param_left_without_memory_is_failed_and_restored_by_the_next_update";
    if !under_fake_driver(name, false) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let v2 = write_model(dir.path(), 2);
    // The first swap cannot map the new memory, nor the old one again.
    f.fail("cuMemMap", ptrs.len() as i32);
    f.fail("cuMemMap", 0);
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert!(
        e.message.contains(&format!("param '{}'", v2[0].name))
            && e.message.contains("holds no memory until the next update"),
        "{e}"
    );
    assert_eq!(m.status().state, State::Failed);
    assert_eq!(f.handles(&ptrs[..1]), vec![0]);
    assert_holds(&ptrs[1..], &model(1)[1..], "params not swapped");
    assert_eq!(f.used(), (ptrs.len() as u64 - 1) * GRANULE);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_eq!(m.status().state, State::Normal);
    assert_holds(&ptrs, &v2, "the next update");
    assert_eq!(f.used(), ptrs.len() as u64 * GRANULE);
}

#[test]
fn an_upload_that_fails_at_commit_keeps_the_old_weights_only_with_the_swap() {
    let name = "an_upload_that_fails_at_commit_keeps_the_old_weights_only_with_the_swap";
    if !under_fake_driver(name, false) {
        return;
    }
    let f = Fake::open();
    for swap in [true, false] {
        let (m, ptrs, dir) = engine(swap);
        let used = f.used();
        write_model(dir.path(), 2);
        // The third upload of the commit fails.
        f.fail("cuMemcpyAsync", 2);
        let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
        assert!(e.message.contains("cuMemcpyAsync"), "{e}");
        if swap {
            // The uploads went to the shadows: the params never changed.
            assert_kept_version_1(&m);
            assert_holds(&ptrs, &model(1), "after the failed upload");
            assert_eq!(f.used(), used);
        } else {
            // Uploaded into the params: some hold new bytes, some old.
            assert_eq!(m.status().state, State::Failed);
        }
    }
}

#[test]
fn shadows_that_do_not_fit_fail_the_update_before_it_reads() {
    if !under_fake_driver(
        "shadows_that_do_not_fit_fail_the_update_before_it_reads",
        false,
    ) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let used = f.used();
    // Room for three shadows of six.
    f.set_total(used + 3 * GRANULE);
    write_model(dir.path(), 2);
    let e = m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_OUT_OF_MEMORY, "{e}");
    assert!(
        e.message.contains("device page swap shadow") && e.message.contains("param '"),
        "{e}"
    );
    assert_kept_version_1(&m);
    assert_holds(&ptrs, &model(1), "after the refused update");
    assert_eq!(f.used(), used);
}

#[test]
fn a_truncated_file_leaves_the_old_weights_and_frees_the_shadows() {
    let name = "a_truncated_file_leaves_the_old_weights_and_frees_the_shadows";
    if !under_fake_driver(name, false) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let (before, used) = (f.handles(&ptrs), f.used());
    write_model(dir.path(), 2);
    shorten(&dir.path().join("model_state.tp0.0.safetensors"), 100);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap_err();
    assert_kept_version_1(&m);
    assert_holds(&ptrs, &model(1), "after the truncated file");
    assert_eq!(f.handles(&ptrs), before);
    assert_eq!(f.used(), used);
}

#[test]
fn clear_and_restore_after_a_swap_keep_the_addresses() {
    if !under_fake_driver("clear_and_restore_after_a_swap_keep_the_addresses", false) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let params = ptrs.len() as u64 * GRANULE;
    write_model(dir.path(), 2);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    // The regions own the memory swapped in: a clear frees it all (and
    // says so, from the driver's free-memory query).
    let cleared = m.clear().unwrap();
    assert_eq!(f.used(), 0);
    assert_eq!(cleared.device_bytes_freed, params);
    assert_eq!(f.handles(&ptrs), vec![0; ptrs.len()]);
    let v3 = write_model(dir.path(), 3);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v3, "after clear and restore");
    assert_eq!(m.status().device_bytes_restored, params);
    assert_eq!(f.used(), params);
}

#[test]
fn the_swap_is_harmless_where_the_driver_sees_no_device() {
    if !under_fake_driver("the_swap_is_harmless_where_the_driver_sees_no_device", true) {
        return;
    }
    let m = Manager::new(ManagerConfig {
        swap_device_pages: true,
        ..Default::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let v = write_model(dir.path(), 1);
    let e = m.allocate(&device_spec(&v[0])).unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_UNSUPPORTED);
    assert!(e.message.contains("no device"), "{e}");
    let params = register(&m, &v);
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_params(&params, &v);
}

/// A staged update (`Manager::stage`) of library-owned device params with
/// the swap uploads into the shadows while it stages: the params still
/// hold version 1 and the uploads are done (and the shadows' views
/// unmapped) when `stage` returns, so the commit (the pause) makes no
/// upload, only the swap.
#[test]
fn a_staged_update_uploads_into_the_shadows_before_the_commit() {
    if !under_fake_driver(
        "a_staged_update_uploads_into_the_shadows_before_the_commit",
        false,
    ) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let m = std::sync::Arc::new(m);
    let v1 = model(1);
    let v2 = write_model(dir.path(), 2);
    let before = f.calls("cuMemcpyAsync");
    let staged = m.stage(UpdateRequest::snapshot(dir.path())).unwrap();
    let staging = f.calls("cuMemcpyAsync");
    assert!(staging > before, "nothing was uploaded while staging");
    assert_holds(&ptrs, &v1, "staged");
    let unmaps = f.calls("cuMemUnmap");
    staged.commit().unwrap();
    assert_eq!(
        f.calls("cuMemUnmap"),
        staging_unmaps(unmaps, ptrs.len()),
        "the commit unmapped more than the params' old memory"
    );
    assert_eq!(f.calls("cuMemcpyAsync"), staging, "the commit uploaded");
    assert_holds(&ptrs, &v2, "committed");
}

/// The shadows' views are unmapped before `stage` returns: the commit
/// (and the release of the old memory after it) unmaps each param once.
fn staging_unmaps(before_commit: u64, params: usize) -> u64 {
    before_commit + params as u64
}

/// A staged commit's pause is the remaps alone: the memory it takes out
/// of the params is freed by a thread of its own once the commit
/// returned (the shadows' views were unmapped while staging), and the
/// next update waits for that thread before it takes device memory.
#[test]
fn a_staged_commit_frees_the_old_memory_after_it_returned() {
    if !under_fake_driver(
        "a_staged_commit_frees_the_old_memory_after_it_returned",
        false,
    ) {
        return;
    }
    let f = Fake::open();
    let (m, ptrs, dir) = engine(true);
    let params = ptrs.len() as u64 * GRANULE;
    let m = std::sync::Arc::new(m);
    let v2 = write_model(dir.path(), 2);
    f.hold_freeing(true);
    let staged = m.stage(UpdateRequest::snapshot(dir.path())).unwrap();
    staged.commit().unwrap();
    // Returned while the old memory still waits to be freed.
    assert_holds(&ptrs, &v2, "committed");
    assert_eq!(f.used(), 2 * params, "freed before the commit returned");
    f.hold_freeing(false);
    assert!(!f.hold_expired(), "the commit waited for the freeing");
    let v3 = write_model(dir.path(), 3);
    f.reset_peak();
    m.update(UpdateRequest::snapshot(dir.path())).unwrap();
    assert_holds(&ptrs, &v3, "the next update");
    assert_eq!(f.used(), params, "old memory left alive");
    assert_eq!(
        f.peak(),
        2 * params,
        "the next update ran beside the freeing"
    );
}

/// The pinned staging of device params holds at most its budget, 512 MiB
/// per GPU (README "GPU params and CUDA IPC"), and more than one 256 MiB
/// snapshot batch, so the next batch is read while the last one's copies
/// run: 24 tensors of 32 MiB in place into library-owned device params,
/// with every copy kept in flight for a while (the fake's event delay).
#[test]
fn the_pinned_staging_keeps_to_its_budget() {
    if !under_fake_driver("the_pinned_staging_keeps_to_its_budget", false) {
        return;
    }
    const MIB: u64 = 1 << 20;
    let f = Fake::open();
    f.set_total(2048 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let f32 = weight_manager_core::DType::F32;
    let v: Vec<T> = (0..24)
        .map(|i| tensor(&format!("layers.{i}"), f32, &[8 << 20], 1))
        .collect();
    write_safetensors(&dir.path().join("model_state.tp0.0.safetensors"), &v);
    write_version(dir.path(), "1");
    let m = Manager::new(ManagerConfig::default()).unwrap();
    let ptrs: Vec<u64> = v
        .iter()
        .map(|t| m.allocate(&device_spec(t)).unwrap().0 as u64)
        .collect();
    f.event_delay(200);
    let mut req = UpdateRequest::snapshot(dir.path());
    req.mode = weight_manager_core::Mode::InPlace;
    m.update(req).unwrap();
    assert_holds(&ptrs, &v, "the update");
    let peak = f.pinned_peak();
    println!("pinned at most {} MiB", peak / MIB);
    assert!(peak <= 512 * MIB + 64 * MIB, "{} MiB pinned", peak / MIB);
    assert!(
        peak > 256 * MIB,
        "only {} MiB pinned: one batch at a time",
        peak / MIB
    );
}
