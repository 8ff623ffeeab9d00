//! `wm bench <kind>`: each benchmark prints its figures beside floors or
//! targets measured in the same run. Every bench is a file (or folder) of
//! this folder; what they share is [`harness`] (timing, verdicts, floors,
//! child processes) and [`model`] (the layers they move). The hidden
//! subcommands are the child processes the benches start (this program run
//! again as a trainer or a rank).

mod atomic;
mod delta;
mod delta_update;
mod gpu;
pub mod harness;
mod ipc;
mod model;
mod net;
mod quant;
mod quant_update;
mod shard;
mod signal;
mod snapshot;
mod stage;
mod ucx_floor;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum Bench {
    /// Snapshot update throughput beside its floors
    Snapshot(snapshot::Args),
    /// Per-step latency of the signal across real ranks
    Signal(signal::Args),
    /// Same-node IPC update throughput beside its floor
    Ipc(ipc::Args),
    /// rdma over UCX beside the raw UCX floor (UCX_TLS=tcp without RDMA hardware)
    Net(net::Args),
    /// Device params on a real GPU beside their floors (needs an NVIDIA GPU)
    Gpu(gpu::Args),
    /// FP8 block quantization beside memcpy and PyTorch
    Quant(quant::Args),
    /// Deltas between training steps beside memcpy and PyTorch
    Delta(delta::Args),
    /// Sharded updates (planning; snapshot, UCX and IPC ranks) beside their targets and floors
    Shard(shard::Args),
    /// Two-phase updates: the commit's pause beside the one-call update and memcpy
    Stage(stage::Args),
    #[command(hide = true)]
    SignalRank(signal::RankArgs),
    #[command(hide = true)]
    IpcPublisher(ipc::PublisherArgs),
    #[command(hide = true)]
    NetPublisher(net::PublisherArgs),
    #[command(hide = true)]
    ShardSnapshotRank(shard::snapshot::RankArgs),
    #[command(hide = true)]
    ShardUcxPublisher(shard::ucx::PublisherArgs),
    #[command(hide = true)]
    ShardUcxRank(shard::ucx::RankArgs),
    #[command(hide = true)]
    ShardIpcRank(shard::ipc::RankArgs),
}

pub fn run(b: &Bench) -> Result<(), String> {
    match b {
        Bench::Snapshot(a) => snapshot::run(a),
        Bench::Signal(a) => signal::run(a),
        Bench::Ipc(a) => ipc::run(a),
        Bench::Net(a) => net::run(a),
        Bench::Gpu(a) => gpu::run(a),
        Bench::Quant(a) => quant::run(a),
        Bench::Delta(a) => delta::run(a),
        Bench::Shard(a) => shard::run(a),
        Bench::Stage(a) => stage::run(a),
        Bench::SignalRank(a) => signal::rank(a),
        Bench::IpcPublisher(a) => ipc::publisher(a),
        Bench::NetPublisher(a) => net::publisher(a),
        Bench::ShardSnapshotRank(a) => shard::snapshot::rank(a),
        Bench::ShardUcxPublisher(a) => shard::ucx::publisher(a),
        Bench::ShardUcxRank(a) => shard::ucx::rank(a),
        Bench::ShardIpcRank(a) => shard::ipc::rank(a),
    }
}
