//! What a tensor the trainer adds would clash with, found without comparing
//! it with every tensor of its name: only shards of one global tensor
//! (same dtype and global shape) whose boxes do not overlap may be
//! published side by side for a rank; a whole tensor is published alone.
//!
//! Per name and rank the shards are kept by their offset (a B-tree: the
//! shards of a set are disjoint, so their offsets differ). A new box meets
//! an old one only where, along every dimension, the old box starts within
//! the longest length before the new box's end; the search walks those
//! starts dimension by dimension, a B-tree step each. For row, column,
//! expert and grid splits that is a few steps per dimension, so adding n
//! shards costs `O(n log n)` (comparing with every shard of the name cost
//! 2.3 s for 20,000 shards of one tensor, quadratic). Layouts where a box's
//! range holds many starts (one long shard among many short ones) may cost
//! more: the steps of the adds that went in are counted per name, and past
//! `box_sweep::budget` of its shard count an add is refused, naming the
//! tensor, instead of growing quadratically. A refused add is not counted
//! (its search is bounded by what the budget has left), and a batch taken
//! back (`add_all`) gives its steps and its shards' lengths back.

use super::offer::ServedTensor;
use crate::box_sweep::{budget, meet};
use crate::result::{Error, Result};
use crate::tensor::shape_text;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

/// The tensors added so far, by name and rank, as positions in the
/// content's tensors.
#[derive(Debug, Default)]
pub(super) struct Clashes {
    names: HashMap<String, Named>,
}

/// One name's tensors.
#[derive(Debug, Default)]
struct Named {
    /// By the rank they are for (None: every rank).
    ranks: HashMap<Option<u32>, RankSet>,
    /// Tensors of the name (all ranks), and the search steps their adds
    /// took: an add may search while the total stays within
    /// `box_sweep::budget(tensors + 1)`.
    tensors: usize,
    steps: u64,
}

/// One name's tensors for one rank (or for every rank).
#[derive(Debug, Default)]
struct RankSet {
    /// Every position in the set, with the search steps its add was
    /// charged (given back if it is taken out again). The first stands
    /// for all on wholeness, dtype and global shape: they agree (an add
    /// that disagreed was refused), and a whole tensor is alone in its set.
    members: BTreeMap<usize, u64>,
    /// The shards holding an element, by offset.
    by_offset: BTreeMap<Vec<u64>, usize>,
    /// The longest of those shards per dimension; recomputed before the
    /// next search when a longest one was taken out (`stale`).
    longest: Vec<u64>,
    stale: bool,
}

impl Clashes {
    /// Refuse `t` if it clashes with a tensor of `ts` added before it for
    /// the same rank (a tensor for every rank clashes with any rank's).
    /// Ok: the search steps to charge to `t` when it is added
    /// ([`Clashes::insert`]). A refused add is not charged: its search
    /// is bounded by what the name's budget has left.
    pub(super) fn check(&mut self, ts: &[ServedTensor], t: &ServedTensor) -> Result<u64> {
        let Some(named) = self.names.get_mut(&t.name) else {
            return Ok(0);
        };
        let limit = budget(named.tensors + 1);
        let Named { ranks, steps, .. } = named;
        let before = *steps;
        let mut check_set = |set: &mut RankSet| -> Result<()> {
            *steps += 1;
            let Some((&first, _)) = set.members.first_key_value() else {
                return Ok(());
            };
            check_kind(&ts[first], t)?;
            set.refresh_longest(ts);
            match set.find_overlap((ts, t), steps, limit) {
                Ok(None) => Ok(()),
                Ok(Some(at)) => Err(overlap_error(&ts[at], t)),
                Err(()) => Err(too_fragmented(t, limit)),
            }
        };
        let r = match t.rank {
            Some(_) => [t.rank, None]
                .iter()
                .try_for_each(|rank| ranks.get_mut(rank).map_or(Ok(()), &mut check_set)),
            // Every rank's tensors: counted as steps too.
            None => ranks.values_mut().try_for_each(&mut check_set),
        };
        let r = r.and_then(|()| match *steps > limit {
            true => Err(too_fragmented(t, limit)),
            false => Ok(*steps - before),
        });
        // Charged when `t` goes in (`insert`), never here.
        *steps = before;
        r
    }

    /// Note `ts[at]`, checked (its search took `charged` steps) and added.
    pub(super) fn insert(&mut self, ts: &[ServedTensor], at: usize, charged: u64) {
        let t = &ts[at];
        let named = self.names.entry(t.name.clone()).or_default();
        named.tensors += 1;
        named.steps += charged;
        let set = named.ranks.entry(t.rank).or_default();
        set.members.insert(at, charged);
        if let (Some(p), true) = (&t.placement, holds_elements(t)) {
            set.widen(&t.shape);
            set.by_offset.insert(p.offset.clone(), at);
        }
    }

    /// Forget `ts[at]`, taken out again: its steps are given back.
    pub(super) fn remove(&mut self, ts: &[ServedTensor], at: usize) {
        let t = &ts[at];
        let Some(named) = self.names.get_mut(&t.name) else {
            return;
        };
        named.tensors -= 1;
        if let Some(set) = named.ranks.get_mut(&t.rank) {
            let charged = set.members.remove(&at).unwrap_or(0);
            named.steps = named.steps.saturating_sub(charged);
            if let Some(p) = &t.placement {
                if set.by_offset.get(&p.offset) == Some(&at) {
                    set.by_offset.remove(&p.offset);
                    let longest = set.longest.iter().zip(&t.shape);
                    set.stale |= longest.into_iter().any(|(&l, &n)| n >= l);
                }
            }
            if set.members.is_empty() {
                named.ranks.remove(&t.rank);
            }
        }
        if named.tensors == 0 {
            self.names.remove(&t.name);
        }
    }
}

impl RankSet {
    fn widen(&mut self, shape: &[u64]) {
        if self.longest.len() < shape.len() {
            self.longest.resize(shape.len(), 0);
        }
        for (l, &n) in self.longest.iter_mut().zip(shape) {
            *l = (*l).max(n);
        }
    }

    /// The longest shards again, after a longest one was taken out (a
    /// refused batch's): a pass over the set, once per refused batch.
    fn refresh_longest(&mut self, ts: &[ServedTensor]) {
        if !std::mem::take(&mut self.stale) {
            return;
        }
        self.longest.clear();
        let held: Vec<usize> = self.by_offset.values().copied().collect();
        for at in held {
            self.widen(&ts[at].shape);
        }
    }

    /// A shard of this set sharing an element with `t` (a shard holding
    /// elements), searched within `limit` steps in all (`steps` counts
    /// them); Err past it.
    fn find_overlap(
        &self,
        (ts, t): (&[ServedTensor], &ServedTensor),
        steps: &mut u64,
        limit: u64,
    ) -> std::result::Result<Option<usize>, ()> {
        let Some(p) = t.placement.as_ref().filter(|_| holds_elements(t)) else {
            return Ok(None);
        };
        if self.by_offset.is_empty() {
            return Ok(None);
        }
        let mut search = Search {
            set: self,
            ts,
            new: (&p.offset, &t.shape),
            steps,
            limit,
        };
        search.walk(&mut Vec::with_capacity(p.offset.len()))
    }
}

/// A search of one set's offsets for a shard meeting the box `new`.
struct Search<'a> {
    set: &'a RankSet,
    ts: &'a [ServedTensor],
    new: (&'a [u64], &'a [u64]),
    steps: &'a mut u64,
    limit: u64,
}

impl Search<'_> {
    /// Below `prefix` (the offsets' first coordinates, fixed), each start
    /// along the next dimension from which a shard may reach the new box,
    /// in order, one B-tree step each; at a whole offset, that shard if it
    /// meets the new box.
    fn walk(&mut self, prefix: &mut Vec<u64>) -> std::result::Result<Option<usize>, ()> {
        let (offset, shape) = self.new;
        let d = prefix.len();
        if d == offset.len() {
            let at = self.set.by_offset.get(prefix.as_slice()).copied();
            return Ok(at.filter(|&at| self.meets(at)));
        }
        let longest = self.set.longest.get(d).copied().unwrap_or(0);
        let lo = offset[d].saturating_sub(longest.saturating_sub(1));
        let hi = offset[d].saturating_add(shape[d]);
        let mut from = lo;
        while from < hi {
            *self.steps += 1;
            if *self.steps > self.limit {
                return Err(());
            }
            prefix.push(from);
            let next = (self.set.by_offset)
                .range::<[u64], _>((Bound::Included(prefix.as_slice()), Bound::Unbounded))
                .next()
                .filter(|(key, _)| key[..d] == prefix[..d])
                .map(|(key, _)| key[d]);
            prefix.pop();
            let Some(start) = next.filter(|&s| s < hi) else {
                break;
            };
            prefix.push(start);
            let found = self.walk(prefix)?;
            prefix.pop();
            if found.is_some() {
                return Ok(found);
            }
            match start.checked_add(1) {
                Some(n) => from = n,
                None => break,
            }
        }
        Ok(None)
    }

    fn meets(&self, at: usize) -> bool {
        let old = &self.ts[at];
        let offset = old.placement.as_ref().map_or(&[][..], |p| &p.offset);
        meet((offset, &old.shape), self.new)
    }
}

/// A shard with no element (a length of 0) shares nothing.
fn holds_elements(t: &ServedTensor) -> bool {
    t.shape.iter().all(|&n| n > 0)
}

/// Whether `new` may sit beside `old` (same name, same rank) at all: both
/// shards of one global tensor (same dtype and global shape).
fn check_kind(old: &ServedTensor, new: &ServedTensor) -> Result<()> {
    let name = &new.name;
    let clash = |why: String| Err(Error::invalid_argument(format!("tensor '{name}': {why}")));
    match (&old.placement, &new.placement) {
        (None, None) => clash("already published for that rank".into()),
        (None, Some(_)) | (Some(_), None) => clash(
            "published both whole and as shards for that rank (a whole tensor is \
             published alone)"
                .into(),
        ),
        (Some(a), Some(b)) if a.global_shape != b.global_shape || old.dtype != new.dtype => {
            clash(format!(
                "shards disagree on the global tensor: {} {} and {} {}",
                old.dtype,
                shape_text(&a.global_shape),
                new.dtype,
                shape_text(&b.global_shape)
            ))
        }
        _ => Ok(()),
    }
}

fn overlap_error(old: &ServedTensor, new: &ServedTensor) -> Error {
    let offset = |t: &ServedTensor| {
        t.placement
            .as_ref()
            .map_or(String::new(), |p| shape_text(&p.offset))
    };
    Error::invalid_argument(format!(
        "tensor '{}': the shard at offset {} (shape {}) overlaps the one at offset {} (shape {}) \
         already published for that rank",
        new.name,
        offset(new),
        shape_text(&new.shape),
        offset(old),
        shape_text(&old.shape)
    ))
}

fn too_fragmented(t: &ServedTensor, limit: u64) -> Error {
    Error::invalid_argument(format!(
        "tensor '{}': its shards are too fragmented to check for overlaps in bounded work \
         (over {limit} search steps); publish fewer, larger shards",
        t.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Placement;
    use crate::memory::SendPtr;
    use crate::tensor::DType;
    use crate::test_rng::Rng;

    fn shard(rank: Option<u32>, global: &[u64], offset: &[u64], shape: &[u64]) -> ServedTensor {
        ServedTensor {
            name: "w".into(),
            dtype: DType::U8,
            shape: shape.to_vec(),
            data: SendPtr(std::ptr::null_mut()),
            len: shape.iter().product::<u64>() as usize,
            rank,
            checksum: None,
            device: None,
            placement: Some(Placement {
                global_shape: global.to_vec(),
                offset: offset.to_vec(),
            }),
        }
    }

    /// Add `t` as `Current::add_all` does: checked, then kept.
    fn add(c: &mut Clashes, ts: &mut Vec<ServedTensor>, t: ServedTensor) -> Result<()> {
        let charged = c.check(ts, &t)?;
        ts.push(t);
        c.insert(ts, ts.len() - 1, charged);
        Ok(())
    }

    /// Shard i's offset and shape.
    type Placed = fn(u64) -> (Vec<u64>, Vec<u64>);

    fn steps(c: &Clashes) -> u64 {
        c.names.get("w").map_or(0, |n| n.steps)
    }

    /// The steps charged to the tensors of "w" that are in.
    fn charged(c: &Clashes) -> u64 {
        let sets = c.names.get("w").map(|n| n.ranks.values());
        sets.into_iter()
            .flatten()
            .flat_map(|s| s.members.values())
            .sum()
    }

    /// Row, column and 2D grid splits of 20,000 shards each go in with a
    /// few search steps per shard (comparing with every shard before took
    /// 2e8 comparisons), and a shard overlapping any of them is still
    /// refused, naming both boxes.
    #[test]
    fn splits_are_checked_in_a_few_steps_per_shard() {
        let n = 20_000u64;
        let splits: [(Vec<u64>, Placed); 3] = [
            (vec![n * 4, 8], |i| (vec![i * 4, 0], vec![4, 8])),
            (vec![8, n * 4], |i| (vec![0, i * 4], vec![8, 4])),
            (vec![400, 400], |i| {
                (vec![(i / 100) * 4, (i % 100) * 4], vec![4, 4])
            }),
        ];
        for (global, at) in splits {
            let (mut c, mut ts) = (Clashes::default(), Vec::new());
            // Out of order: every other shard first, then the rest.
            for i in (0..n).step_by(2).chain((1..n).step_by(2)) {
                let (offset, shape) = at(i);
                add(&mut c, &mut ts, shard(Some(0), &global, &offset, &shape)).unwrap();
            }
            assert!(steps(&c) <= 12 * n, "{global:?}: {} steps", steps(&c));
            let (offset, _) = at(n / 2);
            let inside: Vec<u64> = offset.iter().map(|o| o + 1).collect();
            let e = add(&mut c, &mut ts, shard(Some(0), &global, &inside, &[2, 2])).unwrap_err();
            assert!(e.message.contains("overlaps the one at offset"), "{e}");
        }
    }

    /// Random boxes (some overlapping, some empty, for a few ranks and for
    /// every rank), added and taken out again in random order: every
    /// verdict is the one comparing with every kept shard gives.
    #[test]
    fn verdicts_match_comparing_with_every_shard() {
        let mut rng = Rng(11);
        for round in 0..40 {
            let ndim = 1 + (round % 3) as usize;
            let global = vec![24u64; ndim];
            let (mut c, mut ts) = (Clashes::default(), Vec::<ServedTensor>::new());
            for _ in 0..300 {
                if !ts.is_empty() && rng.next().is_multiple_of(5) {
                    c.remove(&ts, ts.len() - 1);
                    ts.pop();
                    continue;
                }
                let offset: Vec<u64> = (0..ndim).map(|_| rng.next() % 24).collect();
                let shape: Vec<u64> = (offset.iter())
                    .map(|&o| rng.next() % (24 - o).min(6 + 1))
                    .collect();
                let rank = match rng.next() % 4 {
                    0 => None,
                    r => Some(r as u32 % 2),
                };
                let t = shard(rank, &global, &offset, &shape);
                let expected = ts.iter().any(|o| {
                    let same_rank = o.rank.is_none() || rank.is_none() || o.rank == rank;
                    let po = o.placement.as_ref().unwrap();
                    same_rank && meet((&po.offset, &o.shape), (&offset, &shape))
                });
                let got = add(&mut c, &mut ts, t);
                assert_eq!(got.is_err(), expected, "round {round}: {got:?}");
            }
        }
    }

    /// Whole tensors, a whole tensor beside shards, and shards of other
    /// global tensors are refused for the same rank; other ranks' tensors
    /// are not in the way, a tensor for every rank is in every rank's.
    #[test]
    fn kinds_clash_per_rank() {
        let (mut c, mut ts) = (Clashes::default(), Vec::new());
        let whole = |rank| ServedTensor {
            placement: None,
            ..shard(rank, &[4], &[0], &[4])
        };
        add(&mut c, &mut ts, whole(Some(0))).unwrap();
        let e = add(&mut c, &mut ts, whole(Some(0))).unwrap_err();
        assert!(e.message.contains("already published"), "{e}");
        let e = add(&mut c, &mut ts, shard(Some(0), &[4], &[0], &[2])).unwrap_err();
        assert!(e.message.contains("both whole and as shards"), "{e}");
        add(&mut c, &mut ts, shard(Some(1), &[4], &[0], &[2])).unwrap();
        let e = add(&mut c, &mut ts, shard(Some(1), &[8], &[4], &[2])).unwrap_err();
        assert!(e.message.contains("disagree on the global tensor"), "{e}");
        add(&mut c, &mut ts, shard(Some(1), &[4], &[2], &[2])).unwrap();
        // For every rank: beside rank 0's whole tensor, overlapping rank
        // 1's shard at [2]: either is named.
        let e = add(&mut c, &mut ts, shard(None, &[4], &[3], &[1])).unwrap_err();
        assert!(
            e.message.contains("overlaps the one at offset [2]")
                || e.message.contains("whole and as shards"),
            "{e}"
        );
        // Whole beside rank 0's whole tensor, or beside rank 1's shards:
        // either is named.
        let e = add(&mut c, &mut ts, whole(None)).unwrap_err();
        assert!(
            e.message.contains("already published") || e.message.contains("whole and as shards"),
            "{e}"
        );
        add(&mut c, &mut ts, whole(Some(2))).unwrap();
    }

    /// Refused adds are not counted: a shard refused 10,000 times leaves
    /// room for the next one. A batch taken back gives back its steps and
    /// its long shard's reach: 50,000 one-row shards go in after it.
    #[test]
    fn refused_adds_and_batches_taken_back_cost_the_tensor_nothing() {
        let (mut c, mut ts) = (Clashes::default(), Vec::new());
        add(&mut c, &mut ts, shard(Some(0), &[100], &[0], &[10])).unwrap();
        for _ in 0..10_000 {
            let e = add(&mut c, &mut ts, shard(Some(0), &[100], &[5], &[1])).unwrap_err();
            assert!(e.message.contains("overlaps"), "{e}");
        }
        add(&mut c, &mut ts, shard(Some(0), &[100], &[50], &[10])).unwrap();
        let n = 50_000u64;
        let (mut c, mut ts) = (Clashes::default(), Vec::new());
        let global = [2 * n + 1_000_000, 2];
        add(&mut c, &mut ts, shard(Some(0), &global, &[0, 0], &[1, 2])).unwrap();
        add(&mut c, &mut ts, shard(Some(0), &global, &[1, 0], &[1, 2])).unwrap();
        let before = steps(&c);
        assert_eq!(before, charged(&c), "each step counted once");
        // A batch: a long shard, then one overlapping the first: taken back.
        let long = shard(Some(0), &global, &[n, 0], &[1_000_000, 2]);
        add(&mut c, &mut ts, long).unwrap();
        assert!(steps(&c) > before);
        c.remove(&ts, ts.len() - 1);
        ts.pop();
        assert_eq!(steps(&c), before, "the batch's steps given back");
        for i in 2..n {
            add(&mut c, &mut ts, shard(Some(0), &global, &[i, 0], &[1, 2])).unwrap();
        }
        assert!(steps(&c) <= 12 * n, "{} steps", steps(&c));
        assert_eq!(steps(&c), charged(&c));
    }

    /// One long shard among many short ones puts many starts in a box's
    /// range: the steps stop at the name's budget and the add is refused,
    /// naming the tensor, instead of growing quadratically.
    #[test]
    fn too_fragmented_shards_are_refused_within_the_budget() {
        let (mut c, mut ts) = (Clashes::default(), Vec::new());
        let n = 30_000u64;
        let global = [n + 1_000_000, 2];
        add(
            &mut c,
            &mut ts,
            shard(Some(0), &global, &[n, 0], &[1_000_000, 1]),
        )
        .unwrap();
        let mut refused = None;
        for i in 0..n {
            if let Err(e) = add(&mut c, &mut ts, shard(Some(0), &global, &[i, 0], &[1, 2])) {
                refused = Some(e);
                break;
            }
        }
        let e = refused.expect("refused before the last shard");
        assert!(
            e.message.contains("tensor 'w'") && e.message.contains("too fragmented"),
            "{e}"
        );
        assert!(steps(&c) <= budget(ts.len() + 1) + 1, "{} steps", steps(&c));
    }
}
