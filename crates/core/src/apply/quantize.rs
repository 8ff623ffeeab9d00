//! Quantized params at the end of an update.
//!
//! Quantized here (a snapshot), their bytes arrive as their global tensors
//! hold them (bf16, f16 or f32: the plan lays the runs out in that dtype)
//! into the atomic arena, or in place into a buffer of the manager's; they
//! were verified against the sources' checksums as they arrived. Before
//! anything is committed, every block's amax is found, so that a NaN or an
//! infinity fails the update naming the tensor and the element while the
//! params keep their old bytes (atomic; in place the other params are
//! written by then, as with any late failure). Then, with the rest of the
//! commit, the FP8 bytes and the scales are written into the two params
//! together.
//!
//! Quantized by the publishers (`on_wire`), their FP8 bytes arrive like
//! any param's; each block's amax is agreed before any byte moves: every
//! publisher reports the amax of the blocks its requests touch
//! ([`Applier::offer_amax`]), the largest is the block's
//! ([`Applier::agreed_amax`] answers each publisher), and the scales
//! written at the commit are made from the agreed amax
//! ([`crate::quant::Scheme::write_scales`]).
//!
//! Quantized here in place from a snapshot that is not verified, a whole
//! param's tensor is not copied at all: the file's mapping of it is its
//! `wide` bytes ([`Applier::quantize_from_file`]), read once for the amax
//! and once to cast (the page cache read twice, one byte written per
//! element). The copy into a buffer first was a third pass over memory
//! (measured on the 2-core machine: 0.37 of the bf16 snapshot's speed
//! with it, 0.50-0.54 without, each band's amax found again as it is
//! cast: the file may be written meanwhile). Quantizing each band as its
//! amax is found would read once, but would write FP8 bytes before a NaN
//! in a later band is seen. Verified updates keep the copy: they hash
//! what lands, where it lands.

use super::arena::Arena;
use super::types::Chunk;
use super::Applier;
use crate::memory::copy::CopySource;
use crate::memory::mapped_file::MappedWindow;
use crate::memory::SendPtr;
use crate::pieces::Piece;
use crate::plan::Target;
use crate::quant::bands::{self, Wide};
use crate::quant::{QuantError, Scheme};
use crate::result::{Error, Result};
use crate::tensor::DType;

/// A quantized param an update writes.
#[derive(Clone, Debug)]
pub struct QuantTarget {
    pub param: usize,
    pub name: String,
    pub scheme: Scheme,
    pub shape: Vec<u64>,
    /// To name the global tensor of an element in errors.
    pub pieces: Vec<Piece>,
    /// The FP8 param's memory (one byte per element).
    pub fp8: SendPtr,
    /// The scales param's memory, and how many scales (of the scheme's
    /// scale dtype) it holds.
    pub scales: (SendPtr, usize),
    /// Quantized here, in place: where its bytes land (the destination
    /// of its entries). Atomic, or quantized by the publishers: None.
    pub wide: Option<SendPtr>,
    /// The publishers quantize it.
    pub on_wire: bool,
    /// The GPU holding both params (their pointers are device addresses);
    /// None: host memory.
    pub device: Option<i32>,
}

/// How a source that handed a file's mapping checks, after it was read,
/// that the file did not change since the plan was made.
pub type FileCheck = Box<dyn Fn() -> Result<()> + Send>;

/// The quantized params of an update, and their amax once found.
#[derive(Default)]
pub(super) struct Quantizing {
    pub targets: Vec<QuantTarget>,
    amax: Option<Vec<Vec<f32>>>,
    /// Quantized by the publishers: per target, each block's agreed amax
    /// so far, and whether any publisher reported it.
    pub(super) agreed: Vec<(Vec<f32>, Vec<bool>)>,
    /// Quantized from a snapshot's mapping: (target, the mapping, the
    /// file as errors name it, the check that it did not change).
    from_file: Vec<(usize, MappedWindow, String, FileCheck)>,
}

impl Applier<'_, '_> {
    /// The bytes the params took: the plan's runs, except that a quantized
    /// param took its FP8 bytes and its scales, whatever its runs carried
    /// (a snapshot's bf16, a publisher's FP8 without the scales).
    pub(super) fn params_took(&self) -> u64 {
        let targets = &self.quant.targets;
        if targets.is_empty() {
            return self.plan.bytes;
        }
        let quantized = |e: &crate::plan::PlanEntry| match e.target {
            Target::Param(i) => targets.binary_search_by_key(&i, |t| t.param).is_ok(),
            _ => false,
        };
        let runs: u64 = (self.plan.entries.iter())
            .filter(|e| e.target != Target::Skip && quantized(e))
            .map(|e| e.bytes)
            .sum();
        let held: u64 = (targets.iter())
            .map(|t| {
                let fp8: u64 = t.shape.iter().product();
                fp8 + (t.scales.1 * t.scheme.scale_dtype().size()) as u64
            })
            .sum();
        (self.plan.bytes - runs.min(self.plan.bytes)) + held
    }

    /// The params this update quantizes (see [`QuantTarget`]); those the
    /// plan does not fill (the per-tensor callback's updates) are left.
    pub fn with_quantized(mut self, targets: Vec<QuantTarget>) -> Self {
        let plan = self.plan;
        self.quant.targets = targets
            .into_iter()
            .filter(|t| plan.quantized(t.param).is_some())
            .collect();
        self.quant.agreed = (self.quant.targets.iter())
            .map(|t| match t.on_wire {
                true => (vec![0.0; t.scales.1], vec![false; t.scales.1]),
                false => Default::default(),
            })
            .collect();
        self
    }

    /// The quantized target plan entry `e` fills, when a snapshot may hand
    /// its bytes as a mapping of the file ([`Applier::quantize_from_file`]):
    /// quantized here, in place, into host memory, unverified, and the
    /// entry is the param's whole tensor in one run.
    pub(crate) fn quantizes_from_file(&self, e: usize) -> bool {
        self.file_target(e).is_some()
    }

    fn file_target(&self, e: usize) -> Option<usize> {
        let Target::Param(i) = self.plan.entries[e].target else {
            return None;
        };
        let k = (self.quant.targets)
            .binary_search_by_key(&i, |t| t.param)
            .ok()?;
        let t = &self.quant.targets[k];
        let dtype = self.plan.quantized_from(i)?;
        let bytes = t.shape.iter().product::<u64>() * dtype.size() as u64;
        let fits = !t.on_wire && t.device.is_none() && t.wide.is_some();
        let whole = self.plan.moves_whole(e) && self.plan.entries[e].bytes == bytes;
        (fits && whole && self.landing.in_place() && !self.verifier.on).then_some(k)
    }

    /// Plan entry `e` (see [`Applier::quantizes_from_file`]) is all of
    /// `window`, a mapping of `file`: its param is quantized from there at
    /// the end of the update, and the entry is accounted as received. The
    /// mapping lives until the applier ends. After each pass over it, a
    /// read that faulted (the file shrank) or `unchanged` failing (the
    /// file was rewritten since the plan: its bytes may be another
    /// version's) fails the update.
    pub(crate) fn quantize_from_file(
        &mut self,
        file: &str,
        e: usize,
        window: MappedWindow,
        unchanged: FileCheck,
    ) -> Result<()> {
        let Some(k) = self.file_target(e) else {
            return Err(Error::invalid_argument(format!(
                "tensor '{}' is not quantized from a file here",
                self.plan.entries[e].meta.name
            )));
        };
        let (at, len) = (window.bytes().as_ptr() as *mut u8, window.bytes().len());
        if len as u64 != self.plan.entries[e].bytes {
            return Err(Error::invalid_argument(format!(
                "{file}: tensor '{}': a mapping of {len} bytes for {}",
                self.plan.entries[e].meta.name, self.plan.entries[e].bytes
            )));
        }
        self.quant.targets[k].wide = Some(SendPtr(at));
        self.quant
            .from_file
            .push((k, window, file.to_string(), unchanged));
        let chunk = Chunk {
            tensor: e,
            offset: 0,
            len,
            src: CopySource::Memory(SendPtr(at)),
        };
        self.account_landed(file, &[chunk])
    }

    /// Target `k`'s mapping, when it has one, was read whole: Err when
    /// the read faulted (the file shrank) or the file changed.
    fn file_read(&self, k: usize) -> Result<()> {
        let Some((_, w, file, unchanged)) = self.quant.from_file.iter().find(|f| f.0 == k) else {
            return Ok(());
        };
        if w.faulted() {
            return Err(Error::format(format!(
                "{file} was truncated while it was read (a mapped read ran past its end; \
                 was it truncated or replaced after the plan was made?)"
            )));
        }
        unchanged()
    }

    /// The bytes target `k` received, in its source's dtype.
    fn wide(&self, k: usize, arena: Option<&Arena>) -> Wide<'_> {
        let t = &self.quant.targets[k];
        let dtype = self.plan.quantized_from(t.param).unwrap_or(DType::Bf16);
        let elements = t.shape.iter().product::<u64>() as usize;
        let at = match (arena, t.wide) {
            (Some(a), _) => a.param_shadow(t.param),
            (None, Some(p)) => p.0,
            (None, None) => unreachable!("an in-place quantized param lands in its buffer"),
        };
        // SAFETY: the plan covered every element of the param in `dtype`
        // (its runs end at `elements * size`), and every byte arrived
        // (checked before this runs); nothing writes it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(at, elements * dtype.size()) };
        Wide {
            dtype,
            shape: &t.shape,
            bytes,
        }
    }

    /// Find every quantized param's amax (once): Err names a non-finite
    /// element. Runs before anything is committed (a staged update: when
    /// it reports itself staged).
    pub(super) fn check_quantized(&mut self, arena: Option<&Arena>) -> Result<()> {
        if self.quant.amax.is_some() || self.quant.targets.is_empty() {
            return Ok(());
        }
        let mut all = Vec::with_capacity(self.quant.targets.len());
        for k in 0..self.quant.targets.len() {
            let t = &self.quant.targets[k];
            if t.on_wire {
                all.push(self.agreed_for(k)?);
                continue;
            }
            let found = bands::amax(t.scheme, self.wide(k, arena), self.opts.threads);
            // Zeros read from a shrunk file are not the tensor's amax.
            self.file_read(k)?;
            all.push(found.map_err(|e| quant_error(t, e))?);
        }
        self.quant.amax = Some(all);
        Ok(())
    }

    /// Write every quantized param's FP8 bytes and scales (after
    /// [`Applier::check_quantized`]).
    pub(super) fn write_quantized(&mut self, arena: Option<&Arena>) -> Result<()> {
        self.check_quantized(arena)?;
        let Some(amax) = self.quant.amax.take() else {
            return Ok(());
        };
        self.landing.writes_params();
        for (k, a) in amax.iter().enumerate() {
            let t = &self.quant.targets[k];
            if let Some(ordinal) = t.device {
                self.write_on_device(k, ordinal, a, arena)?;
                continue;
            }
            let n = t.shape.iter().product::<u64>() as usize;
            let scale_bytes = t.scales.1 * t.scheme.scale_dtype().size();
            // SAFETY: the registry sized both params for this scheme and
            // shape (`quant::params::check_declaration`); they are the
            // engine's weights, written only by the update that holds them.
            let (fp8, scales) = unsafe {
                (
                    std::slice::from_raw_parts_mut(t.fp8.0, n),
                    std::slice::from_raw_parts_mut(t.scales.0 .0, scale_bytes),
                )
            };
            if scales.len() != a.len() * t.scheme.scale_dtype().size() {
                return Err(scales_mismatch(t, a.len()));
            }
            // Quantized by the publishers, the FP8 bytes came with the rest
            // of the commit; here, they are made from the bytes that came.
            if !t.on_wire {
                // Read from a file's mapping: each band's amax again as
                // it is cast (the file may be written meanwhile).
                let mapped = self.quant.from_file.iter().any(|f| f.0 == k);
                let wide = self.wide(k, arena);
                let wrote = bands::write(t.scheme, wide, a, fp8, (self.opts.threads, mapped));
                self.file_read(k)?;
                wrote.map_err(|e| quant_error(t, e))?;
            }
            t.scheme.write_scales(a, scales);
        }
        Ok(())
    }
}

impl Applier<'_, '_> {
    /// Target `k` on GPU `ordinal`: quantized by the kernels from the bytes
    /// that arrived (unless the publishers did), its scales uploaded.
    fn write_on_device(
        &self,
        k: usize,
        ordinal: i32,
        amax: &[f32],
        arena: Option<&Arena>,
    ) -> Result<()> {
        let t = &self.quant.targets[k];
        if !t.on_wire {
            let wide = self.wide(k, arena);
            crate::quant::device::write_from_host(ordinal, t.scheme, wide, amax, t.fp8.0 as u64)
                .map_err(|e| e.context(format!("param '{}'", t.name)))?;
        }
        if amax.len() != t.scales.1 {
            return Err(scales_mismatch(t, amax.len()));
        }
        let bytes = amax.len() * t.scheme.scale_dtype().size();
        let mut scales = vec![0u8; bytes];
        t.scheme.write_scales(amax, &mut scales);
        // SAFETY: the scales param is device memory of that GPU holding
        // `scales.1` scales of the scheme's dtype (its registration); a
        // synchronous copy.
        unsafe {
            crate::memory::cuda_ipc::upload(
                ordinal,
                t.scales.0 .0 as u64,
                scales.as_ptr().cast(),
                bytes,
            )
        }
        .map_err(|e| e.context(format!("param '{}': its scales", t.name)))
    }
}

/// Quantized param `t` has room for other than `blocks` scales.
fn scales_mismatch(t: &QuantTarget, blocks: usize) -> Error {
    Error::invalid_argument(format!(
        "param '{}': {} scales for {blocks} blocks",
        t.name, t.scales.1
    ))
}

/// `e` for quantized param `t`: a non-finite element named by its global
/// tensor and index there (and the param's).
fn quant_error(t: &QuantTarget, e: QuantError) -> Error {
    match e {
        QuantError::NonFinite { index, value } => {
            let at = unflatten(index as u64, &t.shape);
            let global = t.pieces.iter().find_map(|p| global_index(p, &t.shape, &at));
            Error::format(format!(
                "{} is {value} (param '{}' element {at:?}): FP8 quantization refuses NaN and \
                 infinity, so a diverged trainer's FP8 weights do not reach the engine",
                global.unwrap_or_else(|| format!("element {at:?}")),
                t.name
            ))
        }
        QuantError::Invalid(why) => Error::invalid_argument(format!("param '{}': {why}", t.name)),
        QuantError::Changed { row } => Error::format(format!(
            "param '{}': its source changed between finding its amax and casting it (from row \
             {row}): the snapshot file was written during the update",
            t.name
        )),
    }
}

/// "element [..] of tensor '..'" for element `at` of a `shape` param, when
/// piece `p` holds it.
fn global_index(p: &Piece, shape: &[u64], at: &[u64]) -> Option<String> {
    let a = p.aligned(shape);
    let nd = a.in_param.ndim();
    let mut idx = vec![0; nd - at.len()];
    idx.extend_from_slice(at);
    let (o, n) = (&a.in_param.offset, &a.in_param.len);
    if !(0..nd).all(|d| idx[d] >= o[d] && idx[d] < o[d] + n[d]) {
        return None;
    }
    let g: Vec<u64> = (0..nd)
        .map(|d| a.global.offset[d] + idx[d] - o[d])
        .collect();
    let g = &g[nd - p.global.ndim()..];
    Some(format!("element {g:?} of tensor '{}'", p.tensor))
}

fn unflatten(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut at = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        let n = shape[d].max(1);
        at[d] = flat % n;
        flat /= n;
    }
    at
}
