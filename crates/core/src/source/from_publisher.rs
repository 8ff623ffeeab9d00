//! The `Source` face of a publisher's sessions (ipc and network alike):
//! WANT, AMAX/SCALES, the deltas WANT asked for, then the buckets, each
//! source saying only how bucket bytes reach it ([`FromPublisher`]).

use super::deltas;
use super::publisher_link::PublisherLink;
use super::Step;
use crate::apply::Applier;
use crate::manifest::Manifest;
use crate::plan::Plan;
use crate::result::{Error, Result};
use std::time::Duration;

/// A source fed by a publisher: the `Source` impl comes with it, and a failed
/// update tells the publisher why.
pub trait FromPublisher {
    fn link(&self) -> &PublisherLink;
    fn link_mut(&mut self) -> &mut PublisherLink;
    /// WANT is sent: get ready to receive (nothing is applied yet).
    fn begin(&mut self, plan: &Plan, applier: &mut Applier) -> Result<()>;
    /// Take what came (one bucket, or one landed entry) to the applier,
    /// waiting at most about `wait` for it.
    fn advance(&mut self, plan: &Plan, applier: &mut Applier, wait: Duration) -> Result<Step>;
    /// The update failed: hold none of the publisher's memory any more.
    fn give_up(&mut self);
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

    /// Parts of tensors come with their xxh3-128 (SUMS), computed by the
    /// publisher as it serves them.
    fn checks_slices(&self) -> bool {
        true
    }

    fn start(&mut self, plan: &Plan, me: usize, applier: &mut Applier) -> Result<()> {
        self.link_mut().send_want(plan, me, applier)
    }

    fn collect(&mut self, applier: &mut Applier) -> Result<()> {
        self.link_mut().take_amax(applier)
    }

    fn answer(&mut self, applier: &Applier) -> Result<()> {
        self.link_mut().send_scales(applier)
    }

    fn start_streaming(&mut self, plan: &Plan, _: usize, applier: &mut Applier) -> Result<()> {
        if self.link().deltas_asked() {
            deltas::take(self.link_mut(), plan, applier)?;
        }
        self.begin(plan, applier)
    }

    /// A publisher that says it sent all (END) must have sent every byte
    /// planned from it: checked here, naming it, rather than at the commit
    /// (which cannot tell whose bytes are missing).
    fn step(
        &mut self,
        plan: &Plan,
        me: usize,
        applier: &mut Applier,
        wait: Duration,
    ) -> Result<Step> {
        let r = self
            .advance(plan, applier, wait)
            .and_then(|step| match step {
                Step::Done => {
                    (applier.check_received_from(me, self.link().conn.peer())).map(|()| step)
                }
                step => Ok(step),
            });
        if r.is_err() {
            self.give_up();
        }
        r
    }

    fn abort(&mut self, why: &Error) {
        self.link_mut().conn.send_error(why);
        self.give_up();
    }
}
