//! A trainer layout: the global tensors, and per trainer rank its shards,
//! turned into one [`Manifest`] per rank (placements, no bytes).

use super::json::{bad, expand, Obj};
use super::limits::*;
use crate::manifest::{Manifest, Placement, TensorMeta};
use crate::result::Result;
use crate::tensor::{byte_size, check_name, DType};
use serde_json::Value;
use std::collections::HashMap;
use std::ops::Range;

/// A global tensor: what the trainer holds shards of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GlobalSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

#[derive(Debug, Default)]
pub struct TrainerLayout {
    /// Every global tensor, in the layout's order.
    pub tensors: Vec<GlobalSpec>,
    /// Per trainer rank, its shards.
    pub manifests: Vec<Manifest>,
    by_name: HashMap<String, usize>,
    shards: usize,
}

const TOP: &[&str] = &["ranks", "dtype", "tensors", "shards"];
const RULE: &[&str] = &[
    "name",
    "shape",
    "dtype",
    "layers",
    "experts",
    "ranks",
    "split",
    "replicate",
    "expert_groups",
];
const SHARD: &[&str] = &["rank", "tensor", "offsets", "shape"];

impl TrainerLayout {
    /// The index of global tensor `name` in `tensors`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The global tensor `name`.
    pub fn find(&self, name: &str) -> Option<&GlobalSpec> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Elements of every global tensor together.
    pub fn elements(&self) -> u128 {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().map(|&d| u128::from(d)).product::<u128>())
            .sum()
    }

    /// Read a trainer layout from its parsed JSON.
    pub fn from_json(v: &Value) -> Result<TrainerLayout> {
        let top = Obj::new(v, "trainer".into(), TOP)?;
        let ranks = top.need_num("ranks", MAX_RANKS)? as usize;
        if ranks == 0 {
            return Err(bad(&top.field("ranks"), "must be 1 or more"));
        }
        let dtype = match top.has("dtype") {
            true => Some(top.dtype(None)?),
            false => None,
        };
        let mut t = TrainerLayout {
            manifests: vec![Manifest::default(); ranks],
            ..Default::default()
        };
        for (i, rule) in top.list("tensors")?.iter().enumerate() {
            let rule = Obj::new(rule, format!("trainer.tensors[{i}]"), RULE)?;
            t.add_rule(&rule, dtype)?;
        }
        for (i, shard) in top.list("shards")?.iter().enumerate() {
            let shard = Obj::new(shard, format!("trainer.shards[{i}]"), SHARD)?;
            t.add_explicit(&shard)?;
        }
        Ok(t)
    }

    /// One tensor rule: its tensors (over layers and experts) and, with
    /// `split` or `replicate`, their shards.
    fn add_rule(&mut self, rule: &Obj, default: Option<DType>) -> Result<()> {
        let template = rule.need_text("name")?;
        let shape = rule
            .dims("shape")?
            .ok_or_else(|| bad(&rule.field("shape"), "is missing"))?;
        let dtype = rule.dtype(default)?;
        byte_size(&rule.field("shape"), dtype, &shape)?;
        let layers = rule.range("layers", MAX_LAYERS)?;
        let experts = rule.range("experts", MAX_EXPERTS)?;
        let ranks = rule
            .range("ranks", self.manifests.len() as u64)?
            .unwrap_or(0..self.manifests.len() as u64);
        let how = Placing::of(rule, &shape)?;
        let groups = rule.num("expert_groups", MAX_RANKS)?;
        let count = |r: &Option<Range<u64>>| r.as_ref().map_or(1, |r| r.end - r.start);
        let tensors = count(&layers) * count(&experts);
        let groups = ExpertGroups::of(rule, groups, &experts, &ranks)?;
        let per = match how {
            Placing::Split(_) | Placing::Replicate => groups.width(&ranks),
            Placing::Explicit => 0,
        };
        if self.tensors.len() as u64 + tensors > MAX_TENSORS as u64
            || self.shards as u64 + tensors * per > MAX_SHARDS as u64
        {
            return Err(bad(
                &rule.path,
                format!("more than {MAX_TENSORS} tensors or {MAX_SHARDS} shards in all"),
            ));
        }
        for layer in layers.clone().map_or(vec![None], |r| r.map(Some).collect()) {
            for expert in experts
                .clone()
                .map_or(vec![None], |r| r.map(Some).collect())
            {
                let name = expand(template, layer, expert, &rule.field("name"))?;
                check_name("tensor", &name).map_err(|e| e.context(rule.field("name")))?;
                let on = groups.ranks_of(expert, &ranks);
                self.add_tensor(rule, name, dtype, &shape, how, on)?;
            }
        }
        Ok(())
    }

    fn add_tensor(
        &mut self,
        rule: &Obj,
        name: String,
        dtype: DType,
        shape: &[u64],
        how: Placing,
        ranks: Range<u64>,
    ) -> Result<()> {
        if self.by_name.contains_key(&name) {
            return Err(bad(
                &rule.field("name"),
                format!("tensor '{name}' is described twice"),
            ));
        }
        let spec = GlobalSpec {
            name: name.clone(),
            dtype,
            shape: shape.to_vec(),
        };
        self.by_name.insert(name, self.tensors.len());
        let k = ranks.end - ranks.start;
        for (i, r) in ranks.enumerate() {
            let (offset, len) = match how {
                Placing::Explicit => break,
                Placing::Replicate => (vec![0; shape.len()], shape.to_vec()),
                Placing::Split(d) => {
                    // PyTorch's chunks: ceil(n / k) each, the last shorter.
                    let chunk = shape[d].div_ceil(k);
                    let start = (chunk * i as u64).min(shape[d]);
                    let end = (start + chunk).min(shape[d]);
                    if end == start {
                        continue;
                    }
                    let mut off = vec![0; shape.len()];
                    let mut len = shape.to_vec();
                    (off[d], len[d]) = (start, end - start);
                    (off, len)
                }
            };
            self.push_shard(r as usize, &spec, offset, len)?;
        }
        self.tensors.push(spec);
        Ok(())
    }

    fn push_shard(
        &mut self,
        rank: usize,
        spec: &GlobalSpec,
        offset: Vec<u64>,
        shape: Vec<u64>,
    ) -> Result<()> {
        let nbytes = byte_size(&spec.name, spec.dtype, &shape)?;
        self.shards += 1;
        self.manifests[rank].tensors.push(TensorMeta {
            name: spec.name.clone(),
            dtype: spec.dtype,
            nbytes,
            checksum: None,
            placement: Some(Placement {
                global_shape: spec.shape.clone(),
                offset,
            }),
            shape,
        });
        Ok(())
    }

    /// An explicit shard: a box of a tensor the rules described.
    fn add_explicit(&mut self, shard: &Obj) -> Result<()> {
        let rank = shard.need_num("rank", self.manifests.len() as u64 - 1)? as usize;
        let name = shard.need_text("tensor")?;
        let spec = self.find(name).cloned().ok_or_else(|| {
            bad(
                &shard.field("tensor"),
                format!("'{name}' is not in trainer.tensors"),
            )
        })?;
        let need = |k: &str| {
            shard
                .dims(k)?
                .ok_or_else(|| bad(&shard.field(k), "is missing"))
        };
        let (offset, shape) = (need("offsets")?, need("shape")?);
        let placement = Placement {
            global_shape: spec.shape.clone(),
            offset: offset.clone(),
        };
        placement
            .check(name, &shape)
            .map_err(|e| e.context(&shard.path))?;
        if self.shards >= MAX_SHARDS {
            return Err(bad(
                &shard.path,
                format!("more than {MAX_SHARDS} shards in all"),
            ));
        }
        self.push_shard(rank, &spec, offset, shape)
    }
}

/// How a rule places its tensors on its ranks.
#[derive(Clone, Copy)]
enum Placing {
    /// Dimension `d` split evenly over the ranks.
    Split(usize),
    /// The whole tensor on every rank.
    Replicate,
    /// Only where `shards` says.
    Explicit,
}

impl Placing {
    fn of(rule: &Obj, shape: &[u64]) -> Result<Placing> {
        if shape.is_empty() && rule.has("split") {
            return Err(bad(
                &rule.field("split"),
                "a scalar has no dimension to split",
            ));
        }
        let split = rule.num("split", shape.len().saturating_sub(1) as u64);
        let split =
            split.map_err(|e| e.context(format!("the shape has {} dimensions", shape.len())))?;
        match (split, rule.flag("replicate")?) {
            (Some(_), true) => Err(bad(
                &rule.path,
                "'split' and 'replicate' exclude each other",
            )),
            (Some(d), false) => Ok(Placing::Split(d as usize)),
            (None, true) => Ok(Placing::Replicate),
            (None, false) => Ok(Placing::Explicit),
        }
    }
}

/// Experts spread over groups of ranks: the rule's ranks cut into `groups`
/// equal groups, its experts into as many equal ranges; expert range `g`
/// lives on rank group `g`.
struct ExpertGroups(Option<(u64, u64, u64)>);

impl ExpertGroups {
    fn of(
        rule: &Obj,
        groups: Option<u64>,
        experts: &Option<Range<u64>>,
        ranks: &Range<u64>,
    ) -> Result<ExpertGroups> {
        let Some(g) = groups else {
            return Ok(ExpertGroups(None));
        };
        let path = rule.field("expert_groups");
        let Some(e) = experts else {
            return Err(bad(&path, "needs experts"));
        };
        let (ne, nr) = (e.end - e.start, ranks.end - ranks.start);
        if g == 0 || ne % g != 0 || nr % g != 0 {
            return Err(bad(
                &path,
                format!("{g} groups must divide both the {ne} experts and the {nr} ranks"),
            ));
        }
        Ok(ExpertGroups(Some((e.start, ne / g, nr / g))))
    }

    /// How many ranks hold each expert.
    fn width(&self, ranks: &Range<u64>) -> u64 {
        self.0
            .map_or(ranks.end - ranks.start, |(_, _, width)| width)
    }

    /// The ranks holding `expert`.
    fn ranks_of(&self, expert: Option<u64>, ranks: &Range<u64>) -> Range<u64> {
        match (self.0, expert) {
            (Some((first, per_group, width)), Some(e)) => {
                let g = (e - first) / per_group;
                ranks.start + g * width..ranks.start + (g + 1) * width
            }
            _ => ranks.clone(),
        }
    }
}
