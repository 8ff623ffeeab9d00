"""The source side of sharded transfer from Python: Publisher.add_shard, and
add_state_dict publishing DTensors as shards placed by their `placements`.

What an engine receives is read off the wire: the test is the engine, speaks
HELLO over the publisher's real Unix socket and decodes the MANIFEST frame
(`docs/wire.md`), so the placement checked is the one the library sent.
DTensor offsets are checked against PyTorch's own rule
(`torch.distributed.tensor._utils`), with real DTensors on a fake process
group (one process plays each rank in turn)."""

import itertools
import socket
import struct
import threading

import numpy as np
import pytest

from weight_manager import Publisher, WeightManagerError
from weight_manager.torch_bridge import shard_box

PROTOCOL = 10


def _frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<IB", len(payload) + 1, kind) + payload


def _text(s: str) -> bytes:
    return struct.pack("<I", len(s)) + s.encode()


class _Reader:
    def __init__(self, body: bytes):
        self.body, self.at = body, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.body, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def text(self) -> str:
        (n,) = self.take("<I")
        self.at += n
        return self.body[self.at - n:self.at].decode()


def _recv_exact(conn, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        assert chunk, "the publisher hung up"
        out += chunk
    return out


def manifest_over_ipc(sock_path: str) -> dict:
    """{name: [(shape, global_shape or None, offset or None)]}, as an engine
    of rank 0 decodes its MANIFEST."""
    hello = struct.pack("<IIII", 0x574D4950, PROTOCOL, 0, 1) + _text("0") + _text("") + _text("")
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(20)
        conn.connect(sock_path)
        conn.sendall(_frame(1, hello))
        (n,) = struct.unpack("<I", _recv_exact(conn, 4))
        body = _Reader(_recv_exact(conn, n))
    assert body.take("<B") == (2,), "a MANIFEST frame"
    body.text()
    (count,) = body.take("<I")
    tensors = {}
    for _ in range(count):
        name = body.text()
        _dtype, ndim = body.take("<II")
        shape = body.take(f"<{ndim}Q")
        body.take("<Q")
        if body.take("<B") == (1,):
            body.take("16s")
        placement = (None, None)
        if body.take("<B") == (1,):
            placement = (body.take(f"<{ndim}Q"), body.take(f"<{ndim}Q"))
        tensors.setdefault(name, []).append((shape, *placement))
    return tensors


def served_manifest(tmp_path, fill) -> dict:
    """Publish what `fill(publisher)` adds and return an engine's manifest."""
    sock = str(tmp_path / "trainer.sock")
    with Publisher(sock) as p:
        fill(p)
        p.set_version("step-1")
        errors = []

        def serve():
            try:
                p.serve(1, timeout=20)
            except WeightManagerError as e:  # the engine hangs up after the manifest
                errors.append(e)

        t = threading.Thread(target=serve)
        t.start()
        try:
            return manifest_over_ipc(sock)
        finally:
            t.join()


def test_add_shard_sends_the_placement(tmp_path):
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.ones(3, dtype=np.float32)

    def fill(p):
        p.add_shard("w", rows[:2], (8, 3), (4, 0))
        p.add_shard("w", rows[2:], (8, 3), (6, 0))
        p.add("b", b)

    m = served_manifest(tmp_path, fill)
    assert sorted(m["w"]) == [((2, 3), (8, 3), (4, 0)), ((2, 3), (8, 3), (6, 0))]
    assert m["b"] == [((3,), None, None)]


def test_add_shard_takes_a_torch_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    local = torch.zeros(3, 2, dtype=torch.bfloat16)
    m = served_manifest(tmp_path, lambda p: p.add_shard("emb", local, (9, 2), (3, 0)))
    assert m["emb"] == [((3, 2), (9, 2), (3, 0))]


def test_bad_shards_are_refused_naming_the_tensor(tmp_path):
    a = np.zeros((2, 3), dtype=np.float32)
    with Publisher(str(tmp_path / "p.sock")) as p:
        with pytest.raises(WeightManagerError, match=r"'w'.*dimension 0: offset 7"):
            p.add_shard("w", a, (8, 3), (7, 0))
        with pytest.raises(ValueError, match=r"'w'.*one value per dimension"):
            p.add_shard("w", a, (8,), (0,))
        p.add_shard("w", a, (8, 3), (0, 0))
        with pytest.raises(WeightManagerError, match=r"'w'.*offset \[0, 0\] .*overlaps the one at offset \[0, 0\]"):
            p.add_shard("w", a, (8, 3), (0, 0))
        # Overlapping rows at another offset are refused too (they were
        # taken, and every engine then failed planning).
        with pytest.raises(WeightManagerError, match=r"'w'.*offset \[1, 0\] \(shape \[2, 3\]\) overlaps"):
            p.add_shard("w", a, (8, 3), (1, 0))
        p.add_shard("w", a, (8, 3), (2, 0))  # next to it: taken
        with pytest.raises(WeightManagerError, match=r"'w'.*both whole and as shards"):
            p.add("w", np.zeros((8, 3), dtype=np.float32))


# Meshes, placements and shapes covering even, uneven (short and empty last
# chunks) and nested splits of one dim, and replication.
MESHES = [(4,), (2, 2), (3, 2), (2, 3)]
SHAPES = [(8, 6), (7, 5), (3, 2), (1, 9), (0, 4)]


def _placement_sets(torch_placements, ndim_mesh):
    Shard, Replicate = torch_placements
    choices = [Shard(0), Shard(1), Shard(-1), Replicate()]
    return itertools.product(choices, repeat=ndim_mesh)


def test_shard_box_follows_pytorch():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    checked = 0
    for mesh in MESHES:
        for placements in _placement_sets((Shard, Replicate), len(mesh)):
            # PyTorch normalizes Shard(-1) when a DTensor is made; its
            # offset helper takes normalized dims.
            normal = [Shard(p.dim % 2) if isinstance(p, Shard) else p for p in placements]
            for shape in SHAPES:
                for coord in itertools.product(*(range(k) for k in mesh)):
                    want = _compute_local_shape_and_global_offset(shape, mesh, list(coord), normal)
                    got = shard_box(shape, mesh, coord, placements)
                    assert got == tuple(want), (mesh, placements, shape, coord)
                    checked += 1
    assert checked > 1000


class _Partial:
    def __repr__(self):
        return "Partial(sum)"


def test_unsupported_placements_are_refused_naming_the_tensor():
    with pytest.raises(ValueError, match=r"'layers.0.w'.*Partial\(sum\)"):
        shard_box((4,), (2,), (0,), [_Partial()], "layers.0.w")


@pytest.fixture
def fake_world():
    """A function that makes this process rank `rank` of `world` (a fake
    process group: real DTensors, no peers) for the block that uses it."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    FakeStore = pytest.importorskip("torch.testing._internal.distributed.fake_pg").FakeStore

    def join(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield join, torch
    if dist.is_initialized():
        dist.destroy_process_group()


def test_add_state_dict_publishes_dtensors_as_shards(tmp_path, fake_world):
    join, torch = fake_world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    plain = torch.ones(3)
    boxes = []
    for rank in range(4):
        join(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [Shard(0), Shard(0)]  # uneven: rows 2, 2, 2, 1
        shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local = full[box].contiguous()
        w = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
        rep = DTensor.from_local(plain.clone(), mesh, [Replicate(), Replicate()], run_check=False)
        state = {"w": w, "r": rep, "b": plain}
        m = served_manifest(tmp_path, lambda p: p.add_state_dict(state))
        assert m["w"] == [(tuple(shape), (7, 5), tuple(offset))], rank
        assert m["r"] == [((3,), (3,), (0,))], "a replica is a shard covering its tensor"
        assert m["b"] == [((3,), None, None)], "a plain tensor stays whole"
        boxes.append(tuple(offset) + tuple(shape))
    assert sorted(boxes) == [(0, 0, 2, 5), (2, 0, 2, 5), (4, 0, 2, 5), (6, 0, 1, 5)]


def test_many_shards_of_one_tensor_are_checked_within_bounds(tmp_path):
    """20,000 row shards go in (each checked against the few shards whose
    rows may reach it, not against every one before it), an overlapping
    one is still refused; a layout that would make the check quadratic
    (one long shard among many one-row ones) is refused naming the tensor
    within the bound, and so is a later shard of it whose search would not
    fit in what is left, until the tensors are cleared; other tensors are
    not held up."""
    row = np.zeros((1, 4), dtype=np.float32)
    n = 20_000
    order = list(range(0, n, 2)) + list(range(1, n, 2))
    with Publisher(str(tmp_path / "p.sock")) as p:
        for i in order:
            p.add_shard("rows", row, (n, 4), (i, 0))
        with pytest.raises(WeightManagerError, match=r"'rows'.*offset \[777, 1\].*overlaps"):
            p.add_shard("rows", np.zeros((1, 2), dtype=np.float32), (n, 4), (777, 1))
        long = np.zeros((1_000_000, 1), dtype=np.float32)
        p.add_shard("mixed", long, (1_000_000 + n, 1), (n, 0))
        one = np.zeros((1, 1), dtype=np.float32)
        with pytest.raises(WeightManagerError, match=r"'mixed'.*too fragmented to check for overlaps"):
            for i in range(n):
                p.add_shard("mixed", one, (1_000_000 + n, 1), (i, 0))
        assert 100 < i < n
        with pytest.raises(WeightManagerError, match=r"'mixed'.*too fragmented"):
            p.add_shard("mixed", one, (1_000_000 + n, 1), (n - 1, 0))
        p.add_shard("rows2", row, (n, 4), (0, 0))
        p.clear()
        p.add_shard("mixed", one, (1_000_000 + n, 1), (n - 1, 0))
