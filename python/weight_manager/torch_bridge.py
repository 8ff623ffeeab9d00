"""PyTorch tensors seen as the library sees memory: (pointer, bytes, dtype,
shape, device). Duck-typed: this module never imports torch, so the package
works without it; torch objects only arrive when a caller passes them.

Publisher.add_state_dict / add_torch and Manager.register_module map each
tensor through `tensor_memory` and then use the same calls as numpy arrays
and raw device pointers; nothing here talks to the library.
"""

import warnings
from dataclasses import dataclass

from .types import DType, parse_dtype

HOST = -1  # TensorMemory.device of CPU memory

CONTIGUOUS_POLICIES = ("refuse", "copy")


@dataclass(frozen=True)
class TensorMemory:
    """Where a tensor's bytes are: `device` is HOST (-1) or a CUDA ordinal."""
    ptr: int
    nbytes: int
    dtype: DType
    shape: tuple
    device: int

    def key(self) -> tuple:
        """Identity of the memory: tensors with equal keys are the same
        bytes seen twice (tied weights)."""
        return (self.ptr, self.nbytes, self.device, self.dtype, self.shape)


def is_tensor(obj) -> bool:
    """A torch.Tensor, recognized by the attributes this module uses."""
    return all(hasattr(obj, a) for a in ("data_ptr", "element_size", "numel", "is_contiguous",
                                         "device", "dtype", "shape"))


def _require_tensor(name: str, obj) -> None:
    if not is_tensor(obj):
        raise TypeError(f"'{name}' is a {type(obj).__name__}, not a torch.Tensor")


def _device_ordinal(name: str, tensor) -> int:
    device = tensor.device
    # Tensor-likes without device.type say is_cuda (as torch tensors also do).
    kind = getattr(device, "type", "cuda" if getattr(tensor, "is_cuda", False) else "cpu")
    if kind == "cpu":
        return HOST
    if kind == "cuda":
        return 0 if device.index is None else int(device.index)
    raise ValueError(f"tensor '{name}' is on device '{device}': only cpu and cuda tensors are supported")


def _require_strided(name: str, tensor) -> None:
    """A torch tensor with a dense (strided) layout, else raise naming it
    (a sparse one has no strides to be contiguous in)."""
    _require_tensor(name, tensor)
    layout = str(getattr(tensor, "layout", "torch.strided"))
    if layout != "torch.strided":
        raise ValueError(f"tensor '{name}' has layout {layout}: only dense (strided) tensors are supported")


def tensor_memory(name: str, tensor) -> TensorMemory:
    """The memory of a contiguous, strided torch tensor; raises naming the
    tensor when its dtype, layout, device or strides do not fit."""
    _require_strided(name, tensor)
    try:
        dtype = parse_dtype(tensor.dtype)
    except ValueError:
        raise ValueError(f"tensor '{name}' has dtype {tensor.dtype}, which weight_manager does not support "
                         f"(supported: {', '.join(d.name.lower() for d in DType)})") from None
    device = _device_ordinal(name, tensor)
    if not tensor.is_contiguous():
        raise ValueError(f"tensor '{name}' is not contiguous{_strides(tensor)}; "
                         f"pass a contiguous tensor (.contiguous())")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if dtype.itemsize != int(tensor.element_size()):
        raise ValueError(f"tensor '{name}': dtype {tensor.dtype} has {tensor.element_size()}-byte items, "
                         f"{dtype.name} needs {dtype.itemsize}")
    return TensorMemory(int(tensor.data_ptr()), nbytes, dtype, tuple(int(d) for d in tensor.shape), device)


def _strides(tensor) -> str:
    stride = getattr(tensor, "stride", None)
    return f" (strides {tuple(stride())})" if callable(stride) else ""


def contiguous_for_publishing(name: str, tensor, policy: str):
    """The tensor to publish for a state_dict entry: itself when contiguous;
    otherwise, by `policy`, refused ("refuse", naming it) or copied now
    ("copy", with a warning naming it: the copy is a snapshot, so later
    in-place changes to the original are not served until it is added again)."""
    if policy not in CONTIGUOUS_POLICIES:
        raise ValueError(f"contiguous must be one of {CONTIGUOUS_POLICIES}, not {policy!r}")
    _require_strided(name, tensor)
    if tensor.is_contiguous():
        return tensor
    if policy == "refuse":
        raise ValueError(f"tensor '{name}' is not contiguous{_strides(tensor)}; "
                         f"make it contiguous or pass contiguous=\"copy\"")
    warnings.warn(f"weight_manager: tensor '{name}' is not contiguous; publishing a contiguous copy "
                  f"taken now (later in-place changes to it are not served until it is added again)",
                  stacklevel=3)
    return tensor.contiguous()


def unique_memory(named_tensors):
    """Split (name, tensor) pairs into the first name of each distinct
    memory and the tied names: returns ([(name, tensor, TensorMemory)],
    {tied name: first name}). Tied weights (an embedding shared with the
    output layer) appear under several names of one state_dict; their bytes
    are published and registered once, under the first name, so no two
    params overlap and both sides agree on which name carries them."""
    first = {}
    unique, aliases = [], {}
    for name, tensor in named_tensors:
        mem = tensor_memory(name, tensor)
        key = mem.key()
        if mem.nbytes and key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        unique.append((name, tensor, mem))
    return unique, aliases


def check_disjoint(unique) -> None:
    """Refuse, before anything is registered, two distinct tensors of
    `unique` (unique_memory's first list) whose memory overlaps (a buffer
    viewed with another shape or dtype): a param's memory takes one
    tensor's bytes, and the library would refuse the second param midway."""
    spans = sorted((mem.device, mem.ptr, mem.ptr + mem.nbytes, name)
                   for name, _, mem in unique if mem.nbytes)
    for (dev_a, _, end_a, a), (dev_b, start_b, _, b) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            raise ValueError(f"tensors '{a}' and '{b}' share memory without being the same tensor (a view "
                             f"with another shape or dtype): register one of them (name_map can skip the other)")


def module_state(module):
    """A module's (name, tensor) pairs as its state_dict names them (every
    parameter and persistent buffer, tied names included), as the module's
    own tensors: the same names a trainer's `model.state_dict()` publishes.
    Non-persistent buffers are left out: a trainer's state_dict has none."""
    own = {int(t.data_ptr()) for _, t in module.named_parameters(remove_duplicate=False)}
    own |= {int(t.data_ptr()) for _, t in module.named_buffers(remove_duplicate=False)}
    pairs = list(module.state_dict(keep_vars=True).items())
    for name, tensor in pairs:
        _require_tensor(name, tensor)
        if tensor.numel() and int(tensor.data_ptr()) not in own:
            # A state_dict hook returned a copy: updating it would not reach the module.
            raise ValueError(f"state_dict entry '{name}' is not the memory of a parameter or buffer of "
                             f"the module (a state_dict hook made a copy?)")
    return pairs


def map_name(name: str, name_map):
    """The published name of module name `name` (None: not registered)."""
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


@dataclass(frozen=True)
class ShardPlacement:
    """Where a local tensor sits in its global tensor: the global shape and
    the offset of the local box in it, per dimension."""
    global_shape: tuple
    offset: tuple


def is_dtensor(obj) -> bool:
    """A torch.distributed.tensor.DTensor, recognized by the attributes this
    module uses (never by importing torch)."""
    return all(hasattr(obj, a) for a in ("placements", "device_mesh", "to_local", "shape"))


def _placement_kind(name: str, placement) -> str:
    """"shard" or "replicate"; anything else (partial sums, strided shards
    of FSDP2 under TP) is refused naming the tensor."""
    kind = type(placement).__name__
    if kind == "Shard" and isinstance(getattr(placement, "dim", None), int):
        return "shard"
    if kind == "Replicate":
        return "replicate"
    raise ValueError(f"tensor '{name}': DTensor placement {placement!r} is not supported "
                     f"(Shard(dim) and Replicate() are; reduce a Partial, or redistribute first)")


def shard_box(global_shape, mesh_shape, coordinate, placements, name: str = "tensor"):
    """(local shape, global offset) of the mesh coordinate `coordinate`, by
    PyTorch's rule: mesh dims in order, Shard(d) splits the current extent
    of dim d into chunks of ceil(n / k), so the last chunks may be shorter
    or empty (an empty chunk's offset is the global size, as PyTorch says);
    Replicate leaves it. Pure arithmetic, so it is tested against PyTorch's
    own function."""
    shape = [int(d) for d in global_shape]
    offset = [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if _placement_kind(name, placement) == "replicate":
            continue
        dim = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        if not 0 <= dim < len(shape):
            raise ValueError(f"tensor '{name}': Shard({placement.dim}) of a {len(shape)}-dimensional tensor")
        cur, k, c = shape[dim], int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        chunk = -(-cur // k)
        start = min(cur, chunk * c)
        shape[dim] = max(0, min(cur, start + chunk) - start)
        offset[dim] = int(global_shape[dim]) if shape[dim] == 0 else offset[dim] + start
    return tuple(shape), tuple(offset)


def dtensor_shard(name: str, dtensor):
    """(local tensor, ShardPlacement) of a DTensor on this rank, or None
    when this rank is not in its device mesh. The local tensor's shape is
    checked against the placement's box (a DTensor sharded by another rule
    is refused naming it)."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    global_shape = tuple(int(d) for d in dtensor.shape)
    shape, offset = shard_box(global_shape, tuple(mesh.shape), coordinate, dtensor.placements, name)
    local = dtensor.to_local()
    if tuple(int(d) for d in local.shape) != shape:
        raise ValueError(f"tensor '{name}': the local tensor has shape {tuple(local.shape)}, its placement "
                         f"{tuple(dtensor.placements)} on mesh {tuple(mesh.shape)} at {tuple(coordinate)} "
                         f"gives {shape}")
    return local, ShardPlacement(global_shape, offset)
