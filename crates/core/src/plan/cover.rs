//! Every piece of every param against the shards that hold its global
//! tensor: the piece must lie inside the tensor, share its dtype, and be
//! covered exactly once (shards do not overlap, so "at least once" by
//! volume is "exactly once"); each common box becomes runs.

use super::clock::Clock;
use super::global::{Global, Globals, Held};
use super::params::ParamView;
use super::region::{Lined, Span};
use super::runs::push_runs;
use super::QuantizedParam;
use super::{Run, Target};
use crate::pieces::Piece;
use crate::quant::params::QuantRole;
use crate::quant::Scheme;
use crate::tensor::shape_text;
use crate::tensor::DType;
use crate::tensor_box::TensorBox;

/// A run found: `Run::entry` is the number of its shard
/// ([`Globals::shard_number`]) until entries are made, `Run::target` its
/// param.
pub(super) type FoundRun = Run;

/// The runs found so far, at most `limit` of them: every (piece, shard)
/// pair sharing a box is a run before runs are joined, so the sources'
/// geometry against the params' pieces (32,768 one-column pieces over 512
/// one-row shards: 16.7 M runs, 1.4 GB) decides how many unless bounded
/// by something the engine controls (its params' bytes, `max_blocks`).
pub(super) struct Found {
    pub runs: Vec<FoundRun>,
    pub limit: usize,
    /// The param whose pieces went over `limit` (nothing more is found).
    pub over: Option<usize>,
    /// Quantized params covered.
    pub quantized: Vec<QuantizedParam>,
    /// The sources quantize (publishers): runs into quantized params
    /// count elements (`QuantizedParam::on_wire`).
    pub on_wire: bool,
}

impl Found {
    fn push(&mut self, run: FoundRun, param: usize) {
        match self.runs.len() < self.limit {
            true => self.runs.push(run),
            false => self.over = self.over.or(Some(param)),
        }
    }
}

/// Cover param `index`'s pieces; `used` marks the global tensors named
/// (indexed like `globals.tensors`). Messages are only formatted for
/// problems: planning a large layout allocates nothing per piece.
pub(super) fn cover_param(
    index: usize,
    param: ParamView,
    globals: &Globals,
    spread: usize,
    used: &mut [bool],
    (out, problems, clock): (&mut Found, &mut Vec<String>, &mut Clock),
) {
    let scheme = match param.quant {
        // Written by quantizing its weight: no source holds it.
        QuantRole::Scales { .. } => return,
        QuantRole::Weight { scheme, .. } => Some(scheme),
        QuantRole::Plain => None,
    };
    if param.pieces.is_empty() {
        problems.push(format!("param '{}' has no pieces", param.name));
    }
    let implicit = param.whole;
    let mut wide = None;
    for (k, piece) in param.pieces.iter().enumerate() {
        if !clock.tick() || out.over.is_some() {
            return;
        }
        let what = || match implicit {
            true => format!("param '{}'", param.name),
            false => format!(
                "param '{}': piece {k} ('{}' {})",
                param.name, piece.tensor, piece.global
            ),
        };
        let Some(g) = globals.find(&piece.tensor) else {
            problems.push(match implicit {
                true => format!("param '{}' is registered but not in the source", param.name),
                false => format!(
                    "{}: global tensor '{}' is in no source",
                    what(),
                    piece.tensor
                ),
            });
            continue;
        };
        used[g] = true;
        let g = globals.get(g);
        if let Some(p) = piece_problem(&param, (piece, g), scheme, &mut wide) {
            problems.push(format!("{}: {p}", what()));
            continue;
        }
        // A quantized param's bytes arrive as its global tensors hold
        // them, or quantized by the sources: one byte per element.
        let esize = match (scheme, out.on_wire) {
            (Some(_), true) => 1,
            _ => g.dtype.size() as u64,
        };
        let target = (index, esize, spread + k);
        if let Err(p) = cover_piece(piece, param.shape, (globals, g), target, out) {
            problems.push(format!("{}: {p}", what()));
        }
    }
    if let (Some(_), Some(dtype)) = (scheme, wide) {
        out.quantized.push(QuantizedParam {
            param: index,
            source: dtype,
            on_wire: out.on_wire,
        });
    }
}

/// What keeps `piece` of `param` from global tensor `g`: a dtype that does
/// not match (or, quantized with `scheme`, one FP8 is not made from), or a
/// box outside the tensor (a param registered without pieces is all of its
/// tensor: a longer tensor is a mismatch, not a tensor it holds the start
/// of). `wide`: the dtype of the param's first piece.
fn piece_problem(
    param: &ParamView,
    (piece, g): (&Piece, Global),
    scheme: Option<Scheme>,
    wide: &mut Option<DType>,
) -> Option<String> {
    let dtype = match scheme {
        None => (g.dtype != param.dtype).then(|| {
            format!(
                "dtype mismatch: registered {}, source {}",
                param.dtype, g.dtype
            )
        }),
        Some(scheme) => quantized_problem(scheme, piece, g, *wide.get_or_insert(g.dtype)),
    };
    if dtype.is_some() {
        return dtype;
    }
    if param.whole && g.shape != param.shape {
        return Some(format!(
            "shape mismatch: registered {}, source {}",
            shape_text(param.shape),
            shape_text(g.shape)
        ));
    }
    (!piece.global.inside(g.shape)).then(|| match param.whole {
        true => format!(
            "shape mismatch: registered {}, source {}",
            shape_text(param.shape),
            shape_text(g.shape)
        ),
        false => format!("outside the global tensor's shape {}", shape_text(g.shape)),
    })
}

/// What keeps `piece` of a param quantized with `scheme` from global
/// tensor `g`: a dtype FP8 is not made from, one other than the param's
/// other pieces' (`wide`: the bytes of one param arrive in one dtype), or a
/// partial block that is not at the tensor's edge (registration checked
/// the param's side, `quant::params`).
fn quantized_problem(scheme: Scheme, piece: &Piece, g: Global, wide: DType) -> Option<String> {
    if !matches!(g.dtype, DType::Bf16 | DType::F16 | DType::F32) {
        return Some(format!(
            "{} quantization takes bf16, f16 or f32 tensors, not {}",
            scheme.name(),
            g.dtype
        ));
    }
    if g.dtype != wide {
        return Some(format!(
            "its global tensor is {}, another piece's is {wide}: a quantized param's pieces share one dtype",
            g.dtype
        ));
    }
    let b = &piece.global;
    if scheme == Scheme::Fp8Tensor && (b.offset.iter().any(|&o| o != 0) || b.len != g.shape) {
        return Some(format!(
            "one scale per tensor needs all of the global tensor {}",
            shape_text(g.shape)
        ));
    }
    let (what, dims, edge) = match scheme {
        Scheme::Fp8Block128 => ("a 128x128 block", 2, 128),
        Scheme::Mxfp8 => ("an MXFP8 block of 32", 1, 32),
        Scheme::Fp8Tensor => return None,
    };
    let n = b.ndim().min(g.shape.len());
    for d in n.saturating_sub(dims)..n {
        let end = b.offset[d] + b.len[d];
        if !b.len[d].is_multiple_of(edge) && end != g.shape[d] {
            return Some(format!(
                "dimension {d} ends at offset {end} of the global tensor {}, inside {what}",
                shape_text(g.shape)
            ));
        }
    }
    None
}

/// The runs of one piece; Err names the part no source holds.
fn cover_piece(
    piece: &Piece,
    param_shape: &[u64],
    (globals, g): (&Globals, Global),
    (index, esize, spread): (usize, u64, usize),
    out: &mut Found,
) -> std::result::Result<(), String> {
    let lined = Lined::new(piece, param_shape);
    let extra = lined.ndim() - g.shape.len();
    let want = Span::of_box(&piece.global);
    let candidates = g.candidates(want);
    let mut covered = 0u64;
    for h in candidates {
        let Some(common) = want.intersect(g.region(h)) else {
            continue;
        };
        covered += common.volume().unwrap_or(0);
        let shard = globals.shard_number(g.replica(h, spread));
        // Padded when the piece has more dimensions than its tensor (an
        // expert stacked into a param).
        push_runs(
            &common.span().padded(extra),
            &g.region(h).padded(extra),
            &lined,
            esize,
            Target::Param(index),
            |r| out.push(Run { entry: shard, ..r }, index),
        );
    }
    if out.over.is_some() {
        return Ok(());
    }
    let need = piece.global.volume().unwrap_or(0);
    if covered == need {
        return Ok(());
    }
    Err(match uncovered(&piece.global, g, candidates) {
        Some(b) => format!("{b} of '{}' is held by no source", piece.tensor),
        None => format!("sources hold {covered} of its {need} elements"),
    })
}

/// A box of `piece` that no candidate holds, found on the grid of every
/// box's edges (bounded work: None when the grid, times the candidates
/// each cell is compared with, is too large to walk).
fn uncovered(piece: &TensorBox, g: Global, candidates: &[Held]) -> Option<TensorBox> {
    let ndim = piece.ndim();
    let cuts: Vec<Vec<u64>> = (0..ndim)
        .map(|d| {
            let (lo, hi) = (piece.offset[d], piece.offset[d] + piece.len[d]);
            let mut c = vec![lo, hi];
            for h in candidates {
                let r = g.region(h);
                let (s, e) = (r.offset[d], r.offset[d] + r.len[d]);
                c.extend([s, e].into_iter().filter(|&x| x > lo && x < hi));
            }
            c.sort_unstable();
            c.dedup();
            c
        })
        .collect();
    let cells = cuts
        .iter()
        .try_fold(1usize, |n, c| n.checked_mul(c.len() - 1));
    let work = cells.and_then(|c| c.checked_mul(candidates.len().max(1)));
    let cells = cells.filter(|_| work.is_some_and(|w| w <= 4_000_000))?;
    let mut idx = vec![0usize; ndim];
    for _ in 0..cells {
        let cell = TensorBox {
            offset: (0..ndim).map(|d| cuts[d][idx[d]]).collect(),
            len: (0..ndim)
                .map(|d| cuts[d][idx[d] + 1] - cuts[d][idx[d]])
                .collect(),
        };
        if !candidates
            .iter()
            .any(|h| Span::of_box(&cell).intersect(g.region(h)).is_some())
        {
            return Some(cell);
        }
        for d in (0..ndim).rev() {
            idx[d] += 1;
            if idx[d] + 1 < cuts[d].len() {
                break;
            }
            idx[d] = 0;
        }
    }
    None
}
