//! Reaching a network publisher: the TCP connection and the engine's side
//! of the challenge, after which every frame is authenticated both ways.

use super::NetOptions;
use crate::checksum::KEYED;
use crate::result::{Error, Result};
use crate::source::publisher_link::unexpected;
use crate::transport::auth::{self, Secret};
use crate::transport::conn::Conn;
use crate::transport::seal::Role;
use crate::wire::{Frame, HANDSHAKE_FRAME};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// A TCP connection to the publisher at `opts.address` (its first address
/// that answers), within the bucket timeout and `deadline`.
pub(super) fn connect(opts: &NetOptions, deadline: Instant) -> Result<TcpStream> {
    let addrs: Vec<_> = opts
        .address
        .to_socket_addrs()
        .map_err(|e| {
            Error::invalid_argument(format!(
                "publisher address '{}' is not host:port ({e})",
                opts.address
            ))
        })?
        .collect();
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .min(opts.pull.bucket_timeout)
        .max(Duration::from_millis(1));
    let mut last = None;
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, wait) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let stream = stream.ok_or_else(|| {
        let e = last.map_or("no address".to_string(), |e| e.to_string());
        Error::not_found(format!("no publisher answers at {} ({e})", opts.address))
    })?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The engine's side of the challenge (see `transport::auth`); once the
/// publisher's proof checks, every frame is authenticated both ways.
/// Returns the session's key of the bucket bytes' digests.
pub(super) fn authenticate(
    conn: &mut Conn,
    secret: &Secret,
    hello: &[u8],
    deadline: Instant,
) -> Result<[u8; KEYED]> {
    // Until the publisher's proof checks (`secure` lifts it).
    conn.limit_frames(HANDSHAKE_FRAME);
    let theirs = match conn.recv(deadline)? {
        Frame::Challenge { nonce } => nonce,
        other => return Err(unexpected(conn, "CHALLENGE", &other)),
    };
    let mine = auth::nonce()?;
    conn.send(&Frame::Proof {
        mac: secret.engine_proof(&theirs, &mine),
        nonce: mine,
    })?;
    match conn.recv(deadline) {
        Ok(Frame::Proof { mac, .. }) if secret.check_publisher_proof(&mine, &theirs, &mac) => {
            let keys = secret.session_keys(&theirs, &mine, hello);
            conn.secure(&keys, Role::Engine);
            Ok(keys.bytes)
        }
        Ok(Frame::Proof { .. }) => Err(Error::auth(format!(
            "authentication failed: {} does not hold this engine's shared secret",
            conn.peer()
        ))),
        Ok(other) => Err(unexpected(conn, "PROOF", &other)),
        Err(e) => Err(e),
    }
}
