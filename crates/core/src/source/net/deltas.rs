//! A network session's deltas: one UCX message each (`wire::delta_tag`),
//! received once this side's worker is up (after READY) and before any
//! bucket, a batch at a time (`source::deltas::batches`), each batch
//! patched before the next is posted. A message longer than its announced
//! delta is a UCX truncation, refused; a shorter one is refused here.

use super::receive::Receiver;
use crate::apply::Applier;
use crate::plan::Plan;
use crate::result::{try_vec, Error, Result};
use crate::source::deltas;
use crate::source::publisher_link::PublisherLink;
use crate::wire::delta_tag;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a wait for deltas runs before it looks at the connection
/// again: the publisher's death shows there (its UCX messages just stop).
const WATCH: Duration = Duration::from_millis(50);
/// How long a hung-up publisher's frames still in the socket are read.
const LAST_WORDS: Duration = Duration::from_millis(100);

impl Receiver {
    /// Receive and apply the deltas DELTAS announced.
    pub(super) fn receive_deltas(
        &mut self,
        link: &mut PublisherLink,
        plan: &Plan,
        applier: &mut Applier,
    ) -> Result<()> {
        let due = link.take_pending_deltas();
        let deadline = applier.deadline();
        for batch in deltas::batches(&due) {
            self.deltas = batch
                .iter()
                .map(|r| {
                    let mut d = try_vec(r.len as usize, "a delta")?;
                    d.resize(r.len as usize, 0);
                    Ok(d)
                })
                .collect::<Result<_>>()?;
            let mut left: HashMap<u64, usize> = HashMap::new();
            for (i, r) in batch.iter().enumerate() {
                let (ptr, len) = (self.deltas[i].as_mut_ptr(), self.deltas[i].len());
                // SAFETY: the buffer is the receiver's until the pump is
                // dropped (before the buffers) or the completion is taken.
                unsafe { self.pump().recv(delta_tag(r.request), ptr, len) }?;
                left.insert(delta_tag(r.request), i);
            }
            let mut since = Instant::now();
            while !left.is_empty() {
                let slice = deadline.min(Instant::now() + WATCH);
                let Some(c) = self.pump().next(slice)? else {
                    watch(link, (deadline, since), left.len())?;
                    applier.check_deadline()?;
                    continue;
                };
                since = Instant::now();
                let bad = |why: String| Error::peer(format!("{}: {why}", link.conn.peer()));
                let i = left.remove(&c.tag).ok_or_else(|| {
                    bad(format!(
                        "a UCX message tagged {:#x} while deltas were due",
                        c.tag
                    ))
                })?;
                let got = c
                    .result
                    .map_err(|e| e.context(format!("{}: a delta", link.conn.peer())))?;
                if got != batch[i].len as usize {
                    return Err(bad(format!(
                        "a delta of {got} bytes for request #{} announced as {}",
                        batch[i].request, batch[i].len
                    )));
                }
            }
            let received = std::mem::take(&mut self.deltas);
            deltas::apply(link, plan, applier, (batch, &received))?;
        }
        Ok(())
    }
}

/// Between waits for `left` deltas: a publisher that died (or failed, said
/// why and hung up) shows on its connection, while its UCX messages just
/// stop. Frames it sent before are left unread (a BUCKET may come while
/// the last deltas are still on their way), unless it hung up. None came
/// since `since` within the link's bound on each delta, or the update's
/// `deadline` passed: a timeout naming it.
fn watch(
    link: &mut PublisherLink,
    (deadline, since): (Instant, Instant),
    left: usize,
) -> Result<()> {
    let peer = link.conn.peer().to_string();
    if link.conn.peer_hung_up() {
        // Its last words (an ERROR says why), else the hang-up itself.
        let frame = link.conn.recv(Instant::now() + LAST_WORDS)?;
        return Err(Error::peer(format!(
            "{peer} hung up after a {} frame while {left} deltas were due",
            frame.name()
        )));
    }
    if Instant::now() >= deadline {
        return Err(Error::timeout(format!(
            "{peer}: {left} deltas did not come before the update's deadline"
        )));
    }
    let bound = link.frame_timeout();
    match since.elapsed() > bound {
        true => Err(Error::timeout(format!(
            "{peer}: no delta came within {bound:?} (the bucket timeout; {left} due)"
        ))),
        false => Ok(()),
    }
}
