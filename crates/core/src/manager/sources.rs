//! Opening the sources an update request names (each source's options are
//! built here from the config and the request), and the gdr check.

use super::{Manager, UpdateRequest};
use crate::registry::Registry;
use crate::result::{Error, Result};
use crate::source::ipc::{IpcOptions, IpcSource};
use crate::source::net::{NetOptions, NetSource};
use crate::source::snapshot::{SnapshotLocation, SnapshotSource};
use crate::source::{locations, PullOptions, Source, SourceKind};
use crate::transport::auth::Secret;
use std::path::{Path, PathBuf};
use std::time::Instant;

impl Manager {
    /// Open every source `req` names, in order. `gdr`: a gdr request that
    /// may land in GPU memory (`check_gdr`). A new source kind gets its
    /// arm here.
    /// `base`: the version the params hold, named to publishers as the base
    /// of deltas. `most`: the most tensors one publisher may announce.
    pub(super) fn open_sources(
        &self,
        req: &UpdateRequest,
        gdr: bool,
        base: Option<&String>,
        most: usize,
    ) -> Result<Vec<Box<dyn Source>>> {
        let locations = locations::expand(&req.locations)?;
        if req.source == SourceKind::Snapshot && locations.len() <= 1 {
            let read_version = req.version.is_none();
            let one = self.open_snapshot(req, locations.first(), (read_version, most))?;
            return Ok(vec![Box::new(one)]);
        }
        if req.source == SourceKind::Snapshot {
            return self.open_snapshots(req, &locations, most);
        }
        if locations.is_empty() {
            return Err(Error::invalid_argument(match req.source {
                SourceKind::Ipc => {
                    "an ipc update needs the publisher's socket path as its location".to_string()
                }
                kind => format!(
                    "a {} update needs the publisher's host:port as its location",
                    kind.name()
                ),
            }));
        }
        let mut opened: Vec<Box<dyn Source>> = Vec::with_capacity(locations.len());
        let several = locations.len() > 1;
        for (i, loc) in locations.iter().enumerate() {
            let one = match req.source {
                SourceKind::Ipc => self.open_ipc(req, loc, (base.cloned(), most)),
                SourceKind::Rdma | SourceKind::Gdr => {
                    self.open_net(req, loc, gdr, (base.cloned(), most))
                }
                SourceKind::Snapshot => Err(Error::state("snapshots are opened above (internal)")),
            };
            match one {
                Ok(source) => opened.push(source),
                // The publishers already reached hear why the update ends.
                Err(e) => {
                    // Named as a source failing later is (`stream_all`).
                    let e = match several {
                        true => {
                            e.context(format!("source {i} (the publisher at {})", loc.display()))
                        }
                        false => e,
                    };
                    for s in opened.iter_mut() {
                        s.abort(&e);
                    }
                    return Err(e);
                }
            }
        }
        Ok(opened)
    }

    /// Several snapshot folders: each one's version.yaml is read even when
    /// the request names the version, so that the plan refuses folders of
    /// different versions (the request's still names the update); a folder
    /// without one, beside folders that name one, holds theirs.
    /// `most` bounds the tensors of all folders together: each folder
    /// may announce what the ones before it left.
    fn open_snapshots(
        &self,
        req: &UpdateRequest,
        locations: &[PathBuf],
        most: usize,
    ) -> Result<Vec<Box<dyn Source>>> {
        let mut folders = Vec::with_capacity(locations.len());
        let mut left = most;
        for loc in locations {
            let f = self.open_snapshot(req, Some(loc), (true, left))?;
            left -= f.manifest().tensors.len();
            folders.push(f);
        }
        let named = folders.iter().find_map(|f| f.manifest().version.clone());
        if let (Some(v), Some(_)) = (named, &req.version) {
            folders.iter_mut().for_each(|f| f.name_if_unnamed(&v));
        }
        Ok(folders
            .into_iter()
            .map(|f| Box::new(f) as Box<dyn Source>)
            .collect())
    }

    fn open_snapshot(
        &self,
        req: &UpdateRequest,
        at: Option<&PathBuf>,
        (read_version, most): (bool, usize),
    ) -> Result<SnapshotSource> {
        let dir = at
            .cloned()
            .or_else(|| self.config.model_dir.clone())
            .ok_or_else(|| {
                Error::invalid_argument(
                    "snapshot update names no location and the config has no model_dir",
                )
            })?;
        let loc = SnapshotLocation {
            model_dir: dir,
            fallback_dir: self.config.fallback_dir.clone(),
            rank: self.config.rank,
            gpu_id: self.gpu_id.clone(),
        };
        let deadline = Instant::now() + req.timeout;
        SnapshotSource::open_until(&loc, &self.config.logger, (deadline, read_version), most)
    }

    /// What this rank asks a publisher for, and how long it waits.
    fn pull_options(
        &self,
        req: &UpdateRequest,
        base: Option<String>,
        manifest_tensors: usize,
    ) -> PullOptions {
        PullOptions {
            rank: self.config.rank,
            world_size: self.config.world_size,
            gpu_id: self.gpu_id.clone(),
            version: req.version.clone(),
            base,
            manifest_tensors,
            bucket_timeout: crate::defaults::BUCKET_TIMEOUT.min(req.timeout),
            stop: self.stop_flag(),
        }
    }

    fn open_ipc(
        &self,
        req: &UpdateRequest,
        socket: &Path,
        (base, manifest_tensors): (Option<String>, usize),
    ) -> Result<Box<dyn Source>> {
        let socket = socket.to_path_buf();
        let opts = IpcOptions {
            socket,
            pull: self.pull_options(req, base, manifest_tensors),
            allow_other_uids: self.config.allow_other_uids,
            // CUDA IPC buffers open on the rank's GPU (device
            // copies to params on other GPUs go peer to peer).
            gpu: self.config.device.max(0),
        };
        Ok(Box::new(IpcSource::open(
            &opts,
            Instant::now() + req.timeout,
            self.kept.ipc_buffers.clone(),
        )?))
    }

    fn open_net(
        &self,
        req: &UpdateRequest,
        address: &Path,
        gdr: bool,
        (base, manifest_tensors): (Option<String>, usize),
    ) -> Result<Box<dyn Source>> {
        let opts = NetOptions {
            address: address.display().to_string(),
            pull: self.pull_options(req, base, manifest_tensors),
            secret: Secret::resolve(self.config.net.secret.as_deref())?,
            bucket_size: self.config.net.bucket_size,
            depth: self.config.net.depth,
            direct: gdr || !self.config.net.staged,
            keyed: self.config.net.keyed_digests,
        };
        if gdr && opts.keyed {
            return Err(Error::unsupported(
                "keyed digests are checked on the CPU: they apply to rdma updates, not gdr \
                 (bytes land in GPU memory)",
            ));
        }
        let source = NetSource::open(opts, Instant::now() + req.timeout).inspect_err(|e| {
            if e.code == crate::result::wm_result::WM_ERR_AUTH {
                self.config
                    .logger
                    .warn(&format!("{} update: {e}", req.source.name()));
            }
        })?;
        Ok(Box::new(source))
    }

    /// gdr lands bytes straight in GPU memory: it needs a UCX built with CUDA
    /// and device params. Ok(true): device params receive straight from the
    /// wire (direct receive, `source::net`; host params too); Ok(false): run
    /// as rdma, when the config allows the fallback.
    pub(super) fn check_gdr(&self, registry: &Registry) -> Result<bool> {
        let ucx = crate::transport::ucx::ucx()?;
        let on_gpu = registry.params().iter().any(|p| p.device.is_some());
        let why = if !on_gpu {
            "this manager's params are host memory (gdr needs device params)".to_string()
        } else if !ucx.supports_cuda() {
            ucx.no_cuda_reason()
        } else {
            return Ok(true);
        };
        if self.config.net.gdr_fallback {
            self.config.logger.warn(&format!(
                "gdr: {why}; falling back to rdma as the config allows"
            ));
            return Ok(false);
        }
        Err(Error::unsupported(format!(
            "gdr: {why}; use source rdma, or allow the fallback to rdma in the config"
        )))
    }
}
