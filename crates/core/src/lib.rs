//! weight_manager_core: the rules of weight_manager, which swaps new model
//! weights into a running inference engine, as a Rust API. Start here.
//!
//! The chosen API is re-exported at this crate's root (the engine's
//! `Manager` and its config, requests and params; the trainer's
//! `Publisher` and `TensorDesc`; the `Controller`; manifests; errors), with
//! the public modules [`checkpoint`], [`plan`], [`quant`], [`delta`],
//! [`checksum`] and [`defaults`]. Everything else is `pub(crate)`; this
//! workspace's tests and benchmarks reach what they need of it through
//! [`internals`], one list.
//!
//! An engine rank links the library (C ABI in `include/weight_manager.h`),
//! registers its params, and calls `wm_update` when the trainer has new
//! weights. Every update follows one path, whatever the source:
//!
//! ```text
//! sources -> manifests -> plan (runs: every piece of every param against
//! every shard, checked before any byte moves, kept while the layouts do
//! not change) -> chunks (the sources stepped together) -> applier (range
//! checks, parallel copy, checksums, staging) -> commit (version, stats,
//! state NORMAL)
//! ```
//!
//! Module map, roughly bottom up:
//! - [`result`]: result codes and the error type. [`defaults`]: every
//!   default value, once. [`logging`]: per-manager log sinks.
//! - [`tensor`]: dtypes, shapes, byte math. [`checksum`]: XXH3-128 of
//!   tensors. [`state`]: the manager's states (the control word's values).
//! - [`tensor_box`], [`pieces`]: boxes of global tensors; what a param
//!   holds of which. [`registry`]: params by name. [`manifest`]: what a
//!   source offers (shards, placed in their global tensors).
//!   [`plan`]: the sources' manifests against the params, cut into runs
//!   (also without memory, for `wm plan`). [`apply`]: the applier
//!   (landing, verification, staging, commit).
//! - [`memory`]: library-owned host and GPU memory, pinned staging, CUDA
//!   IPC buffers, the parallel copier.
//! - [`wire`]: the frames of the IPC and network protocol (`docs/wire.md`).
//!   [`transport`]: frames over Unix and TCP sockets, peer checks and
//!   authentication, UCX (loaded at run time).
//! - [`checkpoint`]: checkpoints on disk for both wings (layouts,
//!   safetensors headers, checksums files, `version.yaml`, the version rule).
//! - [`source`]: where bytes come from: snapshot files, same-node IPC from
//!   publishers, the network (rdma, gdr) over UCX; several at once
//!   (`source/streaming.rs`).
//! - [`publisher`]: the trainer side, serving versions over IPC or the
//!   network.
//! - [`signal`]: the control cell, rank groups, fan-out meetings, the
//!   controller, the failure report. [`fanout`]: NCCL fan-out of an update
//!   among a node's ranks.
//! - [`manager`]: the state machine that runs updates and clears.
//!
//! The C boundary is not here: the `weight_manager` crate at the
//! repository root holds it, over this crate's public API.
//!
//! Where things go:
//! - A network chunk: `source/net/receive.rs` posts each bucket entry's UCX
//!   receive where `source/net/landing.rs` decides: a staging slot; where
//!   `Applier::receive_scatter` says, in one part or scattered by UCX into
//!   the parts it lands in; else a bounce buffer the applier scatters from
//!   (`apply/landing.rs`: in place the param itself, atomic the staging arena, a device param
//!   without gdr a host buffer, pinned where it can, that goes up to the
//!   GPU in `apply/upload.rs`; gdr GPU memory); when it lands the applier
//!   routes it (`apply/route.rs`, `apply/batch.rs`) and checks it against
//!   the manifest's checksum (or, for a part of a tensor, the publisher's
//!   slice sum) while it is still in cache (`apply/verify.rs`);
//!   keyed digests, when asked for, are checked by the source first.
//! - A new source: a module under [`source`] implementing
//!   [`source::Source`], its [`source::SourceKind`] number, and one arm in
//!   `manager/sources.rs` that opens it.
//! - A new C function: its rules in a plain Rust module here, then the
//!   function in the C API crate's file of its topic (`src/manager.rs`,
//!   `src/update.rs`, `src/publisher.rs`, ... at the repository root),
//!   inside `ffi_guard!`; then regenerate the header
//!   (`WM_BLESS=1 cargo test --test header`).

#![cfg_attr(not(test), warn(clippy::undocumented_unsafe_blocks))]

// The core's parts. Only the modules below marked `pub` are API (their
// public items are); the rest is reached through the re-exports that
// follow, which are the chosen API, and, for this workspace's own tests and
// benchmarks only, through [`internals`].
pub(crate) mod apply;
pub(crate) mod box_sweep;
pub mod checkpoint;
pub mod checksum;
/// Not C API: the header's field comments state these values.
/// cbindgen:ignore
pub mod defaults;
pub mod delta;
pub(crate) mod dynlib;
pub(crate) mod fanout;
pub(crate) mod logging;
pub(crate) mod manager;
pub(crate) mod manifest;
pub(crate) mod memory;
pub(crate) mod parallel;
pub(crate) mod pieces;
pub mod plan;
pub(crate) mod publisher;
pub mod quant;
pub(crate) mod registry;
pub(crate) mod result;
pub(crate) mod signal;
pub(crate) mod source;
pub(crate) mod state;
pub(crate) mod stop;
pub(crate) mod tensor;
pub(crate) mod tensor_box;
#[cfg(test)]
mod test_rng;
pub(crate) mod transport;
pub(crate) mod wire;

// The engine: a manager, its config and params, updates and clears.
pub use apply::{Hooks, Mode, Progress, TensorView};
pub use checkpoint::version::{check_version, MAX_VERSION_LEN};
pub use fanout::FanoutSettings;
pub use logging::{LogLevel, Logger};
pub use manager::{
    AcquireHook, DeltaFallback, DeltaMode, DeltaStats, GroupSettings, Manager, ManagerConfig,
    NetSettings, ReleaseHook, Staged, UpdateRequest, UpdateStats,
};
pub use pieces::{Piece, MAX_PIECES_PER_PARAM};
pub use registry::{MemoryKind, ParamSpec};
pub use source::locations::MAX_SOURCES;
pub use source::SourceKind;
pub use state::State;
pub use tensor::{DType, MAX_NDIM};
pub use tensor_box::TensorBox;
// What a source offers, and where a shard lies in its global tensor.
pub use manifest::{Manifest, Placement, SharedMeta, TensorMeta};
// The trainer side.
pub use publisher::{Publisher, PublisherConfig, ServeStats, SessionStats, TensorDesc, TEST_HOOKS};
// The controller of a group's control cell.
pub use signal::controller::{Controller, RequestOutcome};
// Errors.
pub use result::{wm_result, Error, Result};

/// Internals that this workspace's own integration tests (`tests/`) and
/// benchmarks (`wm bench`, measuring the floors beside the library) reach:
/// frames, transports, sources, memory and the control plane's parts. Not
/// API: anything here may change in any release; engines and trainers use
/// the crate root's items. One list, so that what escapes the core is seen
/// in one place.
pub mod internals {
    pub use crate::pieces::check_pieces;
    pub use crate::registry::Registry;
    pub use crate::tensor::shape_text;

    pub mod fanout {
        pub use crate::fanout::nccl;
    }
    pub mod memory {
        pub use crate::memory::{
            copy, cuda, cuda_ipc, device, hashing, host, mapped_file, nvrtc, shared, SendPtr,
        };
    }

    /// Every GPU kernel source the library compiles at run time: (program
    /// name, source).
    pub fn kernel_sources() -> [(&'static str, &'static str); 2] {
        [
            (crate::quant::device::PROGRAM, crate::quant::device::SOURCE),
            (crate::delta::device::PROGRAM, crate::delta::device::SOURCE),
        ]
    }
    pub mod signal {
        pub use crate::signal::{
            fanout::FanoutMeeting, shm, ControlCell, Group, GroupConfig, SignalPlane,
        };
    }
    pub mod source {
        pub use crate::source::snapshot::reads;
        pub use crate::source::{ipc, net, PullOptions, Source};
    }
    pub mod transport {
        pub use crate::transport::{auth, conn, seal, ucx};
    }
    pub mod wire {
        pub use crate::wire::{
            check_requests, check_windows, delta_tag, message_tag, net_message_bytes,
            split_entries, BucketEntry, CudaBuffer, DeltaBase, DeltaRun, Frame, Request,
            RunVerdict, WantRun, DELTA_PIECE, MAX_BLOCKS,
        };
    }
}
