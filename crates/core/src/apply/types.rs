//! What the applier is given and what it hands out: options, hooks, the
//! chunks sources pass in, the tensors the engine's callback sees, and the
//! summary of an update.

use crate::memory::copy::CopySource;
use crate::tensor::DType;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Atomic,
    InPlace,
}

/// One whole source tensor (a shard of a global tensor, or all of it)
/// handed to the engine's per-tensor callback. `data` is valid only during
/// the call.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// The bytes in host memory; empty when they are GPU memory (`device`).
    pub data: &'a [u8],
    /// Zero-copy from a CUDA IPC bucket: the bytes are GPU memory, not host.
    pub device: Option<DeviceBytes>,
    /// The global tensor `name` this is a shard of: its shape, and where
    /// the shard's box (of `shape`) starts in it. A whole tensor is the box
    /// at zeros covering it all.
    pub global_shape: &'a [u64],
    pub offset: &'a [u64],
}

/// A tensor's bytes in GPU memory: `len` bytes at device address `ptr`,
/// valid in the context of GPU `ordinal` during the callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBytes {
    pub ptr: u64,
    pub len: usize,
    pub ordinal: i32,
}

/// Returns false to cancel the update.
pub type ProgressHook<'h> = &'h mut dyn FnMut(&super::progress::Progress) -> bool;
/// Returns an error text to fail the update.
pub type TensorHook<'h> = &'h mut dyn FnMut(&TensorView) -> std::result::Result<(), String>;

#[derive(Default)]
pub struct Hooks<'h> {
    pub progress: Option<ProgressHook<'h>>,
    pub tensor: Option<TensorHook<'h>>,
}

#[derive(Clone, Copy, Debug)]
pub struct ApplyOptions {
    pub mode: Mode,
    pub verify: bool,
    pub threads: usize,
    /// The update's bound, counted from `begun`: when the update was asked
    /// for, so that opening its sources and planning (before any applier)
    /// count too.
    pub timeout: Duration,
    pub begun: Instant,
    /// The most bytes of tensors for the per-tensor callback the applier
    /// holds (the manager's `callback_staging_limit`): all of them in
    /// atomic mode, any one of them (and those received at once) in place.
    pub callback_staging_limit: u64,
}

/// Bytes `[offset, offset + len)` of source tensor `tensor` (an index into
/// the plan's entries), found at `src`.
#[derive(Clone, Copy)]
pub struct Chunk<'a> {
    pub tensor: usize,
    pub offset: u64,
    pub len: usize,
    pub src: CopySource<'a>,
}

/// What an update moved and how long it took.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub tensors: usize,
    pub bytes: u64,
    pub receive: Duration,
    pub commit: Duration,
    /// Of `commit`: swapping device shadows in (the device page swap,
    /// its wait for the GPU included).
    pub device_swap: Duration,
    /// What deltas did (none: all zero).
    pub deltas: super::DeltaTally,
}
