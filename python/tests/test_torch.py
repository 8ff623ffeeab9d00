"""PyTorch on both ends, with real torch (CPU): a trainer publishes
`model.state_dict()` (a tied weight, a bfloat16 tensor, buffers), an engine
registers a differently-initialized copy with `register_module` and is
updated in place. Also: contiguity, dtypes, name_map, the progress display,
and that the package never imports torch by itself."""

import multiprocessing as mp
import os
import pty
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from weight_manager import Manager, Publisher, WeightManagerError
from weight_manager.progress_bar import render_bar, render_final

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parent


def _import_torch():
    """torch is installed by scripts/setup.sh: in the project's .venv (or with
    WM_REQUIRE_TORCH=1) its absence is a failure, elsewhere a skip saying why."""
    in_project_venv = Path(sys.prefix).resolve() == (REPO / ".venv").resolve()
    if in_project_venv or os.environ.get("WM_REQUIRE_TORCH") == "1":
        import torch
        return torch
    return pytest.importorskip("torch", reason="torch is not installed in this Python "
                                               "(scripts/setup.sh installs it into .venv)")


torch = _import_torch()
nn = torch.nn

VOCAB, DIM, CTX = 32, 16, 8


class TinyLM(nn.Module):
    """Embedding tied to the output layer, a bfloat16 gain, a persistent
    buffer (positions) and a non-persistent one (not in the state_dict)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.randn(DIM).to(torch.bfloat16))
        self.register_buffer("pos", torch.randn(CTX, DIM))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[-1]]
        h = torch.tanh(self.mix(h)) * self.gain.float()
        return self.head(h)


def make_model(seed):
    torch.manual_seed(seed)
    return TinyLM()


INPUT = torch.arange(CTX).remainder(VOCAB).unsqueeze(0)


def run_trainer(sock, out_dir, ready1, ready2):
    """Serves step-1 live from the state_dict's tensors, trains one real
    step in place, publishes step-2 from the same tensors (nothing added
    again): saves what it served each time."""
    torch.manual_seed(0)
    model = make_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with Publisher(sock, bucket_size=16 << 10) as p:
        aliases = p.add_state_dict(model.state_dict())
        assert aliases == {"head.weight": "embed.weight"}, aliases
        for step, ready in ((1, ready1), (2, ready2)):
            if step == 2:
                logits = model(INPUT)
                loss = nn.functional.cross_entropy(logits[0, :-1], INPUT[0, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                torch.save({"state": model.state_dict(), "out": model(INPUT)}, os.path.join(out_dir, f"step-{step}.pt"))
            p.set_version(f"step-{step}")
            if step == 2:
                # publish() copies now: what the trainer does next is not served.
                p.publish()
                with torch.no_grad():
                    for t in model.parameters():
                        t.zero_()
            ready.set()
            st = p.serve(1, timeout=60)
            assert st.sessions == 1 and st.bytes > 0


def assert_module_equals(model, saved):
    state = model.state_dict()
    assert set(state) == set(saved["state"])
    for name, want in saved["state"].items():
        assert state[name].dtype == want.dtype, name
        assert torch.equal(state[name], want), name
    with torch.no_grad():
        torch.testing.assert_close(model(INPUT), saved["out"])


def test_state_dict_over_ipc_updates_module_in_place(tmp_path):
    sock = str(tmp_path / "trainer.sock")
    ctx = mp.get_context("spawn")
    ready1, ready2 = ctx.Event(), ctx.Event()
    trainer = ctx.Process(target=run_trainer, args=(sock, str(tmp_path), ready1, ready2))
    trainer.start()
    try:
        model = make_model(2)
        before = {n: t.data_ptr() for n, t in model.state_dict().items()}
        with Manager(fallback_dir="") as m:
            reg = m.register_module(model)
            assert reg.aliases == {"head.weight": "embed.weight"}
            assert "scratch" not in reg.params and "pos" in reg.params
            for step, ready in ((1, ready1), (2, ready2)):
                assert ready.wait(60), "trainer did not get ready"
                stats = m.update(sock, source="ipc", verify=True, timeout=60)
                assert stats.version == f"step-{step}"
                assert_module_equals(model, torch.load(tmp_path / f"step-{step}.pt"))
        # In place: the module's tensors are where they were, still tied.
        assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before
        assert model.head.weight is model.embed.weight
    finally:
        trainer.join(60)
        if trainer.exitcode is None:
            trainer.kill()
    assert trainer.exitcode == 0


@contextmanager
def serving(sock, add, version="v1", engines=1, engine_fails=False):
    """A publisher in a thread of this process (the library releases the
    GIL in serve): `add(publisher)` adds the tensors. With `engine_fails`,
    serve() must fail too (the engine hangs up)."""
    with Publisher(sock, bucket_size=16 << 10) as p:
        add(p)
        p.set_version(version)
        errors = []

        def serve():
            try:
                p.serve(engines, timeout=30)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        t = threading.Thread(target=serve)
        t.start()
        try:
            yield p
        finally:
            t.join(40)
        assert not t.is_alive(), "serve() did not return"
        if engine_fails:
            assert errors and isinstance(errors[0], WeightManagerError), errors
        elif errors:
            raise errors[0]


class Wrapped(nn.Module):
    """The engine's model under other names: `inner.` in front of each."""

    def __init__(self, seed):
        super().__init__()
        self.inner = make_model(seed)


def test_name_map_callable_dict_and_skip(tmp_path):
    trainer = make_model(1)
    sock = str(tmp_path / "names.sock")
    engine = Wrapped(2)
    with serving(sock, lambda p: p.add_state_dict(trainer.state_dict())):
        with Manager(fallback_dir="") as m:
            m.register_module(engine, name_map=lambda n: n.removeprefix("inner."))
            m.update(sock, source="ipc")
    assert_module_equals(engine.inner, {"state": trainer.state_dict(), "out": trainer(INPUT).detach()})

    # A dict maps the names it has; None leaves a tensor out (its old values stay).
    engine = make_model(3)
    old_pos = engine.pos.clone()
    published = {("w." + n): t for n, t in trainer.state_dict().items()}
    name_map = {n: "w." + n for n in trainer.state_dict()}
    name_map["pos"] = None
    with serving(sock, lambda p: p.add_state_dict(published)):
        with Manager(fallback_dir="") as m:
            reg = m.register_module(engine, name_map=name_map)
            assert "w.pos" not in reg.params and "w.mix.weight" in reg.params
            m.update(sock, source="ipc", skip_unknown=True)
    assert torch.equal(engine.pos, old_pos)
    assert torch.equal(engine.mix.weight, trainer.mix.weight)
    assert torch.equal(engine.gain, trainer.gain)


def test_prefix_and_missing_param_fails_naming_it(tmp_path):
    trainer = make_model(1)
    sock = str(tmp_path / "prefix.sock")
    with serving(sock, lambda p: p.add_state_dict(trainer.state_dict()), engine_fails=True):
        with Manager(fallback_dir="") as m:
            m.register_module(make_model(2), prefix="model.")
            with pytest.raises(WeightManagerError) as e:
                m.update(sock, source="ipc", timeout=30)
    print(e.value)
    assert "'embed.weight'" in str(e.value) or "'model.embed.weight'" in str(e.value), e.value


def test_add_state_dict_adds_all_or_nothing(tmp_path):
    """A state dict with one tensor the library refuses (its name already
    published) raises naming it, and none of the dict is published: each
    of its other tensors can still be added, and the dict without the
    clash goes through."""
    kept, a, b = torch.ones(3), torch.zeros(2), torch.full((4,), 2.0)
    with Publisher(str(tmp_path / "p.sock")) as p:
        p.add_torch("kept", kept)
        with pytest.raises(WeightManagerError) as e:
            p.add_state_dict({"a": a, "kept": torch.ones(3), "b": b})
        assert "tensor 1 of the 3 added together (none was added): tensor 'kept': already published" \
            in str(e.value), e.value
        p.add_state_dict({"a": a, "b": b})
        with pytest.raises(WeightManagerError, match="'a': already published"):
            p.add_torch("a", a)


def test_non_contiguous_refused_or_copied(tmp_path):
    base = torch.randn(4, 8)
    with Publisher(str(tmp_path / "a.sock")) as p:
        with pytest.raises(ValueError, match="'w.t' is not contiguous"):
            p.add_state_dict({"ok": torch.ones(3), "w.t": base.t()})
    sock = str(tmp_path / "copy.sock")
    with pytest.warns(UserWarning, match="'w.t' is not contiguous; publishing a contiguous copy"):
        with serving(sock, lambda p: p.add_state_dict({"w.t": base.t()}, contiguous="copy")):
            with Manager(fallback_dir="") as m:
                got = m.allocate("w.t", "f32", (8, 4))
                m.update(sock, source="ipc")
    np.testing.assert_array_equal(got, base.t().numpy())
    with Publisher(str(tmp_path / "b.sock")) as p, pytest.raises(ValueError, match="contiguous must be one of"):
        p.add_state_dict({"w": base}, contiguous="maybe")
    # A sparse tensor is named for its layout, whatever the policy (it was
    # called not contiguous, and a copy then raised torch's own error).
    for policy in ("refuse", "copy"):
        with Publisher(str(tmp_path / f"s{policy}.sock")) as p:
            with pytest.raises(ValueError, match="'sp' has layout torch.sparse_coo"):
                p.add_state_dict({"sp": torch.eye(3).to_sparse()}, contiguous=policy)

    module = nn.Linear(4, 8)
    module.weight = nn.Parameter(torch.randn(4, 8).t())
    with Manager(fallback_dir="") as m, pytest.raises(ValueError, match="'weight' is not contiguous"):
        m.register_module(module)


def test_unsupported_dtype_raises_naming_tensor(tmp_path):
    with Publisher(str(tmp_path / "d.sock")) as p:
        with pytest.raises(ValueError, match=r"tensor 'z' has dtype torch.complex64"):
            p.add_state_dict({"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)})
        with pytest.raises(TypeError, match="'n' is a ndarray, not a torch.Tensor"):
            p.add_state_dict({"n": np.ones(2)})
    module = nn.Module()
    module.register_buffer("c", torch.ones(2, dtype=torch.complex64))
    with Manager(fallback_dir="") as m, pytest.raises(ValueError, match="tensor 'c' has dtype torch.complex64"):
        m.register_module(module)


def test_dtypes_round_trip_and_publisher_keeps_tensors_alive(tmp_path):
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool]
    want = {str(d): (torch.randn(3, 5) * 50).to(d) for d in dtypes}
    sock = str(tmp_path / "dtypes.sock")
    engine = nn.Module()
    for i, d in enumerate(dtypes):
        engine.register_buffer(f"b{i}", torch.zeros(3, 5, dtype=d))
    # The publisher gets tensors nobody else holds: it must keep them alive.
    with serving(sock, lambda p: p.add_state_dict({f"b{i}": t.clone() for i, t in enumerate(want.values())})):
        with Manager(fallback_dir="") as m:
            m.register_module(engine)
            m.update(sock, source="ipc", verify=True)
    for i, t in enumerate(want.values()):
        assert torch.equal(getattr(engine, f"b{i}"), t), dtypes[i]


def test_progress_final_line_when_not_a_tty(tmp_path):
    out = run_engine_script(tmp_path, stderr=subprocess.PIPE)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.decode().strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("updated to v1: 2 tensors, 0.00 GB in "), lines
    assert "[" not in lines[-1]
    assert out.stdout.decode().strip() == "False"  # progress=True did not import torch either


def test_progress_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    try:
        out = run_engine_script(tmp_path, stderr=slave)
        os.close(slave)
        slave = None
        text = read_all(master)
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert out.returncode == 0, text
    assert "\r[" in text and "] 100%" in text and "GB/s" in text and "2/2 tensors" in text, text
    assert "updated to v1: 2 tensors" in text, text


def read_all(fd) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the other end is closed
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


ENGINE_SCRIPT = """
import sys, threading
import numpy as np
from weight_manager import Manager, Publisher
sock = sys.argv[1]
with Publisher(sock) as p:
    p.add("a", np.arange(1000, dtype=np.float32))
    p.add("b", np.ones((10, 10), np.float16))
    p.set_version("v1")
    t = threading.Thread(target=p.serve, args=(1, 30))
    t.start()
    with Manager(fallback_dir="") as m:
        a = m.allocate("a", "f32", (1000,))
        b = m.allocate("b", "f16", (10, 10))
        m.update(sock, source="ipc", progress=%s)
        assert a[999] == 999 and b[9, 9] == 1
    t.join(30)
print("torch" in sys.modules)
"""


def run_engine_script(tmp_path, stderr, progress="True"):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR))
    script = ENGINE_SCRIPT % progress
    return subprocess.run([sys.executable, "-c", script, str(tmp_path / "p.sock")], stdout=subprocess.PIPE,
                          stderr=stderr, env=env, timeout=60)


def test_torch_is_never_imported_by_the_package(tmp_path):
    out = run_engine_script(tmp_path, stderr=subprocess.PIPE, progress="False")
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().strip() == "False"
    assert out.stderr.decode() == ""


def test_progress_renderers():
    bar = render_bar(1_500_000_000, 3_000_000_000, 4, 10, 1.0)
    assert bar == "[" + "#" * 15 + "." * 15 + "]  50%  1.50/3.00 GB  1.50 GB/s  4/10 tensors"
    assert render_final("step-3", 10, 3_000_000_000, 2.0) == \
        "updated to step-3: 10 tensors, 3.00 GB in 2.00 s (1.50 GB/s)"
