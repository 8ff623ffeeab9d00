//! weight_manager: swap new model weights into a running inference engine.
//!
//! An engine rank links this library (C ABI in `include/weight_manager.h`),
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
//!   `Applier::receive_pieces` says, in one piece or scattered by UCX into
//!   the pieces it lands in; else a bounce buffer the applier scatters from
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

pub mod apply;
pub(crate) mod box_sweep;
pub mod checkpoint;
pub mod checksum;
/// Not C API: the header's field comments state these values.
/// cbindgen:ignore
pub mod defaults;
pub mod delta;
pub(crate) mod dynlib;
pub mod fanout;
pub mod logging;
pub mod manager;
pub mod manifest;
pub mod memory;
pub mod pieces;
pub mod plan;
pub mod publisher;
pub mod quant;
pub mod registry;
pub mod result;
pub mod signal;
pub mod source;
pub mod state;
pub mod tensor;
pub mod tensor_box;
#[cfg(test)]
mod test_rng;
pub mod transport;
pub mod wire;

pub use manager::{Manager, ManagerConfig, UpdateRequest, UpdateStats};
pub use result::{wm_result, Error, Result};
