//! An engine layout: per engine rank, its params and their pieces, turned
//! into [`ParamLayout`]s one rank at a time (nothing allocated for params).

use super::json::{bad, expand, Obj};
use super::limits::*;
use super::trainer::TrainerLayout;
use crate::pieces::{check_pieces, Piece};
use crate::plan::ParamLayout;
use crate::quant::params::{check_weight, QuantRole};
use crate::quant::Scheme;
use crate::result::Result;
use crate::tensor::{byte_size, DType};
use crate::tensor_box::TensorBox;
use serde_json::Value;
use std::collections::HashSet;
use std::ops::Range;

#[derive(Debug)]
pub struct EngineLayout {
    pub ranks: usize,
    rules: Vec<ParamRule>,
}

/// One `params` entry, checked, not yet expanded.
#[derive(Debug)]
struct ParamRule {
    path: String,
    name: String,
    dtype: DType,
    layers: Option<Range<u64>>,
    ranks: Range<u64>,
    shape: Option<Vec<u64>>,
    stack: usize,
    /// The experts, and over how many ranks they are cut (EP).
    experts: Option<(Range<u64>, u64)>,
    /// Empty: the whole global tensor of the param's name.
    pieces: Vec<PieceRule>,
    /// Quantized from its global tensors (an F8_E4M3 param).
    quant: Option<Scheme>,
}

#[derive(Debug)]
struct PieceRule {
    path: String,
    tensor: String,
    /// An explicit box: offsets and lengths.
    boxed: Option<TensorBox>,
    /// Dimension and TP degree: the rank's 1/tp of that dimension.
    split: Option<(usize, u64)>,
    at: Option<Vec<u64>>,
}

const TOP: &[&str] = &["ranks", "dtype", "quant", "params"];
const PARAM: &[&str] = &[
    "name", "dtype", "quant", "layers", "ranks", "rank", "shape", "stack", "experts", "ep",
    "pieces",
];
const PIECE: &[&str] = &["tensor", "offsets", "shape", "split", "tp", "at"];

impl EngineLayout {
    pub fn from_json(v: &Value) -> Result<EngineLayout> {
        let top = Obj::new(v, "engine".into(), TOP)?;
        let ranks = top.need_num("ranks", MAX_RANKS)?;
        if ranks == 0 {
            return Err(bad(&top.field("ranks"), "must be 1 or more"));
        }
        let dtype = match top.has("dtype") {
            true => Some(top.dtype(None)?),
            false => None,
        };
        let quant = quant_of(&top, None)?;
        let params = top.list("params")?;
        if params.len() > MAX_PARAM_RULES {
            return Err(bad(
                &top.field("params"),
                format!("more than {MAX_PARAM_RULES}"),
            ));
        }
        let rules = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let p = Obj::new(p, format!("engine.params[{i}]"), PARAM)?;
                ParamRule::read(&p, (dtype, quant), ranks)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(EngineLayout {
            ranks: ranks as usize,
            rules,
        })
    }

    /// Whether any param is quantized (`"quant"`): its bytes on the wire
    /// are FP8 already.
    pub fn quantizes(&self) -> bool {
        self.rules.iter().any(|r| r.quant.is_some())
    }

    /// Engine rank `rank`'s params, their pieces checked as a registration
    /// checks them. Global shapes come from `trainer`.
    pub fn rank_params(&self, rank: usize, trainer: &TrainerLayout) -> Result<Vec<ParamLayout>> {
        let mut out = Vec::new();
        let mut names = HashSet::new();
        let mut pieces = 0usize;
        for rule in self
            .rules
            .iter()
            .filter(|r| r.ranks.contains(&(rank as u64)))
        {
            let index = rank as u64 - rule.ranks.start;
            let layers = rule
                .layers
                .clone()
                .map_or(vec![None], |r| r.map(Some).collect());
            for layer in layers {
                // Bounded before the param's pieces are built.
                if pieces + rule.pieces_per_param() > MAX_PIECES {
                    return Err(bad(&rule.path, format!("more than {MAX_PIECES} pieces"))
                        .context(format!("engine rank {rank}")));
                }
                let p = rule
                    .param(layer, index, trainer)
                    .map_err(|e| e.context(format!("engine rank {rank}")))?;
                pieces += p.pieces.len();
                if !names.insert(p.name.clone()) {
                    return Err(
                        bad(&rule.path, format!("param '{}' is described twice", p.name))
                            .context(format!("engine rank {rank}")),
                    );
                }
                out.push(p);
            }
        }
        Ok(out)
    }
}

/// `"quant"`: "fp8_block128", "fp8_tensor", "mxfp8" or "none" (else
/// `default`).
fn quant_of(o: &Obj, default: Option<Scheme>) -> Result<Option<Scheme>> {
    match o.text("quant")? {
        None => Ok(default),
        Some("none") => Ok(None),
        Some("fp8_block128") => Ok(Some(Scheme::Fp8Block128)),
        Some("fp8_tensor") => Ok(Some(Scheme::Fp8Tensor)),
        Some("mxfp8") => Ok(Some(Scheme::Mxfp8)),
        Some(s) => Err(bad(
            &o.field("quant"),
            format!("'{s}' is not a scheme (fp8_block128, fp8_tensor, mxfp8 or none)"),
        )),
    }
}

impl ParamRule {
    fn read(
        p: &Obj,
        (default, quant): (Option<DType>, Option<Scheme>),
        ranks: u64,
    ) -> Result<ParamRule> {
        let ranks = match p.num("rank", ranks - 1)? {
            Some(r) if p.has("ranks") => {
                return Err(bad(
                    &p.field("rank"),
                    format!("{r}: give 'rank' or 'ranks', not both"),
                ))
            }
            Some(r) => r..r + 1,
            None => p.range("ranks", ranks)?.unwrap_or(0..ranks),
        };
        let experts = match (p.range("experts", MAX_EXPERTS)?, p.num("ep", MAX_RANKS)?) {
            (Some(e), ep) => {
                let ep = ep.unwrap_or(1);
                if ep == 0 || (e.end - e.start) % ep != 0 {
                    return Err(bad(
                        &p.field("ep"),
                        format!("{ep} must divide the {} experts", e.end - e.start),
                    ));
                }
                Some((e, ep))
            }
            (None, Some(_)) => return Err(bad(&p.field("ep"), "needs experts")),
            (None, None) => None,
        };
        let pieces = p
            .list("pieces")?
            .iter()
            .enumerate()
            .map(|(j, v)| PieceRule::read(&Obj::new(v, format!("{}.pieces[{j}]", p.path), PIECE)?))
            .collect::<Result<Vec<_>>>()?;
        if experts.is_some() && pieces.is_empty() {
            return Err(bad(&p.field("pieces"), "experts need pieces naming {E}"));
        }
        if experts.is_some() && p.has("shape") {
            return Err(bad(
                &p.field("shape"),
                "an expert param's shape follows from its pieces",
            ));
        }
        Ok(ParamRule {
            path: p.path.clone(),
            name: p.need_text("name")?.to_string(),
            dtype: p.dtype(default)?,
            layers: p.range("layers", MAX_LAYERS)?,
            ranks,
            shape: p.dims("shape")?,
            stack: p.num("stack", 7)?.unwrap_or(0) as usize,
            experts,
            pieces,
            quant: quant_of(p, quant)?,
        })
    }

    /// How many pieces one param of this rule has.
    fn pieces_per_param(&self) -> usize {
        let experts = self
            .experts
            .as_ref()
            .map_or(1, |(e, ep)| ((e.end - e.start) / ep) as usize);
        experts.saturating_mul(self.pieces.len().max(1))
    }

    /// The param of `layer` on the rank at `index` among the rule's ranks.
    fn param(
        &self,
        layer: Option<u64>,
        index: u64,
        trainer: &TrainerLayout,
    ) -> Result<ParamLayout> {
        let name = expand(&self.name, layer, None, &format!("{}.name", self.path))?;
        let (shape, pieces) = match &self.experts {
            None if self.pieces.is_empty() => {
                let shape = match (&self.shape, trainer.find(&name)) {
                    (Some(s), _) => s.clone(),
                    (None, Some(g)) => g.shape.clone(),
                    (None, None) => {
                        return Err(bad(
                            &format!("{}.shape", self.path),
                            format!("is missing and '{name}' is not a trainer tensor"),
                        ))
                    }
                };
                let p = ParamLayout::whole(&name, self.dtype, &shape);
                byte_size(&format!("param '{name}'"), self.dtype, &shape)
                    .map_err(|e| e.context(&self.path))?;
                return self.quantized(p);
            }
            None => self.block(layer, None, index, trainer)?,
            Some((experts, ep)) => self.experts(layer, experts, *ep, index, trainer)?,
        };
        byte_size(&format!("param '{name}'"), self.dtype, &shape)
            .and_then(|_| check_pieces(&name, &shape, &pieces))
            .map_err(|e| e.context(&self.path))?;
        self.quantized(ParamLayout {
            name,
            dtype: self.dtype,
            shape,
            pieces,
            whole: false,
            quant: Default::default(),
        })
    }

    /// `p` quantized as the rule says: F8_E4M3 holding its pieces with the
    /// scheme, when it has at least 2 dimensions (a 1-D norm of a quantized
    /// layout stays as it is, whatever the scheme), its pieces on the block
    /// grid.
    fn quantized(&self, mut p: ParamLayout) -> Result<ParamLayout> {
        let Some(scheme) = self.quant else {
            return Ok(p);
        };
        if p.shape.len() < 2 {
            return Ok(p);
        }
        check_weight(&p.name, &p.shape, &p.pieces, scheme).map_err(|e| e.context(&self.path))?;
        p.dtype = DType::F8E4m3;
        // The plan reads the scheme only; the scales are the engine's.
        p.quant = QuantRole::Weight {
            scheme,
            scales: usize::MAX,
        };
        Ok(p)
    }

    /// The rank's experts stacked along a new first dimension, each one a
    /// block of the rule's pieces.
    fn experts(
        &self,
        layer: Option<u64>,
        experts: &Range<u64>,
        ep: u64,
        index: u64,
        trainer: &TrainerLayout,
    ) -> Result<(Vec<u64>, Vec<Piece>)> {
        let per = (experts.end - experts.start) / ep;
        let first = experts.start + (index % ep) * per;
        let mut pieces = Vec::new();
        let mut block = Vec::new();
        for (i, e) in (first..first + per).enumerate() {
            let (shape, mut ps) = self.block(layer, Some(e), index, trainer)?;
            for p in ps.iter_mut() {
                p.at.insert(0, i as u64);
            }
            pieces.append(&mut ps);
            block = shape;
        }
        block.insert(0, per);
        Ok((block, pieces))
    }

    /// The pieces of one param (or one expert's block of it): each piece's
    /// box, placed at its `at` or stacked after the previous along `stack`.
    fn block(
        &self,
        layer: Option<u64>,
        expert: Option<u64>,
        index: u64,
        trainer: &TrainerLayout,
    ) -> Result<(Vec<u64>, Vec<Piece>)> {
        let mut pieces = Vec::with_capacity(self.pieces.len());
        let mut shape: Option<Vec<u64>> = self.shape.clone();
        let mut cursor = 0u64;
        for rule in &self.pieces {
            let (tensor, global) = rule.region(layer, expert, index, trainer)?;
            let at = match &rule.at {
                Some(at) => at.clone(),
                None => {
                    let at = stacked(&global, self.stack, cursor, &rule.path)?;
                    // Checked: a wrapped cursor described a wrong shape.
                    cursor = cursor.checked_add(global.len[self.stack]).ok_or_else(|| {
                        bad(
                            &rule.path,
                            format!(
                                "box {global} stacked after the pieces before it ends past \
                                 2^64 along dimension {}",
                                self.stack
                            ),
                        )
                    })?;
                    if self.shape.is_none() {
                        shape = Some(grow(shape.take(), &global, self.stack, cursor, &rule.path)?);
                    }
                    at
                }
            };
            pieces.push(Piece { tensor, global, at });
        }
        let shape = shape.ok_or_else(|| {
            bad(
                &format!("{}.shape", self.path),
                "is needed when every piece gives 'at'",
            )
        })?;
        Ok((shape, pieces))
    }
}

/// The block's shape once `global` is stacked on `shape`, ending at
/// `cursor` along `dim`; the other dimensions must agree.
fn grow(
    shape: Option<Vec<u64>>,
    global: &TensorBox,
    dim: usize,
    cursor: u64,
    path: &str,
) -> Result<Vec<u64>> {
    let mut grown = global.len.clone();
    grown[dim] = cursor;
    match shape {
        Some(s) if !stacks_on(&s, &grown, dim) => Err(bad(
            path,
            format!("box {global} does not stack along dimension {dim} on the pieces before it"),
        )),
        _ => Ok(grown),
    }
}

/// `grown` differs from `shape` only along `dim`.
fn stacks_on(shape: &[u64], grown: &[u64], dim: usize) -> bool {
    shape.len() == grown.len() && (0..shape.len()).all(|d| d == dim || shape[d] == grown[d])
}

/// The place of a box stacked at `cursor` along `dim`.
fn stacked(global: &TensorBox, dim: usize, cursor: u64, path: &str) -> Result<Vec<u64>> {
    if dim >= global.ndim() {
        return Err(bad(
            path,
            format!("cannot stack along dimension {dim} of box {global}"),
        ));
    }
    let mut at = vec![0; global.ndim()];
    at[dim] = cursor;
    Ok(at)
}

impl PieceRule {
    fn read(p: &Obj) -> Result<PieceRule> {
        let boxed = match (p.dims("offsets")?, p.dims("shape")?) {
            (Some(offset), Some(len)) if offset.len() == len.len() => {
                Some(TensorBox { offset, len })
            }
            (None, None) => None,
            _ => {
                return Err(bad(
                    &p.path,
                    "an explicit box needs 'offsets' and 'shape' of one length",
                ))
            }
        };
        let split = match (p.num("split", 7)?, p.num("tp", MAX_RANKS)?) {
            (Some(_), _) if boxed.is_some() => {
                return Err(bad(
                    &p.field("split"),
                    "a piece is an explicit box or a split, not both",
                ))
            }
            (Some(d), Some(tp)) if tp > 0 => Some((d as usize, tp)),
            (Some(_), _) => return Err(bad(&p.field("tp"), "a split needs tp (1 or more)")),
            (None, Some(_)) => return Err(bad(&p.field("split"), "tp needs a split dimension")),
            (None, None) => None,
        };
        Ok(PieceRule {
            path: p.path.clone(),
            tensor: p.need_text("tensor")?.to_string(),
            boxed,
            split,
            at: p.dims("at")?,
        })
    }

    /// The global tensor's name and the box this piece holds of it.
    fn region(
        &self,
        layer: Option<u64>,
        expert: Option<u64>,
        index: u64,
        trainer: &TrainerLayout,
    ) -> Result<(String, TensorBox)> {
        let tensor = expand(
            &self.tensor,
            layer,
            expert,
            &format!("{}.tensor", self.path),
        )?;
        if let Some(b) = &self.boxed {
            return Ok((tensor, b.clone()));
        }
        let g = trainer.find(&tensor).ok_or_else(|| {
            bad(
                &format!("{}.tensor", self.path),
                format!("'{tensor}' is not a trainer tensor (its shape is needed)"),
            )
        })?;
        let mut b = TensorBox::whole(&g.shape);
        if let Some((d, tp)) = self.split {
            let n = *g.shape.get(d).ok_or_else(|| {
                bad(
                    &format!("{}.split", self.path),
                    format!("'{tensor}' has no dimension {d}"),
                )
            })?;
            if n % tp != 0 {
                return Err(bad(
                    &format!("{}.split", self.path),
                    format!("dimension {d} of '{tensor}' ({n}) does not divide by tp {tp}"),
                ));
            }
            (b.offset[d], b.len[d]) = ((index % tp) * (n / tp), n / tp);
        }
        Ok((tensor, b))
    }
}
