//! Byte transports under the wire format: Unix sockets (with descriptor
//! passing and peer credentials) for same-node IPC.

pub mod unix;
