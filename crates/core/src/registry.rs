//! The engine's params by name: dtype, shape and where their bytes live.
//!
//! A param is either engine-owned (the engine's pointer; the library writes
//! into it and never frees it) or library-owned (a [`HostRegion`] whose pages
//! `wm_clear` releases at a stable address).

use crate::memory::device::DeviceRegion;
use crate::memory::host::HostRegion;
use crate::memory::SendPtr;
use crate::pieces::{check_pieces, Piece};
use crate::quant::params::{check_declaration, Declared, QuantRole};
use crate::quant::Scheme;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, check_name, shape_text, DType};
use std::collections::{BTreeMap, HashMap};

/// Where a param's memory is. Numbers are part of the ABI.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// CPU memory.
    Host = 0,
    /// CUDA device memory (served by the CUDA backend).
    Device = 1,
}

impl MemoryKind {
    pub fn from_raw(raw: u32) -> Option<MemoryKind> {
        match raw {
            0 => Some(MemoryKind::Host),
            1 => Some(MemoryKind::Device),
            _ => None,
        }
    }
}

/// What the engine says about a param when it registers it.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub memory: MemoryKind,
    pub device_ordinal: i32,
    /// What the param holds of which global tensors; empty: all of the
    /// global tensor named like the param (of the param's shape).
    pub pieces: Vec<Piece>,
}

impl ParamSpec {
    /// Error `e` of param `k` of the `n` registered together
    /// ([`Manager::register_all`](crate::manager::Manager::register_all)):
    /// named by its place when there are several, and saying that none was
    /// registered.
    pub fn refused_among(e: Error, k: usize, n: usize) -> Error {
        e.among((k, n), ("param", "registered"))
    }

    pub fn host(name: &str, dtype: DType, shape: &[u64]) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            memory: MemoryKind::Host,
            device_ordinal: -1,
            pieces: Vec::new(),
        }
    }
}

#[derive(Debug)]
pub enum ParamMemory {
    /// The engine's memory; `ptr` may change when an acquire callback hands
    /// back new memory after a clear.
    Engine { ptr: SendPtr },
    /// The library's memory, at a fixed address for the param's life.
    Library(HostRegion),
    /// The library's device memory (CUDA VMM), at a fixed device address
    /// for the param's life.
    LibraryDevice(DeviceRegion),
}

#[derive(Debug)]
pub struct Param {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: usize,
    pub memory: ParamMemory,
    /// GPU ordinal of an engine-owned device param (its pointer is then a
    /// device address); None for host memory.
    pub device: Option<i32>,
    /// False after a clear, until the next update brings memory back.
    pub resident: bool,
    /// What it holds of which global tensors (at least one piece; a param
    /// registered without pieces holds all of the tensor of its name).
    pub pieces: Vec<Piece>,
    /// Registered without pieces. Not inferred from `pieces`: TP rank 0's
    /// first slice of a tensor named like the param looks the same.
    pub whole: bool,
    /// Quantized (or the scales of a quantized param): [`Registry::quantize`].
    pub quant: QuantRole,
}

impl Param {
    /// True when the param was registered without pieces: the whole global
    /// tensor of its own name (the layout every update had before pieces).
    pub fn is_whole_tensor(&self) -> bool {
        self.whole
    }
}

impl Param {
    pub fn ptr(&self) -> *mut u8 {
        match &self.memory {
            ParamMemory::Engine { ptr } => ptr.0,
            ParamMemory::Library(r) => r.ptr(),
            ParamMemory::LibraryDevice(r) => r.ptr() as *mut u8,
        }
    }

    /// Where the applier writes this param.
    pub fn dest(&self) -> Dest {
        match self.device {
            Some(ordinal) => Dest::Device {
                ptr: self.ptr() as u64,
                ordinal,
            },
            None => Dest::Host(SendPtr(self.ptr())),
        }
    }
}

/// Where a param's bytes go (what the applier writes; it lives here, below
/// the applier and the plan, so that both can name it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// Host memory: written by the parallel copier.
    Host(SendPtr),
    /// CUDA device memory of GPU `ordinal`: bytes land in host memory first
    /// (the atomic arena; in place, a pinned buffer of the tensor's own, or
    /// ordinary memory, as `memory::staging::lands_in_own_pinned_buffer`
    /// decides) and go up with an asynchronous copy once the tensor is whole
    /// and verified (atomic: at commit); the applier waits for the copies
    /// before it reports the update done. With gdr (in place) a source
    /// writes the bytes straight into the param instead.
    Device { ptr: u64, ordinal: i32 },
}

/// `len` bytes at `ptr` are device memory of GPU `ordinal`, in one
/// allocation (checked with the driver; no CUDA is `WM_ERR_UNSUPPORTED`).
/// `what` names the param in errors.
pub fn check_device_memory(ordinal: i32, ptr: *mut u8, len: usize, what: &str) -> Result<()> {
    crate::memory::cuda::cuda()
        .map_err(|e| e.context(what))?
        .check_device_range(ordinal, ptr as u64, len, what)
}

#[derive(Debug, Default)]
pub struct Registry {
    params: Vec<Param>,
    by_name: HashMap<String, usize>,
    /// Engine-owned memory as registered, by (device ordinal, -1 for host;
    /// start): (end, param index). Two params sharing bytes would take two
    /// tensors' bytes, the last written winning, after both verified (an
    /// atomic update's commit copies one after the other): refused at
    /// registration ([`Registry::check_disjoint`]), in O(log n). Where
    /// the memory was registered is enough: registration closes at the
    /// first update or clear, before an acquire callback can move any.
    engine_ranges: BTreeMap<(i32, usize), (usize, usize)>,
}

impl Registry {
    fn check_spec(&self, spec: &ParamSpec) -> Result<usize> {
        check_name("param", &spec.name)?;
        if self.by_name.contains_key(&spec.name) {
            return Err(Error::invalid_argument(format!(
                "param '{}' is already registered",
                spec.name
            )));
        }
        let n = byte_size(&format!("param '{}'", spec.name), spec.dtype, &spec.shape)?;
        if !spec.pieces.is_empty() {
            check_pieces(&spec.name, &spec.shape, &spec.pieces)?;
        }
        Ok(n as usize)
    }

    fn push(&mut self, spec: &ParamSpec, nbytes: usize, memory: ParamMemory) {
        let device = (spec.memory == MemoryKind::Device).then_some(spec.device_ordinal);
        self.by_name.insert(spec.name.clone(), self.params.len());
        self.params.push(Param {
            name: spec.name.clone(),
            dtype: spec.dtype,
            shape: spec.shape.clone(),
            nbytes,
            memory,
            device,
            resident: true,
            whole: spec.pieces.is_empty(),
            pieces: if spec.pieces.is_empty() {
                vec![Piece::whole(&spec.name, &spec.shape)]
            } else {
                spec.pieces.clone()
            },
            quant: QuantRole::Plain,
        });
    }

    /// Declare that registered param `weight` (F8_E4M3) holds its pieces
    /// quantized with `scheme`, its scale_inv in registered param `scales`
    /// (F32, the scheme's scales shape, no pieces): checked by
    /// [`check_declaration`], nothing changed on error.
    pub fn quantize(&mut self, weight: &str, scales: &str, scheme: Scheme) -> Result<()> {
        let find = |name: &str| {
            self.index_of(name).ok_or_else(|| {
                Error::not_found(format!("param '{name}' is not registered (declare a quantized param after registering it and its scales)"))
            })
        };
        let (w, s) = (find(weight)?, find(scales)?);
        let declared = |i: usize| {
            let p = &self.params[i];
            Declared {
                name: &p.name,
                dtype: p.dtype,
                shape: &p.shape,
                pieces: &p.pieces,
                whole: p.whole,
                device: p.device,
                role: p.quant,
            }
        };
        check_declaration(&declared(w), &declared(s), scheme)?;
        self.params[w].quant = QuantRole::Weight { scheme, scales: s };
        self.params[s].quant = QuantRole::Scales { weight: w };
        Ok(())
    }

    /// Register engine-owned memory of `len` bytes at `ptr`: host memory, or
    /// for a device param a device address of GPU `spec.device_ordinal`
    /// (checked with the driver: device memory of that GPU, holding `len`
    /// bytes in one allocation; no CUDA is a clear `WM_ERR_UNSUPPORTED`).
    pub fn register_engine(&mut self, spec: &ParamSpec, ptr: *mut u8, len: usize) -> Result<()> {
        let nbytes = self.check_spec(spec)?;
        if len != nbytes {
            return Err(Error::invalid_argument(format!(
                "param '{}': buffer is {len} bytes but {} {} needs {nbytes}",
                spec.name,
                spec.dtype,
                shape_text(&spec.shape)
            )));
        }
        if ptr.is_null() && nbytes > 0 {
            return Err(Error::null_argument(format!(
                "param '{}': data pointer is NULL",
                spec.name
            )));
        }
        let device = match spec.memory {
            MemoryKind::Device => spec.device_ordinal,
            _ => -1,
        };
        let range = self.check_disjoint(&spec.name, device, ptr as usize, nbytes)?;
        if spec.memory == MemoryKind::Device {
            check_device_memory(
                spec.device_ordinal,
                ptr,
                nbytes,
                &format!("param '{}'", spec.name),
            )?;
        }
        if let Some((start, end)) = range {
            (self.engine_ranges).insert((device, start), (end, self.params.len()));
        }
        self.push(spec, nbytes, ParamMemory::Engine { ptr: SendPtr(ptr) });
        Ok(())
    }

    /// Take out the params registered from position `from` on (a batch
    /// registered together, refused part way: [`Manager::register_all`]),
    /// their names and their memory ranges; library-owned memory among them
    /// is freed. Registration is still open then: no plan refers to them.
    ///
    /// [`Manager::register_all`]: crate::manager::Manager::register_all
    pub fn truncate(&mut self, from: usize) {
        while self.params.len() > from {
            let p = self.params.pop().expect("longer than `from`");
            self.by_name.remove(&p.name);
        }
        self.engine_ranges.retain(|_, &mut (_, i)| i < from);
    }

    /// `len` bytes at `start` on `device` (-1: host) share no byte with an
    /// engine-owned param registered before; returns the range to record
    /// (none when empty). A param's memory holds one tensor's bytes.
    fn check_disjoint(
        &self,
        name: &str,
        device: i32,
        start: usize,
        len: usize,
    ) -> Result<Option<(usize, usize)>> {
        if len == 0 {
            return Ok(None);
        }
        let end = start.checked_add(len).ok_or_else(|| {
            Error::invalid_argument(format!(
                "param '{name}': {len} bytes at {start:#x} wrap around"
            ))
        })?;
        let before = self.engine_ranges.range(..=(device, start)).next_back();
        let after = self.engine_ranges.range((device, start)..).next();
        let hit = [before, after]
            .into_iter()
            .flatten()
            .find(|(&(d, s), &(e, _))| d == device && s < end && start < e);
        if let Some((&(_, s), &(e, i))) = hit {
            return Err(Error::invalid_argument(format!(
                "param '{name}': its memory ({len} bytes at {start:#x}) overlaps param '{}' \
                 ({} bytes at {s:#x}): an update would write one tensor over the other; \
                 register shared memory once (a tied weight under one name)",
                self.params[i].name,
                e - s
            )));
        }
        Ok(Some((start, end)))
    }

    /// Allocate library-owned host memory; returns its stable address and length.
    pub fn allocate(&mut self, spec: &ParamSpec) -> Result<(*mut u8, usize)> {
        let nbytes = self.check_spec(spec)?;
        let what = format!("param '{}'", spec.name);
        if spec.memory == MemoryKind::Device {
            let region = DeviceRegion::new(&what, spec.device_ordinal, nbytes)?;
            let ptr = region.ptr() as *mut u8;
            self.push(spec, nbytes, ParamMemory::LibraryDevice(region));
            return Ok((ptr, nbytes));
        }
        let region = HostRegion::new(&what, nbytes)?;
        let ptr = region.ptr();
        self.push(spec, nbytes, ParamMemory::Library(region));
        Ok((ptr, nbytes))
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn params(&self) -> &[Param] {
        &self.params
    }

    pub fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    pub fn total_bytes(&self) -> u64 {
        self.params.iter().map(|p| p.nbytes as u64).sum()
    }

    pub fn resident_bytes(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.resident)
            .map(|p| p.nbytes as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_sharing_memory_are_refused_naming_both() {
        let mut r = Registry::default();
        let mut buf = vec![0u8; 64];
        let base = buf.as_mut_ptr();
        let at = |o: usize| base.wrapping_add(o);
        let f32s = |name: &str, n: u64| ParamSpec::host(name, DType::F32, &[n]);
        r.register_engine(&f32s("a", 4), at(16), 16).unwrap();
        // Either side touching, none sharing a byte: fine.
        r.register_engine(&f32s("before", 4), at(0), 16).unwrap();
        r.register_engine(&f32s("after", 4), at(32), 16).unwrap();
        for (name, off, n) in [
            ("same", 16, 4u64),
            ("inside", 20, 1),
            ("across", 28, 2),
            ("over", 8, 8),
        ] {
            let e = r
                .register_engine(&f32s(name, n), at(off), 4 * n as usize)
                .unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_INVALID_ARGUMENT);
            assert!(e.message.contains(&format!("param '{name}'")), "{e}");
            assert!(e.message.contains("overlaps param '"), "{e}");
        }
        assert_eq!(r.len(), 3);
        // Empty params hold no bytes.
        r.register_engine(&f32s("empty", 0), at(20), 0).unwrap();
    }

    #[test]
    fn registration_rules() {
        let mut r = Registry::default();
        let mut buf = vec![0u8; 16];
        r.register_engine(
            &ParamSpec::host("a", DType::F32, &[4]),
            buf.as_mut_ptr(),
            16,
        )
        .unwrap();
        let e = r
            .register_engine(
                &ParamSpec::host("a", DType::F32, &[4]),
                buf.as_mut_ptr(),
                16,
            )
            .unwrap_err();
        assert!(e.message.contains("already registered"));
        let e = r
            .register_engine(
                &ParamSpec::host("b", DType::F32, &[4]),
                buf.as_mut_ptr(),
                15,
            )
            .unwrap_err();
        assert!(
            e.message.contains("'b'") && e.message.contains("needs 16"),
            "{e}"
        );
        let e = r
            .register_engine(
                &ParamSpec::host("c", DType::F32, &[4]),
                std::ptr::null_mut(),
                16,
            )
            .unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_NULL_ARGUMENT);
        let mut dev = ParamSpec::host("d", DType::F32, &[4]);
        dev.memory = MemoryKind::Device;
        assert_eq!(
            r.allocate(&dev).unwrap_err().code,
            crate::result::wm_result::WM_ERR_UNSUPPORTED
        );
        let (p, n) = r
            .allocate(&ParamSpec::host("e", DType::Bf16, &[3, 5]))
            .unwrap();
        assert!(!p.is_null());
        assert_eq!(n, 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r.total_bytes(), 46);
    }
}
