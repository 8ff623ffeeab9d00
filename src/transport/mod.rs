//! Byte transports under the wire format: Unix sockets (with descriptor
//! passing and peer credentials) for same-node IPC; UCX for the network.

pub mod auth;
pub mod conn;
pub mod ucx;
pub mod unix;
