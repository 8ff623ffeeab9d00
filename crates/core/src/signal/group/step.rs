//! One step (`Group::broadcast`): rank 0 reads the value, leaders write it
//! into their node's ring, everybody else reads the ring entry of its step.

use super::barrier::Failures;
use super::segment::{pack, RING};
use super::{list, Group, Link};
use crate::result::{Error, Result};
use crate::signal::futex;
use crate::signal::link::{self, Msg};
use crate::signal::shm;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Group {
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

    /// Agree on this step's value: `read` runs on rank 0 only. Values other
    /// than NORMAL (0) are followed by a barrier, to which this rank
    /// contributes `mine` (0 for success, see [`Group::barrier`]). Returns
    /// (step, value, and for rank 0 every non-zero contribution).
    pub fn broadcast(
        &mut self,
        read: impl FnOnce() -> Result<i32>,
        mine: i32,
    ) -> Result<(u64, i32, Failures)> {
        self.guarded(|g| g.broadcast_step(read, mine))
    }

    fn broadcast_step(
        &mut self,
        read: impl FnOnce() -> Result<i32>,
        mine: i32,
    ) -> Result<(u64, i32, Failures)> {
        let k = self.step;
        let deadline = Instant::now() + self.cfg.timeout;
        let value = match &mut self.link {
            Link::Local | Link::Root(_) => {
                let v = read()?;
                self.hold_back(k, deadline)?;
                self.publish(k, v);
                if let Link::Root(peers) = &mut self.link {
                    Self::send_to_peers(peers, &Msg::Step { step: k, value: v })?;
                }
                v
            }
            Link::Leader(up) => {
                let v = Self::recv_step(up, k, deadline)?;
                self.hold_back(k, deadline)?;
                self.publish(k, v);
                v
            }
            Link::Member => self.wait_published(k, deadline)?,
        };
        self.me().consumed.store(k + 1, Ordering::Release);
        self.step += 1;
        let said = match value {
            0 => Vec::new(),
            _ => self.barrier_step(mine)?,
        };
        Ok((k, value, said))
    }

    /// A leader of another node: the value of step `k`, from rank 0.
    fn recv_step(up: &mut std::net::TcpStream, k: u64, deadline: Instant) -> Result<i32> {
        let who = "rank 0";
        match link::recv(up, deadline, who)? {
            Msg::Step { step, value } if step == k => Ok(value),
            other => Err(Error::peer(format!(
                "{who}: expected step {k}, got {other:?}"
            ))),
        }
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
}
