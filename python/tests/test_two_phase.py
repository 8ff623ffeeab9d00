"""Two-phase updates from Python (Manager.stage, commit, abort) against the
real library: a reader thread checksums every param while the next version
stages and sees only the old one; after commit() only the new one. Misuse:
commit or abort with nothing staged, stage twice, update while staged,
clear while staged, close while staged."""

import threading

import numpy as np
import pytest

from test_manager import engine, model, write_snapshot
from weight_manager import Manager, Result, State, WeightManagerError


def digests(params: dict) -> tuple:
    return tuple(hash(np.ascontiguousarray(a).tobytes()) for a in params.values())


def expected(tensors: dict) -> tuple:
    return tuple(hash(np.ascontiguousarray(t).tobytes()) for t in tensors.values())


def test_readers_see_the_old_version_until_commit(tmp_path):
    v1, v2 = model(1), model(2)
    write_snapshot(tmp_path / "v1", v1, step=1)
    write_snapshot(tmp_path / "v2", v2, step=2)
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


def test_misuse_is_refused_and_nothing_committed_is_lost(tmp_path):
    v1, v2 = model(1), model(2)
    write_snapshot(tmp_path / "v1", v1, step=1)
    write_snapshot(tmp_path / "v2", v2, step=2)
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
