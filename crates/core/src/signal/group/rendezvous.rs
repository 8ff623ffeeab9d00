//! The rendezvous of a [`Group`]: the node's leader creates the segment,
//! local ranks join it, leaders meet rank 0 over TCP, and every node
//! confirms its ranks are alive before anyone returns (see the parent
//! module's docs).

use super::segment::Segment;
use super::{list, Group, GroupConfig, GroupShared, Link, Peer, NO_RANK};
use crate::result::{Error, Result};
use crate::signal::futex;
use crate::signal::link::{self, Msg};
use crate::signal::shm;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How much longer than local rank 0 the other local ranks wait to meet.
const MEMBER_GRACE: Duration = Duration::from_secs(1);

/// How long a leader finding an unstamped segment waits for its stamp.
const STAMP_GRACE: Duration = Duration::from_millis(200);

impl Group {
    /// Rendezvous: returns once every rank of the group has joined, or fails
    /// at the timeout naming the ranks that never arrived.
    pub fn join(cfg: GroupConfig) -> Result<Group> {
        cfg.check()?;
        let deadline = Instant::now() + cfg.timeout;
        let name = cfg.segment_name();
        let seg = if cfg.local_rank == 0 {
            Self::lead(&name, &cfg)?
        } else {
            Self::attach(&name, &cfg, deadline)?
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let spin = if cores >= cfg.local_world_size {
            futex::SPIN
        } else {
            futex::SPIN_OVERSUBSCRIBED
        };
        let mut g = Group {
            shared: Arc::new(GroupShared {
                spin,
                cfg,
                seg,
                failed_rank: AtomicU32::new(NO_RANK),
            }),
            link: Link::Member,
            step: 0,
            gen: 0,
        };
        let me = g.me();
        // Claim the slot by compare-and-swap: of two processes given the
        // same rank at the same instant, one wins and the other sees it.
        let mine = std::process::id();
        loop {
            let holder = me.pid.load(Ordering::Acquire);
            if holder != 0 && holder != mine && shm::pid_alive(holder) {
                return Err(Self::taken(&g.cfg, holder));
            }
            let claimed =
                me.pid
                    .compare_exchange(holder, mine, Ordering::AcqRel, Ordering::Acquire);
            if claimed.is_ok() {
                break;
            }
        }
        me.rank.store(g.cfg.rank, Ordering::Relaxed);
        me.fanout
            .store(g.cfg.fanout.map_or(0, |f| f + 1), Ordering::Relaxed);
        me.joined.store(1, Ordering::Release);
        let result = g.meet(deadline);
        if g.cfg.local_rank == 0 {
            // Every local rank has mapped the segment (or gave up): the name can go.
            let _ = shm::unlink(&name);
        }
        if let Err(e) = &result {
            // Ranks still waiting for `ready` learn the reason at once.
            g.abort(e);
        }
        result.map(|_| g)
    }

    /// Local rank 0: create the segment, exclusively. One already there is
    /// a live leader's (a second local rank 0 would split the group:
    /// refused naming it) or a stale one (its creator gone: replaced).
    /// A segment not stamped yet may be a leader's of an instant ago: it
    /// counts as stale only when still unstamped after [`STAMP_GRACE`].
    fn lead(name: &str, cfg: &GroupConfig) -> Result<Segment> {
        for _ in 0..3 {
            if let Some(seg) = Segment::create_new(name, cfg.local_world_size)? {
                return Ok(seg);
            }
            let until = Instant::now() + STAMP_GRACE;
            let live = loop {
                match Segment::live(name) {
                    Some((pid, _)) => break Some(pid),
                    // Stamped by a creator gone: stale at once.
                    None if Segment::stamped(name) || Instant::now() >= until => break None,
                    None => std::thread::sleep(Duration::from_millis(5)),
                }
            };
            match live {
                Some(pid) if pid != std::process::id() => return Err(Self::taken(cfg, pid)),
                _ => shm::unlink(name)?,
            }
        }
        Err(Error::busy(format!(
            "group '{}': local rank 0 of node {} could not create the group's segment \
             (another process keeps creating it)",
            cfg.name, cfg.node_rank
        )))
    }

    /// The error for a local rank that a live process `holder` holds.
    fn taken(cfg: &GroupConfig, holder: u32) -> Error {
        Error::invalid_argument(format!(
            "group '{}': local rank {} of node {} is taken by process {holder}: \
             every rank must be given its own number",
            cfg.name, cfg.local_rank, cfg.node_rank
        ))
    }

    /// A member: wait for the leader's live segment.
    fn attach(name: &str, cfg: &GroupConfig, deadline: Instant) -> Result<Segment> {
        let mut tries = 0u64;
        loop {
            tries += 1;
            if let Some(seg) = Segment::open_existing(name, cfg.local_world_size)? {
                return Ok(seg);
            }
            // A live group of another size (looked for every 50 ms): the
            // ranks disagree on the world size, which no wait mends.
            let other = tries
                .is_multiple_of(50)
                .then(|| Segment::live(name))
                .flatten()
                .map(|(_, n)| n)
                .filter(|&n| n != cfg.local_world_size);
            if let Some(n) = other {
                return Err(Error::invalid_argument(format!(
                    "group '{}': local rank 0 of node {} made the group for {n} local rank(s), \
                     but rank {} was told {}: every rank must be given the same world size",
                    cfg.name, cfg.node_rank, cfg.rank, cfg.local_world_size
                )));
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "group '{}': rank {} waited {:?} for local rank 0 of node {} to create the group",
                    cfg.name, cfg.rank, cfg.timeout, cfg.node_rank
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Wait for local ranks, then (leaders) for the other nodes. A rank that
    /// arrived and then died is named at once: the group never meets with a
    /// dead member.
    fn meet(&mut self, deadline: Instant) -> Result<()> {
        // Local rank 0 decides when the group cannot meet; the others wait a
        // little longer, so they learn its reason (the abort) instead of
        // racing it to the same deadline (it would name them as dead).
        let deadline = match self.cfg.local_rank {
            0 => deadline,
            _ => deadline + MEMBER_GRACE,
        };
        self.meet_locally(deadline)?;
        if self.cfg.local_rank == 0 {
            self.link = if self.cfg.world_size == self.cfg.local_world_size {
                Link::Local
            } else if self.cfg.rank == 0 {
                Link::Root(self.accept_leaders(deadline)?)
            } else {
                Link::Leader(self.connect_root(deadline)?)
            };
            self.confirm_alive(deadline)?;
            self.header().ready.store(1, Ordering::Release);
            return Ok(());
        }
        let leader_pid = self.slot(0).pid.load(Ordering::Relaxed);
        while self.header().ready.load(Ordering::Acquire) == 0 {
            self.check_abort()?;
            if !shm::pid_alive(leader_pid) {
                return Err(self.dead(0, "during the rendezvous"));
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "group '{}': the other nodes did not all arrive within {:?}",
                    self.cfg.name, self.cfg.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Leader and members: wait until every local rank joined the segment.
    fn meet_locally(&self, deadline: Instant) -> Result<()> {
        let n = self.cfg.local_world_size;
        loop {
            if self.cfg.local_rank != 0 {
                self.check_abort()?;
            }
            self.check_arrived_alive()?;
            let missing: Vec<u32> = (0..n)
                .filter(|&i| self.slot(i).joined.load(Ordering::Acquire) == 0)
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let names = if self.cfg.world_size == n {
                    format!("ranks never arrived: {}", list(&missing))
                } else {
                    format!(
                        "local ranks never arrived on node {}: {}",
                        self.cfg.node_rank,
                        list(&missing)
                    )
                };
                return Err(Error::timeout(format!(
                    "group '{}': {names}",
                    self.cfg.name
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The last step of the rendezvous: every leader checks that its local
    /// ranks are all still alive and says so (`Arrive` of generation 0);
    /// rank 0 waits for all of them, checks its own, and lets them go
    /// (`Release` of generation 0). No rank's init succeeds with a member
    /// that died during the rendezvous, on any node.
    fn confirm_alive(&mut self, deadline: Instant) -> Result<()> {
        self.check_arrived_alive()?;
        let unexpected = |who: &str, other: Msg| -> Error {
            match other {
                Msg::Abort { reason } => Error::peer(format!("{who}: {reason}")),
                other => Error::peer(format!(
                    "{who}: expected the rendezvous confirmation, got {other:?}"
                )),
            }
        };
        match &mut self.link {
            Link::Leader(up) => {
                let confirm = Msg::Arrive {
                    gen: 0,
                    failures: Vec::new(),
                };
                link::send(up, &confirm, "rank 0")?;
                match link::recv(up, deadline, "rank 0")? {
                    Msg::Release { gen: 0, .. } => Ok(()),
                    other => Err(unexpected("rank 0", other)),
                }
            }
            Link::Root(peers) => {
                for p in peers.iter_mut() {
                    let who = p.who();
                    match link::recv(&mut p.stream, deadline, &who)? {
                        Msg::Arrive { gen: 0, .. } => {}
                        other => return Err(unexpected(&who, other)),
                    }
                }
                self.check_arrived_alive()?;
                let Link::Root(peers) = &mut self.link else {
                    unreachable!("matched above")
                };
                let go = Msg::Release {
                    gen: 0,
                    failures: Vec::new(),
                };
                Self::send_to_peers(peers, &go)
            }
            Link::Local | Link::Member => Ok(()),
        }
    }

    /// Every local rank that joined is still alive.
    fn check_arrived_alive(&self) -> Result<()> {
        let dead = (0..self.cfg.local_world_size).find(|&i| {
            let s = self.slot(i);
            s.joined.load(Ordering::Acquire) != 0 && !shm::pid_alive(s.pid.load(Ordering::Relaxed))
        });
        match dead {
            Some(i) => Err(self.dead(i, "after arriving at the rendezvous")),
            None => Ok(()),
        }
    }

    fn local_ranks(&self) -> Vec<u32> {
        (0..self.cfg.local_world_size)
            .map(|i| self.slot(i).rank.load(Ordering::Relaxed))
            .collect()
    }

    /// Rank 0: take every other node's leader, until every rank is covered.
    fn accept_leaders(&self, deadline: Instant) -> Result<Vec<Peer>> {
        let addr = self.cfg.addr.as_deref().expect("checked");
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::io(
                format!("group '{}': rank 0 listening on {addr}", self.cfg.name),
                e,
            )
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener", e))?;
        let mut covered = vec![false; self.cfg.world_size as usize];
        for r in self.local_ranks() {
            covered[r as usize] = true;
        }
        let mut peers: Vec<Peer> = Vec::new();
        while covered.iter().any(|c| !c) {
            match listener.accept() {
                Ok((stream, from)) => {
                    if let Some(peer) = self.admit_leader(stream, from, &mut covered, deadline)? {
                        peers.push(peer);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<u32> = (0..self.cfg.world_size)
                            .filter(|&r| !covered[r as usize])
                            .collect();
                        return Err(Error::timeout(format!(
                            "group '{}': ranks never arrived: {}",
                            self.cfg.name,
                            list(&missing)
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(Error::io("accepting a group peer", e)),
            }
        }
        for p in &mut peers {
            let who = p.who();
            link::send(&mut p.stream, &Msg::Welcome, &who)?;
        }
        Ok(peers)
    }

    /// One accepted connection: a leader of this group whose ranks are
    /// marked in `covered`, or None when it is not one (it is dropped). Ranks
    /// out of range or taken twice fail the rendezvous.
    fn admit_leader(
        &self,
        mut stream: TcpStream,
        from: SocketAddr,
        covered: &mut [bool],
        deadline: Instant,
    ) -> Result<Option<Peer>> {
        stream
            .set_nonblocking(false)
            .map_err(|e| Error::io("accepted socket", e))?;
        let _ = stream.set_nodelay(true);
        link::bound_sends(&stream, self.cfg.timeout)?;
        let who = format!("group peer {from}");
        let hello = link::recv(&mut stream, deadline, &who);
        let (node, ranks) = match hello {
            Ok(Msg::Hello { group, node, ranks }) if group == self.cfg.name => (node, ranks),
            Ok(Msg::Hello { group, .. }) => {
                let reason = format!("group '{group}' is not '{}'", self.cfg.name);
                let _ = link::send(&mut stream, &Msg::Abort { reason }, &who);
                return Ok(None);
            }
            _ => return Ok(None),
        };
        for &r in &ranks {
            if r >= self.cfg.world_size || covered[r as usize] {
                let reason = format!("rank {r} is out of range or taken");
                let _ = link::send(
                    &mut stream,
                    &Msg::Abort {
                        reason: reason.clone(),
                    },
                    &who,
                );
                return Err(Error::invalid_argument(format!(
                    "group '{}': node {node}: {reason}",
                    self.cfg.name
                )));
            }
            covered[r as usize] = true;
        }
        Ok(Some(Peer {
            stream,
            node,
            ranks,
        }))
    }

    fn connect_root(&self, deadline: Instant) -> Result<TcpStream> {
        let addr = self.cfg.addr.as_deref().expect("checked");
        let who = format!("rank 0 at {addr}");
        let mut stream = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) => {
                    if Instant::now() >= deadline {
                        return Err(Error::timeout(format!(
                            "group '{}': node {} could not reach {who} within {:?} ({e})",
                            self.cfg.name, self.cfg.node_rank, self.cfg.timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let _ = stream.set_nodelay(true);
        link::bound_sends(&stream, self.cfg.timeout)?;
        let hello = Msg::Hello {
            group: self.cfg.name.clone(),
            node: self.cfg.node_rank,
            ranks: self.local_ranks(),
        };
        link::send(&mut stream, &hello, &who)?;
        match link::recv(&mut stream, deadline, &who)? {
            Msg::Welcome => Ok(stream),
            other => Err(Error::peer(format!(
                "{who}: expected a welcome, got {other:?}"
            ))),
        }
    }
}
