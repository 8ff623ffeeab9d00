"""ctypes declarations mirroring include/weight_manager.h.

The header is the source of truth; the `Structure`s below are written out
by hand, in the header's order, and `python/tests/test_abi_layout.py` holds
them to it: it compiles a C program against the header and compares every
struct's size and every field's name, order, offset and size. They are not
generated from the header at import time because an installed package does
not carry the header, and a build step would be one more thing a pure-Python
package has to run. Adding a field in Rust therefore means regenerating the
header and adding the field here; the test fails until both are done (the
`*_init` functions write `sizeof` of the C struct into these buffers).

The library is found, in order: the WM_LIBRARY environment variable (a path
to libweight_manager.so), the copy bundled in this package by the wheel
(`pip install .`), target/release and target/debug of the source tree this
package sits in, then the system loader path.
"""

import ctypes
import ctypes.util
import operator
import os
from pathlib import Path

from .types import Result, WeightManagerError

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p

# ctypes wraps an integer that does not fit its C type (2**32 + 1 becomes 1
# in a uint32_t) and cuts text at a NUL byte, silently: a rank, a piece's
# offset or a name would reach the library as another value. Every struct
# field, array and function argument below is checked first, and such a
# value is refused with ERR_INVALID_ARGUMENT naming it.
_INT_TYPES = (ctypes.c_int8, ctypes.c_uint8, ctypes.c_int16, ctypes.c_uint16, ctypes.c_int32, ctypes.c_uint32,
              ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint, ctypes.c_long,
              ctypes.c_ulong)


def _int_range(ctype) -> tuple:
    bits = 8 * ctypes.sizeof(ctype)
    signed = ctype(-1).value == -1
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def check_value(what: str, ctype, value) -> None:
    """Refuse an integer outside `ctype`'s range and text holding NUL
    (anything else is left to ctypes, which raises on a wrong type)."""
    if ctype in _INT_TYPES and not isinstance(value, float):
        try:
            v = operator.index(value)
        except TypeError:
            return
        lo, hi = _int_range(ctype)
        if not lo <= v <= hi:
            raise WeightManagerError(Result.ERR_INVALID_ARGUMENT,
                                     f"{what}: {v} does not fit ({lo} to {hi})")
    elif ctype is c_char_p and isinstance(value, (bytes, bytearray)) and b"\0" in value:
        raise WeightManagerError(Result.ERR_INVALID_ARGUMENT, f"{what}: {bytes(value)!r} holds a NUL byte")


def name_bytes(what: str, value) -> bytes:
    """A name (a param's, a tensor's, a version's) for the library: a str,
    encoded; anything else is a TypeError naming `what`, not an
    AttributeError from deep inside the binding."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    return value.encode()


def array(ctype, values, what: str):
    """A C array of `values`, each checked against `ctype` (at least one
    element, so its address is never NULL)."""
    values = list(values)
    for i, v in enumerate(values):
        check_value(f"{what}[{i}]", ctype, v)
    return (ctype * max(len(values), 1))(*values)


class _Struct(ctypes.Structure):
    """A header struct whose integer and text fields are checked when set."""

    def __setattr__(self, name, value):
        ctype = dict(self._fields_).get(name)
        if ctype is not None:
            check_value(f"{type(self).__name__}.{name}", ctype, value)
        super().__setattr__(name, value)

VERSION_BUF = 256
MAX_NDIM = 8
MAX_PIECES = 1 << 20  # WM_MAX_PIECES


def _find_library() -> str:
    env = os.environ.get("WM_LIBRARY")
    if env:
        return env
    here = Path(__file__).resolve().parent
    bundled = here / "libweight_manager.so"
    if bundled.exists():
        return str(bundled)
    root = here.parent.parent
    for profile in ("release", "debug"):
        candidate = root / "target" / profile / "libweight_manager.so"
        if candidate.exists():
            return str(candidate)
    found = ctypes.util.find_library("weight_manager")
    if found:
        return found
    raise OSError(
        f"libweight_manager.so not found: not bundled in {here} (install the wheel: "
        "`pip install .`), not in this source tree's target/ (`cargo build --release`), "
        "not on the loader path; or set WM_LIBRARY to its path"
    )


LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_void_p, ctypes.c_uint32, c_char_p)
RELEASE_CALLBACK = ctypes.CFUNCTYPE(None, c_void_p, c_char_p, c_void_p, ctypes.c_size_t)
ACQUIRE_CALLBACK = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_char_p, c_void_p, ctypes.c_size_t)


class GroupConfig(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("name", c_char_p),
        ("local_world_size", ctypes.c_uint32),
        ("local_rank", ctypes.c_uint32),
        ("node_rank", ctypes.c_uint32),
        ("rendezvous_addr", c_char_p),
        ("signal_timeout_ms", ctypes.c_uint64),
    ]


class NetConfig(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("bucket_size", ctypes.c_uint64),
        ("secret", c_char_p),
        ("depth", ctypes.c_uint32),
        ("gdr_fallback", ctypes.c_uint32),
        ("staged", ctypes.c_uint32),
        ("keyed_digests", ctypes.c_uint32),
    ]


class FanoutConfig(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("group", ctypes.c_int32),
        ("nccl_library", c_char_p),
    ]


class MemoryConfig(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("release_callback", RELEASE_CALLBACK),
        ("acquire_callback", ACQUIRE_CALLBACK),
        ("callback_user_data", c_void_p),
        ("callback_staging_limit", ctypes.c_uint64),
        ("free_atomic_staging", ctypes.c_uint32),
        ("swap_device_params", ctypes.c_uint32),
    ]


class Config(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("rank", ctypes.c_uint32),
        ("world_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("model_dir", c_char_p),
        ("fallback_dir", c_char_p),
        ("control_cell", c_char_p),
        ("log_level", ctypes.c_uint32),
        ("log_callback", LOG_CALLBACK),
        ("log_user_data", c_void_p),
        ("copy_threads", ctypes.c_uint32),
        ("allow_other_uids", ctypes.c_uint32),
        ("group", ctypes.POINTER(GroupConfig)),
        ("net", ctypes.POINTER(NetConfig)),
        ("fanout", ctypes.POINTER(FanoutConfig)),
        ("memory", ctypes.POINTER(MemoryConfig)),
    ]


class Piece(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("tensor", c_char_p),
        ("ndim", ctypes.c_size_t),
        ("offset", ctypes.c_uint64 * MAX_NDIM),
        ("len", ctypes.c_uint64 * MAX_NDIM),
        ("param_offset", ctypes.c_uint64 * MAX_NDIM),
    ]


class ParamDesc(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32),
        ("memory", ctypes.c_uint32),
        ("device_ordinal", ctypes.c_int32),
        ("name", c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("ndim", ctypes.c_size_t),
        ("pieces", ctypes.POINTER(Piece)),
        ("npieces", ctypes.c_size_t),
    ]


class ParamRegistration(ctypes.Structure):
    """One element of wm_register_params' array (fixed: no struct_size)."""
    _fields_ = [
        ("desc", ctypes.POINTER(ParamDesc)),
        ("data", c_void_p),
        ("len", ctypes.c_size_t),
    ]


class Progress(_Struct):
    _fields_ = [
        ("bytes_done", ctypes.c_uint64),
        ("bytes_total", ctypes.c_uint64),
        ("tensors_done", ctypes.c_uint64),
        ("tensors_total", ctypes.c_uint64),
    ]


class TensorView(_Struct):
    _fields_ = [
        ("name", c_char_p),
        ("dtype", ctypes.c_uint32),
        ("ndim", ctypes.c_size_t),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("data", c_void_p),
        ("len", ctypes.c_size_t),
        ("device", ctypes.c_int32),
        ("global_shape", ctypes.POINTER(ctypes.c_uint64)),
        ("offset", ctypes.POINTER(ctypes.c_uint64)),
    ]


PROGRESS_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, c_void_p, ctypes.POINTER(Progress))
TENSOR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, c_void_p, ctypes.POINTER(TensorView))


class UpdateRequest(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("source", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("location", c_char_p),
        ("version", c_char_p),
        ("timeout_ms", ctypes.c_uint64),
        ("progress_callback", PROGRESS_CALLBACK),
        ("progress_user_data", c_void_p),
        ("tensor_callback", TENSOR_CALLBACK),
        ("tensor_user_data", c_void_p),
        ("locations", ctypes.POINTER(c_char_p)),
        ("nlocations", ctypes.c_size_t),
    ]


class UpdateStats(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("rank", ctypes.c_uint32),
        ("tensors", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("sync_ns", ctypes.c_uint64),
        ("update_ns", ctypes.c_uint64),
        ("total_ns", ctypes.c_uint64),
        ("plan_ns", ctypes.c_uint64),
        ("plan_reused", ctypes.c_uint32),
        ("sources", ctypes.c_uint32),
        ("version", ctypes.c_char * VERSION_BUF),
    ]


class DeltaStats(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("fallback", ctypes.c_uint32),
        ("runs_delta", ctypes.c_uint64),
        ("runs_whole", ctypes.c_uint64),
        ("wire_bytes", ctypes.c_uint64),
        ("rewritten_bytes", ctypes.c_uint64),
        ("base_version", ctypes.c_char * VERSION_BUF),
    ]


class StatusInfo(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("state", ctypes.c_int32),
        ("last_result", ctypes.c_uint32),
        ("updates", ctypes.c_uint64),
        ("params", ctypes.c_uint64),
        ("param_bytes", ctypes.c_uint64),
        ("resident_bytes", ctypes.c_uint64),
        ("version", ctypes.c_char * VERSION_BUF),
        ("last_update", UpdateStats),
        ("device_bytes_freed", ctypes.c_uint64),
        ("device_bytes_restored", ctypes.c_uint64),
    ]


class PublisherConfig(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("buffers", ctypes.c_uint32),
        ("bucket_size", ctypes.c_uint64),
        ("socket_mode", ctypes.c_uint32),
        ("allow_other_uids", ctypes.c_uint32),
        ("bucket_timeout_ms", ctypes.c_uint64),
        ("checksums", ctypes.c_uint32),
        ("keep_versions", ctypes.c_uint32),
        ("secret", c_char_p),
    ]


class TensorDesc(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("name", c_char_p),
        ("dtype", ctypes.c_uint32),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("ndim", ctypes.c_size_t),
        ("data", c_void_p),
        ("len", ctypes.c_size_t),
        ("memory", ctypes.c_uint32),
        ("device_ordinal", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("global_shape", ctypes.POINTER(ctypes.c_uint64)),
        ("offset", ctypes.POINTER(ctypes.c_uint64)),
    ]


class ShardPlacement(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("global_shape", ctypes.POINTER(ctypes.c_uint64)),
        ("offset", ctypes.POINTER(ctypes.c_uint64)),
    ]


class ServeStats(_Struct):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("sessions", ctypes.c_uint32),
        ("bytes", ctypes.c_uint64),
        ("pack_ns", ctypes.c_uint64),
        ("wait_ns", ctypes.c_uint64),
        ("total_ns", ctypes.c_uint64),
    ]


def default_ucx() -> None:
    """Point the library at the libucx-cu12 wheel's UCX when that wheel is
    installed (`pip install weight_manager[ucx]`) and WM_UCX_LIB is not set.

    The Rust side loads libucp on the first network update, from WM_UCX_LIB
    or else the system loader path, and refuses a UCX older than 1.14 (1.13,
    Debian 12's, can abort the process when a publisher dies mid-update).
    The wheel's UCX (1.22) is a current one wherever pip runs; setting the
    variable here, before first use, also reaches `wm` processes started
    from Python. A WM_UCX_LIB already set wins: `WM_UCX_LIB=libucp.so.0`
    picks the system's (on RDMA clusters the wheel, built without verbs,
    has no InfiniBand transports). Only the module's location is looked up:
    importing `libucx` would load its libraries into this process.
    """
    if "WM_UCX_LIB" in os.environ:
        return
    import importlib.util

    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return
    for d in (spec.submodule_search_locations or []) if spec else []:
        libucp = Path(d) / "lib" / "libucp.so.0"
        if libucp.is_file():
            os.environ["WM_UCX_LIB"] = str(libucp)
            return


# Every function the binding calls: name -> (restype, argtypes), each
# checked against the header's declaration by python/tests/test_abi_layout.py.
R = ctypes.c_uint32  # wm_result
M = c_void_p  # wm_manager *
PROTOTYPES = {
    "wm_version": (c_char_p, []),
    "wm_result_text": (c_char_p, [ctypes.c_uint32]),
    "wm_state_name": (c_char_p, [ctypes.c_int32]),
    "wm_config_init": (R, [ctypes.POINTER(Config)]),
    "wm_group_config_init": (R, [ctypes.POINTER(GroupConfig)]),
    "wm_net_config_init": (R, [ctypes.POINTER(NetConfig)]),
    "wm_fanout_config_init": (R, [ctypes.POINTER(FanoutConfig)]),
    "wm_memory_config_init": (R, [ctypes.POINTER(MemoryConfig)]),
    "wm_init": (R, [ctypes.POINTER(Config), ctypes.POINTER(M)]),
    "wm_destroy": (None, [M]),
    "wm_shutdown": (R, [M]),
    "wm_last_error": (R, [M, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "wm_param_desc_init": (R, [ctypes.POINTER(ParamDesc)]),
    "wm_piece_init": (R, [ctypes.POINTER(Piece)]),
    "wm_piece_narrow": (R, [ctypes.POINTER(Piece), c_char_p, ctypes.POINTER(ctypes.c_uint64),
                            ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64]),
    "wm_register_param": (R, [M, ctypes.POINTER(ParamDesc), c_void_p, ctypes.c_size_t]),
    "wm_register_params": (R, [M, ctypes.POINTER(ParamRegistration), ctypes.c_size_t]),
    "wm_allocate_param": (
        R,
        [M, ctypes.POINTER(ParamDesc), ctypes.POINTER(c_void_p), ctypes.POINTER(ctypes.c_size_t)],
    ),
    "wm_quantize_param": (R, [M, c_char_p, c_char_p, ctypes.c_uint32]),
    "wm_update_request_init": (R, [ctypes.POINTER(UpdateRequest)]),
    "wm_update": (R, [M, ctypes.POINTER(UpdateRequest), ctypes.POINTER(UpdateStats)]),
    "wm_clear": (R, [M]),
    "wm_stage": (R, [M, ctypes.POINTER(UpdateRequest), ctypes.POINTER(UpdateStats)]),
    "wm_commit": (R, [M, ctypes.POINTER(UpdateStats)]),
    "wm_abort": (R, [M]),
    "wm_status": (R, [M, ctypes.POINTER(StatusInfo)]),
    "wm_update_delta_stats": (R, [M, ctypes.POINTER(DeltaStats)]),
    "wm_update_source_bytes": (
        R,
        [M, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "wm_broadcast_signal": (R, [M, ctypes.POINTER(ctypes.c_int32)]),
    "wm_controller_open": (R, [c_char_p, ctypes.POINTER(c_void_p)]),
    "wm_controller_destroy": (None, [c_void_p]),
    "wm_controller_get": (R, [c_void_p, ctypes.POINTER(ctypes.c_int32)]),
    "wm_controller_set": (R, [c_void_p, ctypes.c_int32]),
    "wm_controller_request": (R, [c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint32)]),
    "wm_controller_wait": (R, [c_void_p, ctypes.c_int32, ctypes.c_uint64]),
    "wm_publisher_config_init": (R, [ctypes.POINTER(PublisherConfig)]),
    "wm_publisher_create": (R, [c_char_p, ctypes.POINTER(PublisherConfig), ctypes.POINTER(c_void_p)]),
    "wm_publisher_create_net": (R, [c_char_p, ctypes.POINTER(PublisherConfig), ctypes.POINTER(c_void_p)]),
    "wm_publisher_address": (
        R,
        [c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "wm_publisher_publish": (R, [c_void_p]),
    "wm_publisher_prepare": (R, [c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]),
    "wm_publisher_destroy": (None, [c_void_p]),
    # The one add call; the header's four positional add calls are
    # deprecated and not declared here.
    "wm_tensor_desc_init": (R, [ctypes.POINTER(TensorDesc)]),
    "wm_publisher_add": (R, [c_void_p, ctypes.POINTER(TensorDesc)]),
    "wm_publisher_add_all": (R, [c_void_p, ctypes.POINTER(TensorDesc), ctypes.c_size_t]),
    "wm_publisher_set_dir": (R, [c_void_p, c_char_p]),
    "wm_publisher_set_version": (R, [c_void_p, c_char_p]),
    "wm_publisher_clear": (R, [c_void_p]),
    "wm_publisher_serve": (R, [c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.POINTER(ServeStats)]),
    "wm_publisher_last_error": (
        R,
        [c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "wm_controller_last_error": (
        R,
        [c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "wm_last_create_error": (R, [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
}


class _Checked:
    """A library function whose integer and text arguments are checked
    (`check_value`) before ctypes converts them."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.checks = [(i, t) for i, t in enumerate(fn.argtypes) if t in _INT_TYPES or t is c_char_p]

    @property
    def restype(self):
        return self.fn.restype

    @property
    def argtypes(self):
        return self.fn.argtypes

    def __call__(self, *args):
        for i, t in self.checks:
            if i < len(args):
                check_value(f"{self.name}: argument {i + 1}", t, args[i])
        return self.fn(*args)


class _Library:
    """The loaded library: its functions, checked (see `_Checked`)."""

    def __init__(self, lib: ctypes.CDLL):
        self.cdll = lib
        for name, (restype, argtypes) in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, _Checked(name, fn) if argtypes else fn)

    def __getattr__(self, name):
        # A function the binding does not declare (tests call a few): as
        # ctypes finds it, unchecked.
        return getattr(self.cdll, name)


def load() -> "_Library":
    default_ucx()
    return _Library(ctypes.CDLL(_find_library()))


LIB = load()
