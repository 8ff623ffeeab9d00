"""The Manager class: owns one wm_manager handle."""

import ctypes
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from . import _lib, torch_bridge
from .interrupt import on_ctrl_c
from .progress_bar import ProgressBar
from .torch_bridge import HOST
from .types import (DELTAS, DTYPE_TO_NUMPY, IN_PLACE, SKIP_UNKNOWN, VERIFY_CHECKSUMS, WHOLE, DeltaFallback, QuantScheme,
                    DType, Result, Source, State, WeightManagerError, as_sizes, parse_dtype)

LIB = _lib.LIB
MEMORY_DEVICE = 1  # wm_memory: WM_MEMORY_DEVICE


@dataclass(frozen=True)
class DeltaStats:
    """What an update's deltas did: runs (a param piece's bytes from one
    source) sent as deltas and whole, bytes the sources sent (whole runs
    plus deltas), bytes the deltas rewrote, why runs came whole, and
    ``base_version``: the version the params held that the update named to
    its publishers as the base, also when runs came whole (NOT_KEPT,
    DIFFERS); "" when it named none (REFUSED, NO_BASE, NOT_ASKED, and
    NOT_APPLICABLE for a snapshot, keyed digests or a tensor callback)."""
    fallback: DeltaFallback = DeltaFallback.NONE
    runs_delta: int = 0
    runs_whole: int = 0
    wire_bytes: int = 0
    rewritten_bytes: int = 0
    base_version: str = ""


@dataclass
class UpdateStats:
    version: str
    rank: int
    tensors: int
    # Bytes the params took (a quantized param's FP8 bytes and scales).
    bytes: int
    sync_s: float
    update_s: float
    total_s: float
    # Planning time, and whether the last update's plan was reused (the
    # layouts had not changed).
    plan_s: float = 0.0
    plan_reused: bool = False
    # Bytes of the runs taken from each source (a quantized param's in the
    # dtype they carry), in the order the update named them.
    source_bytes: tuple = ()
    # What deltas did (None where not asked: stage()'s result).
    deltas: Optional[DeltaStats] = None


@dataclass(frozen=True)
class Placement:
    """Where a tensor handed to `on_tensor` sits in its global tensor: the
    global shape, and the offset of the tensor's box in it per dimension
    (all zeros, and the tensor's own shape, for a whole tensor)."""
    global_shape: tuple
    offset: tuple


@dataclass
class Status:
    state: State
    version: Optional[str]
    updates: int
    params: int
    param_bytes: int
    resident_bytes: int
    last_result: Result
    last_update: Optional[UpdateStats]
    # GPU memory freed by the last clear / taken back after it (library-owned
    # device params), as the driver reports it.
    device_bytes_freed: int = 0
    device_bytes_restored: int = 0


@dataclass
class RegisteredModule:
    """What Manager.register_module registered: `params` (published name ->
    the module's tensor) and `aliases` (tied name -> the registered name
    whose memory it shares)."""
    params: dict
    aliases: dict


@dataclass
class Progress:
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int


def last_error_text(last_error, handle) -> str:
    """A handle's last error text, read through one of the *_last_error calls."""
    buf = ctypes.create_string_buffer(4096)
    n = ctypes.c_size_t()
    if last_error(handle, buf, len(buf), ctypes.byref(n)) != 0:
        return ""
    return buf.value.decode(errors="replace")


def create_error(rc: int, what: str) -> WeightManagerError:
    """The error of a failed create call (wm_init, wm_publisher_create*,
    wm_controller_open), with the reason the library kept for this thread."""
    buf = ctypes.create_string_buffer(4096)
    n = ctypes.c_size_t()
    text = ""
    if LIB.wm_last_create_error(buf, len(buf), ctypes.byref(n)) == 0:
        text = buf.value.decode(errors="replace")
    return WeightManagerError(rc, f"{what}: {text or LIB.wm_result_text(rc).decode()}")


# The longest wait a call may ask for: 7 days (the C ABI's millisecond
# counts would take more, which no engine means).
_MAX_SECONDS = 7 * 24 * 3600


def millis(seconds, what: str) -> int:
    """`seconds` (a wait) in whole milliseconds; anything but a number from
    0 to 7 days raises WeightManagerError(ERR_INVALID_ARGUMENT) naming it."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        s = float("nan")
    if not 0 <= s <= _MAX_SECONDS:
        raise WeightManagerError(Result.ERR_INVALID_ARGUMENT,
                                 f"{what}: {seconds!r} is not a number of seconds from 0 to {_MAX_SECONDS}")
    return int(s * 1000)


def raise_for(rc: int, last_error, handle) -> None:
    """Raise WeightManagerError for a failed call, with the handle's text."""
    if rc != 0:
        raise WeightManagerError(rc, last_error_text(last_error, handle) or LIB.wm_result_text(rc).decode())


def _stats(s: _lib.UpdateStats, source_bytes=(), deltas=None) -> UpdateStats:
    return UpdateStats(s.version.decode(), s.rank, s.tensors, s.bytes, s.sync_ns / 1e9,
                       s.update_ns / 1e9, s.total_ns / 1e9, s.plan_ns / 1e9, bool(s.plan_reused),
                       tuple(source_bytes), deltas)


def _takes_placement(fn) -> bool:
    """Whether `on_tensor` takes a third argument (the Placement)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _encode(s) -> Optional[bytes]:
    """Text for the library: str, bytes or a path (a NUL in it is refused
    where it is set, see `_lib.check_value`)."""
    if s is None:
        return None
    if isinstance(s, os.PathLike):
        s = os.fspath(s)
    if isinstance(s, str):
        return s.encode()
    if isinstance(s, (bytes, bytearray)):
        return bytes(s)
    raise TypeError(f"expected text (str, bytes or a path), got {type(s).__name__} {s!r}")


def _locations(location) -> list:
    """An update's locations: one (text or a path) or a list of them."""
    if isinstance(location, (str, bytes, os.PathLike)):
        return [location]
    if location is None:
        return []
    try:
        return list(location)
    except TypeError:
        raise TypeError(f"location must be a str, a path or a list of them, got "
                        f"{type(location).__name__} {location!r}") from None


def _dims(what: str, shape) -> tuple:
    """A shape's sizes as ints, each checked to fit a uint64_t: no bools,
    no floats (int() would truncate 2.5 to 2)."""
    out = as_sizes(what, shape)
    for i, v in enumerate(out):
        _lib.check_value(f"{what}[{i}]", ctypes.c_uint64, v)
    return out


def _request(location, version, source, verify, in_place, skip_unknown, timeout, deltas=None):
    """A wm_update_request, and the encoded strings it points to (keep them
    alive through the call)."""
    req = _lib.UpdateRequest()
    LIB.wm_update_request_init(ctypes.byref(req))
    sources = [s.name.lower() for s in Source]
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, one of {sources}; got {type(source).__name__} {source!r}")
    try:
        req.source = int(Source[source.upper()])
    except KeyError:
        raise ValueError(f"source must be one of {sources}") from None
    locations = _locations(location)
    keep = [_encode(loc) for loc in locations]
    if keep:
        req.locations = _lib.array(ctypes.c_char_p, keep, "location")
        req.nlocations = len(keep)
    encoded_version = _encode(version)
    req.version = encoded_version
    keep.append(encoded_version)
    req.flags = (VERIFY_CHECKSUMS if verify else 0) | (IN_PLACE if in_place else 0) | \
                (SKIP_UNKNOWN if skip_unknown else 0) | \
                {None: 0, True: DELTAS, False: WHOLE}[None if deltas is None else bool(deltas)]
    if timeout is not None:
        req.timeout_ms = max(1, millis(timeout, "timeout"))
    return req, keep


def _array_at(address: int, nbytes: int, dtype: DType, shape, owner) -> np.ndarray:
    buf = (ctypes.c_uint8 * nbytes).from_address(address) if nbytes else (ctypes.c_uint8 * 1)()
    buf._wm_owner = owner  # keeps the memory (a _HandleKeeper) alive as long as the array
    arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
    return arr.view(DTYPE_TO_NUMPY[dtype]).reshape(tuple(shape))


@dataclass(frozen=True)
class DeviceArray:
    """A tensor in GPU memory: handed to `on_tensor` (zero-copy from a
    trainer's CUDA IPC buffer; valid only during the call), or returned by
    `Manager.allocate(..., device=N)` (valid until close()). It carries
    `__cuda_array_interface__`, so `torch.as_tensor(a, device="cuda")`, CuPy
    or Numba view it without a copy."""
    ptr: int
    nbytes: int
    device: int
    dtype: DType
    shape: tuple

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = DTYPE_TO_NUMPY[self.dtype].str
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "version": 3}


class OwnedHandle:
    """Base of the classes that own one library handle: `close()` (idempotent),
    context manager, and destruction on garbage collection. Subclasses set
    `_destroy` (the wm_*_destroy function) and `_what` (for errors)."""

    _handle = None
    _what = "handle"

    @staticmethod
    def _destroy(handle) -> None:
        raise NotImplementedError

    def _h(self):
        if self._handle is None:
            raise WeightManagerError(Result.ERR_INVALID_HANDLE, f"the {self._what} is closed")
        return self._handle

    def _on_close(self) -> None:
        """Drop references kept for the library (arrays, callbacks)."""

    def close(self) -> None:
        """Destroy the handle. Idempotent."""
        if self._handle is not None:
            type(self)._destroy(self._handle)
            self._handle = None
            self._on_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _HandleKeeper:
    """Owns a manager handle for as long as the Manager or an array from
    its allocate() lives: library-owned param memory is freed by wm_destroy,
    so the handle is destroyed only when the last of them is gone (CPython
    frees it at once when the last reference drops)."""

    def __init__(self, handle):
        self.handle = handle

    def __del__(self):
        try:
            LIB.wm_destroy(self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_LOG_LEVELS = {"off": 0, "error": 1, "warn": 2, "info": 3, "debug": 4}


class Manager(OwnedHandle):
    """One engine rank's weight manager.

    Use as a context manager, or call close(). Arrays returned by allocate()
    point into library memory and keep it alive: after close() the manager
    refuses every call, and its handle (and that memory) is destroyed once
    the last such array is gone.
    """

    _what = "manager"
    _keeper = None

    @staticmethod
    def _destroy(handle) -> None:
        # close() hands the handle to the keeper instead (see _on_close).
        LIB.wm_destroy(handle)

    def __init__(self, rank: int = 0, world_size: int = 1, *, device: int = -1,
                 model_dir=None, fallback_dir=None, control_cell: Optional[str] = None,
                 group: Optional[str] = None, local_rank: int = 0, local_world_size: int = 0,
                 node_rank: int = 0, rendezvous_addr: Optional[str] = None,
                 signal_timeout: Optional[float] = None,
                 log_level: str = "warn", log: Optional[Callable[[int, str], None]] = None,
                 copy_threads: int = 0, net_secret: Optional[str] = None, net_bucket_size: int = 0,
                 net_depth: int = 0, net_staged: bool = False, gdr_fallback: bool = False,
                 fanout_group: Optional[int] = None, nccl_library=None,
                 net_keyed_digests: bool = False,
                 callback_staging_limit: int = 0, keep_atomic_staging: bool = True,
                 swap_device_params: bool = False, allow_other_uids: bool = False):
        self._handle = None
        cfg = _lib.Config()
        LIB.wm_config_init(ctypes.byref(cfg))
        cfg.rank, cfg.world_size, cfg.device = rank, world_size, device
        # wm_config's optional blocks (each its own growable struct), all
        # passed: their fields' defaults are those of a NULL block.
        grp, net, fan, mem = _lib.GroupConfig(), _lib.NetConfig(), _lib.FanoutConfig(), _lib.MemoryConfig()
        LIB.wm_group_config_init(ctypes.byref(grp))
        LIB.wm_net_config_init(ctypes.byref(net))
        LIB.wm_fanout_config_init(ctypes.byref(fan))
        LIB.wm_memory_config_init(ctypes.byref(mem))
        self._keep = [_encode(model_dir and str(model_dir)), _encode(fallback_dir and str(fallback_dir)),
                      _encode(control_cell), _encode(group), _encode(rendezvous_addr), _encode(net_secret),
                      _encode(nccl_library and str(nccl_library))]
        (cfg.model_dir, cfg.fallback_dir, cfg.control_cell, grp.name,
         grp.rendezvous_addr, net.secret, fan.nccl_library) = self._keep
        # NCCL fan-out (README "NCCL fan-out"): None, every rank pulls its own.
        fan.group = -1 if fanout_group is None else fanout_group
        net.bucket_size, net.depth = net_bucket_size, net_depth
        net.staged, net.gdr_fallback = int(net_staged), int(gdr_fallback)
        net.keyed_digests = int(net_keyed_digests)
        grp.local_rank, grp.local_world_size, grp.node_rank = local_rank, local_world_size, node_rank
        if signal_timeout is not None:
            grp.signal_timeout_ms = max(1, millis(signal_timeout, "signal_timeout"))
        cfg.group, cfg.net = ctypes.pointer(grp), ctypes.pointer(net)
        cfg.fanout, cfg.memory = ctypes.pointer(fan), ctypes.pointer(mem)
        if log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {sorted(_LOG_LEVELS)}")
        cfg.log_level = _LOG_LEVELS[log_level]
        if log is not None:
            self._log_cb = _lib.LOG_CALLBACK(lambda _u, level, msg: log(level, msg.decode(errors="replace")))
            cfg.log_callback = self._log_cb
        cfg.copy_threads = copy_threads
        # IPC: accept a publisher running as another uid (both sides check).
        cfg.allow_other_uids = int(allow_other_uids)
        # Bytes of per-tensor-callback tensors an update may stage; 0: 4 GiB.
        mem.callback_staging_limit = callback_staging_limit
        # Atomic staging kept between updates (README "States and transitions");
        # False frees it after each update.
        mem.free_atomic_staging = int(not keep_atomic_staging)
        # Atomic updates of library-owned device params by a device page
        # swap (README "GPU params and CUDA IPC"); costs one more copy of
        # them in GPU memory during each update.
        mem.swap_device_params = int(swap_device_params)
        handle = ctypes.c_void_p()
        rc = LIB.wm_init(ctypes.byref(cfg), ctypes.byref(handle))
        if rc != 0:
            raise create_error(rc, "wm_init failed")
        self._keeper = _HandleKeeper(handle)
        self._handle = handle
        self._params = {}
        self._engine_owned = set()  # names of the params register() gave memory to

    # -- plumbing ---------------------------------------------------------
    def last_error(self) -> str:
        return last_error_text(LIB.wm_last_error, self._h())

    def _check(self, rc: int):
        raise_for(rc, LIB.wm_last_error, self._h())

    @staticmethod
    def _desc(name: str, dtype: DType, shape, pieces=None) -> tuple:
        name_b = _lib.name_bytes("param name", name)
        shape = _dims(f"param '{name}': shape", shape)
        d = _lib.ParamDesc()
        LIB.wm_param_desc_init(ctypes.byref(d))
        dims = _lib.array(ctypes.c_uint64, shape, f"param '{name}': shape")
        d.name, d.dtype, d.shape, d.ndim = name_b, int(dtype), dims, len(shape)
        keep = [name_b, dims]
        if pieces:
            if len(pieces) > _lib.MAX_PIECES:
                raise ValueError(f"param '{name}': {len(pieces)} pieces, more than the {_lib.MAX_PIECES} "
                                 "one param may have")
            arr = (_lib.Piece * len(pieces))()
            for c, p in zip(arr, pieces):
                LIB.wm_piece_init(ctypes.byref(c))
                if len(p.offset) > _lib.MAX_NDIM:
                    raise ValueError(f"param '{name}': piece of '{p.tensor}' has more than {_lib.MAX_NDIM} dimensions")
                at = p.at if p.at is not None else (0,) * len(shape)
                if len(at) != len(shape):
                    raise ValueError(f"param '{name}': piece of '{p.tensor}': `at` needs one value per param "
                                     f"dimension ({len(shape)})")
                tensor_b = _lib.name_bytes(f"param '{name}': piece's tensor", p.tensor)
                keep.append(tensor_b)
                c.tensor, c.ndim = tensor_b, len(p.offset)
                piece = f"param '{name}': piece of '{p.tensor}'"
                c.offset[:len(p.offset)] = _dims(f"{piece}: offset", p.offset)
                c.len[:len(p.length)] = _dims(f"{piece}: length", p.length)
                c.param_offset[:len(at)] = _dims(f"{piece}: at", at)
            d.pieces, d.npieces = arr, len(pieces)
            keep.append(arr)
        return d, keep

    # -- params -----------------------------------------------------------
    def register(self, name: str, array: np.ndarray, dtype=None, pieces=None) -> None:
        """Register a numpy array as an engine-owned host param. The array
        must be C-contiguous and writeable; the manager keeps a reference.
        `pieces` (a list of `Piece`): what the param holds of which global
        tensors; default, all of the global tensor `name`."""
        if not isinstance(array, np.ndarray):
            raise TypeError("register() takes a numpy array")
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError(f"param '{name}': array must be C-contiguous and writeable")
        wm_dtype = parse_dtype(dtype if dtype is not None else array.dtype)
        if wm_dtype.itemsize != array.dtype.itemsize:
            raise ValueError(f"param '{name}': dtype {wm_dtype.name} needs {wm_dtype.itemsize}-byte "
                             f"items, the array has {array.dtype.itemsize}")
        self._register_memory(name, array.ctypes.data, array.nbytes, wm_dtype, array.shape, HOST, array,
                              pieces)

    def _register_memory(self, name: str, ptr: int, nbytes: int, dtype: DType, shape, device: int,
                         owner, pieces=None) -> None:
        """wm_register_param for host (device HOST) or CUDA memory; `owner`
        (the array or tensor) is kept alive as long as the manager."""
        self._register_all([(name, ptr, nbytes, dtype, shape, device, owner, pieces)])

    def _register_all(self, items) -> None:
        """wm_register_params of (name, ptr, nbytes, dtype, shape, device,
        owner, pieces) items: every one or none (a refused one is named by
        its place, and the call registers nothing, so the caller can fix it
        and register them again). Each `owner` is kept alive as long as
        the manager. An empty batch is still checked (refused where
        registering is: busy, or closed after the first update or clear)."""
        regs = (_lib.ParamRegistration * len(items))()
        keep = []
        for reg, (name, ptr, nbytes, dtype, shape, device, _owner, pieces) in zip(regs, items):
            d, k = self._desc(name, dtype, shape, pieces)
            if device != HOST:
                d.memory, d.device_ordinal = MEMORY_DEVICE, device
            keep.append((d, k))
            reg.desc, reg.data, reg.len = ctypes.pointer(d), ptr or None, nbytes
        self._check(LIB.wm_register_params(self._h(), regs, len(items)))
        for name, *_, owner, _pieces in items:
            self._params[name] = owner
            self._engine_owned.add(name)

    def register_module(self, module, name_map=None, prefix: str = "") -> RegisteredModule:
        """Register every tensor of a torch.nn.Module's state_dict (parameters
        and persistent buffers, CPU or CUDA) as an engine-owned param at the
        tensor's own memory: updates write the module's weights in place.

        The published name of module name `n` is `name_map(prefix + n)`
        (a callable, or a dict: names it lacks stay as they are; None skips
        the tensor). Tied tensors (one memory under several names) are
        registered once, under the first name, as Publisher.add_state_dict
        publishes them; the others are in the result's `aliases`.
        Non-contiguous tensors are refused, naming them. All or nothing: a
        tensor refused (a name already registered, memory shared with a
        param registered before) fails the call naming it and its place,
        and none of the module's tensors is registered.

        The library writes the memory directly: autograd does not see it
        (like a write under torch.no_grad(), but the tensors' version
        counters are not bumped either), so do not update while a backward
        pass still needs the old values."""
        named = []
        for name, tensor in torch_bridge.module_state(module):
            published = torch_bridge.map_name(prefix + name, name_map)
            if published is not None:
                named.append((published, tensor))
        unique, aliases = torch_bridge.unique_memory(named)
        torch_bridge.check_disjoint(unique)
        self._register_all([(name, mem.ptr, mem.nbytes, mem.dtype, mem.shape, mem.device, tensor, None)
                            for name, tensor, mem in unique])
        return RegisteredModule({name: tensor for name, tensor, _ in unique}, aliases)

    def quantize_module(self, registered: RegisteredModule, scheme="fp8_block128",
                        scales_suffix: str = "_scale_inv") -> list:
        """Declare every float8_e4m3fn tensor of a registered module that
        has its scales beside it (the same name plus `scales_suffix`, as
        DeepSeek-V3 / Kimi-K2 FP8 checkpoints name `weight_scale_inv`) as
        quantized with `scheme` (see quantize()): updates then fill both
        from the trainer's bf16/f16/f32 tensors of the weight's name.
        Returns the weights declared; a float8 tensor without scales is
        left as it is (copied as its source holds it)."""
        declared = []
        for name, tensor in registered.params.items():
            scales = name + scales_suffix
            if parse_dtype(tensor.dtype) == DType.F8_E4M3 and scales in registered.params:
                self.quantize(name, scales, scheme)
                declared.append(name)
        return declared

    def allocate(self, name: str, dtype, shape, pieces=None, *, device: Optional[int] = None):
        """Allocate a library-owned param; `pieces` as for register().

        Host (`device` None): returns a numpy view of its memory. On GPU
        `device` (CUDA VMM memory): returns a `DeviceArray`, viewable through
        `__cuda_array_interface__` (`torch.as_tensor(a, device="cuda")`).
        Either stays valid at the same address until close(): a clear()
        gives the memory back but keeps the address, and the next update
        maps memory in there again, so kernels (and captured CUDA graphs)
        that read it need no new pointer. Between a clear() and that update
        the address holds no memory: do not run them then."""
        wm_dtype = parse_dtype(dtype)
        d, keep = self._desc(name, wm_dtype, shape, pieces)
        if device is not None:
            d.memory, d.device_ordinal = MEMORY_DEVICE, device
        ptr, n = ctypes.c_void_p(), ctypes.c_size_t()
        self._check(LIB.wm_allocate_param(self._h(), ctypes.byref(d), ctypes.byref(ptr), ctypes.byref(n)))
        if device is not None:
            arr = DeviceArray(ptr.value or 0, n.value, device, wm_dtype, tuple(shape))
            self._params[name] = arr
            return arr
        arr = _array_at(ptr.value or 0, n.value, wm_dtype, shape, self._keeper)
        self._params[name] = arr
        return arr

    def quantize(self, weight: str, scales: str, scheme="fp8_block128") -> None:
        """Declare that registered param `weight` (float8_e4m3fn) holds its
        global tensors quantized with `scheme` ("fp8_block128": one f32
        scale_inv per 128x128 block of the last two dimensions, scales
        shaped [..., ceil(M/128), ceil(N/128)]; "fp8_tensor": one for the
        whole tensor; "mxfp8": one E8M0 byte per 32 elements along the last
        dimension, scales uint8 shaped [..., ceil(N/32)]),
        its scales in registered param `scales` (float32, or uint8 for
        mxfp8, registered without pieces). Updates then take the global
        bf16, f16 or f32 tensors (verified against their checksums when the
        update verifies), and write both params together at
        commit, bit for bit as PyTorch computes
        `(x.float() * (448 / amax)).to(torch.float8_e4m3fn)` with amax =
        max(|x|) per block clamped at 1e-4, scale_inv = amax / 448 (mxfp8:
        e = clamp(floor(log2(amax)) - 8, -127, 127) from amax's f32
        exponent, q = (x.float() / torch.exp2(e.float())).clamp(-448,
        448).to(float8_e4m3fn),
        scale byte e + 127; see the README). A NaN or
        infinity fails the update naming the tensor and the element. Both
        params in host memory, or both on one GPU (device params: a CUDA
        kernel compiled by NVRTC quantizes there, bit for bit the same;
        set WM_NVRTC_LIB to a libnvrtc.so, e.g. the one PyTorch's wheels
        ship, if the loader does not find one). Like registering: only
        before the first update or clear."""
        s = QuantScheme.parse(scheme)
        weight_b = _lib.name_bytes("quantize: the weight param's name", weight)
        scales_b = _lib.name_bytes("quantize: the scales param's name", scales)
        self._check(LIB.wm_quantize_param(self._h(), weight_b, scales_b, int(s)))

    # -- the engine's calls -------------------------------------------------
    def update(self, location=None, version: Optional[str] = None, *, source: str = "snapshot",
               verify: bool = False, in_place: bool = False, skip_unknown: bool = False,
               timeout: Optional[float] = None,
               progress: Union[bool, Callable[[Progress], Optional[bool]], None] = None,
               on_tensor: Optional[Callable[[str, np.ndarray], None]] = None,
               deltas: Optional[bool] = None) -> UpdateStats:
        """Update the params. `location`: one location (snapshot dir or
        file, socket path, host:port) or a list of them (several publishers,
        one per trainer rank, serving one version together; "@FILE" names a
        file listing locations, one per line). `progress`: a callable
        (returning False cancels), or True for a bar on stderr when it is a
        terminal (bytes, GB/s, tensors) and one final line otherwise;
        `on_tensor` receives (name, read-only array valid only during the
        call: copy what you keep) for
        every tensor, plus a `Placement` (which box of the global tensor it
        is) when it takes a third argument, and replaces the plain copy into
        registered params. From a trainer's
        GPU version (CUDA IPC, in place) the array is a `DeviceArray`: GPU
        memory, viewable through `__cuda_array_interface__`.

        `deltas`: None (default) takes each run as its changes since the
        version the params hold over the network (rdma) when the publisher
        keeps it, and whole over IPC; True takes deltas over IPC too; False
        never. `stats.deltas` says what happened.

        Ctrl-C meanwhile (on the main thread) closes the manager, which
        cancels the update, and raises KeyboardInterrupt at once (the same
        for stage(), commit() and Publisher.serve())."""
        req, keep = _request(location, version, source, verify, in_place, skip_unknown, timeout,
                             deltas)
        raised = []
        bar = None
        if progress is True:
            bar = ProgressBar()
            progress = bar.on_progress
        if progress is not None and progress is not False:
            def _progress(_u, p):
                try:
                    go = progress(Progress(p[0].bytes_done, p[0].bytes_total, p[0].tensors_done,
                                           p[0].tensors_total))
                    return 1 if go is False else 0
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    raised.append(e)
                    return 1
            req.progress_callback = _lib.PROGRESS_CALLBACK(_progress)
        if on_tensor is not None:
            with_placement = _takes_placement(on_tensor)

            def _tensor(_u, t):
                try:
                    t = t[0]
                    dtype = DType(t.dtype)
                    shape = [t.shape[i] for i in range(t.ndim)]
                    if t.device >= 0:
                        view = DeviceArray(t.data or 0, t.len, t.device, dtype, tuple(shape))
                    else:
                        view = _array_at(t.data or 0, t.len, dtype, shape, None)
                        # The library's memory (zero-copy: the publisher's,
                        # mapped read-only): a write would crash the engine.
                        view.flags.writeable = False
                    if with_placement:
                        placement = Placement(tuple(t.global_shape[i] for i in range(t.ndim)),
                                              tuple(t.offset[i] for i in range(t.ndim)))
                        on_tensor(t.name.decode(), view, placement)
                    else:
                        on_tensor(t.name.decode(), view)
                    return 0
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    raised.append(e)
                    return 1
            req.tensor_callback = _lib.TENSOR_CALLBACK(_tensor)
        stats = _lib.UpdateStats()
        stats.struct_size = ctypes.sizeof(stats)
        held = self._held()
        h = held.handle
        with on_ctrl_c(self.close):
            rc = LIB.wm_update(h, ctypes.byref(req), ctypes.byref(stats))
        del keep  # the request's strings lived through the call
        if bar is not None and rc == 0:
            bar.finish(_stats(stats))
        elif bar is not None:
            bar.abort()
        if rc != 0:
            err = WeightManagerError(rc, last_error_text(LIB.wm_last_error, h))
            if raised:
                raise err from raised[0]
            raise err
        return _stats(stats, self._source_bytes(h), self._delta_stats(h))

    def stage(self, location=None, version: Optional[str] = None, *, source: str = "snapshot",
              verify: bool = False, skip_unknown: bool = False,
              timeout: Optional[float] = None, deltas: Optional[bool] = None) -> UpdateStats:
        """Stage the next version while the engine keeps serving: fetch,
        verify and hold every byte, the params untouched (memory for one
        more copy of what the update writes). Returns once staged, with the
        staged `version` and `sync` (the staging's time); the other fields
        are 0 until commit(). Then commit() switches, abort() drops it.
        Arguments as for update() (atomic only, no callbacks). One staged
        version at a time; update() is refused (busy) until the commit or
        abort; clear() drops it; close() aborts it."""
        req, keep = _request(location, version, source, verify, False, skip_unknown, timeout,
                             deltas)
        stats = _lib.UpdateStats()
        stats.struct_size = ctypes.sizeof(stats)
        held = self._held()
        with on_ctrl_c(self.close):
            rc = LIB.wm_stage(held.handle, ctypes.byref(req), ctypes.byref(stats))
        del keep  # the request's strings lived through the call
        raise_for(rc, LIB.wm_last_error, held.handle)
        return _stats(stats)

    def commit(self) -> UpdateStats:
        """Make the staged version the params' contents; `update` in the
        result is the pause (this call's time), `sync` the staging's receive
        time. Do not read the params while it runs. Nothing staged:
        WeightManagerError (ERR_STATE)."""
        stats = _lib.UpdateStats()
        stats.struct_size = ctypes.sizeof(stats)
        held = self._held()
        h = held.handle
        with on_ctrl_c(self.close):
            rc = LIB.wm_commit(h, ctypes.byref(stats))
        raise_for(rc, LIB.wm_last_error, h)
        return _stats(stats, self._source_bytes(h), self._delta_stats(h))

    def abort(self) -> None:
        """Drop the staged version (the old weights and version stay).
        Nothing staged: WeightManagerError (ERR_STATE)."""
        self._check(LIB.wm_abort(self._h()))

    def _delta_stats(self, h) -> DeltaStats:
        """What the last update's deltas did."""
        d = _lib.DeltaStats()
        d.struct_size = ctypes.sizeof(d)
        raise_for(LIB.wm_update_delta_stats(h, ctypes.byref(d)), LIB.wm_last_error, h)
        return DeltaStats(DeltaFallback(d.fallback), d.runs_delta, d.runs_whole, d.wire_bytes,
                          d.rewritten_bytes, d.base_version.decode())

    def _source_bytes(self, h) -> tuple:
        """Bytes of the runs the last update took from each of its sources
        (with deltas, stats.deltas has the wire bytes)."""
        n = ctypes.c_size_t()
        raise_for(LIB.wm_update_source_bytes(h, None, 0, ctypes.byref(n)), LIB.wm_last_error, h)
        out = (ctypes.c_uint64 * max(1, n.value))()
        raise_for(LIB.wm_update_source_bytes(h, out, n.value, ctypes.byref(n)), LIB.wm_last_error, h)
        return tuple(out[:n.value])

    def clear(self) -> None:
        """Release weight memory (library-owned params keep their addresses)."""
        held = self._held()
        raise_for(LIB.wm_clear(held.handle), LIB.wm_last_error, held.handle)

    def status(self) -> Status:
        s = _lib.StatusInfo()
        s.struct_size = ctypes.sizeof(s)
        self._check(LIB.wm_status(self._h(), ctypes.byref(s)))
        h = self._h()
        last = _stats(s.last_update, self._source_bytes(h), self._delta_stats(h)) if s.updates else None
        return Status(State(s.state), s.version.decode() or None, s.updates, s.params, s.param_bytes,
                      s.resident_bytes, Result(s.last_result), last,
                      s.device_bytes_freed, s.device_bytes_restored)

    def broadcast_signal(self) -> State:
        out = ctypes.c_int32()
        self._check(LIB.wm_broadcast_signal(self._h(), ctypes.byref(out)))
        return State(out.value)

    def close(self) -> None:
        """Close the manager: every call on it is refused from now on. An
        update, stage or commit running on another thread is cancelled, as
        wm_destroy cancels it in C (wm_shutdown): it raises
        WeightManagerError with Result.ERR_CANCELLED in that thread at its
        next batch boundary or when the wait it is in ends (within about 50
        ms of a wait on a silent trainer), and commits nothing more. close()
        does not wait for it. The handle is destroyed once no call runs on
        it and no array from allocate() is alive (it keeps the memory they
        view); the arrays given to register() are kept until then."""
        if self._handle is not None:
            LIB.wm_shutdown(self._handle)
            self._handle = None
            self._on_close()

    def _held(self) -> "_HandleKeeper":
        """The handle's keeper, for a call to hold while it runs: a close()
        on another thread meanwhile leaves the handle (and the arrays the
        call may write) alive until the call returns."""
        keeper = self._keeper
        if keeper is None or self._handle is None:
            self._h()  # raises: closed
        return keeper

    def _on_close(self) -> None:
        # The registered arrays live as long as the handle: a call running
        # on another thread (it holds the keeper) may still write them.
        # (Not the allocate() arrays: they hold the keeper themselves.)
        if self._keeper is not None:
            self._keeper.arrays = {n: self._params[n] for n in self._engine_owned}
        self._params.clear()
        # Destroys the handle unless an allocate() array or a running call
        # still holds it.
        self._keeper = None


class Controller(OwnedHandle):
    """The controller's side of the control cell (FastDeploy's protocol, see README "The worker loop and the controller"): what
    an engine's API server uses to ask every rank for an update or a clear."""

    OUTCOMES = ("done", "already_done", "busy", "refused")
    _what = "controller"
    _destroy = staticmethod(lambda h: LIB.wm_controller_destroy(h))

    def __init__(self, cell: str):
        handle = ctypes.c_void_p()
        rc = LIB.wm_controller_open(_lib.name_bytes("control cell", cell), ctypes.byref(handle))
        if rc != 0:
            raise create_error(rc, f"opening control cell '{cell}'")
        self._handle = handle

    def _check(self, rc: int):
        raise_for(rc, LIB.wm_controller_last_error, self._h())

    def get(self) -> State:
        out = ctypes.c_int32()
        self._check(LIB.wm_controller_get(self._h(), ctypes.byref(out)))
        return State(out.value)

    def set(self, state: State) -> None:
        self._check(LIB.wm_controller_set(self._h(), int(state)))

    def wait(self, state: State, timeout: float = 60.0) -> None:
        self._check(LIB.wm_controller_wait(self._h(), int(state), millis(timeout, "timeout")))

    def _request(self, action: State, timeout: float) -> str:
        out = ctypes.c_uint32()
        self._check(LIB.wm_controller_request(self._h(), int(action), millis(timeout, "timeout"),
                                              ctypes.byref(out)))
        return self.OUTCOMES[out.value]

    def request_update(self, timeout: float = 60.0) -> str:
        """Returns "done", "already_done" (up to date), "busy" or "refused";
        raises WeightManagerError when the engine failed or timed out."""
        return self._request(State.UPDATING, timeout)

    def request_clear(self, timeout: float = 60.0) -> str:
        return self._request(State.CLEARING, timeout)



def version() -> str:
    return LIB.wm_version().decode()
