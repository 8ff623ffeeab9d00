//! The global tensors the sources hold together: every shard of every
//! source, grouped by global tensor and checked before anything is planned.
//!
//! Checked here: each tensor's byte size against its dtype and shape, its
//! placement (rank, box inside the global shape), one dtype and one global
//! shape per global tensor across all sources, the same box at most once
//! per source, and shards of one tensor that do not overlap (the same box
//! from several sources is a replica, which is allowed).

use crate::manifest::{Manifest, TensorMeta};
use crate::tensor::{byte_size, shape_text, DType};
use crate::tensor_box::TensorBox;
use std::collections::HashMap;

/// One shard: tensor `tensor` of source `source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ShardRef {
    pub source: usize,
    pub tensor: usize,
}

/// A box of a global tensor and every source holding it (replicas: the
/// first inline, since most boxes have one, and the others in source order).
#[derive(Debug)]
pub(super) struct Held {
    pub region: TensorBox,
    first: ShardRef,
    more: Vec<ShardRef>,
    /// The shard carries a placement (named by its box in messages).
    placed: bool,
}

impl Held {
    /// The replica an engine rank with `spread` reads.
    pub fn replica(&self, spread: usize) -> ShardRef {
        match spread % (1 + self.more.len()) {
            0 => self.first,
            i => self.more[i - 1],
        }
    }

    fn holds_from(&self, source: usize) -> bool {
        self.first.source == source || self.more.iter().any(|r| r.source == source)
    }
}

#[derive(Debug)]
pub(super) struct GlobalTensor<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Distinct boxes, sorted by offset.
    pub held: Vec<Held>,
    /// The longest box along dimension 0 (to find the boxes a piece meets).
    max_len0: u64,
}

impl GlobalTensor<'_> {
    /// The boxes that may meet `b` (same rank): those starting along
    /// dimension 0 before `b` ends and not ending before it starts.
    pub fn candidates(&self, b: &TensorBox) -> &[Held] {
        let (Some(&start), Some(&len)) = (b.offset.first(), b.len.first()) else {
            return &self.held;
        };
        let from = start.saturating_sub(self.max_len0);
        let lo = self.held.partition_point(|h| h.region.offset[0] < from);
        let hi = self
            .held
            .partition_point(|h| h.region.offset[0] < start + len);
        &self.held[lo..hi]
    }
}

/// Who has what: the global tensors in first-seen order (for messages),
/// found by name (borrowed from the manifests: nothing is copied per
/// shard).
#[derive(Debug, Default)]
pub(super) struct Globals<'a> {
    pub tensors: Vec<GlobalTensor<'a>>,
    by_name: HashMap<&'a str, usize>,
}

impl<'a> Globals<'a> {
    /// The index of global tensor `name` in `tensors`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }
}

/// The box tensor `t` holds of its global tensor.
pub(super) fn region_of(t: &TensorMeta) -> TensorBox {
    match &t.placement {
        Some(p) => TensorBox {
            offset: p.offset.clone(),
            len: t.shape.clone(),
        },
        None => TensorBox::whole(&t.shape),
    }
}

/// Group every tensor of every source by global tensor; every problem
/// found is appended to `problems`.
pub(super) fn collect<'a>(sources: &[&'a Manifest], problems: &mut Vec<String>) -> Globals<'a> {
    let mut g = Globals::default();
    for (s, m) in sources.iter().enumerate() {
        for (i, t) in m.tensors.iter().enumerate() {
            if let Some(p) = shard_problem(t) {
                problems.push(p);
                continue;
            }
            add(
                &mut g,
                t,
                ShardRef {
                    source: s,
                    tensor: i,
                },
                problems,
            );
        }
    }
    let mut open = Vec::new();
    for t in g.tensors.iter_mut() {
        join_replicas(t, problems);
        t.max_len0 = t
            .held
            .iter()
            .map(|h| h.region.len.first().copied().unwrap_or(1))
            .max()
            .unwrap_or(0);
        overlaps(t, sources, &mut open, problems);
    }
    g
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
        let region = region_of(t);
        format!(
            "tensor '{}': shard {region} is not a box of its global shape {}",
            t.name,
            shape_text(&p.global_shape)
        )
    })
}

fn add<'a>(g: &mut Globals<'a>, t: &'a TensorMeta, at: ShardRef, problems: &mut Vec<String>) {
    let shape = t.global_shape();
    let next = g.tensors.len();
    let index = *g.by_name.entry(t.name.as_str()).or_insert(next);
    if index == next {
        g.tensors.push(GlobalTensor {
            name: &t.name,
            dtype: t.dtype,
            shape: shape.to_vec(),
            held: Vec::new(),
            max_len0: 0,
        });
    }
    let entry = &mut g.tensors[index];
    if entry.dtype != t.dtype || entry.shape != shape {
        problems.push(format!(
            "tensor '{}': sources disagree on it: {} {} and {} {}",
            t.name,
            entry.dtype,
            shape_text(&entry.shape),
            t.dtype,
            shape_text(shape)
        ));
        return;
    }
    entry.held.push(Held {
        region: region_of(t),
        first: at,
        more: Vec::new(),
        placed: t.placement.is_some(),
    });
}

/// Sort `t`'s boxes by offset and join equal ones into one box with its
/// replicas (in source order); the same box twice from one source is a
/// problem. Sorting keeps this linear-logarithmic in the shards.
fn join_replicas(t: &mut GlobalTensor, problems: &mut Vec<String>) {
    t.held
        .sort_by(|a, b| (&a.region.offset, &a.region.len).cmp(&(&b.region.offset, &b.region.len)));
    let name = t.name;
    // `later` is dropped after its replica joins `kept`.
    t.held.dedup_by(|later, kept| {
        if later.region != kept.region {
            return false;
        }
        let at = later.first;
        if kept.holds_from(at.source) {
            let which = match later.placed {
                true => format!(" {}", later.region),
                false => String::new(),
            };
            problems.push(format!(
                "tensor '{name}'{which} appears more than once in the source"
            ));
        } else {
            kept.more.push(at);
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
        let start0 = h.region.offset.first().copied().unwrap_or(0);
        open.retain(|&j| {
            let r = &t.held[j].region;
            r.offset.first().is_none_or(|&o| o + r.len[0] > start0)
        });
        for &j in open
            .iter()
            .filter(|&&j| meets(&t.held[j].region, &h.region))
        {
            if let Some(common) = t.held[j].region.intersect(&h.region) {
                let who = |k: usize| describe(sources, t.held[k].first);
                problems.push(format!(
                    "tensor '{name}': shards {} ({}) and {} ({}) overlap at {common}",
                    t.held[j].region,
                    who(j),
                    h.region,
                    who(i)
                ));
                return;
            }
        }
        open.push(i);
    }
}

/// Two boxes of one rank share an element (without building the common box).
pub(super) fn meets(a: &TensorBox, b: &TensorBox) -> bool {
    (0..a.ndim()).all(|d| {
        a.offset[d].max(b.offset[d]) < (a.offset[d] + a.len[d]).min(b.offset[d] + b.len[d])
    })
}

fn describe(sources: &[&Manifest], r: ShardRef) -> String {
    if sources.len() == 1 {
        "the source".to_string()
    } else {
        format!("source {}", r.source)
    }
}
