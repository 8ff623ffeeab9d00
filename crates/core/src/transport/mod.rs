//! Byte transports under the wire format: Unix sockets (with descriptor
//! passing and peer credentials) for same-node IPC; UCX for the network.

pub mod auth;
pub mod conn;
pub mod seal;
pub mod ucx;
pub mod unix;

/// An I/O error that means the peer is gone (it exited, crashed or closed
/// its end): the same event as a read of 0 bytes, whichever call met it.
pub(crate) fn peer_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}
