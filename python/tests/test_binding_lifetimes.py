"""What the binding keeps alive for the library, and what it refuses before
ctypes would change it: a close() or a clear() while another thread's call
runs must not free memory that call writes or reads, and a value ctypes
would wrap or cut (an int out of its C type's range, text with a NUL) is an
error naming it."""

import gc
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import Controller, Manager, Piece, Publisher, Result, State, WeightManagerError

N = 4 << 20  # floats: 16 MiB, several buckets of 1 MiB


def _hold_first_progress(first, go):
    def progress(_p):
        if not first.is_set():
            first.set()
            go.wait(20)
    return progress


def _serve_once(p):
    try:
        p.serve(1, timeout=30)
    except WeightManagerError:
        pass  # the engine went away: its update was cancelled


def test_close_cancels_an_update_waiting_on_a_silent_trainer(tmp_path):
    """An update waiting for a trainer that accepted and says nothing is
    cancelled by close() on another thread within the stop poll (not at its
    60 s timeout), as wm_destroy cancels it in C."""
    import socket
    import time
    sock = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock)
    srv.listen(4)
    m = Manager(fallback_dir="")
    m.register("w", np.zeros(16, np.float32))
    out = {}

    def update():
        try:
            m.update(sock, source="ipc", timeout=60)
        except WeightManagerError as e:
            out["error"] = e

    t = threading.Thread(target=update)
    t.start()
    conn, _ = srv.accept()  # the engine connected and waits for an answer
    time.sleep(0.3)
    began = time.monotonic()
    m.close()
    t.join(20)
    took = time.monotonic() - began
    conn.close()
    srv.close()
    assert not t.is_alive()
    assert out["error"].code == Result.ERR_CANCELLED, out
    assert took < 10, took
    with pytest.raises(WeightManagerError) as e:
        m.update(sock, source="ipc")
    assert e.value.code == Result.ERR_INVALID_HANDLE


@pytest.mark.parametrize("in_place", [False, True])
def test_close_during_an_update_cancels_it_and_keeps_its_memory(tmp_path, in_place):
    """The registered array is held by the manager alone; close() runs while
    the update is between buckets. The update is cancelled (it raises
    ERR_CANCELLED in its thread, with its text) and writes nothing into
    memory freed meanwhile (it used to write into freed memory, or raise
    INVALID_HANDLE after committing); atomic, nothing of it is committed."""
    sock = str(tmp_path / "t.sock")
    p = Publisher(sock, bucket_size=1 << 20)
    p.add("big", np.full(N, 3.0, np.float32))
    p.add("small", np.ones(16, np.float32))
    p.set_version("v1")
    served = threading.Thread(target=_serve_once, args=(p,))
    served.start()
    m = Manager(fallback_dir="")
    m.register("big", np.zeros(N, np.float32))  # only the manager holds it
    small = m.allocate("small", "f32", (16,))  # keeps the handle alive past close()
    first, go = threading.Event(), threading.Event()
    out = {}

    def update():
        try:
            out["version"] = m.update(sock, source="ipc", in_place=in_place,
                                      progress=_hold_first_progress(first, go)).version
        except WeightManagerError as e:
            out["error"] = e

    t = threading.Thread(target=update)
    t.start()
    assert first.wait(20)
    m.close()
    gc.collect()
    # Memory freed too early would now hold these, and the update write them.
    junk = [np.zeros(N, np.float32) for _ in range(4)]
    go.set()
    t.join(30)
    served.join(30)
    p.close()
    assert set(out) == {"error"}, out
    assert out["error"].code == Result.ERR_CANCELLED, out
    assert "shut down" in str(out["error"]), out
    assert all(float(j.max()) == 0.0 for j in junk)
    if not in_place:
        assert (small == 0.0).all()
    with pytest.raises(WeightManagerError) as e:
        m.status()
    assert e.value.code == Result.ERR_INVALID_HANDLE


def test_publisher_clear_while_serving_keeps_the_tensors_until_serve_returns(tmp_path):
    sock = str(tmp_path / "t.sock")
    p = Publisher(sock, bucket_size=1 << 18)
    p.add("a", np.full(N, 1.5, np.float32))  # only the publisher holds it
    p.set_version("v1")
    served = threading.Thread(target=lambda: p.serve(1, timeout=30))
    served.start()
    m = Manager(fallback_dir="")
    a = np.zeros(N, np.float32)
    m.register("a", a)
    first, go = threading.Event(), threading.Event()
    out = {}

    def update():
        out["version"] = m.update(sock, source="ipc", verify=True,
                                  progress=_hold_first_progress(first, go), timeout=20).version

    t = threading.Thread(target=update)
    t.start()
    assert first.wait(20)
    p.clear()
    gc.collect()
    junk = [np.full(N, 9.0, np.float32) for _ in range(3)]
    go.set()
    t.join(30)
    served.join(30)
    p.close()
    m.close()
    assert out == {"version": "v1"}
    assert (a == 1.5).all()
    del junk


def test_values_ctypes_would_change_are_refused_naming_them(tmp_path):
    save_file({"q": np.arange(40, dtype=np.float32).reshape(8, 5)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "version.yaml").write_text("step: 1\n")

    def refused(call, *names):
        with pytest.raises(WeightManagerError) as e:
            call()
        assert e.value.code == Result.ERR_INVALID_ARGUMENT, e.value
        for n in names:
            assert n in e.value.message, e.value.message

    refused(lambda: Manager(rank=2**32 + 1, world_size=2), "rank", str(2**32 + 1))
    refused(lambda: Manager(copy_threads=2**32), "copy_threads")
    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        # A piece offset of 2**64 + 4 used to become 4: rows nobody asked for.
        refused(lambda: m.register("p", np.zeros((4, 5), np.float32),
                                   pieces=[Piece("q", (2**64 + 4, 0), (4, 5))]), "offset[0]")
        refused(lambda: m.register("p", np.zeros((4, 5), np.float32),
                                   pieces=[Piece("q", (-1, 0), (4, 5))]), "offset[0]")
        refused(lambda: m.allocate("q", "f32", (2**64 + 8, 5)), "param 'q'", "shape[0]")
        with pytest.raises(TypeError):
            m.allocate("q", "f32", (8.0, 5))
        with pytest.raises(TypeError):
            m.allocate("q", "f32", (True, 5))
        # Piece sizes too: 1.9 and True used to become 1 (another box, loaded silently).
        with pytest.raises(TypeError, match=r"offset\[0\]: 1.9 is not a size"):
            Piece("q", (1.9, 0), (2, 5))
        with pytest.raises(TypeError, match=r"length\[0\]: True is not a size"):
            Piece("q", (0, 0), (True, 5))
        with pytest.raises(TypeError, match=r"at\[1\]: 0.0 is not a size"):
            Piece("q", (0, 0), (2, 5), at=(0, 0.0))
        # Text with a NUL used to be cut there: "w\0x" registered as "w".
        refused(lambda: m.register("q\0x", np.zeros((8, 5), np.float32)), "name", "NUL")
        assert m.status().params == 0  # nothing half-registered
        q = np.zeros((8, 5), np.float32)
        m.register("q", q)
        refused(lambda: m.update(version="v1\0hidden"), "version", "NUL")
        refused(lambda: m.update(str(tmp_path) + "\0/elsewhere"), "location", "NUL")
        with pytest.raises(TypeError):
            m.update(version=7)  # used to become seven NUL bytes
        assert m.status().updates == 0 and not q.any()
        assert m.update().version == "1" and q[7, 4] == 39.0
    with Publisher(str(tmp_path / "p.sock")) as p:
        refused(lambda: p.set_version("ok\0bad"), "NUL")
        # A shard's global shape and offset: ints only (4.9 used to become 4).
        with pytest.raises(TypeError, match=r"global_shape\[0\]: 4.9 is not a size"):
            p.add_shard("s", np.zeros((2, 4), np.float32), global_shape=(4.9, 4), offset=(2, 0))
        with pytest.raises(TypeError, match=r"offset\[0\]: True is not a size"):
            p.add_shard("s", np.zeros((2, 4), np.float32), global_shape=(4, 4), offset=(True, 0))
        refused(lambda: p.prepare(2**32 + 1), "argument 2")
    from multiprocessing import shared_memory
    import os
    name = f"model_weights_status.wmwrap{os.getpid()}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=4)
    try:
        with Controller(name) as c:
            c.set(State.CLEARED)
            refused(lambda: c.set(2**32), "argument 2")  # used to become 0, NORMAL
            assert c.get() == State.CLEARED
    finally:
        shm.close()
        shm.unlink()


def test_names_and_sources_of_another_type_are_type_errors_naming_the_argument(tmp_path):
    """A name that is no str (an int, say) is a TypeError naming what it
    was for, not an AttributeError from inside the binding."""
    a = np.zeros(4, np.float32)
    with Manager(model_dir=tmp_path, fallback_dir="") as m:
        for call, what in [
            (lambda: m.register(5, a), "param name"),
            (lambda: m.allocate(5, "f32", (4,)), "param name"),
            (lambda: Piece(7, (0,), (4,)), "piece's tensor"),
            (lambda: m.quantize(1, 2), "weight param's name"),
            (lambda: m.update(source=3), "source"),
            (lambda: m.update(5), "location"),
        ]:
            with pytest.raises(TypeError, match=what):
                call()
        assert m.status().params == 0
    with Publisher(str(tmp_path / "p.sock")) as p:
        with pytest.raises(TypeError, match="tensor name"):
            p.add(3, a)
        with pytest.raises(TypeError, match="version"):
            p.set_version(4)
        # An empty name is named as a tensor's, not a param's.
        with pytest.raises(WeightManagerError, match="tensor name is empty"):
            p.add("", a)


def test_params_sharing_memory_are_refused_naming_both():
    """An engine that registered one buffer under two names (a tied weight)
    took two different tensors into it: the commit wrote one over the other
    after both verified. Refused at registration now."""
    buf = np.zeros((8, 4), np.float32)
    with Manager(fallback_dir="") as m:
        m.register("embed", buf)
        with pytest.raises(WeightManagerError) as e:
            m.register("lm_head", buf)
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        assert "'lm_head'" in e.value.message and "'embed'" in e.value.message
        with pytest.raises(WeightManagerError):
            m.register("half", buf[4:])  # a view into it
        m.register("other", np.zeros((8, 4), np.float32))
        assert m.status().params == 2


def test_register_module_refuses_views_of_one_buffer_before_registering_any():
    """Two state_dict entries over the same bytes with another dtype (not
    tied weights: those are registered once) are refused naming both, with
    nothing registered, instead of failing midway."""
    torch = pytest.importorskip("torch")

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", torch.zeros(8))
            self.register_buffer("first", torch.zeros(4))
            self.register_buffer("b", self.a.view(torch.int32))

    with Manager(fallback_dir="") as m:
        with pytest.raises(ValueError) as e:
            m.register_module(Views())
        assert "'a'" in str(e.value) and "'b'" in str(e.value)
        assert m.status().params == 0


def test_register_module_registers_every_tensor_or_none():
    """A module whose third tensor the library refuses (its name registered
    before) registers none of its tensors: the error names the tensor and
    its place, and the module registers once the clash is gone."""
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with Manager(fallback_dir="") as m:
        m.register("1.weight", np.zeros((2, 4), np.float32))
        with pytest.raises(WeightManagerError) as e:
            m.register_module(module)
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        assert "param 2 of the 4 registered together (none was registered)" in e.value.message
        assert "'1.weight'" in e.value.message
        assert m.status().params == 1
        registered = m.register_module(module, prefix="engine.")
        assert m.status().params == 5
        assert sorted(registered.params) == ["engine.0.bias", "engine.0.weight",
                                             "engine.1.bias", "engine.1.weight"]
