//! The C API's enums, defined here (the C boundary) rather than in the core,
//! so cbindgen reads this crate only. Each has the core's variants and
//! numbers: conversions both ways are exhaustive matches (a variant added on
//! one side only does not compile), and the unit tests below check every
//! number against the core's.
//!
//! Fields and arguments of these types are plain integers in C
//! (`uint32_t`, `int32_t`): the library validates them with `from_raw`.

use weight_manager_core::quant::Scheme as CoreScheme;
use weight_manager_core::DType as CoreDType;
use weight_manager_core::DeltaFallback as CoreDeltaFallback;
use weight_manager_core::LogLevel as CoreLogLevel;
use weight_manager_core::MemoryKind as CoreMemoryKind;
use weight_manager_core::RequestOutcome as CoreRequestOutcome;
use weight_manager_core::SourceKind as CoreSourceKind;
use weight_manager_core::State as CoreState;

/// Element type of a param or tensor. Numbers are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum wm_dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    F8E4m3 = 3,
    F8E5m2 = 4,
    I8 = 5,
    U8 = 6,
    I32 = 7,
    I64 = 8,
    Bool = 9,
    F64 = 10,
    I16 = 11,
    U16 = 12,
    U32 = 13,
    U64 = 14,
}
mirror!(
    wm_dtype,
    CoreDType,
    u32,
    [F32, F16, Bf16, F8E4m3, F8E5m2, I8, U8, I32, I64, Bool, F64, I16, U16, U32, U64]
);

#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum wm_state {
    /// Serving with complete weights (or, before the first update, whatever
    /// the engine loaded itself).
    Normal = 0,
    /// An update is running.
    Updating = 1,
    /// A clear is running.
    Clearing = -1,
    /// Weight memory released; the next update brings it back.
    Cleared = -2,
    /// An in-place update failed after bytes moved: params are half-written.
    /// Only a later successful update returns to NORMAL.
    Failed = -3,
    /// A signal only (`wm_broadcast_signal`), never a state: every rank
    /// staged the same version (two-phase updates); call `wm_commit` now,
    /// before the next step.
    Commit = 2,
}
mirror!(
    wm_state,
    CoreState,
    i32,
    [Normal, Updating, Clearing, Cleared, Failed, Commit]
);

/// How a quantized param holds its global tensors (`wm_quantize_param`).
/// Numbers are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum wm_quant_scheme {
    /// FP8 E4M3 with one f32 scale_inv per 128x128 block of the last two
    /// dimensions (the DeepSeek-V3 / Kimi-K2 checkpoint format): scales
    /// `[..., ceil(M/128), ceil(N/128)]` for a `[..., M, N]` param.
    Fp8Block128 = 1,
    /// FP8 E4M3 with one f32 scale_inv for the whole global tensor: scales
    /// of one element.
    Fp8Tensor = 2,
    /// MXFP8 (OCP Microscaling): FP8 E4M3 with one E8M0 scale byte
    /// (`2^(byte - 127)`) per 32 elements along the last dimension: scales
    /// u8 `[..., ceil(N/32)]` for a `[..., N]` param.
    Mxfp8 = 3,
}
mirror!(
    wm_quant_scheme,
    CoreScheme,
    u32,
    [Fp8Block128, Fp8Tensor, Mxfp8]
);

/// Why runs of an update came whole (`wm_delta_stats.fallback`). Numbers
/// are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum wm_delta_fallback {
    /// Deltas were asked for every run with a base; each came as a delta
    /// unless that would not have been under half its bytes.
    None = 0,
    /// The params held no version: the first update, or one after a clear
    /// or after an update that failed having written params (FAILED; an
    /// atomic update that failed leaves the version held).
    NoBase = 1,
    /// The request asked for a whole update (`WM_UPDATE_WHOLE`).
    Refused = 2,
    /// A publisher no longer keeps the base version (or holds it where it
    /// cannot diff it: GPU memory, a directory, a base laid out
    /// otherwise (its shard of the tensor another); or, for an FP8 param,
    /// keeps no FP8 image of the base's run).
    NotKept = 3,
    /// Some params' bytes were not the base's (written since by something
    /// else): those runs came whole.
    Differs = 4,
    /// The source sends whole (a snapshot; rdma when the engine asks for
    /// keyed digests, which authenticate bucket bytes, not deltas), or no
    /// param has a base here (a tensor callback; device params whose GPU
    /// cannot run the delta kernels, without NVRTC; GPU params an entry
    /// lands in as several runs).
    NotApplicable = 5,
    /// An IPC update that did not ask for deltas (`WM_UPDATE_DELTAS`).
    NotAsked = 6,
}
mirror!(
    wm_delta_fallback,
    CoreDeltaFallback,
    u32,
    [
        None,
        NoBase,
        Refused,
        NotKept,
        Differs,
        NotApplicable,
        NotAsked
    ]
);

/// The update paths. Numbers are part of the ABI (`wm_update_request.source`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum wm_source {
    /// safetensors files on disk.
    Snapshot = 0,
    /// Same node: buffers a trainer shares over a Unix socket.
    Ipc = 1,
    /// Other node over UCX: received straight into param memory (or the
    /// atomic arena) by default; into staging slots first with `wm_net_config.staged`.
    Rdma = 2,
    /// Other node: straight into GPU memory.
    Gdr = 3,
}
mirror!(wm_source, CoreSourceKind, u32, [Snapshot, Ipc, Rdma, Gdr]);

/// Where a param's memory is. Numbers are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum wm_memory {
    /// CPU memory.
    Host = 0,
    /// CUDA device memory (served by the CUDA backend).
    Device = 1,
}
mirror!(wm_memory, CoreMemoryKind, u32, [Host, Device]);

/// Log levels; numbers are part of the ABI (`wm_config.log_level`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum wm_log_level {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}
mirror!(
    wm_log_level,
    CoreLogLevel,
    u32,
    [Off, Error, Warn, Info, Debug]
);

/// How a request ended (when it did not fail).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum wm_request_outcome {
    /// The engine did it.
    Done = 0,
    /// Nothing to do: already up to date (update) or already cleared (clear).
    AlreadyDone = 1,
    /// The same action is already running.
    Busy = 2,
    /// The opposite action is running: cannot do this now.
    Refused = 3,
}
mirror!(
    wm_request_outcome,
    CoreRequestOutcome,
    u32,
    [Done, AlreadyDone, Busy, Refused]
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::wm_result;
    use weight_manager_core::wm_result as CoreResult;

    /// Every C variant converts to the core variant of the same number, and
    /// back; and the numbers the core accepts are exactly the C ones.
    macro_rules! same_numbers {
        ($c:ident, $core:ident, $raw:ty, $core_from_raw:expr) => {{
            for &v in $c::ALL {
                let core: $core = v.into();
                assert_eq!(v as $raw, core as $raw, "{v:?}");
                assert_eq!($c::from(core), v);
            }
            for raw in -300..300 {
                let raw = raw as $raw;
                let core: Option<$core> = $core_from_raw(raw);
                assert_eq!(
                    core.map(|c| c as $raw),
                    $c::from_raw(raw).map(|c| c as $raw),
                    "{} {raw}",
                    stringify!($c)
                );
            }
        }};
    }

    #[test]
    fn every_variant_has_the_cores_number() {
        same_numbers!(wm_result, CoreResult, u32, CoreResult::from_raw);
        same_numbers!(wm_dtype, CoreDType, u32, CoreDType::from_raw);
        same_numbers!(wm_state, CoreState, i32, CoreState::from_raw);
        same_numbers!(wm_source, CoreSourceKind, u32, CoreSourceKind::from_raw);
        same_numbers!(wm_memory, CoreMemoryKind, u32, CoreMemoryKind::from_raw);
        same_numbers!(wm_log_level, CoreLogLevel, u32, CoreLogLevel::from_raw);
        // The core has no from_raw for outcomes: its numbers are those of
        // the C variants (checked above), so these are all there are.
        same_numbers!(wm_request_outcome, CoreRequestOutcome, u32, |raw: u32| {
            wm_request_outcome::from_raw(raw).map(CoreRequestOutcome::from)
        });
        same_numbers!(wm_quant_scheme, CoreScheme, u32, CoreScheme::from_raw);
        same_numbers!(wm_delta_fallback, CoreDeltaFallback, u32, |raw: u32| {
            wm_delta_fallback::from_raw(raw).map(CoreDeltaFallback::from)
        });
    }
}
