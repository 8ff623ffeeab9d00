//! Admitting engines: only a connection that finishes its handshake counts
//! as one of the engines a serve call waits for.
//!
//! Each accepted connection gets its own thread for its handshake (HELLO
//! and, over the network, the challenge), bounded by
//! `PublisherConfig::handshake_timeout`, so the accept loop never waits on
//! one: a port probe or a silent connection neither takes an engine's place
//! nor delays a real engine beyond that bound, and is dropped when it runs
//! out. It holds a thread and a socket, nothing a real engine needs (no
//! buffers, no manifest). At most `MAX_HANDSHAKES` run at once; beyond that
//! the loop stops accepting for a moment and the kernel's backlog holds the
//! rest.

use super::buffers::Pools;
use super::config::PublisherConfig;
use super::handshake;
use super::offer::Offer;
use super::session;
use super::socket::{Connections, Listener};
use super::stats::{ServeStats, SessionStats};
use crate::result::{Error, Result};
use crate::transport::auth::Secret;
use parking_lot::Mutex;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Handshakes in progress at once, at most.
const MAX_HANDSHAKES: usize = 64;

/// The longest the accept loop waits for a connection before it looks at
/// `stop` and its deadline again (a connection wakes it at once).
const ACCEPT_TICK: Duration = Duration::from_millis(20);

/// At most one line a second about connections turned away.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// What the accept loop and the handshake threads share.
struct Admission {
    engines: usize,
    admitted: AtomicUsize,
    handshaking: AtomicUsize,
    /// Why the last connection was turned away, for the timeout's message.
    last_refusal: Mutex<Option<Error>>,
    /// When a refusal was last logged, and how many were not since.
    refusals_unlogged: Mutex<(Option<Instant>, u64)>,
}

impl Admission {
    /// Take one engine's place, if one is left.
    fn claim(&self) -> bool {
        self.admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.engines).then_some(n + 1)
            })
            .is_ok()
    }
}

/// What a serve call admits engines with: the publisher's listener and
/// settings.
pub(super) struct Acceptor<'a> {
    /// The socket path, or the TCP address (for messages).
    pub(super) path: &'a Path,
    pub(super) listener: &'a Listener,
    /// Network publishers: the shared secret of the challenge.
    pub(super) secret: Option<&'a Secret>,
    pub(super) cfg: &'a PublisherConfig,
    pub(super) pool: &'a Pools,
    pub(super) connections: &'a Connections,
}

impl Acceptor<'_> {
    /// Accept connections until `engines` of them finished their handshake
    /// (or `accept_timeout` passes), serve each on its own thread, and
    /// return once every session ended. The first failure is returned.
    /// `Publisher::stop` ends the loop and shuts every tracked connection
    /// down.
    pub(super) fn admit_and_serve(
        &self,
        offers: &[Arc<Offer>],
        engines: usize,
        accept_timeout: Duration,
        serve_id: u64,
    ) -> Result<ServeStats> {
        let deadline = Instant::now() + accept_timeout;
        self.listener
            .set_nonblocking()
            .map_err(|e| Error::io("listener", e))?;
        let gate = Admission {
            engines,
            admitted: AtomicUsize::new(0),
            handshaking: AtomicUsize::new(0),
            last_refusal: Mutex::new(None),
            refusals_unlogged: Mutex::new((None, 0)),
        };
        std::thread::scope(|s| {
            let mut threads = Vec::new();
            let mut ended = Vec::new();
            let mut accept_error = None;
            while gate.admitted.load(Ordering::SeqCst) < engines {
                // Joined as they end (connections turned away, mostly), so
                // a peer connecting over and over holds no thread.
                let (done, running): (Vec<Handle>, Vec<Handle>) =
                    threads.drain(..).partition(|h: &Handle| h.is_finished());
                // (Turned away: nothing to keep.)
                ended.extend(done.into_iter().filter_map(join_session));
                threads = running;
                if let Err(e) = self.connections.check_stopping(self.path) {
                    accept_error = Some(e);
                    break;
                }
                if Instant::now() >= deadline {
                    accept_error = Some(self.too_few(&gate, accept_timeout));
                    break;
                }
                if gate.handshaking.load(Ordering::SeqCst) >= MAX_HANDSHAKES {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                match self.listener.accept() {
                    Ok(stream) => {
                        let tracked = self.connections.track(serve_id, &stream);
                        gate.handshaking.fetch_add(1, Ordering::SeqCst);
                        let gate = &gate;
                        threads.push(s.spawn(move || {
                            // The stream is closed when this returns; its
                            // second handle goes with it.
                            let r = self.one_engine(stream, offers, gate);
                            self.connections.untrack(tracked);
                            r
                        }));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        // Bounded, so that a stop or the deadline is
                        // noticed within it.
                        self.listener.wait_incoming(ACCEPT_TICK);
                    }
                    // Out of descriptors or memory for now (a flood of
                    // connections in their handshakes): those end within
                    // the handshake timeout, so wait, not give up serving.
                    Err(e) if out_of_resources(&e) => {
                        std::thread::sleep(ACCEPT_TICK);
                    }
                    Err(e) => {
                        accept_error = Some(Error::io("accepting an engine", e));
                        break;
                    }
                }
            }
            ended.extend(threads.into_iter().filter_map(join_session));
            self.collect(ended, accept_error)
        })
    }

    /// Log a connection turned away: at most one line a second, saying how
    /// many were not logged since (a flood would write a line per
    /// connection, and a log nobody reads would fill and stop this thread).
    fn log_refusal(&self, gate: &Admission, e: &Error) {
        let mut unlogged = gate.refusals_unlogged.lock();
        let (last, skipped) = *unlogged;
        if last.is_some_and(|t| t.elapsed() < REFUSAL_LOG_EVERY) {
            unlogged.1 += 1;
            return;
        }
        *unlogged = (Some(Instant::now()), 0);
        drop(unlogged);
        let more = match skipped {
            0 => String::new(),
            n => format!(" ({n} more turned away since the last such line)"),
        };
        (self.cfg.logger).warn(&format!("publisher: turned a connection away: {e}{more}"));
    }

    /// One connection: its handshake, then (if it was in time and a place
    /// is left) its session; None when it was turned away.
    fn one_engine(
        &self,
        stream: crate::transport::conn::Stream,
        offers: &[Arc<Offer>],
        gate: &Admission,
    ) -> Option<Result<SessionStats>> {
        let shook = handshake::handshake(stream, self.secret, self.cfg);
        gate.handshaking.fetch_sub(1, Ordering::SeqCst);
        let admitted = match shook {
            Ok(Some(a)) => a,
            // A probe (closed unheard): nothing to log or to blame.
            Ok(None) => return None,
            Err(e) => {
                self.log_refusal(gate, &e);
                *gate.last_refusal.lock() = Some(e);
                return None;
            }
        };
        if !gate.claim() {
            admitted.refuse(&Error::peer(format!(
                "this publisher already serves the {} engine(s) it waits for",
                gate.engines
            )));
            return None;
        }
        Some(session::run(admitted, offers, self.cfg, self.pool))
    }

    fn too_few(&self, gate: &Admission, accept_timeout: Duration) -> Error {
        let mut e = Error::timeout(format!(
            "publisher at {}: {} of {} engine(s) connected and authenticated within {accept_timeout:?}",
            self.path.display(),
            gate.admitted.load(Ordering::SeqCst),
            gate.engines
        ));
        if let Some(why) = gate.last_refusal.lock().take() {
            e.message += &format!(" (the last connection turned away: {why})");
        }
        e
    }

    /// Join the sessions; the accept loop's error first, else the first
    /// failed session's (each logged). Once the publisher is stopped, the
    /// stop is a failed session's error: it shut the sessions' connections
    /// down, so what they saw ("the engine closed the connection") is its
    /// echo.
    fn collect(
        &self,
        ended: Vec<Result<SessionStats>>,
        accept_error: Option<Error>,
    ) -> Result<ServeStats> {
        let mut stats = ServeStats::default();
        let stopped = self.connections.check_stopping(self.path).err();
        let mut first_error = accept_error;
        for r in ended {
            match r {
                Ok(st) => stats.sessions.push(st),
                Err(e) if stopped.is_some() => {
                    (self.cfg.logger).info(&format!("publisher: a session ended by the stop: {e}"));
                    first_error.get_or_insert_with(|| stopped.clone().expect("stopped"));
                }
                Err(e) => {
                    self.cfg.logger.warn(&format!("publisher: {e}"));
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }
}

/// A connection's thread: its session's outcome (None: turned away).
type Handle<'s> = std::thread::ScopedJoinHandle<'s, Option<Result<SessionStats>>>;

fn join_session(h: Handle<'_>) -> Option<Result<SessionStats>> {
    h.join().unwrap_or_else(|_| {
        Some(Err(Error::new(
            crate::result::wm_result::WM_ERR_PANIC,
            "session panicked",
        )))
    })
}

/// An accept that failed for want of descriptors or memory, which
/// connections ending give back.
fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}
