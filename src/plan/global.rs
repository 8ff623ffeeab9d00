//! The global tensors the sources hold together: every shard of every
//! source, grouped by global tensor and checked before anything is planned.
//!
//! Checked here: each tensor's byte size against its dtype and shape, its
//! placement (rank, box inside the global shape), one dtype and one global
//! shape per global tensor across all sources, the same box at most once
//! per source, and shards of one tensor that do not overlap (the same box
//! from several sources is a replica, which is allowed).

use super::region::Span;
use crate::manifest::{Manifest, TensorMeta};
use crate::tensor::{byte_size, shape_text, DType};
use std::collections::HashMap;

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
/// first inline, since most boxes have one, and the others in source order).
#[derive(Debug)]
pub(super) struct Held<'a> {
    /// The first replica's metadata (named in messages).
    meta: &'a TensorMeta,
    /// Where its box is in its global tensor's `boxes`.
    at: usize,
    first: ShardRef,
    /// Rare, so a boxed slice (two words, nothing allocated while empty):
    /// every byte of `Held` is paid per shard.
    more: Box<[ShardRef]>,
}

impl Held<'_> {
    fn replicas(&self) -> &[ShardRef] {
        &self.more
    }

    /// The replica an engine rank with `spread` reads.
    pub fn replica(&self, spread: usize) -> ShardRef {
        match spread % (1 + self.replicas().len()) {
            0 => self.first,
            i => self.replicas()[i - 1],
        }
    }

    fn holds_from(&self, source: u32) -> bool {
        self.first.source == source || self.replicas().iter().any(|r| r.source == source)
    }
}

#[derive(Debug)]
pub(super) struct GlobalTensor<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// Distinct boxes, sorted by offset.
    pub held: Vec<Held<'a>>,
    /// The boxes of `held`, copied together: per box its offset then its
    /// lengths. Sorting, sweeping and intersecting them then reads this,
    /// not metadata spread over the heap (80,000 shards' of it).
    boxes: Vec<u64>,
    /// The longest box along dimension 0 (to find the boxes a piece meets).
    max_len0: u64,
}

impl<'a> GlobalTensor<'a> {
    /// The box of `h` (one of `held`).
    pub fn region(&self, h: &Held) -> Span<'_> {
        region_in(&self.boxes, self.shape.len(), h)
    }

    /// The boxes that may meet `b` (same rank): those starting along
    /// dimension 0 before `b` ends and not ending before it starts.
    pub fn candidates(&self, b: Span) -> &[Held<'a>] {
        if b.ndim() == 0 {
            return &self.held;
        }
        let (start, len) = (b.start0(), b.len0());
        let from = start.saturating_sub(self.max_len0);
        let lo = self.held.partition_point(|h| self.boxes[h.at] < from);
        let hi = self
            .held
            .partition_point(|h| self.boxes[h.at] < start + len);
        &self.held[lo..hi]
    }
}

/// Who has what: the global tensors in first-seen order (for messages),
/// found by name. Names, shapes and metadata are borrowed from the
/// manifests; only each shard's box is copied (beside its tensor's others).
#[derive(Debug, Default)]
pub(super) struct Globals<'a> {
    pub tensors: Vec<GlobalTensor<'a>>,
    by_name: ByName<'a>,
    /// Per source, the number of its first shard when all are numbered
    /// source by source.
    first_shard: Vec<usize>,
    shards: usize,
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

    /// The index of shard `t`'s global tensor, added if new. `guess` is
    /// tried first, with one comparison instead of hashing the name:
    /// trainer ranks mostly list the same tensors in the same order, so
    /// the previous source's tensor at the same position is usually it.
    fn intern(&mut self, t: &'a TensorMeta, guess: Option<usize>) -> usize {
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
                held: Vec::new(),
                boxes: Vec::new(),
                max_len0: 0,
            });
        }
        k
    }
}

/// Group every tensor of every source by global tensor; every problem
/// found is appended to `problems`.
pub(super) fn collect<'a>(sources: &[&'a Manifest], problems: &mut Vec<String>) -> Globals<'a> {
    let mut g = Globals::default();
    for m in sources {
        g.first_shard.push(g.shards);
        g.shards += m.tensors.len();
    }
    // At least the largest source's tensors are distinct global tensors.
    let most = sources.iter().map(|m| m.tensors.len()).max().unwrap_or(0);
    g.tensors.reserve(most);
    g.by_name.reserve(most);
    // Which global tensor each shard is of (None: refused), and how many
    // shards each has, so that its boxes are allocated once, not grown.
    let mut of: Vec<Option<u32>> = Vec::with_capacity(g.shards);
    let mut count: Vec<usize> = Vec::with_capacity(most);
    for (s, m) in sources.iter().enumerate() {
        // The previous source's shards, by position: guesses for this one's.
        let previous = match s {
            0 => 0..0,
            _ => g.first_shard[s - 1]..g.first_shard[s],
        };
        for (i, t) in m.tensors.iter().enumerate() {
            let guess = previous.clone().nth(i).and_then(|j| of[j]);
            let k = global_of(&mut g, t, guess.map(|k| k as usize), problems);
            if let Some(k) = k {
                count.resize(g.tensors.len(), 0);
                count[k] += 1;
            }
            of.push(k.map(|k| k as u32));
        }
    }
    for (t, &n) in g.tensors.iter_mut().zip(&count) {
        t.held.reserve_exact(n);
        t.boxes.reserve_exact(n * 2 * t.shape.len());
    }
    let shards = sources
        .iter()
        .enumerate()
        .flat_map(|(s, m)| m.tensors.iter().enumerate().map(move |(i, t)| (s, i, t)));
    for ((s, i, t), k) in shards.zip(of) {
        let Some(k) = k else { continue };
        let global = &mut g.tensors[k as usize];
        let region = Span::of_shard(t);
        global.held.push(Held {
            meta: t,
            at: global.boxes.len(),
            first: ShardRef {
                source: s as u32,
                tensor: i as u32,
            },
            more: Box::default(),
        });
        // Element by element: a few numbers are not worth a memcpy call.
        for &x in region.offset.iter().chain(region.len) {
            global.boxes.push(x);
        }
    }
    let mut open = Vec::new();
    for t in g.tensors.iter_mut() {
        join_replicas(t, problems);
        t.max_len0 = t.held.iter().map(|h| t.region(h).len0()).max().unwrap_or(0);
        overlaps(t, sources, &mut open, problems);
    }
    g
}

/// The global tensor of shard `t` (interned), or None when the shard is
/// refused: its size or placement is wrong, or it disagrees with the
/// global tensor's dtype or shape as first seen.
fn global_of<'a>(
    g: &mut Globals<'a>,
    t: &'a TensorMeta,
    guess: Option<usize>,
    problems: &mut Vec<String>,
) -> Option<usize> {
    if let Some(p) = shard_problem(t) {
        problems.push(p);
        return None;
    }
    let k = g.intern(t, guess);
    let entry = &g.tensors[k];
    let shape = t.global_shape();
    if entry.dtype != t.dtype || entry.shape != shape {
        problems.push(format!(
            "tensor '{}': sources disagree on it: {} {} and {} {}",
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

/// A tensor whose byte size or placement is wrong.
fn shard_problem(t: &TensorMeta) -> Option<String> {
    // The name is only formatted for an error (this runs for every shard).
    match byte_size("", t.dtype, &t.shape) {
        Ok(n) if n == t.nbytes => {}
        Ok(n) => {
            return Some(format!(
                "tensor '{}': {} bytes but {} {} needs {n}",
                t.name,
                t.nbytes,
                t.dtype,
                shape_text(&t.shape)
            ))
        }
        Err(_) => {
            let what = format!("tensor '{}'", t.name);
            return byte_size(&what, t.dtype, &t.shape).err().map(|e| e.message);
        }
    }
    let p = t.placement.as_ref()?;
    let inside = p.offset.len() == t.shape.len()
        && p.global_shape.len() == t.shape.len()
        && (0..t.shape.len()).all(|d| {
            p.offset[d]
                .checked_add(t.shape[d])
                .is_some_and(|end| end <= p.global_shape[d])
        });
    (!inside).then(|| {
        format!(
            "tensor '{}': shard {} is not a box of its global shape {}",
            t.name,
            Span::of_shard(t),
            shape_text(&p.global_shape)
        )
    })
}

/// Sort `t`'s boxes by offset and join equal ones into one box with its
/// replicas (in source order); the same box twice from one source is a
/// problem. Sorting keeps this linear-logarithmic in the shards.
fn join_replicas(t: &mut GlobalTensor, problems: &mut Vec<String>) {
    let (boxes, ndim, name) = (&t.boxes, t.shape.len(), t.name);
    let region = |h: &Held| region_in(boxes, ndim, h);
    t.held.sort_by(|a, b| {
        let (a, b) = (region(a), region(b));
        (a.offset, a.len).cmp(&(b.offset, b.len))
    });
    // `later` is dropped after its replica joins `kept`.
    t.held.dedup_by(|later, kept| {
        if region(later) != region(kept) {
            return false;
        }
        let at = later.first;
        if kept.holds_from(at.source) {
            let which = match later.meta.placement.is_some() {
                true => format!(" {}", region(later)),
                false => String::new(),
            };
            problems.push(format!(
                "tensor '{name}'{which} appears more than once in the source"
            ));
        } else {
            kept.more = kept.more.iter().copied().chain([at]).collect();
        }
        true
    });
}

/// Distinct boxes of one tensor must not share an element. Boxes are
/// sorted by offset; only those still open along dimension 0 are compared.
fn overlaps(
    t: &GlobalTensor,
    sources: &[&Manifest],
    open: &mut Vec<usize>,
    problems: &mut Vec<String>,
) {
    let name = t.name;
    open.clear();
    for (i, h) in t.held.iter().enumerate() {
        let here = t.region(h);
        open.retain(|&j| {
            let r = t.region(&t.held[j]);
            r.ndim() == 0 || r.start0() + r.len0() > here.start0()
        });
        for &j in open.iter() {
            let there = t.region(&t.held[j]);
            if let Some(common) = there.intersect(here) {
                let who = |k: usize| describe(sources, t.held[k].first);
                problems.push(format!(
                    "tensor '{name}': shards {there} ({}) and {here} ({}) overlap at {}",
                    who(j),
                    who(i),
                    common.span()
                ));
                return;
            }
        }
        open.push(i);
    }
}

/// The box at `h.at` in `boxes` (a global tensor's, of `ndim` dimensions).
fn region_in<'b>(boxes: &'b [u64], ndim: usize, h: &Held) -> Span<'b> {
    let (offset, len) = boxes[h.at..h.at + 2 * ndim].split_at(ndim);
    Span { offset, len }
}

fn describe(sources: &[&Manifest], r: ShardRef) -> String {
    if sources.len() == 1 {
        "the source".to_string()
    } else {
        format!("source {}", r.source)
    }
}
