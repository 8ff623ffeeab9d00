//! The TCP link between rank 0 and the leader (local rank 0) of every other
//! node. Frames are `[type u8][length u32 LE][payload]`, payload fields little
//! endian; every read has a deadline, and a closed connection is a peer error.

use crate::result::{Error, Result};
use crate::wire::{In, Out};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x574d_5347; // "WMSG"
/// 2: the finishing barrier has two rounds (a release mixing with 1
/// would pair one rank's second round with another's next barrier).
const PROTOCOL: u32 = 2;
const MAX_FRAME: u32 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Leader to rank 0: who I am.
    Hello {
        group: String,
        node: u32,
        ranks: Vec<u32>,
    },
    /// Rank 0 to leader: accepted.
    Welcome,
    /// Rank 0 to leader: the signal of step `step`.
    Step { step: u64, value: i32 },
    /// Leader to rank 0: my node reached barrier `gen`; these ranks failed.
    Arrive { gen: u64, failures: Vec<(u32, u32)> },
    /// Rank 0 to leader: everybody reached barrier `gen`.
    Release { gen: u64, failures: Vec<(u32, u32)> },
    /// Either way: the sender gives up, with a reason.
    Abort { reason: String },
}

fn put_pairs(w: &mut Out, v: &[(u32, u32)]) {
    w.u32(v.len() as u32);
    for (a, b) in v {
        w.u32(*a);
        w.u32(*b);
    }
}

fn get_pairs(r: &mut In) -> Result<Vec<(u32, u32)>> {
    let n = r.count(8, "failures")?;
    (0..n).map(|_| Ok((r.u32()?, r.u32()?))).collect()
}

impl Msg {
    fn encode(&self) -> Vec<u8> {
        let mut w = Out(Vec::new());
        let kind = match self {
            Msg::Hello { group, node, ranks } => {
                w.u32(MAGIC);
                w.u32(PROTOCOL);
                w.str(group);
                w.u32(*node);
                w.u32(ranks.len() as u32);
                ranks.iter().for_each(|r| w.u32(*r));
                1
            }
            Msg::Welcome => 2,
            Msg::Step { step, value } => {
                w.u64(*step);
                w.u32(*value as u32);
                3
            }
            Msg::Arrive { gen, failures } => {
                w.u64(*gen);
                put_pairs(&mut w, failures);
                4
            }
            Msg::Release { gen, failures } => {
                w.u64(*gen);
                put_pairs(&mut w, failures);
                5
            }
            Msg::Abort { reason } => {
                w.str(reason);
                6
            }
        };
        let mut frame = vec![kind];
        frame.extend_from_slice(&(w.0.len() as u32).to_le_bytes());
        frame.extend_from_slice(&w.0);
        frame
    }

    fn decode(kind: u8, payload: &[u8]) -> Result<Msg> {
        let mut r = In(payload);
        Ok(match kind {
            1 => {
                if r.u32()? != MAGIC {
                    return Err(Error::peer("signal link: not a weight_manager peer"));
                }
                let protocol = r.u32()?;
                if protocol != PROTOCOL {
                    return Err(Error::peer(format!(
                        "signal link: peer speaks protocol {protocol}, this library {PROTOCOL}"
                    )));
                }
                let group = r.str()?;
                let node = r.u32()?;
                let n = r.count(4, "ranks")?;
                let ranks = (0..n).map(|_| r.u32()).collect::<Result<_>>()?;
                Msg::Hello { group, node, ranks }
            }
            2 => Msg::Welcome,
            3 => Msg::Step {
                step: r.u64()?,
                value: r.u32()? as i32,
            },
            4 => Msg::Arrive {
                gen: r.u64()?,
                failures: get_pairs(&mut r)?,
            },
            5 => Msg::Release {
                gen: r.u64()?,
                failures: get_pairs(&mut r)?,
            },
            6 => Msg::Abort { reason: r.str()? },
            other => {
                return Err(Error::peer(format!(
                    "signal link: unknown frame type {other}"
                )))
            }
        })
    }
}

/// Send one message. `who` names the peer in errors.
pub fn send(stream: &mut TcpStream, msg: &Msg, who: &str) -> Result<()> {
    stream.write_all(&msg.encode()).map_err(|e| {
        // A dead peer, noticed on a write rather than a read (see read_exact).
        if crate::transport::peer_gone(&e) {
            Error::peer(format!("{who} closed the connection (process died?)"))
        } else if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            Error::timeout(format!(
                "{who} took no message within the group's timeout (stopped or hung: \
                 its socket's buffers are full)"
            ))
        } else {
            Error::peer(format!("{who}: connection lost while sending ({e})"))
        }
    })
}

/// Bound every send on `stream` by the group's `timeout`: a peer that
/// stopped reading (stopped, hung) fills the socket's buffers after enough
/// steps, and a send would then wait for it without end.
pub fn bound_sends(stream: &TcpStream, timeout: Duration) -> Result<()> {
    stream
        .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|e| Error::io("a group socket's send timeout", e))
}

/// Receive one message before `deadline`. `who` names the peer in errors.
pub fn recv(stream: &mut TcpStream, deadline: Instant, who: &str) -> Result<Msg> {
    let mut head = [0u8; 5];
    read_exact(stream, &mut head, deadline, who)?;
    let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
    if len > MAX_FRAME {
        return Err(Error::peer(format!(
            "{who}: frame of {len} bytes is over the {MAX_FRAME} limit"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    read_exact(stream, &mut payload, deadline, who)?;
    match Msg::decode(head[0], &payload)? {
        Msg::Abort { reason } => Err(Error::peer(format!("{who} gave up: {reason}"))),
        m => Ok(m),
    }
}

fn read_exact(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
    who: &str,
) -> Result<()> {
    while !buf.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::timeout(format!(
                "{who} sent nothing before the deadline"
            )));
        }
        stream
            .set_read_timeout(Some(deadline - now))
            .map_err(|e| Error::io("setting a read timeout", e))?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(Error::peer(format!(
                    "{who} closed the connection (process died?)"
                )))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::peer(format!("{who}: connection lost ({e})"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let msgs = [
            Msg::Hello {
                group: "g".into(),
                node: 1,
                ranks: vec![2, 3],
            },
            Msg::Welcome,
            Msg::Step { step: 9, value: -2 },
            Msg::Arrive {
                gen: 4,
                failures: vec![(3, 10)],
            },
            Msg::Release {
                gen: 4,
                failures: vec![],
            },
        ];
        for m in msgs {
            let f = m.encode();
            assert_eq!(Msg::decode(f[0], &f[5..]).unwrap(), m);
        }
        assert!(Msg::decode(4, &[1, 2]).is_err());
        // A list claiming more items than the frame holds is refused before allocating.
        let mut bad = 7u64.to_le_bytes().to_vec();
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Msg::decode(4, &bad)
            .unwrap_err()
            .message
            .contains("cannot fit"));
    }
}
