//! weight_manager: swap new model weights into a running inference engine.
//!
//! An engine rank links this library (C ABI in `include/weight_manager.h`),
//! registers its params, and calls `wm_update` when the trainer has new
//! weights. Every update follows one path, whatever the source:
//!
//! ```text
//! source -> manifest -> plan (checked against the registry, before any byte
//! moves) -> chunks -> applier (range checks, parallel copy, checksums,
//! staging) -> commit (version, stats, state NORMAL)
//! ```
//!
//! Module map:
//! - [`result`]: result codes and the error type.
//! - [`tensor`]: dtypes, shapes, byte math. [`registry`]: params by name.
//! - [`manifest`], [`plan`], [`apply`]: the update pipeline.
//! - [`memory`]: library-owned host and GPU memory, pinned staging, CUDA IPC
//!   buffers, and the parallel copier.
//! - [`source`]: where bytes come from (snapshot files now).
//! - [`manager`]: the state machine. [`state`]: its states.
//! - [`signal`]: the control cell and the per-step signal.
//! - [`fanout`]: NCCL fan-out of an update among a node's ranks.
//! - [`ffi`]: the C boundary, and nothing else.

pub mod apply;
pub mod checksum;
/// Not C API: the header's field comments state these values.
/// cbindgen:ignore
pub mod defaults;
pub(crate) mod dynlib;
pub mod fanout;
pub mod ffi;
pub mod logging;
pub mod manager;
pub mod manifest;
pub mod memory;
pub mod plan;
pub mod publisher;
pub mod registry;
pub mod result;
pub mod signal;
pub mod source;
pub mod state;
pub mod tensor;
pub mod transport;
pub mod wire;

pub use manager::{Manager, ManagerConfig, UpdateRequest, UpdateStats};
pub use result::{wm_result, Error, Result};
