//! What the ipc and network sources share: the control connection to a
//! trainer's publisher, the handshake that ends with this rank's manifest,
//! the WANT that follows the plan, and the `Source` face of it all. Each
//! source adds only how bucket bytes reach it.

use super::Step;
use crate::apply::Applier;
use crate::manifest::Manifest;
use crate::plan::{Plan, Target};
use crate::result::{Error, Result};
use crate::transport::conn::Conn;
use crate::wire::Frame;
use std::time::{Duration, Instant};

/// Who this rank is and which version it asks for.
pub struct Hello<'a> {
    pub rank: u32,
    pub world_size: u32,
    pub gpu_id: &'a str,
    /// None: the publisher's latest.
    pub version: Option<&'a str>,
}

pub struct PublisherLink {
    pub conn: Conn,
    pub manifest: Manifest,
}

impl PublisherLink {
    /// Send HELLO, run `before_manifest` (the network challenge, given the
    /// HELLO's encoding, which the session keys bind), then take the
    /// MANIFEST, all before `deadline`.
    pub fn handshake(
        mut conn: Conn,
        hello: &Hello,
        deadline: Instant,
        before_manifest: impl FnOnce(&mut Conn, &[u8]) -> Result<()>,
    ) -> Result<PublisherLink> {
        let hello = Frame::Hello {
            rank: hello.rank,
            world_size: hello.world_size,
            gpu_id: hello.gpu_id.to_string(),
            version: hello.version.unwrap_or_default().to_string(),
        };
        conn.send(&hello)?;
        before_manifest(&mut conn, &hello.encode())?;
        let manifest = match conn.recv(deadline)? {
            Frame::Manifest { version, tensors } => Manifest {
                tensors,
                version: (!version.is_empty()).then_some(version),
            },
            other => return Err(unexpected(&conn, "MANIFEST", &other)),
        };
        Ok(PublisherLink { conn, manifest })
    }

    /// Ask for every planned tensor of source `me` that is not skipped.
    pub fn send_want(&mut self, plan: &Plan, me: usize) -> Result<()> {
        if me != 0 || !plan.is_whole_tensors() {
            return Err(Error::unsupported(format!(
                "{}: this engine's params need parts of the publisher's tensors (pieces or shards), \
                 and a publisher sends whole tensors only so far; use a snapshot",
                self.conn.peer()
            )));
        }
        let tensors = (0..plan.entries.len() as u32)
            .filter(|&i| plan.entries[i as usize].target != Target::Skip)
            .collect();
        self.conn.send(&Frame::Want { tensors })
    }
}

/// "<peer>: expected X, got Y".
pub fn unexpected(conn: &Conn, expected: &str, got: &Frame) -> Error {
    Error::peer(format!(
        "{}: expected {expected}, got {}",
        conn.peer(),
        got.name()
    ))
}

/// A source fed by a publisher: the `Source` impl comes with it, and a failed
/// update tells the publisher why.
pub trait FromPublisher {
    fn link(&self) -> &PublisherLink;
    fn link_mut(&mut self) -> &mut PublisherLink;
    /// WANT is sent; receive and apply every bucket.
    fn receive(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()>;
}

impl<T: FromPublisher> super::Source for T {
    fn manifest(&self) -> &Manifest {
        &self.link().manifest
    }

    fn no_version_reason(&self) -> String {
        format!("{} named no version", self.link().conn.peer())
    }

    fn describe(&self) -> String {
        self.link().conn.peer().to_string()
    }

    fn start(&mut self, plan: &Plan, me: usize, _: &mut Applier) -> Result<()> {
        self.link_mut().send_want(plan, me)
    }

    fn step(&mut self, plan: &Plan, _: usize, applier: &mut Applier, _: Duration) -> Result<Step> {
        self.receive(plan, applier).map(|()| Step::Done)
    }

    fn abort(&mut self, why: &Error) {
        self.link_mut().conn.send_error(why);
    }
}
