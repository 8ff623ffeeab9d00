//! The barrier: local ranks count in on a shared word, the leader waits for
//! them, leaders report to rank 0, rank 0 releases them, they release their
//! ranks. Each rank contributes a result code; rank 0 learns them all.

use super::{list, Group, Link, Peer};
use crate::result::{Error, Result};
use crate::signal::futex;
use crate::signal::link::{self, Msg};
use crate::signal::shm;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// (rank, code) of every rank that contributed non-zero.
pub(super) type Failures = Vec<(u32, u32)>;

impl Group {
    /// Every rank passes together, contributing `result` (0 for success).
    /// Rank 0 gets the (rank, code) of every rank that contributed non-zero;
    /// the others get an empty list.
    pub fn barrier(&mut self, result: i32) -> Result<Failures> {
        self.guarded(|g| g.barrier_step(result))
    }

    pub(super) fn barrier_step(&mut self, result: i32) -> Result<Failures> {
        self.gen += 1;
        let gen = self.gen;
        let deadline = Instant::now() + self.cfg.timeout;
        let me = self.me();
        me.result.store(result, Ordering::Relaxed);
        me.barrier.store(gen, Ordering::Release);
        if self.cfg.local_rank != 0 {
            self.arrive_and_wait_release(gen, deadline)?;
            return Ok(Vec::new());
        }
        self.wait_local_arrivals(gen, deadline)?;
        self.header().arrived.store(0, Ordering::SeqCst);
        let local = self.local_failures();
        let mut failures = match &mut self.link {
            Link::Root(peers) => Self::gather_and_release(peers, gen, local, deadline)?,
            Link::Leader(up) => Self::report_and_wait_release(up, gen, local, deadline)?,
            Link::Local | Link::Member => local,
        };
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

    /// A member: count in, then sleep until the leader releases `gen`.
    fn arrive_and_wait_release(&self, gen: u64, deadline: Instant) -> Result<()> {
        let h = self.header();
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
                // The node's slots show who has not come in: name them, as
                // the leader would (its own deadline may pass a moment
                // later, and the first error becomes the group's reason).
                let missing = self.missing_locally(0, gen);
                match missing.is_empty() {
                    false => Error::timeout(format!(
                        "group '{}': rank(s) {} did not reach barrier {gen} within {:?} (seen by rank {})",
                        self.cfg.name,
                        list(&missing),
                        self.cfg.timeout,
                        self.cfg.rank,
                    )),
                    true => Error::timeout(format!(
                        "group '{}': rank {} waited {:?} at barrier {gen} for rank {} (or the ranks it waits for)",
                        self.cfg.name,
                        self.cfg.rank,
                        self.cfg.timeout,
                        leader.rank.load(Ordering::Relaxed)
                    )),
                }
            },
        )
    }

    /// The ranks of this node's slots from `first` on that have not entered
    /// barrier `gen`.
    fn missing_locally(&self, first: u32, gen: u64) -> Vec<u32> {
        (first..self.cfg.local_world_size)
            .map(|i| self.slot(i))
            .filter(|s| s.barrier.load(Ordering::Acquire) < gen)
            .map(|s| s.rank.load(Ordering::Relaxed))
            .collect()
    }

    /// The leader: wait until every other local rank entered barrier `gen`.
    fn wait_local_arrivals(&self, gen: u64, deadline: Instant) -> Result<()> {
        let h = self.header();
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
                Error::timeout(format!(
                    "group '{}': rank(s) {} did not reach barrier {gen} within {:?}",
                    self.cfg.name,
                    list(&self.missing_locally(1, gen)),
                    self.cfg.timeout
                ))
            },
        )
    }

    /// (rank, code) of this node's ranks that contributed non-zero.
    fn local_failures(&self) -> Failures {
        (0..self.cfg.local_world_size)
            .map(|i| self.slot(i))
            .filter(|s| s.result.load(Ordering::Relaxed) != 0)
            .map(|s| {
                (
                    s.rank.load(Ordering::Relaxed),
                    s.result.load(Ordering::Relaxed) as u32,
                )
            })
            .collect()
    }

    /// Rank 0: every other node's arrival at `gen`, then release them all
    /// with the failures of the whole group.
    fn gather_and_release(
        peers: &mut [Peer],
        gen: u64,
        mut failures: Failures,
        deadline: Instant,
    ) -> Result<Failures> {
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
        let release = Msg::Release {
            gen,
            failures: failures.clone(),
        };
        Self::send_to_peers(peers, &release)?;
        Ok(failures)
    }

    /// A leader of another node: report this node's arrival at `gen`, and
    /// take the group's failures from rank 0's release.
    fn report_and_wait_release(
        up: &mut TcpStream,
        gen: u64,
        failures: Failures,
        deadline: Instant,
    ) -> Result<Failures> {
        link::send(up, &Msg::Arrive { gen, failures }, "rank 0")?;
        match link::recv(up, deadline, "rank 0")? {
            Msg::Release { gen: g, failures } if g == gen => Ok(failures),
            other => Err(Error::peer(format!(
                "rank 0: expected release {gen}, got {other:?}"
            ))),
        }
    }
}
