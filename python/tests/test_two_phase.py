"""Two-phase updates from Python (Manager.stage, commit, abort) against the
real library: a reader thread (and, for a shared engine, another process
reading the params in shared memory) checksums every param while the next
version stages and sees only the old one; after commit() only the new
one. Misuse:
commit or abort with nothing staged, stage twice, update while staged,
clear while staged, close while staged."""

import threading
import zlib

import numpy as np
import pytest

from test_manager import engine, model, write_snapshot
from weight_manager import Manager, Result, State, WeightManagerError


def digests(params: dict) -> tuple:
    return tuple(hash(np.ascontiguousarray(a).tobytes()) for a in params.values())


def expected(tensors: dict) -> tuple:
    return tuple(hash(np.ascontiguousarray(t).tobytes()) for t in tensors.values())


def two_versions(tmp_path):
    """Versions 1 and 2 of the test model, as snapshots v1/ and v2/."""
    v1, v2 = model(1), model(2)
    write_snapshot(tmp_path / "v1", v1, step=1)
    write_snapshot(tmp_path / "v2", v2, step=2)
    return v1, v2


def test_readers_see_the_old_version_until_commit(tmp_path):
    v1, v2 = two_versions(tmp_path)
    with Manager() as m:
        params = engine(m, v1)
        m.update(str(tmp_path / "v1"))
        seen, stop = set(), threading.Event()

        def read():
            while not stop.is_set():
                seen.add(digests(params))

        reader = threading.Thread(target=read)
        reader.start()
        staged = m.stage(str(tmp_path / "v2"))
        stop.set()
        reader.join()
        assert staged.version == "2"
        assert seen == {expected(v1)}, "a reader saw bytes of the staged version"
        assert m.status().version == "1"
        done = m.commit()
        assert done.version == "2"
        assert digests(params) == expected(v2)
        st = m.status()
        assert (st.state, st.version) == (State.NORMAL, "2")
        # The status's last update is what commit() returned (the pause).
        assert (st.last_update.update_s, st.last_update.total_s) == (done.update_s, done.total_s)


def test_misuse_is_refused_and_nothing_committed_is_lost(tmp_path):
    v1, v2 = two_versions(tmp_path)
    with Manager() as m:
        params = engine(m, v1)
        m.update(str(tmp_path / "v1"))
        for call in (m.commit, m.abort):
            with pytest.raises(WeightManagerError) as e:
                call()
            assert e.value.code == Result.ERR_STATE and "nothing is staged" in str(e.value)
        m.stage(str(tmp_path / "v2"))
        with pytest.raises(WeightManagerError) as e:
            m.stage(str(tmp_path / "v2"))
        assert e.value.code == Result.ERR_STATE
        with pytest.raises(WeightManagerError) as e:
            m.update(str(tmp_path / "v2"))
        assert e.value.code == Result.ERR_BUSY and "staged" in str(e.value)
        m.abort()
        assert digests(params) == expected(v1)
        assert m.status().version == "1"
        # A clear drops a staged version; the commit then says so.
        m.stage(str(tmp_path / "v2"))
        m.clear()
        with pytest.raises(WeightManagerError) as e:
            m.commit()
        assert e.value.code == Result.ERR_CANCELLED and "clear" in str(e.value)
        m.update(str(tmp_path / "v2"))
        assert digests(params) == expected(v2)
        # A failed stage stages nothing.
        with pytest.raises(WeightManagerError):
            m.stage(str(tmp_path / "missing"))
        with pytest.raises(WeightManagerError) as e:
            m.commit()
        assert e.value.code == Result.ERR_STATE
        # Closing with a version staged aborts it.
        m.stage(str(tmp_path / "v1"))
    assert digests(params) == expected(v2)


def _shared_reader(shm_name, layout, reading, stop, out):
    """A second process of a shared engine: checksums every param in the
    shared memory until told to stop (saying when it read once); sends
    the set of digests it saw."""
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        seen = set()
        while not stop.is_set():
            seen.add(tuple(zlib.crc32(shm.buf[o:o + n]) for o, n in layout))
            reading.set()
        out.put(seen)
    finally:
        shm.close()


def test_a_second_process_sees_the_old_version_until_commit(tmp_path):
    """A shared engine: params in shared memory (registered engine-owned),
    read by another process while the next version stages: it sees only
    the old bytes; after commit(), only the new ones."""
    import multiprocessing as mp
    from multiprocessing import shared_memory
    rng = np.random.default_rng(5)
    shapes = {"a": (1024, 1024), "b": (2048, 256), "c": (16,)}
    v1 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    v2 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    write_snapshot(tmp_path / "v1", v1, step=1)
    write_snapshot(tmp_path / "v2", v2, step=2)
    layout, at = [], 0
    for t in v1.values():
        layout.append((at, t.nbytes))
        at += t.nbytes
    shm = shared_memory.SharedMemory(create=True, size=at)
    ctx = mp.get_context("spawn")
    try:
        with Manager() as m:
            for (name, t), (o, n) in zip(v1.items(), layout):
                arr = np.ndarray(t.shape, dtype=t.dtype, buffer=shm.buf, offset=o)
                m.register(name, arr)
            m.update(str(tmp_path / "v1"))
            old = tuple(zlib.crc32(shm.buf[o:o + n]) for o, n in layout)
            reading, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
            reader = ctx.Process(target=_shared_reader, args=(shm.name, layout, reading, stop, out))
            reader.start()
            assert reading.wait(timeout=60), "the reader process never read"
            m.stage(str(tmp_path / "v2"))
            stop.set()
            seen = out.get(timeout=60)
            reader.join(timeout=60)
            assert seen == {old}, "the other process saw bytes of the staged version"
            m.commit()
            for (name, t), (o, n) in zip(v2.items(), layout):
                assert bytes(shm.buf[o:o + n]) == t.tobytes(), name
            del arr
    finally:
        shm.close()
        shm.unlink()


def test_calls_answer_at_once_while_a_stage_waits_on_a_silent_trainer(tmp_path):
    """A stage waiting on a publisher that never serves: commit, abort and
    a second stage say ERR_STATE at once (they waited for the whole
    staging), and clear stops the staging at once (it waited for the
    publisher, up to the bucket timeout); the old weights stay."""
    import time
    from weight_manager import Publisher
    v1, _ = two_versions(tmp_path)
    sock = str(tmp_path / "silent.sock")
    with Publisher(sock), Manager() as m:
        params = engine(m, v1)
        m.update(str(tmp_path / "v1"))
        ended = []
        stager = threading.Thread(
            target=lambda: ended.append(_code_of(lambda: m.stage(sock, source="ipc", timeout=30))))
        stager.start()
        time.sleep(0.3)
        for call in (m.commit, m.abort, lambda: m.stage(str(tmp_path / "v2"))):
            t = time.monotonic()
            assert _code_of(call) == Result.ERR_STATE
            assert time.monotonic() - t < 2
        t = time.monotonic()
        m.clear()
        stager.join(10)
        assert not stager.is_alive() and time.monotonic() - t < 5
        assert ended == [Result.ERR_CANCELLED]
        m.update(str(tmp_path / "v1"))
        assert digests(params) == expected(v1)


def _code_of(call):
    try:
        call()
        return Result.OK
    except WeightManagerError as e:
        return e.code
