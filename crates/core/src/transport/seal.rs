//! Authenticated frames of a network session's control channel.
//!
//! Once the challenge is done (`transport::auth`), every frame either side
//! sends carries a 32-byte tag, `HMAC-SHA256(key, seq | body)`, after its
//! body (the length prefix counts it). `key` is the sender's direction key;
//! `seq` counts the frames sent that way, from 0, and is not sent: the
//! receiver checks each frame against the next number it expects, so a
//! frame altered, replayed, dropped or reordered on the way fails its check.
//!
//! The IPC path does not seal: its peer is a process of the same uid on the
//! same node (the socket's mode and SO_PEERCRED decide who connects), and
//! nothing on the way can touch its frames.

use super::auth::{SessionKeys, MAC};
use crate::result::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes a sealed frame carries beyond its body.
pub(crate) const TAG: usize = MAC;

/// One side's keys and counters.
pub(crate) struct FrameSeal {
    send_key: [u8; MAC],
    recv_key: [u8; MAC],
    sent: u64,
    received: u64,
}

/// Which end of the session this side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Engine,
    Publisher,
}

impl FrameSeal {
    pub(crate) fn new(keys: &SessionKeys, role: Role) -> FrameSeal {
        let (send_key, recv_key) = match role {
            Role::Engine => (keys.engine_to_publisher, keys.publisher_to_engine),
            Role::Publisher => (keys.publisher_to_engine, keys.engine_to_publisher),
        };
        FrameSeal {
            send_key,
            recv_key,
            sent: 0,
            received: 0,
        }
    }

    /// Append the tag to `frame` (length prefix included) and count it.
    pub(crate) fn seal(&mut self, frame: &mut Vec<u8>) {
        let t = tag(&self.send_key, self.sent, &frame[4..]);
        self.sent += 1;
        frame.extend_from_slice(&t);
        let len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&len.to_le_bytes());
    }

    /// Check the tag at the end of `body` (what followed the length prefix)
    /// against the next frame expected; the body without it.
    pub(crate) fn open<'a>(&mut self, body: &'a [u8], peer: &str) -> Result<&'a [u8]> {
        let seq = self.received;
        let refused = || {
            Error::auth(format!(
                "authentication failed: frame {seq} from {peer} does not carry this session's MAC \
                 (altered, replayed, dropped or reordered on the way, or sent without the session key)"
            ))
        };
        if body.len() <= TAG {
            return Err(refused());
        }
        let (inner, got) = body.split_at(body.len() - TAG);
        let mut m = mac(&self.recv_key, seq);
        m.update(inner);
        m.verify_slice(got).map_err(|_| refused())?;
        self.received += 1;
        Ok(inner)
    }
}

fn mac(key: &[u8; MAC], seq: u64) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key");
    m.update(&seq.to_le_bytes());
    m
}

fn tag(key: &[u8; MAC], seq: u64, body: &[u8]) -> [u8; TAG] {
    let mut m = mac(key, seq);
    m.update(body);
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::auth::{nonce, Secret};
    use crate::wire::Frame;

    fn pair() -> (FrameSeal, FrameSeal) {
        let k = Secret::resolve(Some(b"0123456789abcdef-secret")).unwrap();
        let keys = k.session_keys(&nonce().unwrap(), &nonce().unwrap(), b"hello");
        (
            FrameSeal::new(&keys, Role::Publisher),
            FrameSeal::new(&keys, Role::Engine),
        )
    }

    #[test]
    fn altered_replayed_and_reordered_frames_fail() {
        let (mut tx, mut rx) = pair();
        let frames: Vec<Vec<u8>> = (0..3u64)
            .map(|seq| {
                let mut f = Frame::Ack { seq }.encode();
                tx.seal(&mut f);
                f
            })
            .collect();
        assert_eq!(
            rx.open(&frames[0][4..], "p").unwrap(),
            &Frame::Ack { seq: 0 }.encode()[4..]
        );
        // Replaying frame 0, skipping to 2, or flipping a bit: refused.
        for bad in [frames[0].clone(), frames[2].clone(), {
            let mut f = frames[1].clone();
            f[6] ^= 1;
            f
        }] {
            let e = rx.open(&bad[4..], "p").unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_AUTH);
            assert!(e.message.contains("frame 1 from p"), "{e}");
        }
        assert!(rx.open(&frames[1][4..], "p").is_ok());
        // A frame sealed for the other direction does not open.
        let mut back = Frame::Ack { seq: 9 }.encode();
        rx.seal(&mut back);
        assert!(rx.open(&back[4..], "p").is_err());
        assert!(tx.open(&back[4..], "e").is_ok());
    }
}
