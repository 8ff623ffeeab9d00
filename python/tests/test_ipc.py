"""IPC with numpy arrays as the trainer's tensors: the publisher in a
process of its own (multiprocessing), engines in this process."""

import multiprocessing as mp
import os

import numpy as np
import pytest

from weight_manager import Manager, Publisher, Result, WeightManagerError


def trainer_tensors(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((256, 64)).astype(np.float32),
        "qkv": rng.standard_normal((192, 64)).astype(np.float16),
        "bias": rng.standard_normal((64,)).astype(np.float32),
    }


def run_trainer(sock, seed, engines, ready, corrupt_with_rank_shard):
    tensors = trainer_tensors(seed)
    with Publisher(sock, bucket_size=16 << 10) as p:
        for name, arr in tensors.items():
            p.add(name, arr)
        if corrupt_with_rank_shard:
            p.add("rank1_only", np.full(8, 7, np.int32), rank=1)
        p.set_version(f"step-{seed}")
        ready.set()
        st = p.serve(engines, timeout=30)
        assert st.sessions == engines and st.bytes > 0


def start_trainer(sock, seed, engines=1, rank_shard=False):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=run_trainer, args=(sock, seed, engines, ready, rank_shard))
    proc.start()
    assert ready.wait(30)
    return proc


def spawn_trainer(target, *args):
    """Start `target(*args, ready)` in a process of its own; return it once
    it set `ready` (its publisher listens)."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready))
    proc.start()
    assert ready.wait(30)
    return proc


def test_numpy_tensors_over_ipc_copy_and_zero_copy(tmp_path):
    sock = str(tmp_path / "trainer.sock")
    trainer = start_trainer(sock, 1, engines=2)
    want = trainer_tensors(1)
    with Manager(fallback_dir="") as m:
        params = {name: m.allocate(name, t.dtype, t.shape) for name, t in want.items()}
        stats = m.update(sock, source="ipc", verify=True)
        assert stats.version == "step-1"
        for name, t in want.items():
            np.testing.assert_array_equal(params[name], t)
    with Manager(fallback_dir="") as m:
        got = {}
        writable = []

        def keep(n, a):
            # Zero-copy: the publisher's memory, mapped read-only; the view
            # says so (a write would fault) instead of crashing the engine.
            writable.append(a.flags.writeable)
            got[n] = a.copy()
        m.update(sock, source="ipc", in_place=True, on_tensor=keep)
        assert set(got) == set(want) and not any(writable)
        np.testing.assert_array_equal(got["qkv"], want["qkv"])
    trainer.join(30)
    assert trainer.exitcode == 0


def test_a_tensor_callback_takes_no_deltas(tmp_path):
    # A callback takes every tensor instead of the params: no base is
    # named, first update or not, and the stats say NOT_APPLICABLE.
    from weight_manager import DeltaFallback
    sock = str(tmp_path / "cb.sock")
    trainer = start_trainer(sock, 3, engines=3)
    want = trainer_tensors(3)
    with Manager(fallback_dir="") as fresh:
        d = fresh.update(sock, source="ipc", deltas=True, on_tensor=lambda n, a: None).deltas
        assert (d.fallback, d.base_version, d.runs_delta) == (DeltaFallback.NOT_APPLICABLE, "", 0)
    with Manager(fallback_dir="") as m:
        params = {name: m.allocate(name, t.dtype, t.shape) for name, t in want.items()}
        m.update(sock, source="ipc", deltas=True)
        got = []
        d = m.update(sock, source="ipc", deltas=True, on_tensor=lambda n, a: got.append(n)).deltas
        assert (d.fallback, d.base_version) == (DeltaFallback.NOT_APPLICABLE, ""), d
        assert sorted(got) == sorted(want)
        np.testing.assert_array_equal(params["embed"], want["embed"])
    trainer.join(30)
    assert trainer.exitcode == 0


def test_rank_shards(tmp_path):
    sock = str(tmp_path / "shard.sock")
    trainer = start_trainer(sock, 2, engines=2, rank_shard=True)
    names = {}
    for rank in (0, 1):
        with Manager(rank, 2, fallback_dir="") as m:
            got = []
            m.update(sock, source="ipc", in_place=True, on_tensor=lambda n, a: got.append(n))
            names[rank] = sorted(got)
    assert "rank1_only" in names[1] and "rank1_only" not in names[0]
    trainer.join(30)
    assert trainer.exitcode == 0


def test_no_publisher():
    with Manager(fallback_dir="") as m:
        m.allocate("w", "f32", (4,))
        with pytest.raises(WeightManagerError) as e:
            m.update(f"/tmp/wm-no-such-{os.getpid()}.sock", source="ipc")
        assert e.value.code == Result.ERR_NOT_FOUND


class TensorLike:
    """What add_torch reads of a torch.Tensor (torch itself is not installed
    here): contiguity, dtype, shape, element size, device and data_ptr()."""

    def __init__(self, array, dtype, cuda=False):
        self.array, self.dtype, self.is_cuda = array, dtype, cuda
        self.shape = array.shape
        self.device = type("Device", (), {"index": 0})()

    def is_contiguous(self):
        return self.array.flags.c_contiguous

    def numel(self):
        return self.array.size

    def element_size(self):
        return self.array.itemsize

    def data_ptr(self):
        return self.array.ctypes.data


def run_torch_style_trainer(sock, ready):
    tensors = trainer_tensors(3)
    with Publisher(sock) as p:
        p.add_torch("embed", TensorLike(tensors["embed"], "float32"))
        p.add_torch("qkv", TensorLike(tensors["qkv"].view(np.uint16), "bfloat16"))
        p.set_version("torch-1")
        p.publish()
        ready.set()
        p.serve(1, timeout=30)


def test_torch_tensors_publish_by_data_ptr(tmp_path):
    sock = str(tmp_path / "torch.sock")
    proc = spawn_trainer(run_torch_style_trainer, sock)
    want = trainer_tensors(3)
    with Manager(fallback_dir="") as m:
        embed = m.allocate("embed", "f32", want["embed"].shape)
        qkv = m.allocate("qkv", "bf16", want["qkv"].shape)
        assert m.update(sock, source="ipc", verify=True).version == "torch-1"
        np.testing.assert_array_equal(embed, want["embed"])
        np.testing.assert_array_equal(qkv, want["qkv"].view(np.uint16))
    proc.join(30)
    assert proc.exitcode == 0


def test_torch_cuda_tensor_must_be_gpu_memory(tmp_path):
    host = np.zeros(16, np.float32)
    with Publisher(str(tmp_path / "gpu.sock")) as p:
        with pytest.raises(WeightManagerError) as e:
            p.add_torch("w", TensorLike(host, "float32", cuda=True))
        # No driver here: unsupported, naming the driver; on a GPU machine:
        # refused as not device memory. Either way the tensor is named.
        assert "tensor 'w'" in str(e.value)
        with pytest.raises(ValueError):
            p.add_torch("t", TensorLike(np.zeros((4, 4), np.float32)[:, ::2], "float32"))


def test_device_arrays_expose_the_cuda_array_interface():
    from weight_manager import DeviceArray, DType
    a = DeviceArray(0x7F0000001000, 4096, 1, DType.F16, (32, 64))
    assert a.__cuda_array_interface__ == {
        "shape": (32, 64), "typestr": "<f2", "data": (0x7F0000001000, False), "version": 3}


def test_prepare_makes_the_buffers_publishes_copy_into(tmp_path):
    data = np.arange(1000, dtype=np.float32)
    with Publisher(str(tmp_path / "prep.sock")) as p:
        with pytest.raises(WeightManagerError) as e:
            p.prepare()
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        assert "add the tensors" in str(e.value)
        p.add("w", data)
        with pytest.raises(WeightManagerError):
            p.prepare(65)
        # count 0: keep_versions + 1 buffers (the default keeps 2 versions).
        assert p.prepare() == 3 * data.nbytes
        assert p.prepare(2) == 2 * data.nbytes
        for k in range(4):
            p.set_version(f"v{k}")
            p.publish()


def test_an_empty_version_and_impossible_waits_are_refused(tmp_path):
    """set_version("") is refused (None alone means version.yaml) and the
    version set before stays; a negative, infinite or NaN wait and a
    negative engine count raise ERR_INVALID_ARGUMENT instead of wrapping
    into a wait of years."""
    t = trainer_tensors(3)
    with Publisher(str(tmp_path / "p.sock")) as p:
        for name, a in t.items():
            p.add(name, a)
        p.set_version("v1")
        with pytest.raises(WeightManagerError) as e:
            p.set_version("")
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        p.publish()  # still v1: publishing needs a version
        for engines, timeout in [(-1, 1.0), (1, -1.0), (1, float("inf")), (1, float("nan"))]:
            with pytest.raises(WeightManagerError) as e:
                p.serve(engines, timeout)
            assert e.value.code == Result.ERR_INVALID_ARGUMENT, (engines, timeout)
    with Manager() as m:
        with pytest.raises(WeightManagerError) as e:
            m.update(str(tmp_path), timeout=float("inf"))
        assert e.value.code == Result.ERR_INVALID_ARGUMENT and "timeout" in str(e.value)


def run_republishing_trainer(sock, serves, ready):
    # Publishes step after step on a thread, each of one value, and writes
    # minus that value into its live tensor right after: bytes a published
    # copy never holds. The main thread serves meanwhile.
    import threading
    import time
    data = np.zeros((256, 1024), np.float32)
    with Publisher(sock, keep_versions=1, bucket_size=1 << 20) as p:
        p.add("w", data)
        p.set_version("0")
        p.publish()
        stop = threading.Event()

        def steps():
            i = 1
            while not stop.is_set():
                data[:] = i
                p.set_version(str(i))
                p.publish()
                data[:] = -i
                i += 1
                time.sleep(0.001)
        t = threading.Thread(target=steps)
        t.start()
        ready.set()
        try:
            for _ in range(serves):
                p.serve(1, timeout=30)
        finally:
            stop.set()
            t.join()


def test_a_serve_during_a_publish_never_offers_live_tensors(tmp_path):
    # keep_versions=1: a publish drops the only version before copying the
    # next into its buffer. A serve in that moment used to offer the live
    # tensors under the new version's name (here: minus the version, or a
    # mix), which an engine then committed as that version.
    sock = str(tmp_path / "race.sock")
    serves = 30
    trainer = spawn_trainer(run_republishing_trainer, sock, serves)
    wrong = []
    with Manager(fallback_dir="") as m:
        w = m.allocate("w", np.float32, (256, 1024))
        for _ in range(serves):
            version = m.update(sock, source="ipc", timeout=30).version
            values = np.unique(w)
            if values.tolist() != [float(version)]:
                wrong.append((version, values[:4].tolist()))
    trainer.join(60)
    assert trainer.exitcode == 0
    assert wrong == []


def run_one_version(sock, ready):
    with Publisher(sock) as p:
        p.add("a", np.full(4096, 1, np.float32))
        p.set_version("v")
        p.publish()
        ready.set()
        p.serve(2, timeout=30)


def test_an_engine_cannot_write_a_published_version(tmp_path):
    # The version's buffer reaches every engine as a memory file: one that
    # reopens it read-write (/proc/self/fd) and writes is refused, so the
    # next engine still reads the trainer's bytes.
    sock = str(tmp_path / "sealed.sock")
    trainer = spawn_trainer(run_one_version, sock)
    tried = 0
    with Manager(fallback_dir="") as m:
        m.allocate("a", "f32", (4096,))
        m.update(sock, source="ipc")
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if "wm-bucket" not in link:
                continue
            tried += 1
            with pytest.raises(PermissionError):
                w = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                try:
                    os.pwrite(w, np.full(16, 666, np.float32).tobytes(), 0)
                finally:
                    os.close(w)
    assert tried > 0
    with Manager(fallback_dir="") as m:
        a = m.allocate("a", "f32", (4096,))
        m.update(sock, source="ipc")
        assert (a == 1).all()
    trainer.join(30)
    assert trainer.exitcode == 0
