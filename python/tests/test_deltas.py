"""Delta updates through the Python package with real processes: the
generator (`scripts/delta_steps.py`, a small PyTorch transformer trained in
bf16 with fp32 masters and AdamW) writes 5 steps; a trainer process
publishes each as a version; 2 engine processes update to each over IPC and
over UCX (tcp), check every param's bytes against the step's file, and
report their delta statistics: deltas from the second version on (over
IPC when asked: `deltas=True`), a small share of the bytes on the wire.
The same with the engines serving the 2-D weights in FP8: the publisher
quantizes and sends deltas of the FP8 bytes, checked against PyTorch's
quantization of each step.
Then a trainer keeping one version: whole, NOT_KEPT; `deltas=False`:
REFUSED; IPC by default: NOT_ASKED.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "UCX_TLS": "tcp"}
SECRET = "delta-python-secret-0123"
STEPS = 5

COMMON = r'''
import json, struct, sys, time
from pathlib import Path
import numpy as np

DTYPES = {"BF16": ("bf16", np.uint16), "F32": ("f32", np.float32), "F16": ("f16", np.float16)}

def read_safetensors(path):
    """{name: (wm dtype, numpy array of the raw elements)}."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in sorted(header.items()):
        if name == "__metadata__":
            continue
        wm, np_dtype = DTYPES[t["dtype"]]
        a, b = t["data_offsets"]
        data = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np_dtype).reshape(t["shape"]).copy()
        out[name] = (wm, data)
    return out

def wait_for(path, timeout=120):
    end = time.time() + timeout
    while not Path(path).exists():
        if time.time() > end:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.01)
'''

TRAINER = COMMON + r'''
from weight_manager import Publisher
steps, work, via, where, keep = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
if via == "ipc":
    p = Publisher(socket_path=where, keep_versions=keep)
else:
    p = Publisher(net=where, secret="''' + SECRET + r'''", keep_versions=keep)
    (work / "address").write_text(p.address)
for k in range(''' + str(STEPS) + r'''):
    p.clear()
    for name, (dtype, arr) in read_safetensors(f"{steps}/step{k}.safetensors").items():
        p.add(name, arr, dtype=dtype)
    p.set_version(f"step-{k}")
    p.publish()
    (work / f"ready{k}").touch()
    p.serve(2, timeout=120)
'''

ENGINE = COMMON + r'''
from weight_manager import Manager
steps, work, via, rank, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
fp8 = sys.argv[6] == "fp8"
deltas = {"default": None, "on": True, "off": False}[mode]
first = read_safetensors(f"{steps}/step0.safetensors")
m = Manager(rank=rank, world_size=2, net_secret="''' + SECRET + r'''")
params, scales = {}, {}
for name, (dtype, arr) in first.items():
    if fp8 and dtype == "bf16" and arr.ndim == 2:
        # Served in FP8: the publisher quantizes, deltas patch FP8 bytes.
        params[name] = m.allocate(name, "float8_e4m3fn", arr.shape)
        blocks = (-(-arr.shape[0] // 128), -(-arr.shape[1] // 128))
        scales[name] = m.allocate(name + ".scale_inv", "float32", blocks)
        m.quantize(name, name + ".scale_inv", "fp8_block128")
        continue
    params[name] = np.zeros_like(arr)
    m.register(name, params[name], dtype=dtype)

def expected(name, arr):
    """The bytes (and scales) a param holds for a step's tensor: FP8 as
    PyTorch's reference expression quantizes it, else the tensor's."""
    if name not in scales:
        return arr.tobytes(), None
    import torch
    x = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    m_, n_ = x.shape
    pm, pn = -(-m_ // 128) * 128, -(-n_ // 128) * 128
    padded = torch.zeros(pm, pn, dtype=x.dtype)
    padded[:m_, :n_] = x
    v = padded.view(pm // 128, 128, pn // 128, 128)
    amax = v.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (v.float() * (448.0 / amax)).to(torch.float8_e4m3fn).view(pm, pn)[:m_, :n_]
    return q.contiguous().view(torch.uint8).numpy().tobytes(), (amax / 448.0).view(-1).numpy().tobytes()

for k in range(''' + str(STEPS) + r'''):
    wait_for(work / f"ready{k}")
    if via == "ipc":
        location = str(work / "trainer.sock")
    else:
        location = (work / "address").read_text()
    s = m.update(location, f"step-{k}", source=via, deltas=deltas)
    want = read_safetensors(f"{steps}/step{k}.safetensors")
    wrong = []
    for n, (_, a) in want.items():
        q, sc = expected(n, a)
        held = np.asarray(params[n]).tobytes()
        if held != q or (sc is not None and np.asarray(scales[n]).tobytes() != sc):
            wrong.append(n)
    d = s.deltas
    print(json.dumps({"step": k, "wrong": wrong, "bytes": s.bytes, "fallback": d.fallback.name,
                      "runs_delta": d.runs_delta, "runs_whole": d.runs_whole,
                      "wire": d.wire_bytes, "base": d.base_version}), flush=True)
'''


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("steps")
    subprocess.run([PY, str(ROOT / "scripts" / "delta_steps.py"), str(out), "--steps", str(STEPS - 1),
                    "--lrs", "1e-5"], check=True, env=ENV, timeout=600)
    (lr,) = list(out.iterdir())
    return lr


def run(steps, tmp_path, via, keep=2, deltas="on", kind="bf16"):
    """The trainer and 2 engines; each engine's report per step."""
    if via == "rdma":
        from weight_manager import _lib
        if _lib.LIB is None:
            pytest.skip("no library")
    tmp_path.mkdir(exist_ok=True)
    where = str(tmp_path / "trainer.sock") if via == "ipc" else "127.0.0.1:0"
    trainer = subprocess.Popen([PY, "-c", TRAINER, str(steps), str(tmp_path), via, where, str(keep)],
                               env=ENV)
    engines = [subprocess.Popen([PY, "-c", ENGINE, str(steps), str(tmp_path), via, str(r), deltas, kind],
                                env=ENV, stdout=subprocess.PIPE, text=True) for r in range(2)]
    reports = []
    for e in engines:
        out, _ = e.communicate(timeout=600)
        assert e.returncode == 0, out
        reports.append([json.loads(line) for line in out.splitlines()])
    assert trainer.wait(timeout=120) == 0
    for rep in reports:
        assert [r["step"] for r in rep] == list(range(STEPS))
        for r in rep:
            assert r["wrong"] == [], r
    return reports


@pytest.mark.parametrize("via", ["ipc", "rdma"])
def test_five_steps_to_two_ranks(steps, tmp_path, via):
    # Over rdma by default; over IPC when asked.
    for rep in run(steps, tmp_path, via, deltas="on" if via == "ipc" else "default"):
        assert rep[0]["fallback"] == "NO_BASE" and rep[0]["runs_delta"] == 0
        for r in rep[1:]:
            assert r["fallback"] == "NONE", r
            assert r["base"] == f"step-{r['step'] - 1}"
            assert r["runs_delta"] > 0, r
            # AdamW at 1e-5 changes a few percent of bf16 elements a step.
            assert r["wire"] < r["bytes"] / 2, r


@pytest.mark.parametrize("via", ["ipc", "rdma"])
def test_fp8_params_take_deltas_of_their_fp8_bytes(steps, tmp_path, via):
    # The engines serve every 2-D weight in FP8 (128x128 blocks): the
    # publisher quantizes, keeps each version's FP8 image and sends the
    # changes of the FP8 bytes; every FP8 byte and scale is PyTorch's
    # quantization of the step's bf16 weights.
    for rep in run(steps, tmp_path, via, deltas="on", kind="fp8"):
        assert rep[0]["fallback"] == "NO_BASE" and rep[0]["runs_delta"] == 0
        for r in rep[1:]:
            assert r["fallback"] == "NONE", r
            assert r["runs_delta"] > 0, r
            assert r["wire"] < r["bytes"] / 2, r


def test_base_not_kept_and_whole(steps, tmp_path):
    for rep in run(steps, tmp_path / "one", "ipc", keep=1):
        assert all(r["fallback"] == "NOT_KEPT" and r["runs_delta"] == 0 for r in rep[1:]), rep
    for rep in run(steps, tmp_path / "asked", "ipc", deltas="off"):
        assert all(r["fallback"] == "REFUSED" and r["wire"] == r["bytes"] for r in rep[1:]), rep
    for rep in run(steps, tmp_path / "default", "ipc", deltas="default"):
        assert all(r["fallback"] == "NOT_ASKED" and r["runs_delta"] == 0 for r in rep[1:]), rep
