"""The network path with numpy arrays as the trainer's tensors: the
publisher (over TCP + UCX) in a process of its own, the engine in this
process. UCX runs over TCP on loopback (UCX_TLS=tcp, set by conftest)."""

import multiprocessing as mp

import numpy as np
import pytest

from weight_manager import Manager, Publisher, Result, WeightManagerError

SECRET = "python-test-secret-0123456789"


def trainer_tensors(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((256, 64)).astype(np.float32),
        "qkv": rng.standard_normal((192, 64)).astype(np.float16),
    }


def run_trainer(addr_queue, engines):
    with Publisher(net="127.0.0.1:0", secret=SECRET, keep_versions=2) as p:
        tensors = trainer_tensors(1)
        for name, arr in tensors.items():
            p.add(name, arr)
        p.set_version("step-1")
        p.publish()
        # The trainer goes on training: its arrays change, the published copy does not.
        for arr in tensors.values():
            arr *= 2
        p.set_version("step-2")
        p.publish()
        addr_queue.put(p.address)
        p.serve(engines, timeout=30)


def test_numpy_tensors_over_the_network_by_version():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=run_trainer, args=(q, 2))
    proc.start()
    addr = q.get(timeout=30)
    assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
    want = trainer_tensors(1)
    with Manager(fallback_dir="", net_secret=SECRET, net_bucket_size=8 << 10) as m:
        params = {name: m.allocate(name, t.dtype, t.shape) for name, t in want.items()}
        stats = m.update(addr, "step-1", source="rdma")
        assert stats.version == "step-1"
        for name, t in want.items():
            np.testing.assert_array_equal(params[name], t)
        stats = m.update(addr, source="rdma")  # latest
        assert stats.version == "step-2"
        for name, t in want.items():
            np.testing.assert_array_equal(params[name], t * 2)
    proc.join(30)
    assert proc.exitcode == 0


def test_wrong_secret_raises_auth_error():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=run_trainer, args=(q, 1))
    proc.start()
    addr = q.get(timeout=30)
    with Manager(fallback_dir="", net_secret="not-the-secret-0123456789") as m:
        m.allocate("embed", np.float32, (256, 64))
        m.allocate("qkv", np.float16, (192, 64))
        with pytest.raises(WeightManagerError) as e:
            m.update(addr, source="rdma")
        assert e.value.code == Result.ERR_AUTH
        assert "authentication failed" in str(e.value)
    # A connection that failed the challenge does not count as an engine, so
    # the trainer still waits for a real one: stop it rather than wait out
    # its accept timeout.
    proc.terminate()
    proc.join(10)


def test_network_publisher_without_secret_is_refused(monkeypatch):
    monkeypatch.delenv("WM_NET_SECRET", raising=False)
    with pytest.raises(WeightManagerError) as e:
        Publisher(net="127.0.0.1:0")
    assert e.value.code == Result.ERR_AUTH
