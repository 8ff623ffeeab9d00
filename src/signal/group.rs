//! A signal group: every rank of one engine, in step.
//!
//! **Layout.** Ranks on one node share a segment `/dev/shm/wm.<group>.n<node>`
//! created by the node's leader (local rank 0); once every local rank joined,
//! the leader unlinks its name, so nothing is left in /dev/shm even if the
//! engine crashes. Rank 0 is the leader of node 0. With ranks on several
//! nodes, rank 0 listens on `addr` and every other node's leader connects to
//! it over TCP.
//!
//! **Per step (`broadcast`).** Rank 0 reads the value, writes `(step, value)`
//! into a 64-entry ring in the segment and sends it to the other leaders,
//! which write it into their own node's ring. Everybody else reads the ring
//! entry of its step: in the steady state that is one shared-memory load, no
//! syscall, because the value is there before the reader looks (a bounded
//! spin covers small skews, then a futex sleep). The futex wake is paid only
//! when somebody sleeps. A publisher never laps a reader: before step `k` it
//! checks that every local rank consumed step `k - 62`.
//!
//! **Barrier.** For any value other than NORMAL, every rank passes a barrier
//! before returning, so all enter the update or clear together: local ranks
//! count in on a shared word, the leader waits for them, leaders report to
//! rank 0, rank 0 releases them, they release their ranks. Barriers carry a
//! result code per rank, which the manager uses to learn, at rank 0, whether
//! every rank's update succeeded.
//!
//! **Failure.** Every wait has the group's timeout. Between futex sleeps a
//! waiter checks that the process it waits for is alive, so a dead local rank
//! is reported within milliseconds; a dead remote node shows as a closed TCP
//! connection. Errors name the ranks. The first rank to fail writes its
//! reason into the segment (and sends it over TCP): every other rank's next
//! wait fails with that reason, so all survivors name the rank that died.
//! A group that failed stays failed; the engine restarts its ranks.

use super::futex;
use super::link::{self, Msg};
use super::shm::{self, OpenMode, SharedMapping};
use crate::result::{Error, Result};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

mod rendezvous;

const MAGIC: u64 = 0x574d_4752_4f55_5032; // "WMGROUP2"
const RING: u64 = 64;
const NO_RANK: u32 = u32::MAX;

/// Where a rank sits in its engine.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Names the group (segment and TCP handshake); unique per engine and node.
    pub name: String,
    pub rank: u32,
    pub world_size: u32,
    /// This rank's index among the ranks of its node.
    pub local_rank: u32,
    /// Ranks on this node.
    pub local_world_size: u32,
    /// This node's index (node 0 holds rank 0).
    pub node_rank: u32,
    /// `host:port` rank 0 listens on when ranks span nodes.
    pub addr: Option<String>,
    /// Bound on every wait: rendezvous, a step's value, a barrier.
    pub timeout: Duration,
    /// This rank's fan-out group, if any (see [`super::fanout`]).
    pub fanout: Option<u32>,
}

impl GroupConfig {
    fn check(&self) -> Result<()> {
        super::shm::check_name(&format!("wm.{}.n{}", self.name, self.node_rank))?;
        let bad = |m: String| Err(Error::invalid_argument(m));
        if self.world_size == 0 || self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return bad(format!(
                "local_rank {} is not below local_world_size {}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.local_world_size > self.world_size {
            return bad(format!(
                "local_world_size {} is more than world_size {}",
                self.local_world_size, self.world_size
            ));
        }
        if self.rank == 0 && (self.local_rank != 0 || self.node_rank != 0) {
            return bad("rank 0 must be local rank 0 of node 0".into());
        }
        if self.world_size == self.local_world_size && self.local_rank != self.rank {
            return bad(format!(
                "all ranks are on one node, so local_rank ({}) must equal rank ({})",
                self.local_rank, self.rank
            ));
        }
        if self.world_size > self.local_world_size && self.addr.is_none() {
            return bad("ranks span several nodes: set the rendezvous address of rank 0".into());
        }
        Ok(())
    }

    fn segment_name(&self) -> String {
        format!("wm.{}.n{}", self.name, self.node_rank)
    }
}

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    creator_pid: AtomicU32,
    local_world: AtomicU32,
    /// Set by the leader once the whole group (all nodes) met.
    ready: AtomicU32,
    _p0: [u32; 11],
    /// `(step + 1) as u32` of the newest ring entry; futex word for readers.
    published: AtomicU32,
    pub_waiters: AtomicU32,
    _p1: [u32; 14],
    /// Local ranks (other than the leader) inside the current barrier.
    arrived: AtomicU32,
    arrive_waiters: AtomicU32,
    /// Last released barrier generation; futex word for members.
    released: AtomicU32,
    release_waiters: AtomicU32,
    _p2: [u32; 12],
    ring: [AtomicU64; RING as usize],
    /// Set once when any rank gives up; every waiter then fails with `abort_msg`.
    aborted: AtomicU32,
    abort_msg: [AtomicU8; 252],
}

#[repr(C, align(64))]
pub(super) struct Slot {
    pub(super) pid: AtomicU32,
    joined: AtomicU32,
    pub(super) rank: AtomicU32,
    result: AtomicI32,
    /// `step + 1` of the last step this rank read.
    consumed: AtomicU64,
    /// Last barrier generation this rank entered.
    barrier: AtomicU64,
    /// Fan-out group + 1 (0: none); written before `joined`.
    pub(super) fanout: AtomicU32,
    /// Members: the meeting this rank waits for; the root's: the last
    /// meeting it decided (see `super::fanout`).
    pub(super) fan_seq: AtomicU64,
    /// Members: the communicator generation this rank holds (0: none).
    pub(super) fan_have: AtomicU64,
    /// Root: the generation to use in meeting `fan_seq`, and its id.
    pub(super) fan_gen: AtomicU64,
    pub(super) fan_id: [AtomicU8; super::fanout::ID_BYTES],
}

enum Link {
    /// All ranks on one node.
    Local,
    /// Rank 0 with leaders of other nodes.
    Root(Vec<Peer>),
    /// Leader of another node, connected to rank 0.
    Leader(TcpStream),
    /// Not a leader.
    Member,
}

struct Peer {
    stream: TcpStream,
    node: u32,
    ranks: Vec<u32>,
}

impl Peer {
    fn who(&self) -> String {
        format!("node {} (ranks {})", self.node, list(&self.ranks))
    }
}

/// "0, 2, 5": ranks in messages.
pub(crate) fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub struct Group {
    pub(super) cfg: GroupConfig,
    /// Spin budget of waits: short when ranks outnumber cores.
    spin: u32,
    map: SharedMapping,
    link: Link,
    step: u64,
    gen: u64,
    /// The rank this process found dead (`NO_RANK`: none yet).
    failed_rank: AtomicU32,
}

fn pack(step: u64, value: i32) -> u64 {
    ((step + 1) as u32 as u64) << 32 | value as u32 as u64
}

impl Group {
    fn header(&self) -> &Header {
        // SAFETY: the mapping holds a Header at offset 0 (size checked when mapped).
        unsafe { &*(self.map.ptr() as *const Header) }
    }

    pub(super) fn slot(&self, i: u32) -> &Slot {
        // SAFETY: slots follow the header; i < local_world_size (the mapped count).
        unsafe { &*((self.map.ptr() as *const Header).add(1) as *const Slot).add(i as usize) }
    }

    pub(super) fn me(&self) -> &Slot {
        self.slot(self.cfg.local_rank)
    }

    fn size_for(local_world: u32) -> usize {
        std::mem::size_of::<Header>() + local_world as usize * std::mem::size_of::<Slot>()
    }

    pub(super) fn check_abort(&self) -> Result<()> {
        let h = self.header();
        let aborted = h.aborted.load(Ordering::Acquire);
        // Reads of a segment that shrank under us return zeros (see
        // `super::sigbus`): nothing read from it can be trusted any more.
        self.map
            .check(|| format!("group '{}': segment", self.cfg.name))?;
        if aborted == 0 {
            return Ok(());
        }
        let bytes: Vec<u8> = h
            .abort_msg
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .take_while(|b| *b != 0)
            .collect();
        Err(Error::peer(format!(
            "group '{}' stopped: {}",
            self.cfg.name,
            String::from_utf8_lossy(&bytes)
        )))
    }

    /// Record why this group stops, wake every sleeper, and tell the other
    /// nodes. Only the first reason is kept.
    fn abort(&mut self, e: &Error) {
        let h = self.header();
        if h.aborted.load(Ordering::Acquire) == 0 {
            let text = format!("rank {}: {}", self.cfg.rank, e.message);
            let mut n = text.len().min(h.abort_msg.len() - 1);
            while !text.is_char_boundary(n) {
                n -= 1;
            }
            for (d, b) in h
                .abort_msg
                .iter()
                .zip(text.as_bytes()[..n].iter().chain(std::iter::once(&0)))
            {
                d.store(*b, Ordering::Relaxed);
            }
            h.aborted.store(1, Ordering::SeqCst);
            futex::wake_all(&h.published);
            futex::wake_all(&h.arrived);
            futex::wake_all(&h.released);
        }
        let reason = e.message.clone();
        match &mut self.link {
            Link::Root(peers) => {
                for p in peers.iter_mut() {
                    let _ = link::send(
                        &mut p.stream,
                        &Msg::Abort {
                            reason: reason.clone(),
                        },
                        "peer",
                    );
                }
            }
            Link::Leader(up) => {
                let _ = link::send(up, &Msg::Abort { reason }, "rank 0");
            }
            Link::Local | Link::Member => {}
        }
    }

    /// Run one group operation; on failure, stop the whole group.
    fn guarded<T>(&mut self, op: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.check_abort()?;
        let r = op(self);
        if let Err(e) = &r {
            self.abort(e);
        }
        r
    }

    /// The step the next `broadcast` serves.
    pub fn step(&self) -> u64 {
        self.step
    }

    fn publish(&self, step: u64, value: i32) {
        let h = self.header();
        h.ring[(step % RING) as usize].store(pack(step, value), Ordering::Release);
        h.published.store((step + 1) as u32, Ordering::SeqCst);
        futex::notify(&h.published, &h.pub_waiters);
    }

    /// Publishers wait (rarely) until no local rank is 62 steps behind.
    fn hold_back(&self, step: u64, deadline: Instant) -> Result<()> {
        if step + 2 < RING {
            return Ok(());
        }
        let need = step + 2 - RING;
        loop {
            let lagging: Vec<u32> = (1..self.cfg.local_world_size)
                .filter(|&i| self.slot(i).consumed.load(Ordering::Acquire) < need)
                .collect();
            if lagging.is_empty() {
                return Ok(());
            }
            self.check_abort()?;
            for &i in &lagging {
                let s = self.slot(i);
                if !shm::pid_alive(s.pid.load(Ordering::Relaxed)) {
                    return Err(self.dead(i, "while the others went on"));
                }
            }
            if Instant::now() >= deadline {
                let ranks: Vec<u32> = lagging
                    .iter()
                    .map(|&i| self.slot(i).rank.load(Ordering::Relaxed))
                    .collect();
                return Err(Error::timeout(format!(
                    "group '{}': rank(s) {} stopped calling wm_broadcast_signal ({} steps behind rank {})",
                    self.cfg.name,
                    list(&ranks),
                    RING - 2,
                    self.cfg.rank
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// The rank this process found dead (for the report), if any.
    pub fn failed_rank(&self) -> Option<u32> {
        Some(self.failed_rank.load(Ordering::Relaxed)).filter(|&r| r != NO_RANK)
    }

    pub(super) fn dead(&self, local: u32, when: &str) -> Error {
        let s = self.slot(local);
        self.failed_rank
            .store(s.rank.load(Ordering::Relaxed), Ordering::Relaxed);
        Error::peer(format!(
            "group '{}': rank {} (pid {}) died {when}",
            self.cfg.name,
            s.rank.load(Ordering::Relaxed),
            s.pid.load(Ordering::Relaxed)
        ))
    }

    /// Agree on this step's value: `read` runs on rank 0 only. Values other
    /// than NORMAL (0) are followed by a barrier. Returns (step, value).
    pub fn broadcast(&mut self, read: impl FnOnce() -> Result<i32>) -> Result<(u64, i32)> {
        self.guarded(|g| g.broadcast_step(read))
    }

    fn broadcast_step(&mut self, read: impl FnOnce() -> Result<i32>) -> Result<(u64, i32)> {
        let k = self.step;
        let deadline = Instant::now() + self.cfg.timeout;
        let value = match &mut self.link {
            Link::Local | Link::Root(_) => {
                let v = read()?;
                self.hold_back(k, deadline)?;
                self.publish(k, v);
                if let Link::Root(peers) = &mut self.link {
                    for p in peers.iter_mut() {
                        let who = p.who();
                        link::send(&mut p.stream, &Msg::Step { step: k, value: v }, &who)?;
                    }
                }
                v
            }
            Link::Leader(up) => {
                let who = "rank 0";
                let v = match link::recv(up, deadline, who)? {
                    Msg::Step { step, value } if step == k => value,
                    other => {
                        return Err(Error::peer(format!(
                            "{who}: expected step {k}, got {other:?}"
                        )))
                    }
                };
                self.hold_back(k, deadline)?;
                self.publish(k, v);
                v
            }
            Link::Member => self.wait_published(k, deadline)?,
        };
        self.me().consumed.store(k + 1, Ordering::Release);
        self.step += 1;
        if value != 0 {
            self.barrier_step(0)?;
        }
        Ok((k, value))
    }

    fn wait_published(&self, k: u64, deadline: Instant) -> Result<i32> {
        let h = self.header();
        let entry = &h.ring[(k % RING) as usize];
        let want = (k + 1) as u32;
        let leader = self.slot(0);
        let leader_pid = leader.pid.load(Ordering::Relaxed);
        futex::wait_until(
            self.spin,
            &h.published,
            &h.pub_waiters,
            deadline,
            || (entry.load(Ordering::Acquire) >> 32) as u32 == want,
            || {
                self.check_abort()?;
                if shm::pid_alive(leader_pid) {
                    Ok(())
                } else {
                    Err(self.dead(0, &format!("before publishing step {k}")))
                }
            },
            || {
                Error::timeout(format!(
                    "group '{}': rank {} waited {:?} for rank {} to publish step {k}",
                    self.cfg.name,
                    self.cfg.rank,
                    self.cfg.timeout,
                    leader.rank.load(Ordering::Relaxed)
                ))
            },
        )?;
        Ok(entry.load(Ordering::Acquire) as u32 as i32)
    }

    /// Every rank passes together, contributing `result` (0 for success).
    /// Rank 0 gets the (rank, code) of every rank that contributed non-zero;
    /// the others get an empty list.
    pub fn barrier(&mut self, result: i32) -> Result<Vec<(u32, u32)>> {
        self.guarded(|g| g.barrier_step(result))
    }

    fn barrier_step(&mut self, result: i32) -> Result<Vec<(u32, u32)>> {
        self.gen += 1;
        let gen = self.gen;
        let deadline = Instant::now() + self.cfg.timeout;
        let me = self.me();
        me.result.store(result, Ordering::Relaxed);
        me.barrier.store(gen, Ordering::Release);
        let h = self.header();
        if self.cfg.local_rank != 0 {
            h.arrived.fetch_add(1, Ordering::SeqCst);
            futex::notify(&h.arrived, &h.arrive_waiters);
            let leader = self.slot(0);
            let leader_pid = leader.pid.load(Ordering::Relaxed);
            futex::wait_until(
                self.spin,
                &h.released,
                &h.release_waiters,
                deadline,
                || h.released.load(Ordering::Acquire) == gen as u32,
                || {
                    self.check_abort()?;
                    if shm::pid_alive(leader_pid) {
                        Ok(())
                    } else {
                        Err(self.dead(0, "inside a barrier"))
                    }
                },
                || {
                    Error::timeout(format!(
                        "group '{}': rank {} waited {:?} at barrier {gen} for rank {} (or the ranks it waits for)",
                        self.cfg.name,
                        self.cfg.rank,
                        self.cfg.timeout,
                        leader.rank.load(Ordering::Relaxed)
                    ))
                },
            )?;
            return Ok(Vec::new());
        }
        let others = self.cfg.local_world_size - 1;
        let missing = || -> Vec<u32> {
            (1..self.cfg.local_world_size)
                .filter(|&i| self.slot(i).barrier.load(Ordering::Acquire) < gen)
                .collect()
        };
        futex::wait_until(
            self.spin,
            &h.arrived,
            &h.arrive_waiters,
            deadline,
            || h.arrived.load(Ordering::Acquire) >= others,
            || {
                self.check_abort()?;
                match missing()
                    .into_iter()
                    .find(|&i| !shm::pid_alive(self.slot(i).pid.load(Ordering::Relaxed)))
                {
                    Some(i) => Err(self.dead(i, "before reaching a barrier")),
                    None => Ok(()),
                }
            },
            || {
                let ranks: Vec<u32> = missing()
                    .iter()
                    .map(|&i| self.slot(i).rank.load(Ordering::Relaxed))
                    .collect();
                Error::timeout(format!(
                    "group '{}': rank(s) {} did not reach barrier {gen} within {:?}",
                    self.cfg.name,
                    list(&ranks),
                    self.cfg.timeout
                ))
            },
        )?;
        h.arrived.store(0, Ordering::SeqCst);
        let mut failures: Vec<(u32, u32)> = (0..self.cfg.local_world_size)
            .map(|i| self.slot(i))
            .filter(|s| s.result.load(Ordering::Relaxed) != 0)
            .map(|s| {
                (
                    s.rank.load(Ordering::Relaxed),
                    s.result.load(Ordering::Relaxed) as u32,
                )
            })
            .collect();
        match &mut self.link {
            Link::Root(peers) => {
                for p in peers.iter_mut() {
                    let who = p.who();
                    match link::recv(&mut p.stream, deadline, &who)? {
                        Msg::Arrive {
                            gen: g,
                            failures: f,
                        } if g == gen => failures.extend(f),
                        other => {
                            return Err(Error::peer(format!(
                                "{who}: expected barrier {gen}, got {other:?}"
                            )))
                        }
                    }
                }
                for p in peers.iter_mut() {
                    let who = p.who();
                    let release = Msg::Release {
                        gen,
                        failures: failures.clone(),
                    };
                    link::send(&mut p.stream, &release, &who)?;
                }
            }
            Link::Leader(up) => {
                link::send(up, &Msg::Arrive { gen, failures }, "rank 0")?;
                failures = match link::recv(up, deadline, "rank 0")? {
                    Msg::Release { gen: g, failures } if g == gen => failures,
                    other => {
                        return Err(Error::peer(format!(
                            "rank 0: expected release {gen}, got {other:?}"
                        )))
                    }
                };
            }
            Link::Local | Link::Member => {}
        }
        let h = self.header();
        h.released.store(gen as u32, Ordering::SeqCst);
        futex::notify(&h.released, &h.release_waiters);
        failures.sort_unstable();
        Ok(if self.cfg.rank == 0 {
            failures
        } else {
            Vec::new()
        })
    }
}
