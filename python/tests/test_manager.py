"""The Python binding against the real library, with safetensors files written
by the `safetensors` package."""

import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import DType, Manager, Result, State, WeightManagerError, version


def model(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((64, 32)).astype(np.float32),
        "attn.qkv": rng.standard_normal((96, 32)).astype(np.float16),
        "norm": rng.standard_normal((32,)).astype(np.float32),
        "bias_bf16": rng.integers(0, 2**16, size=(16,), dtype=np.uint16),  # bf16 bits
        "step": np.array(seed, dtype=np.int64),
    }


def write_snapshot(d: Path, tensors: dict, step=None, name="model_state.tp0.0.safetensors"):
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / name))
    if step is not None:
        (d / "version.yaml").write_text(f"step: {step}\n")


def engine(m: Manager, tensors: dict) -> dict:
    """Registers half the params as numpy arrays, allocates the other half."""
    params = {}
    for i, (name, t) in enumerate(tensors.items()):
        if i % 2 == 0:
            params[name] = np.zeros_like(t)
            m.register(name, params[name])
        else:
            params[name] = m.allocate(name, t.dtype, t.shape)
    return params


def test_version():
    assert version() == "0.2.0"


def test_update_clear_update(tmp_path):
    v1 = model(1)
    write_snapshot(tmp_path, v1, step=100)
    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        params = engine(m, v1)
        stats = m.update()
        assert stats.version == "100"
        assert stats.tensors == 5
        assert stats.bytes == sum(t.nbytes for t in v1.values())
        for name, t in v1.items():
            np.testing.assert_array_equal(params[name], t)
        st = m.status()
        assert (st.state, st.version, st.updates) == (State.NORMAL, "100", 1)
        assert st.last_update.bytes == stats.bytes

        m.clear()
        st = m.status()
        assert (st.state, st.version, st.resident_bytes) == (State.CLEARED, None, 0)
        assert not params["attn.qkv"].any()  # library-owned memory released: reads zeros

        v2 = model(2)
        write_snapshot(tmp_path, v2, step=200)
        assert m.update(in_place=True, verify=False).version == "200"
        for name, t in v2.items():
            np.testing.assert_array_equal(params[name], t)  # same arrays, same addresses


def test_bf16_registration_needs_dtype(tmp_path):
    t = {"w": np.arange(8, dtype=np.uint16)}
    save_file({"w": t["w"]}, str(tmp_path / "model_state.tp0.0.safetensors"))
    with Manager(fallback_dir="") as m:
        arr = np.zeros(8, np.uint16)
        m.register("w", arr, dtype="bf16")
        # The file says U16, the param says BF16: dtype mismatch, named.
        with pytest.raises(WeightManagerError) as e:
            m.update(tmp_path, version="1")
        assert e.value.code == Result.ERR_MISMATCH
        assert "param 'w': dtype mismatch: registered bf16, source u16" in e.value.message
    with pytest.raises(ValueError):
        Manager().register("x", np.zeros(4, np.uint8), dtype="bf16")


def test_errors_keep_weights_and_name_the_param(tmp_path):
    v1 = model(3)
    write_snapshot(tmp_path / "good", v1, step=1)
    bad = dict(v1)
    bad["norm"] = np.zeros((16,), np.float32)
    write_snapshot(tmp_path / "bad", bad, step=2)
    with Manager(fallback_dir="") as m:
        params = engine(m, v1)
        m.update(tmp_path / "good")
        with pytest.raises(WeightManagerError) as e:
            m.update(tmp_path / "bad", in_place=True)
        assert e.value.code == Result.ERR_MISMATCH
        assert "param 'norm': shape mismatch: registered [32], source [16]" in str(e.value)
        np.testing.assert_array_equal(params["embed"], v1["embed"])
        assert m.status().version == "1"
        with pytest.raises(WeightManagerError) as e:
            m.update(tmp_path / "missing")
        assert e.value.code == Result.ERR_NOT_FOUND
        with pytest.raises(WeightManagerError) as e:
            m.allocate("late", "f32", (2,))
        assert e.value.code == Result.ERR_STATE
        # An empty batch too, as wm_register_params with count 0.
        with pytest.raises(WeightManagerError) as e:
            m._register_all([])
        assert e.value.code == Result.ERR_STATE


def test_callbacks(tmp_path):
    v = model(4)
    write_snapshot(tmp_path, v, step=4)
    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        got = {}
        m.update(on_tensor=lambda name, arr: got.__setitem__(name, arr.copy()))
        assert set(got) == set(v)
        np.testing.assert_array_equal(got["embed"], v["embed"])
        assert got["bias_bf16"].dtype == np.uint16

        def boom(name, arr):
            raise RuntimeError(f"engine cannot take {name}")

        with pytest.raises(WeightManagerError) as e:
            m.update(on_tensor=boom)
        assert e.value.code == Result.ERR_CALLBACK
        assert isinstance(e.value.__cause__, RuntimeError)

    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        engine(m, v)
        seen = []
        m.update(progress=lambda p: seen.append(p.bytes_done))
        assert seen and seen[-1] == sum(t.nbytes for t in v.values())
        with pytest.raises(WeightManagerError) as e:
            m.update(version="5", progress=lambda p: False)
        assert e.value.code == Result.ERR_CANCELLED
        assert m.status().version == "4"


def test_log_callback_and_skip_unknown(tmp_path):
    v = model(5)
    write_snapshot(tmp_path, v, step=5)
    logs = []
    with Manager(model_dir=tmp_path, fallback_dir="", log=lambda lvl, msg: logs.append(msg)) as m:
        m.register("embed", np.zeros((64, 32), np.float32))
        m.update(skip_unknown=True)
    assert any("attn.qkv" in msg for msg in logs)


def test_hf_shards_with_index(tmp_path):
    v = model(6)
    names = list(v)
    save_file({k: v[k] for k in names[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: v[k] for k in names[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    import json
    weight_map = {k: ("model-00001-of-00002.safetensors" if i < 2 else "model-00002-of-00002.safetensors")
                  for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with Manager(fallback_dir="") as m:
        params = engine(m, v)
        m.update(tmp_path, version="hf")
        for name, t in v.items():
            np.testing.assert_array_equal(params[name], t)


def test_close_is_final_and_threads_see_busy(tmp_path):
    v = model(7)
    write_snapshot(tmp_path, v, step=7)
    m = Manager(model_dir=tmp_path, fallback_dir="")
    engine(m, v)
    entered, release = threading.Event(), threading.Event()
    errors = []

    def hold(p):
        entered.set()
        release.wait(10)
        return True

    t = threading.Thread(target=lambda: m.update(progress=hold))
    t.start()
    assert entered.wait(10)
    try:
        with pytest.raises(WeightManagerError) as e:
            m.update()
        assert e.value.code == Result.ERR_BUSY
        assert m.status().state == State.UPDATING
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    release.set()
    t.join()
    assert not errors
    m.close()
    m.close()
    with pytest.raises(WeightManagerError) as e:
        m.status()
    assert e.value.code == Result.ERR_INVALID_HANDLE


def test_signal_with_fastdeploy_cell():
    from multiprocessing import shared_memory
    import os
    name = f"model_weights_status.wmtest{os.getpid()}"
    # FastDeploy's engine creates the cell zeroed; the library attaches to it.
    shm = shared_memory.SharedMemory(name=name, create=True, size=4)
    try:
        cell = np.ndarray((1,), dtype=np.int32, buffer=shm.buf)
        cell[0] = 0
        with Manager(control_cell=name) as m:
            assert m.broadcast_signal() == State.NORMAL
            cell[0] = State.CLEARING
            assert m.broadcast_signal() == State.CLEARING
        del cell
    finally:
        shm.close()
        shm.unlink()


def test_dtype_names():
    assert DType.BF16.itemsize == 2
    with Manager() as m:
        with pytest.raises(ValueError):
            m.allocate("x", "complex64", (2,))


def test_fanout_config_is_checked_at_init():
    """NCCL fan-out needs ranks in a group and a GPU; each missing piece is
    named in the log, and -1 / None means no fan-out."""
    logs = []
    with pytest.raises(WeightManagerError) as e:
        Manager(fanout_group=0, log=lambda _lvl, msg: logs.append(msg))
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert any("(Python: fanout_group) needs the ranks in a group" in m for m in logs), logs
    with pytest.raises(WeightManagerError) as e:
        Manager(fanout_group=-3, log=lambda _lvl, msg: logs.append(msg))
    assert any("wm_fanout_config.group -3 is not a group number" in m for m in logs), logs
    with Manager(fanout_group=None) as m:
        assert m.status().state == State.NORMAL


_ARRAY_AFTER_CLOSE = """
import ctypes, gc, sys
sys.path.insert(0, sys.argv[1])
from weight_manager import Manager, Result, _lib
m = Manager(fallback_dir="")
a = m.allocate("x", "f32", (1 << 16,))
a[:] = 3
handle = m._handle.value
m.close()
try:
    m.status()
    raise SystemExit("status() on a closed manager did not raise")
except Exception as e:
    assert getattr(e, "code", None) == Result.ERR_INVALID_HANDLE, e
a += 1  # the array still views live memory
assert float(a.sum()) == 4.0 * (1 << 16), a.sum()
s = _lib.StatusInfo()
s.struct_size = ctypes.sizeof(s)
assert _lib.LIB.wm_status(handle, ctypes.byref(s)) == 0, "the array holds the handle"
del a
gc.collect()
assert _lib.LIB.wm_status(handle, ctypes.byref(s)) == Result.ERR_INVALID_HANDLE, "destroyed with the array"
print("ok")
"""


def test_allocated_array_outlives_close_without_crashing():
    """Issue 15 item 14: an allocate() array used after close() must not
    segfault (run in a subprocess so a crash fails the test, not pytest)."""
    import subprocess
    import sys
    package = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", _ARRAY_AFTER_CLOSE, package], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "ok"


def test_failed_creates_say_why(tmp_path):
    """Issue 15 item 18: the reason of a failed create reaches the exception."""
    from weight_manager import Publisher
    from weight_manager.manager import Controller
    with pytest.raises(WeightManagerError) as e:
        Manager(rank=3, world_size=1)
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert "rank 3 is not below world_size 1" in str(e.value)
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("x")
    with pytest.raises(WeightManagerError) as e:
        Publisher(str(not_a_socket))
    assert "not a socket" in str(e.value)
    with pytest.raises(WeightManagerError) as e:
        Controller("bad/name")
    assert "must be 1 to 200 bytes" in str(e.value)


def test_allocating_on_a_gpu_without_one_says_why():
    """A library-owned device param (`allocate(..., device=0)`) where the
    process sees no GPU: WM_ERR_UNSUPPORTED naming the driver, and the
    manager keeps working (its host params unaffected). The GPU side of
    the same call is python/tests/test_cuda_graphs.py."""
    import ctypes.util
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    with Manager() as m:
        with pytest.raises(WeightManagerError) as e:
            m.allocate("w", "f32", (4,), device=0)
        assert e.value.code == Result.ERR_UNSUPPORTED
        assert "libcuda" in str(e.value)
        host = m.allocate("h", "f32", (4,))
        assert host.shape == (4,)


def test_params_of_no_bytes_alone_are_said_so(tmp_path):
    """Params that hold no bytes (a dimension of 0) match their tensors but
    move nothing: the update says so, not that nothing matched."""
    write_snapshot(tmp_path, {"a": np.zeros((0, 4), np.float32)}, step=1)
    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        m.allocate("a", "f32", (0, 4))
        with pytest.raises(WeightManagerError) as e:
            m.update()
        assert e.value.code == Result.ERR_MISMATCH
        assert "every registered param holds no bytes" in e.value.message, e.value.message


def test_a_publisher_missing_among_several_is_named_as_its_source(tmp_path):
    """Of several IPC publishers, the one that cannot be opened is named by
    its index and location, as a source failing later is."""
    from weight_manager import Publisher
    w = np.zeros(4, np.float32)
    with Publisher(str(tmp_path / "p0.sock")) as p, Manager(fallback_dir="") as m:
        p.add("w", np.arange(4, dtype=np.float32))
        p.set_version("1")
        m.register("w", w)
        missing = str(tmp_path / "p1.sock")
        with pytest.raises(WeightManagerError) as e:
            m.update([missing, str(tmp_path / "p0.sock")], source="ipc", timeout=5)
        assert e.value.code == Result.ERR_NOT_FOUND, e.value
        assert f"source 0 (the publisher at {missing})" in e.value.message, e.value.message
