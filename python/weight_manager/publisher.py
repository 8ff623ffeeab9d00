"""The trainer side: publish numpy arrays (or a snapshot directory) to engine
ranks on this node over IPC, or on other nodes over the network (UCX)."""

import ctypes
import operator
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _lib, torch_bridge
from .interrupt import on_ctrl_c
from .manager import MEMORY_DEVICE, OwnedHandle, WeightManagerError, create_error, last_error_text, millis, raise_for
from .types import Result
from .types import as_sizes, parse_dtype

LIB = _lib.LIB


@dataclass
class ServeStats:
    sessions: int
    bytes: int
    pack_s: float
    wait_s: float
    total_s: float


class Publisher(OwnedHandle):
    """Listens on a Unix socket and serves buckets to engines.

    Arrays passed to add() must stay alive and unchanged while serve() runs;
    the publisher keeps references to them. Use as a context manager or call
    close().
    """

    _what = "publisher"
    _destroy = staticmethod(lambda h: LIB.wm_publisher_destroy(h))

    def __init__(self, socket_path: Optional[str] = None, *, net: Optional[str] = None,
                 secret: Optional[str] = None, keep_versions: int = 2,
                 bucket_size: int = 512 << 20, buffers: int = 2,
                 socket_mode: int = 0o600, allow_other_uids: bool = False, checksums: bool = True):
        """Listen on the Unix socket `socket_path` (same node), or, with
        `net="host:port"`, on TCP for engines on other nodes (port 0 picks
        one: see `address`; the shared `secret` defaults to WM_NET_SECRET)."""
        if (socket_path is None) == (net is None):
            raise ValueError("give exactly one of socket_path and net")
        cfg = _lib.PublisherConfig()
        LIB.wm_publisher_config_init(ctypes.byref(cfg))
        cfg.bucket_size, cfg.buffers, cfg.socket_mode = bucket_size, buffers, socket_mode
        cfg.allow_other_uids, cfg.checksums = int(allow_other_uids), int(checksums)
        cfg.keep_versions = keep_versions
        self._secret = _lib.name_bytes("secret", secret) if secret is not None else None
        cfg.secret = self._secret
        handle = ctypes.c_void_p()
        where = str(socket_path if net is None else net)
        create = LIB.wm_publisher_create if net is None else LIB.wm_publisher_create_net
        rc = create(where.encode(), ctypes.byref(cfg), ctypes.byref(handle))
        if rc != 0:
            raise create_error(rc, f"listening on {where}")
        self._handle = handle
        self._arrays = []
        # Arrays cleared while a serve() ran, kept until no serve() runs.
        self._retired, self._serving = [], 0
        self._serving_lock = threading.Lock()

    @property
    def address(self) -> str:
        """The socket path, or the TCP host:port actually bound."""
        return last_error_text(LIB.wm_publisher_address, self._h())

    def publish(self) -> None:
        """Keep the current tensors (copied now, into shared memory that
        every engine on this node reads in place) as the version set with
        set_version, for engines to ask for by name; the oldest beyond
        keep_versions is dropped."""
        self._check(LIB.wm_publisher_publish(self._h()))

    def prepare(self, count: int = 0) -> int:
        """Make the shared buffers the next `count` publishes copy into, now,
        sized for the tensors added so far (call it before the first
        training step: a publish that has to create its buffer pays for
        fresh shared pages, far slower than the copy). `count` 0:
        keep_versions + 1, what steady publishing cycles through. Returns
        the bytes made."""
        out = ctypes.c_uint64(0)
        self._check(LIB.wm_publisher_prepare(self._h(), count, ctypes.byref(out)))
        return out.value

    def _check(self, rc: int):
        raise_for(rc, LIB.wm_publisher_last_error, self._h())

    def add(self, name: str, array: np.ndarray, *, dtype=None, rank: int = -1) -> None:
        """Publish `array` as tensor `name` for engine `rank` (-1: every rank)."""
        self._add_array(name, array, dtype, rank, None)

    def add_shard(self, name: str, data, global_shape, offset, *, dtype=None, rank: int = -1) -> None:
        """Publish `data` (a numpy array, or a CPU or CUDA torch.Tensor) as
        the shard of global tensor `name` whose box starts at `offset` in a
        tensor of `global_shape` (one value per dimension of `data` each).
        Checked now, naming the tensor: the box inside the global shape; a
        second shard at the same offset, or a whole tensor of that name, is
        refused. Several shards of one global tensor may be added (same
        dtype and global shape). Engines get the placement in their
        manifest. `data` must stay alive and unchanged as for add()."""
        placement = torch_bridge.ShardPlacement(as_sizes(f"tensor '{name}': global_shape", global_shape),
                                                as_sizes(f"tensor '{name}': offset", offset))
        if any(d < 0 for d in placement.global_shape + placement.offset):
            raise ValueError(f"tensor '{name}': global_shape {placement.global_shape} and offset "
                             f"{placement.offset} must not be negative")
        if torch_bridge.is_tensor(data):
            self._add_tensor_memory(name, torch_bridge.tensor_memory(name, data), data, rank, placement)
        else:
            self._add_array(name, np.asarray(data) if not isinstance(data, np.ndarray) else data,
                            dtype, rank, placement)

    def _add_array(self, name: str, array: np.ndarray, dtype, rank: int, placement) -> None:
        if not isinstance(array, np.ndarray):
            # As Manager.register: the memory must be an array's (a list has none to serve).
            raise TypeError(f"tensor '{name}': expected a numpy array (torch tensors: add_shard or add_state_dict), "
                            f"got {type(array).__name__}")
        if not array.flags.c_contiguous:
            raise ValueError(f"tensor '{name}': array must be C-contiguous")
        wm_dtype = parse_dtype(dtype if dtype is not None else array.dtype)
        mem = torch_bridge.TensorMemory(int(array.ctypes.data), array.nbytes, wm_dtype, tuple(array.shape),
                                        torch_bridge.HOST)
        self._add_tensor_memory(name, mem, array, rank, placement)

    def add_device(self, name: str, ptr: int, nbytes: int, device: int, *, dtype, shape,
                   rank: int = -1) -> None:
        """Publish `nbytes` of GPU memory at device address `ptr` on CUDA
        device `device` as tensor `name` (dtype x shape). GPU tensors are served
        once published: publish() waits for the device and copies them into a
        GPU buffer that engines on this node open by CUDA IPC handle. The
        memory must stay valid until the next publish() returns."""
        mem = torch_bridge.TensorMemory(int(ptr), int(nbytes), parse_dtype(dtype),
                                        as_sizes(f"tensor '{name}': shape", shape), int(device))
        self._add_memory(name, mem, rank, None)

    def add_torch(self, name: str, tensor, *, rank: int = -1) -> None:
        """Publish a torch.Tensor by its data_ptr(), without this package
        depending on PyTorch: a CUDA tensor as GPU memory (add_device), a CPU
        tensor as host memory. The tensor must be contiguous; a reference is
        kept until clear() or close()."""
        self._add_tensor_memory(name, torch_bridge.tensor_memory(name, tensor), tensor, rank)

    def add_state_dict(self, state_dict, *, rank: int = -1, contiguous: str = "refuse") -> dict:
        """Publish every entry of a `model.state_dict()` (name -> torch.Tensor)
        by pointer: CPU tensors as host memory, CUDA tensors through the
        device path (add_device: served once publish() copies them). Each
        tensor is read where it lies, so the trainer may keep training in
        place and add nothing again: the next publish() or serve() reads the
        new values (publish() takes its copy at once; live CPU tensors are
        read while serve() runs, so do not step the optimizer meanwhile).

        A DTensor (torch.distributed.tensor: FSDP2, tensor parallel) is
        published as this rank's shard of its global tensor (add_shard):
        its local tensor, placed by its `placements` on its device mesh
        (Shard(dim) and Replicate(); PyTorch's uneven split). A DTensor whose
        mesh does not hold this rank is skipped. Plain tensors stay whole.

        References to the tensors are kept until clear() or close() (the
        publisher may read them until then). Non-contiguous tensors are
        refused naming them (contiguous="refuse", the default: a copy would
        silently stop following the trainer's in-place updates), or copied
        now with a warning naming them (contiguous="copy"). Tied tensors
        (one memory under several names) are published once, under the
        first name; returns {tied name: published name}. All or nothing:
        a tensor refused (a dtype the library lacks, a name already
        published for that rank, overlapping shards, ...) raises naming it,
        and none of the state dict is added (one wm_publisher_add_all)."""
        placements, named = {}, []
        for name, t in state_dict.items():
            if torch_bridge.is_dtensor(t):
                shard = torch_bridge.dtensor_shard(name, t)
                if shard is None:
                    continue
                t, placements[name] = shard
            named.append((name, torch_bridge.contiguous_for_publishing(name, t, contiguous)))
        unique, aliases = torch_bridge.unique_memory(named)
        made = [self._desc(name, mem, rank, placements.get(name)) for name, _, mem in unique]
        if made:
            descs = (_lib.TensorDesc * len(made))(*(desc for desc, _ in made))
            self._check(LIB.wm_publisher_add_all(self._h(), descs, len(made)))
        self._arrays.extend(tensor for _, tensor, _ in unique)
        return aliases

    def _add_tensor_memory(self, name: str, mem, owner, rank: int, placement=None) -> None:
        """Add host or device memory as tensor `name` (a shard when
        `placement` is given), keeping `owner` alive."""
        self._add_memory(name, mem, rank, placement)
        self._arrays.append(owner)

    def _add_memory(self, name: str, mem, rank: int, placement) -> None:
        """Add one tensor's host or device memory, whole or a shard."""
        desc, _keep = self._desc(name, mem, rank, placement)
        self._check(LIB.wm_publisher_add(self._h(), ctypes.byref(desc)))

    @staticmethod
    def _desc(name: str, mem, rank: int, placement):
        """The wm_tensor_desc of every add (host or device memory, whole or
        a shard), and the objects its pointers point into, to keep alive
        until the library has read it."""
        encoded = _lib.name_bytes("tensor name", name)
        ndim = len(mem.shape)
        dims = _lib.array(ctypes.c_uint64, mem.shape, f"tensor '{name}': shape")
        desc = _lib.TensorDesc()
        LIB.wm_tensor_desc_init(ctypes.byref(desc))
        desc.name, desc.dtype, desc.ndim, desc.rank = encoded, int(mem.dtype), ndim, rank
        desc.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_uint64))
        desc.data, desc.len = mem.ptr or None, int(mem.nbytes)
        if mem.device != torch_bridge.HOST:
            desc.memory, desc.device_ordinal = MEMORY_DEVICE, int(mem.device)
        keep = [encoded, dims]
        if placement is not None:
            if len(placement.global_shape) != ndim or len(placement.offset) != ndim:
                raise ValueError(f"tensor '{name}': global_shape {placement.global_shape} and offset "
                                 f"{placement.offset} need one value per dimension of its {mem.shape}")
            glob = _lib.array(ctypes.c_uint64, placement.global_shape, f"tensor '{name}': global_shape")
            off = _lib.array(ctypes.c_uint64, placement.offset, f"tensor '{name}': offset")
            desc.global_shape = ctypes.cast(glob, ctypes.POINTER(ctypes.c_uint64))
            desc.offset = ctypes.cast(off, ctypes.POINTER(ctypes.c_uint64))
            keep += [glob, off]
        return desc, keep

    def set_dir(self, directory) -> None:
        """Serve a snapshot directory instead (per-rank files by the layout rules)."""
        self._check(LIB.wm_publisher_set_dir(self._h(), str(directory).encode()))

    def set_version(self, version: Optional[str]) -> None:
        # "" goes to the library, which refuses it; None means version.yaml.
        encoded = None if version is None else _lib.name_bytes("version", version)
        self._check(LIB.wm_publisher_set_version(self._h(), encoded))

    def clear(self) -> None:
        """Forget every tensor added (before adding the next version's).
        A serve() running on another thread may still read them: their
        references are kept until every running serve() returned."""
        self._check(LIB.wm_publisher_clear(self._h()))
        with self._serving_lock:
            if self._serving:
                self._retired.extend(self._arrays)
            self._arrays = []

    def serve(self, engines: int = 1, timeout: float = 600.0) -> ServeStats:
        """Serve `engines` engine connections; blocks until they are done.
        Offers what was published when called: a version published
        meanwhile is offered by the next serve(). Once a publish started,
        only published copies are served, never the live tensors: a serve
        called while a publish has dropped the only version kept
        (keep_versions=1) waits for that publish (within `timeout`) and
        offers its version; when that publish failed, leaving none, serve
        raises ERR_NO_VERSION until a publish succeeds."""
        st = _lib.ServeStats()
        st.struct_size = ctypes.sizeof(st)
        try:
            count = operator.index(engines)  # ints, numpy integers; not floats
        except TypeError:
            count = -1
        if not 0 <= count <= 2**32 - 1:
            raise WeightManagerError(Result.ERR_INVALID_ARGUMENT,
                                     f"serve: engines {engines!r} is not a count from 0 to 2^32 - 1")
        engines = count
        wait = millis(timeout, "serve: timeout")
        with self._serving_lock:
            self._serving += 1
        try:
            h = self._h()
            with on_ctrl_c(self.close):
                rc = LIB.wm_publisher_serve(h, engines, wait, ctypes.byref(st))
            self._check(rc)
        finally:
            with self._serving_lock:
                self._serving -= 1
                if not self._serving:
                    self._retired = []
        return ServeStats(st.sessions, st.bytes, st.pack_ns / 1e9, st.wait_ns / 1e9, st.total_ns / 1e9)

    def _on_close(self) -> None:
        self._arrays.clear()
