"""Numbers shared with the C header: result codes, dtypes, states, flags."""

import enum
import operator

import numpy as np


class Result(enum.IntEnum):
    OK = 0
    ERR_NULL_ARGUMENT = 1
    ERR_INVALID_ARGUMENT = 2
    ERR_STRUCT_SIZE = 3
    ERR_STATE = 4
    ERR_BUSY = 5
    ERR_NOT_FOUND = 6
    ERR_IO = 7
    ERR_FORMAT = 8
    ERR_MISMATCH = 9
    ERR_CHECKSUM = 10
    ERR_TIMEOUT = 11
    ERR_UNSUPPORTED = 12
    ERR_NO_VERSION = 13
    ERR_OUT_OF_MEMORY = 14
    ERR_CALLBACK = 15
    ERR_CANCELLED = 16
    ERR_PEER = 17
    ERR_PANIC = 18
    ERR_INVALID_HANDLE = 19
    ERR_AUTH = 20


class WeightManagerError(Exception):
    """A failed call: `code` (a Result), and the library's message."""

    def __init__(self, code: int, message: str):
        try:
            self.code = Result(code)
        except ValueError:
            self.code = code
        self.message = message
        name = self.code.name if isinstance(self.code, Result) else str(code)
        super().__init__(f"WM_{name}: {message}")


class State(enum.IntEnum):
    NORMAL = 0
    UPDATING = 1
    CLEARING = -1
    CLEARED = -2
    FAILED = -3
    COMMIT = 2  # a signal only: every rank staged the same version; commit now


class Source(enum.IntEnum):
    SNAPSHOT = 0
    IPC = 1
    RDMA = 2
    GDR = 3


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    F8_E4M3 = 3
    F8_E5M2 = 4
    I8 = 5
    U8 = 6
    I32 = 7
    I64 = 8
    BOOL = 9
    F64 = 10
    I16 = 11
    U16 = 12
    U32 = 13
    U64 = 14

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self]


DTYPE_SIZES = {
    DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.F8_E4M3: 1, DType.F8_E5M2: 1,
    DType.I8: 1, DType.U8: 1, DType.I32: 4, DType.I64: 8, DType.BOOL: 1, DType.F64: 8,
    DType.I16: 2, DType.U16: 2, DType.U32: 4, DType.U64: 8,
}

# numpy dtype -> wm dtype. bf16 and the f8 types have no numpy dtype: pass
# dtype="bf16" (etc.) with an array of the same item size (uint16 / uint8).
NUMPY_TO_DTYPE = {
    np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16, np.dtype(np.float64): DType.F64,
    np.dtype(np.int8): DType.I8, np.dtype(np.uint8): DType.U8, np.dtype(np.int16): DType.I16,
    np.dtype(np.uint16): DType.U16, np.dtype(np.int32): DType.I32, np.dtype(np.uint32): DType.U32,
    np.dtype(np.int64): DType.I64, np.dtype(np.uint64): DType.U64, np.dtype(np.bool_): DType.BOOL,
}

# wm dtype -> numpy dtype used for arrays handed to Python (raw bits for bf16/f8).
DTYPE_TO_NUMPY = {v: k for k, v in NUMPY_TO_DTYPE.items()}
DTYPE_TO_NUMPY.update({DType.BF16: np.dtype(np.uint16), DType.F8_E4M3: np.dtype(np.uint8),
                       DType.F8_E5M2: np.dtype(np.uint8)})


# PyTorch's names that numpy does not know. E8M0 (MXFP8's scales) is held
# as its bytes: a u8 param.
TORCH_NAMES = {"float8_e4m3fn": DType.F8_E4M3, "float8_e5m2": DType.F8_E5M2, "bfloat16": DType.BF16,
               "float8_e8m0fnu": DType.U8}


def parse_dtype(value) -> DType:
    """A DType from a DType, a name ("bf16", "F8_E4M3"), a numpy dtype, or a
    torch dtype (torch.bfloat16; torch itself is never imported)."""
    if isinstance(value, DType):
        return value
    if type(value).__module__ == "torch":
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value in TORCH_NAMES:
        return TORCH_NAMES[value]
    if isinstance(value, str):
        key = value.upper().replace("BFLOAT16", "BF16").replace("FLOAT", "F")
        aliases = {"F8E4M3": "F8_E4M3", "F8E5M2": "F8_E5M2"}
        key = aliases.get(key, key)
        if key in DType.__members__:
            return DType[key]
    try:
        return NUMPY_TO_DTYPE[np.dtype(value)]
    except (TypeError, KeyError):
        raise ValueError(f"dtype {value!r} is not a weight_manager dtype") from None


# wm_update_request.flags
VERIFY_CHECKSUMS = 1
IN_PLACE = 2
SKIP_UNKNOWN = 4
SKIP_NETWORK_CHECKSUMS = 8
WHOLE = 16
DELTAS = 32


class QuantScheme(enum.IntEnum):
    """How a quantized param holds its global tensors (`wm_quant_scheme`)."""
    FP8_BLOCK128 = 1  # FP8 E4M3, one f32 scale_inv per 128x128 block of the last two dims
    FP8_TENSOR = 2  # FP8 E4M3, one f32 scale_inv for the whole tensor
    MXFP8 = 3  # FP8 E4M3, one E8M0 scale byte (uint8) per 32 elements of the last dim

    @staticmethod
    def parse(value) -> "QuantScheme":
        """A QuantScheme from itself or its name ("fp8_block128", "fp8_tensor", "mxfp8")."""
        if isinstance(value, QuantScheme):
            return value
        if isinstance(value, int) and value in {m.value for m in QuantScheme}:
            return QuantScheme(value)
        if isinstance(value, str) and value.upper() in QuantScheme.__members__:
            return QuantScheme[value.upper()]
        raise ValueError(f"quantization scheme {value!r} is not one of "
                         f"{[m.lower() for m in QuantScheme.__members__]}")


class DeltaFallback(enum.IntEnum):
    """Why runs of an update came whole (`wm_delta_fallback`)."""
    NONE = 0  # deltas asked for every run with a base
    NO_BASE = 1  # the params held no version (first update, after a clear or a FAILED update)
    REFUSED = 2  # the update asked for whole (deltas=False)
    NOT_KEPT = 3  # a publisher no longer keeps the base (or holds it laid out otherwise, or no FP8 image of it)
    DIFFERS = 4  # some params' bytes were not the base's: those runs came whole
    NOT_APPLICABLE = 5  # a snapshot, a tensor callback, or device params without NVRTC
    NOT_ASKED = 6  # an IPC update that did not ask for deltas (deltas=True)


def as_sizes(what: str, values) -> tuple:
    """Sizes (shapes, offsets, lengths) as ints: no bools, no floats (int()
    would cut 2.5 to 2 and take True as 1, silently giving another box).
    TypeError naming `what` and the index otherwise."""
    out = []
    for i, v in enumerate(values):
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{what}[{i}]: {v!r} is not a size (an int)") from None
    return tuple(out)


class Piece:
    """One piece of a param: the box `offset`/`length` (one value per
    dimension) of global tensor `tensor`, placed in the param starting at
    `at` (one value per param dimension; default: the param's start). The
    box and the param line up at their last dimension; a dimension only one
    side has counts as length 1 on the other, so a [out, in] expert tensor
    stacks into an [experts, out, in] param at (e, 0, 0)."""

    def __init__(self, tensor: str, offset, length, at=None):
        if not isinstance(tensor, str):
            raise TypeError(f"a piece's tensor must be a str (its global tensor's name), got "
                            f"{type(tensor).__name__} {tensor!r}")
        self.tensor = tensor
        self.offset = as_sizes(f"piece of '{tensor}': offset", offset)
        self.length = as_sizes(f"piece of '{tensor}': length", length)
        if len(self.offset) != len(self.length):
            raise ValueError(f"piece of '{tensor}': offset and length need one value per dimension each")
        self.at = None if at is None else as_sizes(f"piece of '{tensor}': at", at)

    @classmethod
    def whole(cls, tensor: str, shape, at=None) -> "Piece":
        """All of global tensor `tensor` of `shape`."""
        return cls(tensor, [0] * len(shape), shape, at)

    @classmethod
    def narrow(cls, tensor: str, global_shape, dim: int, start: int, length: int, at=None) -> "Piece":
        """Global tensor `tensor` narrowed to [start, start+length) along
        `dim` (a tensor-parallel split)."""
        offset, lengths = [0] * len(global_shape), list(global_shape)
        offset[dim], lengths[dim] = start, length
        return cls(tensor, offset, lengths, at)

    def __repr__(self) -> str:
        return f"Piece({self.tensor!r}, offset={self.offset}, length={self.length}, at={self.at})"
