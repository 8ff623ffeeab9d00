//! Reaching the engine's UCX worker: its READY (the first frame after the
//! challenge, protocol 10), checked, and a worker of ours connected to
//! its, made while the session's tensors are hashed for the manifest.

use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::transport::ucx::Pump;
use crate::wire::MAX_NET_BUCKET as MAX_BUCKET;
use crate::wire::{Frame, ALIGN, MAX_BUFFERS};
use std::time::Instant;

/// What the engine asked for in its READY.
pub(super) struct Ready {
    pub address: Vec<u8>,
    pub bucket_size: u64,
    pub depth: usize,
    pub keyed: bool,
}

/// The engine's worker reached: its READY, and our worker connected to it.
pub(super) struct EngineLink {
    pub pump: Pump,
    pub ready: Ready,
}

/// Take the engine's READY (the frame after the challenge) and connect a
/// worker of ours to its worker, before `deadline`. Runs while the
/// session's tensors are hashed for the manifest: making a worker and an
/// endpoint takes milliseconds that would otherwise come after it.
pub(super) fn reach(conn: &mut Conn, deadline: Instant) -> Result<EngineLink> {
    let mut pump = Pump::spawn("publisher")?;
    let ready = recv_ready(conn, deadline)?;
    pump.started(deadline)?;
    pump.connect(&ready.address)
        .map_err(|e| e.context(format!("reaching {}", conn.peer())))?;
    Ok(EngineLink { pump, ready })
}

/// Read the engine's READY and check what it asks for. Staged or direct,
/// the messages are the same: the engine alone decides where each lands
/// (READY's direct flag is informational).
fn recv_ready(conn: &mut Conn, deadline: Instant) -> Result<Ready> {
    let ready = match conn.recv(deadline)? {
        Frame::Ready {
            address,
            bucket_size,
            depth,
            keyed,
            ..
        } => Ready {
            address,
            bucket_size,
            depth: depth as usize,
            keyed,
        },
        other => return Err(Error::peer(format!("expected READY, got {}", other.name()))),
    };
    let (bucket_size, depth) = (ready.bucket_size, ready.depth);
    if !(ALIGN..=MAX_BUCKET).contains(&bucket_size) || depth == 0 || depth > MAX_BUFFERS {
        return Err(Error::peer(format!(
            "{} asked for buckets of {bucket_size} bytes, {depth} in flight ({ALIGN} to {MAX_BUCKET} bytes, 1 to {MAX_BUFFERS} allowed)",
            conn.peer()
        )));
    }
    Ok(ready)
}
