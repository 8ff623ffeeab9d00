//! An engine's handshake: its HELLO and, over the network, the challenge
//! that proves it holds the shared secret.

use super::config::PublisherConfig;
use crate::result::{wm_result, Error, Result};
use crate::transport::auth::{self, Secret};
use crate::transport::conn::{Conn, Stream};
use crate::transport::seal::Role;
use crate::transport::unix::check_peer_uid;
use crate::wire::{Frame, HANDSHAKE_FRAME};
use std::time::Instant;

/// An engine's connection that finished its handshake in time: its HELLO
/// read and, over the network, both proofs checked and the frames sealed.
/// Only such a connection counts as one of the engines a serve call waits
/// for (`accept`).
pub(super) struct Admitted {
    pub(super) conn: Conn,
    pub(super) rank: u32,
    pub(super) gpu_id: String,
    pub(super) version: String,
    /// The version the engine's params hold ("" none), for deltas.
    pub(super) base: String,
    /// Network sessions: the key of the bucket bytes' digests (None: IPC).
    pub(super) bytes_key: Option<[u8; 32]>,
}

impl Admitted {
    /// Turn the engine away (best effort: it is told why).
    pub(super) fn refuse(mut self, e: &Error) {
        self.conn.send_error(e);
    }
}

/// The connection of a peer this publisher may serve, named for messages:
/// over IPC one of this uid (unless `allow_other_uids`); one of another is
/// told why it is turned away (its error read "closed the connection (did
/// it exit or crash?)").
fn admitted_peer(stream: Stream, cfg: &PublisherConfig) -> Result<Conn> {
    let (who, uid) = match &stream {
        Stream::Unix(s) => (
            "an engine".to_string(),
            check_peer_uid(s, cfg.allow_other_uids, "an engine"),
        ),
        Stream::Tcp(s) => match s.peer_addr() {
            Ok(a) => (format!("the engine at {a}"), Ok(())),
            Err(_) => ("an engine".to_string(), Ok(())),
        },
    };
    let mut conn = Conn::new(stream, who);
    if let Err(e) = uid {
        conn.send_error(&e);
        return Err(e);
    }
    Ok(conn)
}

/// Read the engine's HELLO and, with a `secret` (a network publisher), run
/// the challenge, all within `cfg.handshake_timeout`: a connection that
/// does not is dropped, having cost one thread and no buffers. None: the
/// connection closed before sending a byte (a probe, not an engine: a
/// publisher checking whether one listens on its socket, a port check),
/// which is no refusal to log.
pub(super) fn handshake(
    stream: Stream,
    secret: Option<&Secret>,
    cfg: &PublisherConfig,
) -> Result<Option<Admitted>> {
    let deadline = Instant::now() + cfg.handshake_timeout;
    let mut conn = admitted_peer(stream, cfg)?;
    // HELLO and PROOF are small (three strings; 64 bytes): nothing larger
    // is read, or allocated, before the peer proved it holds the secret.
    conn.limit_frames(HANDSHAKE_FRAME);
    let hello = match conn.recv(deadline) {
        Ok(f @ Frame::Hello { .. }) => f,
        Ok(other) => {
            // Told, as a bad magic or version is (it was closed silently).
            let e = Error::peer(format!("expected HELLO, got {}", other.name()));
            conn.send_error(&e);
            return Err(e.context("before its handshake"));
        }
        // Closed before a byte: a probe, no engine (`Conn::heard_anything`).
        Err(e) if e.code == wm_result::WM_ERR_PEER && !conn.heard_anything() => return Ok(None),
        Err(e) => {
            // A HELLO this side cannot read (another protocol version): say
            // why, so that the engine's error names the cause, not a hang-up.
            if e.code == wm_result::WM_ERR_PEER {
                conn.send_error(&e);
            }
            return Err(e.context("before its handshake"));
        }
    };
    let Frame::Hello {
        rank,
        world_size,
        gpu_id,
        version,
        base,
    } = &hello
    else {
        unreachable!("matched above")
    };
    if rank >= world_size {
        // Every engine's config has rank < world_size: a HELLO without is
        // no engine's, and rank shards are picked by these numbers.
        let e = Error::peer(format!(
            "{}: HELLO says rank {rank} of a world of {world_size}",
            conn.peer()
        ));
        conn.send_error(&e);
        return Err(e);
    }
    conn.set_peer(format!("engine rank {rank} ({})", conn.peer()));
    let mut bytes_key = None;
    if let Some(secret) = secret {
        match authenticate(&mut conn, secret, &hello.encode(), deadline) {
            Ok(key) => bytes_key = Some(key),
            Err(e) => {
                conn.send_error(&e);
                return Err(e);
            }
        }
    }
    // The handshake is done: a session's frames (a WANT) may be large.
    conn.limit_frames(usize::MAX);
    Ok(Some(Admitted {
        rank: *rank,
        gpu_id: gpu_id.clone(),
        version: version.clone(),
        base: base.clone(),
        conn,
        bytes_key,
    }))
}

/// The publisher's side of the challenge (see `transport::auth`): a wrong
/// answer is refused before any manifest moves; a right one seals the
/// connection's frames with keys bound to `hello` (its encoding). Returns
/// the session's key for bucket-byte digests.
fn authenticate(
    conn: &mut Conn,
    secret: &Secret,
    hello: &[u8],
    deadline: Instant,
) -> Result<[u8; 32]> {
    let mine = auth::nonce()?;
    conn.send(&Frame::Challenge { nonce: mine })?;
    let (mac, theirs) = match conn.recv(deadline)? {
        Frame::Proof { mac, nonce } => (mac, nonce),
        other => return Err(Error::peer(format!("expected PROOF, got {}", other.name()))),
    };
    if !secret.check_engine_proof(&mine, &theirs, &mac) {
        return Err(Error::auth(format!(
            "authentication failed: {} does not hold this publisher's shared secret",
            conn.peer()
        )));
    }
    conn.send(&Frame::Proof {
        mac: secret.publisher_proof(&theirs, &mine),
        nonce: [0; 32],
    })?;
    let keys = secret.session_keys(&mine, &theirs, hello);
    conn.secure(&keys, Role::Publisher);
    Ok(keys.bytes)
}
