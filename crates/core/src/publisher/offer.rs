//! What sessions serve: the trainer's content (a directory, or tensors in
//! memory), as versions ([`Offer`]), and picking the one a rank asks for.

use super::clashes::Clashes;
use crate::checkpoint::version::read_version_yaml;
use crate::manifest::Placement;
use crate::memory::cuda_ipc::ExportedDeviceBuffer;
use crate::memory::shared::SharedBuffer;
use crate::memory::SendPtr;
use crate::result::{Error, Result};
use crate::tensor::{byte_size, check_name, DType};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A tensor in the trainer's memory.
#[derive(Clone, Debug)]
pub struct ServedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: SendPtr,
    pub len: usize,
    /// The rank it is for; None: every rank.
    pub rank: Option<u32>,
    /// Known checksum: published (immutable) copies are hashed once, at
    /// publish, not by every session.
    pub checksum: Option<u128>,
    /// Some(GPU ordinal): `data` is a CUDA device address of that GPU.
    pub device: Option<i32>,
    /// Where this shard sits in the global tensor `name`; None: whole.
    pub placement: Option<Placement>,
}

impl ServedTensor {
    /// A tensor the trainer adds (not yet checked: see [`Current::add_all`]).
    pub(super) fn new(
        name: &str,
        dtype: DType,
        shape: &[u64],
        data: u64,
        len: usize,
        rank: Option<u32>,
        device: Option<i32>,
    ) -> ServedTensor {
        ServedTensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data: SendPtr(data as *mut u8),
            len,
            rank,
            checksum: None,
            device,
            placement: None,
        }
    }
}

/// What a publisher serves.
#[derive(Clone, Debug)]
pub enum Content {
    /// A snapshot directory; each rank gets the files the layout rules pick for it.
    Dir(PathBuf),
    /// Tensors in memory, which must stay valid and unchanged while served.
    Tensors(Vec<ServedTensor>),
}

/// The content the trainer adds to, with its tensors by name and rank
/// (`clashes.rs`): an add is checked against the tensors of its own name
/// and rank, and among shards of one tensor only against those whose
/// boxes may reach its own, so adding n tensors costs `O(n log n)`.
#[derive(Debug)]
pub(super) struct Current {
    pub(super) content: Content,
    clashes: Clashes,
}

impl Default for Current {
    fn default() -> Current {
        Current::of(Content::Tensors(Vec::new()))
    }
}

impl Current {
    pub(super) fn of(content: Content) -> Current {
        Current {
            content,
            clashes: Clashes::default(),
        }
    }

    /// Add a tensor or shard whose own fields were checked
    /// ([`check_own`]), unless it clashes with a tensor published for the
    /// same rank (`clashes.rs`); a directory served so far is dropped.
    fn add_checked(&mut self, t: ServedTensor) -> Result<()> {
        if let Content::Dir(_) = self.content {
            *self = Current::default();
        }
        let Content::Tensors(ts) = &mut self.content else {
            unreachable!()
        };
        let charged = self.clashes.check(ts, &t)?;
        ts.push(t);
        self.clashes.insert(ts, ts.len() - 1, charged);
        Ok(())
    }

    /// Add each of `ts` in order, or none: every one's own fields are
    /// checked first ([`check_own`]); then on the first that clashes, the
    /// ones added before it are taken out again (and a directory served
    /// before is served again). Err gives the refused one's place in `ts`.
    /// Each added tensor is the last of its name's positions, so taking
    /// them out is as cheap as adding them.
    pub(super) fn add_all(
        &mut self,
        ts: Vec<ServedTensor>,
    ) -> std::result::Result<(), (usize, Error)> {
        let dir = match &self.content {
            Content::Dir(d) => Some(d.clone()),
            Content::Tensors(_) => None,
        };
        // Each tensor's own fields first, for all: a bad one is named before
        // any is compared with the others.
        if let Some((k, e)) =
            (ts.iter().enumerate()).find_map(|(k, t)| check_own(t).err().map(|e| (k, e)))
        {
            return Err((k, e));
        }
        let before = self.tensors().len();
        for (k, t) in ts.into_iter().enumerate() {
            if let Err(e) = self.add_checked(t) {
                self.take_out_from(before);
                if let Some(d) = dir {
                    *self = Current::of(Content::Dir(d));
                }
                return Err((k, e));
            }
        }
        Ok(())
    }

    fn tensors(&self) -> &[ServedTensor] {
        match &self.content {
            Content::Tensors(ts) => ts,
            Content::Dir(_) => &[],
        }
    }

    /// Take out the tensors from position `from` on, last first.
    fn take_out_from(&mut self, from: usize) {
        let Content::Tensors(ts) = &mut self.content else {
            return;
        };
        while ts.len() > from {
            self.clashes.remove(ts, ts.len() - 1);
            ts.pop();
        }
    }
}

/// A tensor's own fields: its name, its byte size against its dtype and
/// shape, its placement, its address.
fn check_own(t: &ServedTensor) -> Result<()> {
    let name = &t.name;
    check_name("tensor", name)?;
    let need = byte_size(&format!("tensor '{name}'"), t.dtype, &t.shape)?;
    if need != t.len as u64 {
        return Err(Error::invalid_argument(format!(
            "tensor '{name}': {} bytes given, {need} needed",
            t.len
        )));
    }
    if let Some(p) = &t.placement {
        p.check(name, &t.shape)?;
        byte_size(
            &format!("tensor '{name}' (global)"),
            t.dtype,
            &p.global_shape,
        )?;
    }
    if t.data.0.is_null() && t.len > 0 {
        return Err(Error::null_argument(format!(
            "tensor '{name}': data is NULL"
        )));
    }
    Ok(())
}

/// A version as sessions serve it.
#[derive(Debug)]
pub(crate) struct Offer {
    /// The name engines ask for (None: the directory names none).
    pub(crate) version: Option<String>,
    pub(crate) content: Content,
    /// A published version's copy, which the content points into; IPC
    /// sessions hand it to engines as is (None: live content).
    pub(crate) published: Option<Published>,
    /// Checksums of live tensors, by index in the content, hashed by the
    /// first session of this serve call that sends them. The tensors stay
    /// unchanged while sessions run (`Publisher::add`'s contract) and an offer
    /// lives for one serve call, so its other sessions (ranks, or engines
    /// pulling again) reuse them; the next call hashes afresh.
    pub(crate) live_sums: Mutex<HashMap<usize, u128>>,
    /// Deltas of this version its sessions share (`delta_cache.rs`).
    pub(crate) deltas: super::delta_cache::DeltaCache,
    /// FP8 images its sessions made, kept as bases of the next version's
    /// deltas (`kept_images.rs`), and the bytes they may take: one per
    /// element of the version.
    pub(crate) images: super::kept_images::KeptImages,
    pub(crate) elements: u64,
}

/// Where a published version's tensors were copied.
#[derive(Clone, Debug)]
pub(crate) enum Published {
    /// One shared host buffer.
    Host(Arc<SharedBuffer>),
    /// GPU tensors, on an IPC publisher: one GPU buffer, handed to engines
    /// by its CUDA IPC handle.
    Device(Arc<ExportedDeviceBuffer>),
}

impl Offer {
    /// The published copy's shared host buffer, if it is one.
    pub(crate) fn shared(&self) -> Option<&Arc<SharedBuffer>> {
        match &self.published {
            Some(Published::Host(b)) => Some(b),
            _ => None,
        }
    }
}

impl Offer {
    pub(super) fn new(version: Option<String>, content: Content) -> Offer {
        let version = version.or_else(|| match &content {
            Content::Dir(dir) => {
                read_version_yaml(dir, Instant::now() + Duration::from_secs(10)).ok()
            }
            Content::Tensors(_) => None,
        });
        let elements = match &content {
            Content::Tensors(ts) => (ts.iter())
                .map(|t| t.len as u64 / t.dtype.size().max(1) as u64)
                .sum(),
            Content::Dir(_) => 0,
        };
        Offer {
            version,
            content,
            published: None,
            live_sums: Mutex::default(),
            deltas: Default::default(),
            images: Default::default(),
            elements,
        }
    }
}

/// The offer a rank asked for: by name, or the newest for "" and "latest".
/// A publisher whose content names no version (nothing published, no
/// version set) serves it under any name the request gives: the request
/// names the version then, as a snapshot folder without `version.yaml`.
pub(super) fn pick<'a>(offers: &'a [Arc<Offer>], wanted: &str, rank: u32) -> Result<&'a Offer> {
    let unnamed = offers.iter().all(|o| o.version.is_none());
    let found = if wanted.is_empty() || wanted == "latest" || unnamed {
        offers.last()
    } else {
        offers
            .iter()
            .rev()
            .find(|o| o.version.as_deref() == Some(wanted))
    };
    found.map(|o| &**o).ok_or_else(|| {
        let names: Vec<String> = offers
            .iter()
            .map(|o| format!("'{}'", o.version.as_deref().unwrap_or("")))
            .collect();
        Error::not_found(format!(
            "rank {rank} asked for version '{wanted}'; this publisher serves {}",
            names.join(", ")
        ))
    })
}
