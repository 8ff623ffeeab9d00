//! The global tensors the sources hold together: every shard of every
//! source, grouped by global tensor and checked before anything is planned.
//!
//! Checked here: each tensor's byte size against its dtype and shape, its
//! placement (rank, box inside the global shape), one dtype and one global
//! shape per global tensor across all sources, the same box at most once
//! per source, and shards of one tensor that do not overlap (the same box
//! from several sources is a replica, which is allowed).

use super::clock::Clock;
use super::region::Span;
use super::shard_check;
use crate::box_sweep;
use crate::manifest::{Manifest, TensorMeta};
use crate::tensor::{shape_text, DType};
use std::collections::HashMap;
use std::ops::Range;

/// Names hashed with foldhash: SipHash was a tenth of planning 80,000
/// shards, and these names come from the engine's own sources.
type ByName<'a> = HashMap<&'a str, usize, foldhash::fast::RandomState>;

/// One shard: tensor `tensor` of source `source` (32 bits each: there
/// is one per shard in the index, which should stay small).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ShardRef {
    pub source: u32,
    pub tensor: u32,
}

/// A box of a global tensor and every source holding it (replicas: the
/// first inline, since most boxes have one, and the others in source order
/// in [`Globals`]' `more`). Sixteen bytes: one per shard is written and
/// read back on every plan from scratch.
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    /// Where its box is in [`Globals`]' `boxes`.
    at: u32,
    /// 0: no other replica; else 1 + the index of the others in `more`.
    more: u32,
    first: ShardRef,
}

/// A global tensor's name, dtype and shape, and where its boxes are.
#[derive(Debug)]
pub(super) struct GlobalTensor<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// Its distinct boxes in [`Globals`]' `held`, sorted by offset.
    held: Range<usize>,
    /// The dimension its boxes are split along (sorted by their start
    /// along it), and the longest box along it: together they find the
    /// boxes a piece meets by a binary search.
    split: usize,
    max_len: u64,
    /// The source it was first seen in (messages name it).
    first_source: u32,
}

/// One global tensor with its boxes, borrowed from [`Globals`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Global<'g> {
    pub name: &'g str,
    pub dtype: DType,
    pub shape: &'g [u64],
    held: &'g [Held],
    boxes: &'g [u64],
    more: &'g [Box<[ShardRef]>],
    split: usize,
    max_len: u64,
}

impl Global<'_> {
    /// The box of `h` (one of this tensor's).
    pub fn region(&self, h: &Held) -> Span<'_> {
        region_in(self.boxes, self.shape.len(), h)
    }

    /// The replica of `h` an engine rank with `spread` reads.
    pub fn replica(&self, h: &Held, spread: usize) -> ShardRef {
        let others = replicas_in(self.more, h);
        match spread % (1 + others.len()) {
            0 => h.first,
            i => others[i - 1],
        }
    }

    /// The boxes that may meet `b` (same rank): those starting along the
    /// split dimension before `b` ends and not ending before it starts.
    pub fn candidates(&self, b: Span) -> &[Held] {
        let d = self.split;
        if b.ndim() <= d {
            return self.held;
        }
        let (start, len) = (b.offset[d], b.len[d]);
        let from = start.saturating_sub(self.max_len);
        let start_of = |h: &Held| self.boxes[h.at as usize + d];
        let lo = self.held.partition_point(|h| start_of(h) < from);
        let hi = self.held.partition_point(|h| start_of(h) < start + len);
        &self.held[lo..hi]
    }
}

/// Who has what: the global tensors in first-seen order (for messages),
/// found by name. Names and shapes are borrowed from the manifests; each
/// shard's box is copied, beside its tensor's others, in one list for all.
#[derive(Debug, Default)]
pub(super) struct Globals<'a> {
    pub tensors: Vec<GlobalTensor<'a>>,
    by_name: ByName<'a>,
    /// Per source, the number of its first shard when all are numbered
    /// source by source.
    first_shard: Vec<usize>,
    shards: usize,
    /// Every global tensor's distinct boxes, tensor after tensor.
    held: Vec<Held>,
    /// The boxes of `held`: per box its offset then its lengths. Sorting,
    /// sweeping and intersecting them then reads this, not metadata spread
    /// over the heap (80,000 shards' of it).
    boxes: Vec<u64>,
    /// The replicas of a box beyond its first (rare).
    more: Vec<Box<[ShardRef]>>,
    /// Every replica beside the first holder of its box, as pairs.
    pub replicas: Vec<(ShardRef, ShardRef)>,
    /// Some shard is a part of a larger global tensor (sharded sources; a
    /// whole tensor announced with a placement is still whole).
    pub placed: bool,
}

impl<'a> Globals<'a> {
    /// Shard `r`'s number, when all are numbered source by source.
    pub fn shard_number(&self, r: ShardRef) -> usize {
        self.first_shard[r.source as usize] + r.tensor as usize
    }

    /// The index of global tensor `name` in `tensors`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Global tensor `k` with its boxes.
    pub fn get(&self, k: usize) -> Global<'_> {
        let t = &self.tensors[k];
        Global {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            held: &self.held[t.held.clone()],
            boxes: &self.boxes,
            more: &self.more,
            split: t.split,
            max_len: t.max_len,
        }
    }

    /// The index of shard `t`'s global tensor, added if new. `guess` is
    /// tried first, with one comparison instead of hashing the name:
    /// trainer ranks mostly list the same tensors in the same order, so
    /// the previous source's tensor at the same position is usually it.
    fn intern(&mut self, t: &'a TensorMeta, (guess, source): (Option<usize>, u32)) -> usize {
        if let Some(k) = guess.filter(|&k| self.tensors[k].name == t.name) {
            return k;
        }
        let next = self.tensors.len();
        let k = *self.by_name.entry(t.name.as_str()).or_insert(next);
        if k == next {
            self.tensors.push(GlobalTensor {
                name: &t.name,
                dtype: t.dtype,
                shape: t.global_shape(),
                held: 0..0,
                split: 0,
                max_len: 0,
                first_source: source,
            });
        }
        k
    }
}

/// A shard refused by `global_of` (in `collect`'s per-shard list).
const REFUSED: u32 = u32::MAX;

/// A shard as the first pass found it: its global tensor (or
/// [`REFUSED`]), and where its box was copied in [`Globals`]' `boxes`.
#[derive(Clone, Copy)]
struct Interned {
    global: u32,
    at: u32,
}

/// Group every tensor of every source by global tensor; every problem
/// found is appended to `problems`.
/// Stops early (incomplete) when `clock` runs out.
pub(super) fn collect<'a>(
    sources: &[&'a Manifest],
    clock: &mut Clock,
    problems: &mut Vec<String>,
) -> Globals<'a> {
    let mut g = Globals::default();
    for m in sources {
        g.first_shard.push(g.shards);
        g.shards += m.tensors.len();
    }
    // At least the largest source's tensors are distinct global tensors.
    let most = sources.iter().map(|m| m.tensors.len()).max().unwrap_or(0);
    g.tensors.reserve(most);
    g.by_name.reserve(most);
    let of = intern_all(&mut g, sources, clock, problems);
    let ranges = group_by_tensor(&mut g, &of);
    // Each tensor's distinct boxes are joined down to `held[kept..]`.
    let mut kept = 0;
    for (k, range) in ranges.into_iter().enumerate() {
        if !clock.tick() {
            break;
        }
        let n = join_replicas(&mut g, k, range, kept, sources, problems);
        g.tensors[k].held = kept..kept + n;
        kept += n;
        sort_along_split(&mut g, k);
        overlaps(g.get(k), sources, problems);
    }
    g.held.truncate(kept);
    g
}

/// Find global tensor `k`'s split dimension and sort its boxes by their
/// start along it (for [`Global::candidates`]).
fn sort_along_split(g: &mut Globals, k: usize) {
    let (boxes, ndim) = (&g.boxes, g.tensors[k].shape.len());
    let held = &mut g.held[g.tensors[k].held.clone()];
    let span = |h: &Held| region_in(boxes, ndim, h);
    let split = box_sweep::split_dim(held.len(), |i| {
        let r = span(&held[i]);
        (r.offset, r.len)
    });
    let Some(d) = split else {
        return;
    };
    held.sort_by_key(|h| span(h).offset[d]);
    let max_len = held.iter().map(|h| span(h).len[d]).max();
    (g.tensors[k].split, g.tensors[k].max_len) = (d, max_len.unwrap_or(0));
}

/// Every shard checked, interned and its box copied (in shard order): the
/// one pass that reads the shards' metadata, spread over the heap.
fn intern_all<'a>(
    g: &mut Globals<'a>,
    sources: &[&'a Manifest],
    clock: &mut Clock,
    problems: &mut Vec<String>,
) -> Vec<Interned> {
    let mut of: Vec<Interned> = Vec::with_capacity(g.shards);
    // Reserved for two dimensions a shard (not touched: unused pages cost
    // nothing); more grows the list.
    g.boxes.reserve(4 * g.shards);
    for (s, m) in sources.iter().enumerate() {
        // The previous source's shards, by position: guesses for this one's.
        let previous = match s {
            0 => 0..0,
            _ => g.first_shard[s - 1]..g.first_shard[s],
        };
        for (i, t) in m.tensors.iter().enumerate() {
            if !clock.tick() {
                // Unread shards are refused: nothing is planned from them.
                of.push(Interned {
                    global: REFUSED,
                    at: 0,
                });
                continue;
            }
            let guess = previous.clone().nth(i).map(|j| of[j].global);
            let guess = guess.filter(|&k| k != REFUSED).map(|k| k as usize);
            let Some(k) = global_of(g, t, (guess, s as u32), problems) else {
                of.push(Interned {
                    global: REFUSED,
                    at: 0,
                });
                continue;
            };
            let at = u32::try_from(g.boxes.len()).expect("shard boxes are numbered in 32 bits");
            let global = u32::try_from(k).expect("global tensors are numbered in 32 bits");
            of.push(Interned { global, at });
            g.placed |= t
                .placement
                .as_ref()
                .is_some_and(|p| p.global_shape != t.shape);
            let region = Span::of_shard(t);
            // Element by element: a few numbers are not worth a memcpy call.
            for &x in region.offset.iter().chain(region.len) {
                g.boxes.push(x);
            }
        }
    }
    of
}

/// The shards not refused, in `held` grouped by global tensor (a counting
/// sort), each tensor's in source order; per tensor, its range there.
fn group_by_tensor(g: &mut Globals, of: &[Interned]) -> Vec<Range<usize>> {
    let n = g.tensors.len();
    let mut place = vec![0usize; n + 1];
    for i in of.iter().filter(|i| i.global != REFUSED) {
        place[i.global as usize + 1] += 1;
    }
    for k in 0..n {
        place[k + 1] += place[k];
    }
    let ranges = (0..n).map(|k| place[k]..place[k + 1]).collect();
    let empty = Held {
        at: 0,
        more: 0,
        first: ShardRef {
            source: 0,
            tensor: 0,
        },
    };
    g.held = vec![empty; place[n]];
    for (s, &first) in g.first_shard.iter().enumerate() {
        let end = g.first_shard.get(s + 1).copied().unwrap_or(g.shards);
        for (i, shard) in of[first..end].iter().enumerate() {
            let Some(at) = place.get_mut(shard.global as usize) else {
                continue;
            };
            g.held[*at] = Held {
                at: shard.at,
                more: 0,
                first: ShardRef {
                    source: s as u32,
                    tensor: i as u32,
                },
            };
            *at += 1;
        }
    }
    ranges
}

/// The global tensor of shard `t` (interned), or None when the shard is
/// refused: its size or placement is wrong, or it disagrees with the
/// global tensor's dtype or shape as first seen.
fn global_of<'a>(
    g: &mut Globals<'a>,
    t: &'a TensorMeta,
    (guess, source): (Option<usize>, u32),
    problems: &mut Vec<String>,
) -> Option<usize> {
    if let Some(p) = shard_check::shard_problem(t) {
        problems.push(p);
        return None;
    }
    let k = g.intern(t, (guess, source));
    let entry = &g.tensors[k];
    let shape = t.global_shape();
    if entry.dtype != t.dtype || entry.shape != shape {
        let who = match g.first_shard.len() {
            1 => "its shards disagree on it:".to_string(),
            _ => format!("sources disagree on it: source {} has", entry.first_source),
        };
        let other = match g.first_shard.len() {
            1 => String::new(),
            _ => format!("source {source} "),
        };
        problems.push(format!(
            "tensor '{}': {who} {} {}, {other}{} {}",
            t.name,
            entry.dtype,
            shape_text(entry.shape),
            t.dtype,
            shape_text(shape)
        ));
        return None;
    }
    Some(k)
}

/// Sort the boxes of global tensor `k` (`held[range]`) by offset and join
/// equal ones into one box with its replicas (in source order), moved
/// down to `held[to..]` (`to` is at most `range.start`); returns how many
/// distinct boxes there are. The same box twice from one source is a
/// problem. Sorting keeps this linear-logarithmic in the shards.
fn join_replicas(
    g: &mut Globals,
    k: usize,
    range: Range<usize>,
    to: usize,
    sources: &[&Manifest],
    problems: &mut Vec<String>,
) -> usize {
    let (boxes, ndim, name) = (&g.boxes, g.tensors[k].shape.len(), g.tensors[k].name);
    let region = |h: &Held| region_in(boxes, ndim, h);
    let held = &mut g.held;
    held[range.clone()].sort_by(|a, b| {
        let (a, b) = (region(a), region(b));
        (a.offset, a.len).cmp(&(b.offset, b.len))
    });
    let mut kept = 0;
    for i in range {
        if kept == 0 || region(&held[i]) != region(&held[to + kept - 1]) {
            held[to + kept] = held[i];
            kept += 1;
            continue;
        }
        let (at, last) = (held[i].first, &mut held[to + kept - 1]);
        let others = replicas_in(&g.more, last);
        if last.first.source == at.source || others.iter().any(|r| r.source == at.source) {
            let shard = &sources[at.source as usize].tensors[at.tensor as usize];
            let which = match shard.placement.is_some() {
                true => format!(" {}", region(last)),
                false => String::new(),
            };
            problems.push(format!(
                "tensor '{name}'{which} appears more than once in the source"
            ));
            continue;
        }
        g.replicas.push((last.first, at));
        let joined = others.iter().copied().chain([at]).collect();
        match last.more {
            0 => {
                g.more.push(joined);
                last.more = u32::try_from(g.more.len()).expect("replicas are numbered in 32 bits");
            }
            m => g.more[m as usize - 1] = joined,
        }
    }
    kept
}

/// Distinct boxes of one tensor must not share an element: a sweep along
/// its split dimension (`box_sweep`), `O(n log n)` in its shards.
fn overlaps(t: Global, sources: &[&Manifest], problems: &mut Vec<String>) {
    let name = t.name;
    let found = box_sweep::find_overlap(t.held.len(), |i| {
        let r = t.region(&t.held[i]);
        (r.offset, r.len)
    });
    match found {
        Ok(None) => {}
        Ok(Some((j, i))) => {
            let (there, here) = (t.region(&t.held[j]), t.region(&t.held[i]));
            let common = there.intersect(here).map(|c| c.span().to_string());
            let who = |k: usize| describe(sources, t.held[k].first);
            problems.push(format!(
                "tensor '{name}': shards {there} ({}) and {here} ({}) overlap at {}",
                who(j),
                who(i),
                common.unwrap_or_default()
            ));
        }
        Err(too) => problems.push(format!(
            "tensor '{name}': its {} shards vary along three or more dimensions in a way \
             too costly to check for overlaps (at most {} box comparisons)",
            too.boxes,
            box_sweep::budget(too.boxes)
        )),
    }
}

/// The box at `h.at` in `boxes` (a global tensor's, of `ndim` dimensions).
fn region_in<'b>(boxes: &'b [u64], ndim: usize, h: &Held) -> Span<'b> {
    let at = h.at as usize;
    let (offset, len) = boxes[at..at + 2 * ndim].split_at(ndim);
    Span { offset, len }
}

/// The replicas of `h` beyond its first, in `more`.
fn replicas_in<'m>(more: &'m [Box<[ShardRef]>], h: &Held) -> &'m [ShardRef] {
    match h.more {
        0 => &[],
        m => &more[m as usize - 1],
    }
}

fn describe(sources: &[&Manifest], r: ShardRef) -> String {
    if sources.len() == 1 {
        "the source".to_string()
    } else {
        format!("source {}", r.source)
    }
}
