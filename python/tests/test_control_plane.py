"""The FastDeploy-compatible control cell, driven the way FastDeploy's
controller drives it: an int32 in multiprocessing.shared_memory, while real
`wm worker` ranks loop."""

import os
import subprocess
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import Controller, Manager, State, WeightManagerError

ROOT = Path(__file__).resolve().parents[2]
WM = os.environ.get("WM_BIN", str(ROOT / "target" / "release" / "wm"))

NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2


def wait_for(cell, value, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(cell[0]) == value:
            return
        time.sleep(0.001)
    raise AssertionError(f"control word stayed {int(cell[0])}, wanted {value}")


@pytest.fixture
def model_dir(tmp_path):
    save_file({"w": np.arange(16, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "version.yaml").write_text("step: 3\n")
    return tmp_path


def test_fastdeploy_controller_drives_worker_ranks(model_dir, tmp_path):
    if not Path(WM).exists():
        pytest.skip(f"{WM} not built (cargo build --release)")
    port = 8000 + os.getpid() % 1000
    name = f"model_weights_status.{port}"
    # FastDeploy's engine creates the word zeroed (NORMAL) ...
    shm = shared_memory.SharedMemory(name=name, create=True, size=4)
    cell = np.ndarray((1,), dtype=np.int32, buffer=shm.buf)
    cell[0] = NORMAL
    ranks = []
    try:
        for rank in range(2):
            ranks.append(subprocess.Popen(
                [WM, "worker", "--rank", str(rank), "--world", "2", "--group", f"pyfd{os.getpid()}",
                 "--cell", name, "--model-dir", str(model_dir), "--steps", "200000", "--step-us", "200",
                 "--timeout-ms", "10000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        # ... and its API server runs FastDeploy's controller protocol on the raw int32.
        for _ in range(3):
            assert int(cell[0]) == NORMAL
            cell[0] = CLEARING
            wait_for(cell, CLEARED)
            cell[0] = UPDATING
            wait_for(cell, NORMAL)
        # The library's own controller agrees on the same object.
        with Controller(name) as c:
            assert c.get() == State.NORMAL
            assert c.request_update(timeout=5) == "already_done"
            assert c.request_clear(timeout=10) == "done"
            assert int(cell[0]) == CLEARED
            assert c.request_update(timeout=10) == "done"
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        del cell
        shm.close()
        shm.unlink()
        # Killed ranks could not remove rank 0's report object.
        Path(f"/dev/shm/{name}.wm_report").unlink(missing_ok=True)


def test_two_ranks_in_threads_share_a_group(model_dir):
    """Two Manager objects as ranks 0 and 1 (threads), one controller."""
    import threading
    name = f"wm_py_cell_{os.getpid()}"
    seen = {0: [], 1: []}
    errors = []

    def rank(r):
        try:
            with Manager(r, 2, group=f"wm_py_group_{os.getpid()}", control_cell=name, model_dir=model_dir,
                         fallback_dir="", signal_timeout=10) as m:
                m.allocate("w", "f32", (16,))
                for _ in range(600):
                    s = m.broadcast_signal()
                    seen[r].append(s)
                    if s == State.UPDATING:
                        m.update()
                    elif s == State.CLEARING:
                        m.clear()
                    else:
                        time.sleep(0.0003)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    try:
        with Controller(name) as c:
            assert c.request_clear(timeout=10) == "done"
            # The ranks read CLEARED at their next broadcast; an update asked
            # for at once could replace the word before they look (a race in
            # the test, not in the library), so wait until they have seen it.
            deadline = time.monotonic() + 10
            while State.CLEARED not in seen[0] and time.monotonic() < deadline:
                time.sleep(0.001)
            assert c.request_update(timeout=10) == "done"
    finally:
        for t in threads:
            t.join()
        try:
            shared_memory.SharedMemory(name=name).unlink()
        except FileNotFoundError:
            pass
    assert not errors, errors
    assert seen[0] == seen[1]
    assert State.CLEARED in seen[0] and State.UPDATING in seen[0]


def test_signal_needs_a_group_name():
    with Manager(0, 2) as m:
        with pytest.raises(WeightManagerError) as e:
            m.broadcast_signal()
        assert "wm_group_config" in e.value.message


_STAGE_THEN_DIE = """
import os, sys, time
from weight_manager import Manager, State
group, cell, model = sys.argv[1:4]
with Manager(1, 2, group=group, control_cell=cell, model_dir=model, fallback_dir="",
             signal_timeout=5) as m:
    m.allocate("w", "f32", (16,))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if m.broadcast_signal() == State.UPDATING:
            m.stage()
            os._exit(0)  # dies between its stage and the commit
        time.sleep(0.001)
"""


def test_a_commit_after_the_group_stopped_writes_nothing(tmp_path):
    """Rank 1 dies between its stage and the commit; rank 0's signal says
    so (ERR_PEER). A commit rank 0 makes anyway is refused before it writes
    (it wrote the new version, then failed the finishing barrier), and its
    params keep the old version."""
    import sys
    from weight_manager import Result
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for d, k in ((v1, 1), (v2, 2)):
        d.mkdir()
        save_file({"w": np.full(16, k, dtype=np.float32)}, str(d / "model.safetensors"))
        (d / "version.yaml").write_text(f"step: {k}\n")
    group, cell = f"wm_py_gs_{os.getpid()}", f"wm_py_cs_{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    rank1 = subprocess.Popen([sys.executable, "-c", _STAGE_THEN_DIE, group, cell, str(v2)], env=env)
    try:
        with Manager(0, 2, group=group, control_cell=cell, model_dir=str(v2), fallback_dir="",
                     signal_timeout=5) as m:
            w = m.allocate("w", "f32", (16,))
            m.update(str(v1))
            with Controller(cell) as c:
                c.set(State.UPDATING)
            stopped = None
            deadline = time.monotonic() + 20
            while stopped is None and time.monotonic() < deadline:
                try:
                    if m.broadcast_signal() == State.UPDATING and not m.status().state == State.UPDATING:
                        m.stage()
                except WeightManagerError as e:
                    stopped = e
                time.sleep(0.001)
            assert stopped is not None and stopped.code == Result.ERR_PEER, stopped
            with pytest.raises(WeightManagerError) as e:
                m.commit()
            assert e.value.code == Result.ERR_PEER and "no commit" in str(e.value)
            assert (w == 1).all()
            assert m.status().version == "1"
    finally:
        rank1.wait(30)
        try:
            shared_memory.SharedMemory(name=cell).unlink()
        except FileNotFoundError:
            pass
