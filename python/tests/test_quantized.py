"""Quantized params through the Python package, checked byte for byte
against PyTorch's reference expressions (DeepGEMM's per_block_cast_to_fp8
for 128x128 blocks; the same with one block for the whole tensor; the OCP
MX rule for MXFP8, `ref_mx`) run on the CPU: from a bf16 snapshot (random data, all-zero blocks, subnormals,
values at a block's max, partial edge blocks, sizes not multiples of 128),
from 4 trainer processes each holding 75 rows (every 128-row block split
over two or three of them) over IPC and over UCX (tcp), and a NaN refused
naming the tensor and the element with the old weights kept.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from weight_manager import Manager, Piece, QuantScheme, Result, WeightManagerError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "UCX_TLS": "tcp"}
SECRET = "quantized-python-secret-01"
TRAINERS = 4


def ref_blocks(x):
    """FP8 bytes (uint8) and scale_inv of `x` [..., M, N], 128x128 blocks."""
    *batch, m, n = x.shape
    pm, pn = -(-m // 128) * 128, -(-n // 128) * 128
    padded = torch.zeros(*batch, pm, pn, dtype=x.dtype)
    padded[..., :m, :n] = x
    v = padded.view(*batch, pm // 128, 128, pn // 128, 128)
    amax = v.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(1e-4)
    q = (v.float() * (448.0 / amax)).to(torch.float8_e4m3fn).view(*batch, pm, pn)[..., :m, :n]
    scales = (amax / 448.0).view(*batch, pm // 128, pn // 128)
    return q.contiguous().view(torch.uint8).numpy(), scales.numpy()


def ref_tensor(x):
    amax = x.abs().float().max().clamp(1e-4)
    q = (x.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
    return q.contiguous().view(torch.uint8).numpy(), (amax / 448.0).reshape(1).numpy()


def ref_mx(x):
    """MXFP8 bytes (uint8) and E8M0 scale bytes of `x` [..., N]: blocks of
    32 along the last dimension, e = clamp(floor(log2(amax)) - 8, -127,
    127) from amax's f32 exponent field, q = (x / 2^e) clamped to +-448."""
    *lead, n = x.shape
    pn = -(-n // 32) * 32
    padded = torch.zeros(*lead, pn, dtype=torch.float32)
    padded[..., :n] = x.float()
    v = padded.view(*lead, pn // 32, 32)
    amax = v.abs().amax(dim=-1, keepdim=True)
    e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8).clamp(-127, 127)
    two_e = torch.where(e > -127, (e + 127) << 23, torch.full_like(e, 1 << 22)).view(torch.float32)
    q = (v / two_e).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(*lead, pn)[..., :n]
    return q.contiguous().view(torch.uint8).numpy(), (e + 127).to(torch.uint8).view(*lead, pn // 32).numpy()


def model(seed):
    """bf16, f16 and f32 tensors with the hard cases in them."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    w[:128, 128:] = 0  # an all-zero block
    w[128:256, :128] = torch.tensor(1e-39).to(torch.bfloat16)  # subnormals
    w[5, 7] = -w.abs().max() * 4  # the max of its block, negative
    experts = (torch.randn(2, 200, 130, generator=g) * 3).to(torch.float16)
    head = torch.randn(130, 129, generator=g) * 50
    return {"w": w, "experts": experts, "head": head, "norm": torch.randn(64, generator=g)}


def engine(m, params):
    """Allocate FP8 params `{name: (shape, scheme, pieces)}` and their scales."""
    out = {}
    for name, (shape, scheme, pieces) in params.items():
        q = m.allocate(name, "float8_e4m3fn", shape, pieces)
        if scheme == "mxfp8":
            s = m.allocate(name + ".scale_inv", "uint8", (*shape[:-1], -(-shape[-1] // 32)))
            m.quantize(name, name + ".scale_inv", scheme)
            out[name] = (q, s)
            continue
        scales_shape = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)) \
            if scheme == "fp8_block128" else (1,)
        s = m.allocate(name + ".scale_inv", "float32", scales_shape)
        m.quantize(name, name + ".scale_inv", scheme)
        out[name] = (q, s)
    return out


SNAPSHOT = {"w": ((300, 200), "fp8_block128", None), "experts": ((2, 200, 130), "fp8_block128", None),
            "head": ((130, 129), "fp8_tensor", None)}


@pytest.mark.parametrize("in_place", [False, True])
def test_a_bf16_snapshot_lands_in_fp8_params_as_pytorch_quantizes_it(tmp_path, in_place):
    m = Manager()
    params = engine(m, SNAPSHOT)
    norm = m.allocate("norm", "float32", (64,))
    for seed, step in [(1, "1"), (2, "2")]:
        ts = model(seed)
        save_file(ts, str(tmp_path / "model.safetensors"))
        (tmp_path / "version.yaml").write_text(f"step: {step}\n")
        assert m.update(str(tmp_path), in_place=in_place).version == step
        for name, (q, s) in params.items():
            ref = ref_blocks if SNAPSHOT[name][1] == "fp8_block128" else ref_tensor
            want_q, want_s = ref(ts[name])
            assert np.array_equal(q.view(np.uint8), want_q), name
            assert np.array_equal(s.view(np.uint32), want_s.view(np.uint32)), name
        assert np.array_equal(norm, ts["norm"].numpy())
    m.close()


MX_SNAPSHOT = {"w": ((300, 200), "mxfp8", None), "experts": ((2, 200, 130), "mxfp8", None),
               "head": ((130, 129), "mxfp8", None), "norm": ((64,), "mxfp8", None)}


@pytest.mark.parametrize("in_place", [False, True])
def test_a_bf16_snapshot_lands_in_mxfp8_params_as_pytorch_quantizes_it(tmp_path, in_place):
    """bf16, f16 and f32 tensors (all-zero blocks, subnormals, a block's
    max negative, rows that end in a partial block, a 1-D tensor) into
    MXFP8 params: every FP8 byte and E8M0 scale byte as `ref_mx`."""
    m = Manager()
    params = engine(m, MX_SNAPSHOT)
    for seed, step in [(1, "1"), (2, "2")]:
        ts = model(seed)
        ts["w"][200, :64] = torch.tensor(3e-38).to(torch.bfloat16)  # tiny normals: e clamps at -127
        save_file(ts, str(tmp_path / "model.safetensors"))
        (tmp_path / "version.yaml").write_text(f"step: {step}\n")
        assert m.update(str(tmp_path), in_place=in_place).version == step
        for name, (q, s) in params.items():
            want_q, want_s = ref_mx(ts[name])
            assert np.array_equal(q.view(np.uint8), want_q), name
            assert np.array_equal(s, want_s), name
    m.close()


def test_readme_mxfp8_expression():
    """The README's one-line PyTorch expression for MXFP8 gives `ref_mx`'s
    bytes and scales (with `2**e` on the int32 `e` it gave +-448 for every
    element of a block whose amax is below 256)."""
    g = torch.Generator().manual_seed(7)
    for scale in (3e-38, 1e-3, 1.0, 300.0, 1e30):
        x = torch.randn(8, 96, generator=g) * scale
        x[0, :32] = 0  # an all-zero block: e = -127
        v = x.float().view(8, 3, 32)
        amax = v.abs().amax(dim=-1, keepdim=True)
        e = (((amax.view(torch.int32) >> 23) & 0xFF) - 135).clamp(-127, 127)
        q = (v / torch.exp2(e.float())).clamp(-448, 448).to(torch.float8_e4m3fn)
        want_q, want_s = ref_mx(x)
        assert np.array_equal(q.view(8, 96).view(torch.uint8).numpy(), want_q), scale
        assert np.array_equal((e + 127).to(torch.uint8).view(8, 3).numpy(), want_s), scale


def test_mxfp8_declarations_are_checked_naming_the_param():
    m = Manager()
    m.allocate("w", "float8_e4m3fn", (64, 100))
    m.allocate("f", "float32", (64, 4))
    m.allocate("s", "uint8", (64, 4))
    with pytest.raises(WeightManagerError) as e:
        m.quantize("w", "f", "mxfp8")
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert "param 'f': the scales of 'w' (mxfp8 [64, 100]) must be u8 [64, 4], not f32 [64, 4]" in str(e.value)
    m.allocate("cut", "float8_e4m3fn", (64, 48), [Piece("t", offset=(0, 16), length=(64, 48))])
    m.allocate("cut_s", "uint8", (64, 2))
    with pytest.raises(WeightManagerError) as e:
        m.quantize("cut", "cut_s", "mxfp8")
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert "param 'cut': piece 0" in str(e.value) and "cuts an MXFP8 block of 32" in str(e.value)
    assert "not a multiple of 32" in str(e.value)
    m.quantize("w", "s", QuantScheme.MXFP8)
    m.close()


def test_a_nan_fails_naming_the_tensor_and_element_and_the_old_weights_stay(tmp_path):
    m = Manager()
    params = engine(m, SNAPSHOT)
    m.allocate("norm", "float32", (64,))
    ts = model(1)
    save_file(ts, str(tmp_path / "model.safetensors"))
    m.update(str(tmp_path), version="1")
    before = {k: (q.copy(), s.copy()) for k, (q, s) in params.items()}
    bad = model(2)
    bad["experts"][1, 150, 3] = float("nan")
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightManagerError) as e:
        m.update(str(tmp_path), version="2")
    assert e.value.code == Result.ERR_FORMAT
    assert "element [1, 150, 3] of tensor 'experts' is NaN" in str(e.value)
    assert m.status().version == "1"
    for k, (q, s) in params.items():
        assert np.array_equal(q.view(np.uint8), before[k][0].view(np.uint8)), k
        assert np.array_equal(s, before[k][1]), k
    m.close()


def test_declarations_are_checked_naming_the_param():
    m = Manager()
    m.allocate("w", "float8_e4m3fn", (256, 256))
    m.allocate("s", "float32", (2, 3))
    with pytest.raises(WeightManagerError) as e:
        m.quantize("w", "s", QuantScheme.FP8_BLOCK128)
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert "param 's': the scales of 'w' (fp8_block128 [256, 256]) must be f32 [2, 2]" in str(e.value)
    with pytest.raises(ValueError, match="mxfp4"):
        m.quantize("w", "s", "mxfp4")
    m.close()


TRAINER = r'''
import sys, torch
from weight_manager import Publisher
sys.path.insert(0, sys.argv[5])
from test_quantized import shared_model
rank, ranks, via, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
p = Publisher(where) if via == "ipc" else Publisher(net=where, secret=sys.argv[6])
full = shared_model()
for name, t in full.items():
    if name == "c":  # by columns: 50 each, so MXFP8 blocks of 32 are split between ranks
        cols = t.shape[1] // ranks
        p.add_shard(name, t[:, rank * cols:(rank + 1) * cols].contiguous(), tuple(t.shape), (0, rank * cols))
        continue
    rows = t.shape[0] // ranks
    p.add_shard(name, t[rank * rows:(rank + 1) * rows].contiguous(), tuple(t.shape),
                (rank * rows,) + (0,) * (t.dim() - 1))
p.set_version("1")
p.publish()
print(p.address, flush=True)
p.serve(engines=1, timeout=60)
'''


def shared_model():
    """What the trainer ranks hold: 300 rows each, in shards of 75."""
    g = torch.Generator().manual_seed(7)
    return {"g": (torch.randn(300, 256, generator=g) * 0.1).to(torch.bfloat16),
            "h": (torch.randn(300, 130, generator=g) * 9).to(torch.bfloat16),
            "c": (torch.randn(64, 200, generator=g) * 0.5).to(torch.bfloat16)}


def start_trainers(tmp_path, via):
    """The 4 trainer processes serving `shared_model()`: (processes, addresses)."""
    procs, addrs = [], []
    for r in range(TRAINERS):
        where = str(tmp_path / f"t{r}.sock") if via == "ipc" else "127.0.0.1:0"
        procs.append(subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(r), str(TRAINERS), via, where, str(Path(__file__).parent),
             SECRET], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    for p in procs:
        line = p.stdout.readline().strip()
        assert line, p.stderr.read()
        addrs.append(line)
    return procs, addrs


def finish(procs):
    for p in procs:
        try:
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("via", ["ipc", "net"])
def test_blocks_split_over_four_trainer_processes(tmp_path, via):
    procs, addrs = start_trainers(tmp_path, via)
    try:
        m = Manager(net_secret=SECRET) if via == "net" else Manager()
        half = [Piece("g", offset=(0, 128), length=(300, 128))]
        params = engine(m, {"half": ((300, 128), "fp8_block128", half),
                            "h": ((300, 130), "fp8_tensor", None)})
        m.update(addrs, source="ipc" if via == "ipc" else "rdma", timeout=60)
        full = shared_model()
        want_q, want_s = ref_blocks(full["g"])
        q, s = params["half"]
        assert np.array_equal(q.view(np.uint8), want_q[:, 128:])
        assert np.array_equal(s.view(np.uint32), want_s[:, 1:].view(np.uint32))
        want_q, want_s = ref_tensor(full["h"])
        q, s = params["h"]
        assert np.array_equal(q.view(np.uint8), want_q)
        assert np.array_equal(s.view(np.uint32), want_s.view(np.uint32))
        m.close()
    finally:
        finish(procs)


@pytest.mark.parametrize("via", ["ipc", "net"])
def test_mxfp8_blocks_split_over_four_trainer_processes(tmp_path, via):
    """MXFP8 from 4 trainer processes, FP8 on the wire: "c" sharded by 50
    columns (blocks of 32 split between two ranks: the amax agreed), "g"
    by rows with the engine taking a column half (a TP piece at 128)."""
    procs, addrs = start_trainers(tmp_path, via)
    try:
        m = Manager(net_secret=SECRET) if via == "net" else Manager()
        half = [Piece("g", offset=(0, 128), length=(300, 128))]
        params = engine(m, {"half": ((300, 128), "mxfp8", half), "c": ((64, 200), "mxfp8", None)})
        m.update(addrs, source="ipc" if via == "ipc" else "rdma", timeout=60)
        full = shared_model()
        want_q, want_s = ref_mx(full["g"])
        q, s = params["half"]
        assert np.array_equal(q.view(np.uint8), want_q[:, 128:])
        assert np.array_equal(s, want_s[:, 4:])
        want_q, want_s = ref_mx(full["c"])
        q, s = params["c"]
        assert np.array_equal(q.view(np.uint8), want_q)
        assert np.array_equal(s, want_s)
        m.close()
    finally:
        finish(procs)


def test_a_torch_mxfp8_module_takes_a_bf16_snapshot(tmp_path):
    """register_module + quantize_module(scheme="mxfp8"): a module whose
    weight is float8_e4m3fn and whose scales are float8_e8m0fnu (held as
    their bytes) gets the snapshot's bf16 weight as ref_mx quantizes it,
    and its dequantized weight is weight * 2^(scale - 127)."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(64, 100, dtype=torch.float8_e4m3fn), requires_grad=False)
    model.register_buffer("weight_scale", torch.zeros(64, 4, dtype=torch.float8_e8m0fnu))
    m = Manager()
    registered = m.register_module(model)
    assert m.quantize_module(registered, scheme="mxfp8", scales_suffix="_scale") == ["weight"]
    w = (torch.randn(64, 100, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    save_file({"weight": w}, str(tmp_path / "model.safetensors"))
    m.update(str(tmp_path), version="1")
    want_q, want_s = ref_mx(w)
    assert np.array_equal(model.weight.view(torch.uint8).numpy(), want_q)
    assert np.array_equal(model.weight_scale.view(torch.uint8).numpy(), want_s)
    scale = model.weight_scale.float().repeat_interleave(32, 1)[:, :100]
    dequantized = model.weight.float() * scale
    assert torch.allclose(dequantized, w.float(), rtol=2 ** -3, atol=0), "E4M3 keeps 3 bits"
    m.close()


class Fp8Linear(torch.nn.Module):
    """A linear layer of an FP8 engine, as DeepSeek-V3 checkpoints hold it:
    `weight` float8_e4m3fn and `weight_scale_inv` float32 per 128x128 block."""

    def __init__(self, out_features, in_features):
        super().__init__()
        w = torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.zeros(-(-out_features // 128), -(-in_features // 128)))

    def forward(self, x):
        scales = self.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        w = self.weight.float() * scales[:self.weight.shape[0], :self.weight.shape[1]]
        return x @ w.t()


def test_a_torch_fp8_module_takes_a_bf16_trainers_weights(tmp_path):
    """register_module + quantize_module: the module's float8 weight and
    its scales are filled from the 4 trainer processes' bf16 shards (FP8
    on the wire), as PyTorch's reference quantizes them; its forward pass
    then gives PyTorch's result with the dequantized weight."""
    procs, addrs = start_trainers(tmp_path, "ipc")
    try:
        model = torch.nn.Module()
        model.g = Fp8Linear(300, 256)
        model.h = torch.nn.Linear(130, 300, bias=False).to(torch.bfloat16)
        m = Manager()
        registered = m.register_module(model, name_map={"g.weight": "g", "g.weight_scale_inv": "g_scale_inv",
                                                        "h.weight": "h"})
        assert m.quantize_module(registered) == ["g"]
        m.update(addrs, source="ipc", timeout=60)
        full = shared_model()
        want_q, want_s = ref_blocks(full["g"])
        assert np.array_equal(model.g.weight.view(torch.uint8).numpy(), want_q)
        assert np.array_equal(model.g.weight_scale_inv.numpy().view(np.uint32), want_s.view(np.uint32))
        assert torch.equal(model.h.weight, full["h"])
        x = torch.randn(3, 256)
        dequantized = torch.from_numpy(want_q).view(torch.float8_e4m3fn).float() * \
            torch.from_numpy(want_s).repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :256]
        assert torch.equal(model.g(x), x @ dequantized.t())
        m.close()
    finally:
        finish(procs)
