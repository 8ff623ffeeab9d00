//! The plan: a manifest checked against the registry before any byte moves.
//!
//! Every problem is found here, not halfway through a copy: unknown names,
//! dtype then shape mismatches (naming the param and both values), params the
//! source does not cover, duplicate names, missing checksums when
//! verification is asked for, and an empty source.
//!
//! What it says: per source tensor, its target (a param, the per-tensor
//! callback, or skipped), and the [`Run`]s, the byte ranges that move.

use crate::logging::Logger;
use crate::manifest::{Manifest, TensorMeta};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, shape_text};
use std::collections::HashSet;
use std::ops::Range;

/// Where one source tensor goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Copied into registered param `usize`.
    Param(usize),
    /// Handed to the engine's per-tensor callback.
    Callback,
    /// Not wanted (unknown name with `skip_unknown`); its bytes are not read.
    Skip,
}

#[derive(Clone, Debug)]
pub struct PlanEntry {
    pub meta: TensorMeta,
    pub target: Target,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PlanOptions {
    /// Unknown names are skipped with a warning instead of failing the plan.
    pub skip_unknown: bool,
    /// Every tensor goes to the per-tensor callback; registered params are
    /// then the engine's business and need not be covered.
    pub callback: bool,
    /// Checksums will be verified: every tensor must carry one.
    pub verify: bool,
}

/// The plan's unit: bytes `source` of source tensor `tensor` go to bytes
/// `param` of `target` (a param, or the per-tensor callback, whose view is
/// the tensor itself). Today every run is a whole tensor; a sharded transfer
/// would add ways to make runs (a slice of a tensor into a slice of a param)
/// without changing how the applier consumes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub tensor: usize,
    pub source: Range<u64>,
    pub target: Target,
    pub param: Range<u64>,
}

impl Run {
    /// The param byte that source byte `offset` (inside this run) goes to.
    pub fn param_offset(&self, offset: u64) -> u64 {
        self.param.start + (offset - self.source.start)
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// One entry per manifest tensor, in manifest order.
    pub entries: Vec<PlanEntry>,
    /// Every byte range that moves, ordered by tensor then source offset
    /// (Skip tensors have none).
    pub runs: Vec<Run>,
    /// Tensors and bytes that will move (Skip excluded).
    pub tensors: usize,
    pub bytes: u64,
}

impl Plan {
    /// The plan of `entries`, each moving tensor one whole-tensor run.
    pub fn new(entries: Vec<PlanEntry>) -> Plan {
        let runs: Vec<Run> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.target != Target::Skip)
            .map(|(tensor, e)| Run {
                tensor,
                source: 0..e.meta.nbytes,
                target: e.target,
                param: 0..e.meta.nbytes,
            })
            .collect();
        let tensors = runs.len();
        let bytes = entries
            .iter()
            .filter(|e| e.target != Target::Skip)
            .map(|e| e.meta.nbytes)
            .sum();
        Plan {
            entries,
            runs,
            tensors,
            bytes,
        }
    }

    /// The runs of source tensor `tensor`, in source order.
    pub fn runs_of(&self, tensor: usize) -> &[Run] {
        let from = self.runs.partition_point(|r| r.tensor < tensor);
        let to = self.runs.partition_point(|r| r.tensor <= tensor);
        &self.runs[from..to]
    }

    /// The run holding byte `offset` of source tensor `tensor` (for an empty
    /// tensor, its empty run), if any.
    pub fn run_at(&self, tensor: usize, offset: u64) -> Option<&Run> {
        let runs = self.runs_of(tensor);
        let i = runs.partition_point(|r| r.source.end <= offset);
        // Past the last run's end (an empty tensor's, or the byte after a
        // tensor's last one), the last run still holds the offset.
        let r = runs.get(i).or(runs.last())?;
        (r.source.start <= offset && offset <= r.source.end).then_some(r)
    }
}

/// At most this many problems are listed in one error message.
const MAX_LISTED: usize = 5;

fn fail(problems: Vec<String>, code: fn(String) -> Error) -> Result<()> {
    if problems.is_empty() {
        return Ok(());
    }
    let n = problems.len();
    let mut msg = problems
        .into_iter()
        .take(MAX_LISTED)
        .collect::<Vec<_>>()
        .join("; ");
    if n > MAX_LISTED {
        msg.push_str(&format!("; and {} more", n - MAX_LISTED));
    }
    Err(code(msg))
}

/// Check `manifest` against `registry` and say where every tensor goes.
pub fn make_plan(
    manifest: &Manifest,
    registry: &Registry,
    opts: PlanOptions,
    logger: &Logger,
) -> Result<Plan> {
    if manifest.tensors.is_empty() {
        return Err(Error::not_found(
            "the source holds no tensors (empty source)",
        ));
    }
    fail(format_problems(manifest), Error::format)?;
    let mut problems = Vec::new();
    let mut covered = vec![false; registry.len()];
    let mut entries = Vec::with_capacity(manifest.tensors.len());
    for t in &manifest.tensors {
        let target = target_of(t, registry, opts, logger, &mut covered, &mut problems);
        if opts.verify && target != Target::Skip && t.checksum.is_none() {
            problems.push(format!(
                "checksum verification was requested but tensor '{}' has no checksum \
                 (for snapshots, write them with `wm manifest <dir>`)",
                t.name
            ));
        }
        entries.push(PlanEntry {
            meta: t.clone(),
            target,
        });
    }
    if !opts.callback {
        uncovered_params(registry, &covered, &mut problems);
    }
    fail(problems, Error::mismatch)?;
    let plan = Plan::new(entries);
    if plan.tensors == 0 {
        return Err(Error::mismatch(
            "no tensor of the source matches a registered param",
        ));
    }
    Ok(plan)
}

/// Duplicate names, and byte sizes that do not match dtype and shape.
fn format_problems(manifest: &Manifest) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for t in &manifest.tensors {
        if !seen.insert(t.name.as_str()) {
            problems.push(format!(
                "tensor '{}' appears more than once in the source",
                t.name
            ));
        }
        match byte_size(&format!("tensor '{}'", t.name), t.dtype, &t.shape) {
            Ok(n) if n == t.nbytes => {}
            Ok(n) => problems.push(format!(
                "tensor '{}': {} bytes but {} {} needs {n}",
                t.name,
                t.nbytes,
                t.dtype,
                shape_text(&t.shape)
            )),
            Err(e) => problems.push(e.message),
        }
    }
    problems
}

/// Where tensor `t` goes; a param it names is marked `covered`, and a
/// dtype or shape that differs from the param's is a problem.
fn target_of(
    t: &TensorMeta,
    registry: &Registry,
    opts: PlanOptions,
    logger: &Logger,
    covered: &mut [bool],
    problems: &mut Vec<String>,
) -> Target {
    if opts.callback {
        return Target::Callback;
    }
    let Some(i) = registry.index_of(&t.name) else {
        if opts.skip_unknown {
            logger.warn(&format!(
                "skipping tensor '{}': not a registered param",
                t.name
            ));
        } else {
            problems.push(format!("tensor '{}' is not a registered param", t.name));
        }
        return Target::Skip;
    };
    let p = &registry.params()[i];
    covered[i] = true;
    if p.dtype != t.dtype {
        problems.push(format!(
            "param '{}': dtype mismatch: registered {}, source {}",
            t.name, p.dtype, t.dtype
        ));
    } else if p.shape != t.shape {
        problems.push(format!(
            "param '{}': shape mismatch: registered {}, source {}",
            t.name,
            shape_text(&p.shape),
            shape_text(&t.shape)
        ));
    }
    Target::Param(i)
}

fn uncovered_params(registry: &Registry, covered: &[bool], problems: &mut Vec<String>) {
    for (p, c) in registry.params().iter().zip(covered) {
        if !c {
            problems.push(format!(
                "param '{}' is registered but not in the source",
                p.name
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::ParamSpec;
    use crate::tensor::DType;

    fn meta(name: &str, dtype: DType, shape: &[u64]) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            nbytes: byte_size(name, dtype, shape).unwrap(),
            checksum: None,
            placement: None,
        }
    }

    fn registry() -> Registry {
        let mut r = Registry::default();
        r.allocate(&ParamSpec::host("a", DType::Bf16, &[2, 3]))
            .unwrap();
        r.allocate(&ParamSpec::host("b", DType::F32, &[4])).unwrap();
        r
    }

    fn plan(m: Vec<TensorMeta>, opts: PlanOptions) -> Result<Plan> {
        make_plan(
            &Manifest {
                tensors: m,
                version: None,
            },
            &registry(),
            opts,
            &Logger::default(),
        )
    }

    #[test]
    fn matching_manifest_plans() {
        let p = plan(
            vec![meta("b", DType::F32, &[4]), meta("a", DType::Bf16, &[2, 3])],
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(p.tensors, 2);
        assert_eq!(p.bytes, 28);
        assert_eq!(p.entries[0].target, Target::Param(1));
    }

    #[test]
    fn dtype_is_compared_before_shape() {
        let e = plan(
            vec![meta("a", DType::F16, &[9]), meta("b", DType::F32, &[4])],
            PlanOptions::default(),
        )
        .unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_MISMATCH);
        assert!(
            e.message
                .contains("param 'a': dtype mismatch: registered bf16, source f16"),
            "{e}"
        );
        let e = plan(
            vec![meta("a", DType::Bf16, &[3, 2]), meta("b", DType::F32, &[4])],
            PlanOptions::default(),
        )
        .unwrap_err();
        assert!(
            e.message
                .contains("shape mismatch: registered [2, 3], source [3, 2]"),
            "{e}"
        );
    }

    #[test]
    fn unknown_missing_duplicate_and_empty() {
        let e = plan(
            vec![meta("a", DType::Bf16, &[2, 3]), meta("zz", DType::U8, &[1])],
            PlanOptions::default(),
        )
        .unwrap_err();
        assert!(e.message.contains("tensor 'zz' is not a registered param"));
        assert!(e
            .message
            .contains("param 'b' is registered but not in the source"));
        let opts = PlanOptions {
            skip_unknown: true,
            ..Default::default()
        };
        let e = plan(
            vec![meta("a", DType::Bf16, &[2, 3]), meta("zz", DType::U8, &[1])],
            opts,
        )
        .unwrap_err();
        assert!(
            !e.message.contains("zz") && e.message.contains("'b'"),
            "{e}"
        );
        let e = plan(
            vec![
                meta("a", DType::Bf16, &[2, 3]),
                meta("a", DType::Bf16, &[2, 3]),
            ],
            PlanOptions::default(),
        )
        .unwrap_err();
        assert_eq!(e.code, crate::wm_result::WM_ERR_FORMAT);
        assert!(plan(vec![], PlanOptions::default())
            .unwrap_err()
            .message
            .contains("empty"));
    }

    #[test]
    fn callback_mode_needs_no_registration_and_verify_needs_checksums() {
        let opts = PlanOptions {
            callback: true,
            ..Default::default()
        };
        let p = plan(vec![meta("q", DType::F16, &[8])], opts).unwrap();
        assert_eq!(p.entries[0].target, Target::Callback);
        let opts = PlanOptions {
            callback: true,
            verify: true,
            ..Default::default()
        };
        let e = plan(vec![meta("q", DType::F16, &[8])], opts).unwrap_err();
        assert!(e.message.contains("'q' has no checksum"));
    }

    #[test]
    fn every_moving_tensor_is_one_whole_run() {
        let opts = PlanOptions {
            skip_unknown: true,
            ..Default::default()
        };
        let p = plan(
            vec![
                meta("zz", DType::U8, &[3]),
                meta("b", DType::F32, &[4]),
                meta("a", DType::Bf16, &[2, 3]),
            ],
            opts,
        )
        .unwrap();
        assert!(p.runs_of(0).is_empty(), "a skipped tensor has no run");
        assert_eq!(
            p.runs_of(1),
            [Run {
                tensor: 1,
                source: 0..16,
                target: Target::Param(1),
                param: 0..16
            }]
        );
        assert_eq!(p.run_at(2, 0).unwrap().target, Target::Param(0));
        assert_eq!(p.run_at(2, 12).unwrap().param_offset(5), 5);
        assert!(p.run_at(2, 13).is_none() && p.run_at(0, 0).is_none());
    }
}
