//! Two-phase updates: stage, commit, abort (the rules: the core's
//! `Manager::stage` and `Staged`). The handle keeps the one staged version.

use super::manager::wm_manager;
use super::update::{
    check_stats_size, request_from_c, stats_out, wm_update_request, wm_update_stats,
};
use super::{code_of, EngineHandle, StageSlot};
use crate::result::wm_result;
use weight_manager_core::{Error, Result, UpdateStats};

/// ==========================================================================
/// TWO-PHASE UPDATES: stage the next version while serving, then switch.
/// ==========================================================================
///
/// Stage the version `request` names without touching the params: fetch,
/// verify and hold every byte (atomic staging: memory for one more copy of
/// the params the update writes), so the engine's threads and GPU kernels
/// keep reading the old weights. Blocks until staged, failed or timed out
/// (`timeout_ms`); the staging runs on a thread of the library's, which
/// waits for `wm_commit` or `wm_abort`.
///
/// `request` as for `wm_update`, but atomic only (`WM_UPDATE_IN_PLACE`:
/// `WM_ERR_INVALID_ARGUMENT`), without `progress_callback` or
/// `tensor_callback` (`WM_ERR_INVALID_ARGUMENT`). With NCCL fan-out the
/// root broadcasts its staged bytes before its commit, so every member
/// stages the same version. One staged version at a time: another
/// `wm_stage` (while this one runs, or after it staged) is
/// `WM_ERR_STATE`, and `wm_update` is `WM_ERR_BUSY` until the commit or
/// abort. The state reads `WM_STATE_UPDATING` from `wm_stage`
/// until `wm_commit` or `wm_abort` return; `wm_status`'s version stays the
/// old one until the commit.
///
/// On success `*out_stats` (optional: NULL to skip; else its `struct_size`
/// must be set) receives the staged `version`, `rank` and `sync_ns` (the
/// staging's time); the other fields are 0 until `wm_commit`. On failure
/// nothing is staged, the old weights and version stay, and the reason is
/// in `wm_last_error`. `wm_clear` drops a staged version (then `wm_commit`
/// says so); `wm_destroy` aborts it.
#[no_mangle]
pub unsafe extern "C" fn wm_stage(
    manager: *mut wm_manager,
    request: *const wm_update_request,
    out_stats: *mut wm_update_stats,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let staged = check_stats_size(out_stats)
            .and_then(|()| request_to_stage(request))
            .and_then(|req| m.stage_and_keep(req));
        stats_out(staged.map_err(|e| m.record_error(e).code.into()), out_stats)
    })
}

/// Make the staged version the params' contents: page swaps into
/// library-owned host params, copies into engine-owned ones, uploads to
/// device params. The engine must not read the params while it runs (this
/// is the pause). Blocks until done (bounded by the staged request's
/// timeout). On success `*out_stats` (optional, as for `wm_update`) receives
/// the update's statistics, with `update_ns` = this call's time (the
/// pause) and `sync_ns` = the staging's receive time; the state is
/// `WM_STATE_NORMAL`.
///
/// Nothing staged, or a `wm_stage` still running on another thread:
/// `WM_ERR_STATE` (at once). A staged version dropped by `wm_clear`:
/// `WM_ERR_CANCELLED` saying so; after `wm_shutdown`, `WM_ERR_CANCELLED`
/// whether or not a version was staged. A commit that fails leaves the old weights
/// or, when it had started writing, `WM_STATE_FAILED` (as `wm_update`'s
/// atomic commit). In a group: after this rank saw the group stop (a rank
/// died; `wm_broadcast_signal` said so), the commit is refused before it
/// writes (`WM_ERR_PEER`, "no commit"; the staged version is dropped); a
/// rank dying during the commit's finishing barrier makes it return that
/// error with the new version committed, as `wm_update` says.
#[no_mangle]
pub unsafe extern "C" fn wm_commit(
    manager: *mut wm_manager,
    out_stats: *mut wm_update_stats,
) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let committed = check_stats_size(out_stats)
            .and_then(|()| m.take_staged("wm_commit"))
            .and_then(|s| s.commit());
        stats_out(
            committed.map_err(|e| m.record_error(e).code.into()),
            out_stats,
        )
    })
}

/// Drop the staged version: the params, version and state stay as they
/// were before `wm_stage`, and the staging memory is freed (or kept for
/// the next update, as `wm_memory_config.free_atomic_staging` says).
/// Nothing staged, or a `wm_stage` still running on another thread:
/// `WM_ERR_STATE` (at once; `wm_clear` stops a running stage). A staged
/// version `wm_clear` dropped already: `WM_OK` (there is nothing left to
/// drop).
#[no_mangle]
pub unsafe extern "C" fn wm_abort(manager: *mut wm_manager) -> wm_result {
    ffi_guard!({
        let m = try_handle!(manager);
        let r = m.take_staged("wm_abort").and_then(|s| s.abort());
        code_of(&m, r)
    })
}

/// The request to stage: callbacks refused (they would run on the stage
/// thread).
unsafe fn request_to_stage(
    request: *const wm_update_request,
) -> Result<weight_manager_core::UpdateRequest<'static>> {
    if request.is_null() {
        return Err(Error::null_argument("wm_stage: request is NULL"));
    }
    let r = &*request;
    if r.progress_callback.is_some() || r.tensor_callback.is_some() {
        return Err(Error::invalid_argument(
            "wm_stage: progress_callback and tensor_callback must be NULL (staging runs on a thread of the library's)",
        ));
    }
    request_from_c(r)
}

impl EngineHandle {
    /// Stage on this handle's manager, keeping the staged version here.
    /// The slot is not held while the staging runs (`StageSlot::Staging`).
    fn stage_and_keep(&self, req: weight_manager_core::UpdateRequest) -> Result<UpdateStats> {
        if self.manager.is_cancelled() {
            return Err(Error::cancelled(
                "wm_stage: the manager was shut down (wm_shutdown)",
            ));
        }
        self.forget_dropped_stage();
        {
            let mut slot = self.staged.lock();
            match *slot {
                Some(StageSlot::Staging) => {
                    return Err(Error::state(
                        "wm_stage: another wm_stage is running on this handle",
                    ))
                }
                Some(StageSlot::Staged(_)) => {
                    return Err(Error::state(
                        "wm_stage: a version is staged already: wm_commit or wm_abort it first",
                    ))
                }
                None => *slot = Some(StageSlot::Staging),
            }
        }
        // The slot leaves Staging however the stage ends (a panic too).
        let _unstage = Unstage(&self.staged);
        let staged = self.manager.stage(req)?;
        let stats = UpdateStats {
            version: staged.version().to_string(),
            rank: self.manager.rank(),
            sync: staged.staged_in(),
            ..Default::default()
        };
        *self.staged.lock() = Some(StageSlot::Staged(staged));
        Ok(stats)
    }

    /// Forget a staged version that a clear or a cancel dropped (its
    /// staging ended; the manager holds nothing of it): once a new stage
    /// begins or a later update succeeded, `wm_commit` and `wm_abort` say
    /// nothing is staged, not why that one was dropped.
    pub(crate) fn forget_dropped_stage(&self) {
        let mut slot = self.staged.lock();
        if matches!(*slot, Some(StageSlot::Staged(_))) && !self.manager.is_staged() {
            slot.take();
        }
    }

    fn take_staged(&self, call: &str) -> Result<weight_manager_core::Staged> {
        // Staged, and `wm_stage` returning on its thread: its vote may have
        // reached the ranks already, so the commit waits that moment out.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while matches!(*self.staged.lock(), Some(StageSlot::Staging))
            && self.manager.stage_at_gate()
            && std::time::Instant::now() < until
        {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        let mut slot = self.staged.lock();
        match slot.take() {
            Some(StageSlot::Staged(staged)) => Ok(staged),
            Some(StageSlot::Staging) => {
                *slot = Some(StageSlot::Staging);
                Err(Error::state(format!(
                    "{call}: a version is still staging (wm_stage has not returned)"
                )))
            }
            None if call == "wm_commit" && self.manager.is_cancelled() => Err(Error::cancelled(
                format!("{call}: the manager was shut down (nothing is staged)"),
            )),
            None => Err(Error::state(format!(
                "{call}: nothing is staged (call wm_stage first)"
            ))),
        }
    }
}

/// Empties a slot still `Staging` when dropped.
struct Unstage<'a>(&'a parking_lot::Mutex<Option<StageSlot>>);

impl Drop for Unstage<'_> {
    fn drop(&mut self) {
        let mut slot = self.0.lock();
        if matches!(*slot, Some(StageSlot::Staging)) {
            *slot = None;
        }
    }
}
