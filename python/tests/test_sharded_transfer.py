"""Sharded transfer with real processes: a trainer of 4 ranks, each serving
its row shards (FSDP-like) from its own publisher, and an engine of 2 ranks
whose params are TP pieces (a column split, a fused QKV from three tensors,
a range of stacked experts, a row split) pulling from all 4 at once, over
IPC and over UCX (TCP here). Every byte is checked against the full
tensors (`sharded_ranks.py`). Also: the same engine from a whole-tensor
HuggingFace-style snapshot, a trainer rank killed mid-update, sources that
serve different versions, and the plan reused by the second update."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharded_ranks  # noqa: E402

RANKS = sharded_ranks.__file__
TRAINERS = 4
VERSIONS = ["step-1", "step-2"]
SECRET = "sharded-transfer-test-secret"


def _env():
    env = dict(os.environ, WM_NET_SECRET=SECRET, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
    return env


def start_trainers(tmp_path, transport, versions, sessions, ranks=TRAINERS, version_of=None):
    """Start the trainer ranks; returns (processes, their addresses)."""
    procs, addrs = [], []
    for r in range(ranks):
        where = str(tmp_path / f"trainer{r}.sock") if transport == "ipc" else "127.0.0.1:0"
        vs = version_of(r) if version_of else versions
        p = subprocess.Popen([sys.executable, RANKS, "trainer", str(r), str(ranks), transport, where,
                              ",".join(vs), str(sessions)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        procs.append(p)
    for p in procs:
        line = p.stdout.readline().strip()
        assert line, f"a trainer rank did not start: {p.stderr.read()}"
        addrs.append(line)
    return procs, addrs


def run_engines(transport, locations, versions, kill=None, ranks=sharded_ranks.ENGINE_RANKS):
    """Run the engine ranks to the end; returns each rank's list of update results."""
    procs = []
    for r in range(ranks):
        cmd = [sys.executable, RANKS, "engine", str(r), transport, ",".join(locations), ",".join(versions)]
        if kill is not None:
            cmd += ["--kill", str(kill)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=_env()))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"engine rank failed: {stderr}"
        out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
    return out


def finish(procs):
    for p in procs:
        try:
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()


def shard_bytes(rank_of_trainer, engine_rank):
    """Bytes of engine rank `engine_rank`'s params that trainer rank
    `rank_of_trainer` holds (its rows of every global tensor)."""
    total = 0
    for name, (shape, pieces, _) in sharded_ranks.layout(engine_rank).items():
        for piece in pieces:
            n = sharded_ranks.GLOBALS[piece.tensor][0]
            start, rows = sharded_ranks.row_chunk(n, rank_of_trainer, TRAINERS)
            lo, hi = max(start, piece.offset[0]), min(start + rows, piece.offset[0] + piece.length[0])
            if hi > lo:
                inner = int(np.prod(piece.length[1:])) if len(piece.length) > 1 else 1
                total += (hi - lo) * inner * 4
    return total


@pytest.mark.parametrize("transport", ["ipc", "net"])
def test_four_trainer_ranks_to_two_engine_ranks_every_byte_once(tmp_path, transport):
    sessions = sharded_ranks.ENGINE_RANKS * len(VERSIONS)
    procs, addrs = start_trainers(tmp_path, transport, VERSIONS, sessions)
    try:
        results = run_engines(transport, addrs, VERSIONS)
    finally:
        finish(procs)
    for rank, updates in enumerate(results):
        assert [u["ok"] for u in updates] == [True, True], updates
        for u in updates:
            assert u["matches"], u
            # Each byte moved once: what the rank received is its params' bytes.
            assert u["bytes"] == u["param_bytes"], u
            assert u["source_bytes"] == [shard_bytes(t, rank) for t in range(TRAINERS)], u
        # The second update found the layouts unchanged and reused the plan.
        assert [u["plan_reused"] for u in updates] == [False, True]


def test_the_same_engine_from_a_whole_tensor_snapshot(tmp_path):
    for v in VERSIONS:
        d = tmp_path / v
        d.mkdir()
        save_file(sharded_ranks.tensors(v), str(d / "model.safetensors"))
    for v in VERSIONS:
        results = run_engines("snapshot", [str(tmp_path / v)], [v])
        for updates in results:
            assert updates[0]["ok"] and updates[0]["matches"], updates
            assert updates[0]["bytes"] == updates[0]["param_bytes"]


def test_sources_serving_different_versions_are_refused_before_bytes_move(tmp_path):
    procs, addrs = start_trainers(tmp_path, "ipc", VERSIONS, sharded_ranks.ENGINE_RANKS,
                                  version_of=lambda r: ["step-2"] if r == 3 else ["step-1"])
    try:
        # Ask for "latest": three ranks serve step-1, one step-2.
        results = run_engines("ipc", addrs, ["latest"])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for updates in results:
        u = updates[0]
        assert not u["ok"] and "different versions" in u["error"], u
        assert u["state"] == "NORMAL" and u["now"] is None, u


def test_snapshot_folders_at_different_versions_are_refused_even_when_the_request_names_one(tmp_path):
    """Two folders, each a row half of `w` with its own version.yaml: a mix
    is refused (before, naming a version skipped reading version.yaml and
    committed half of each version)."""
    from weight_manager import Manager, WeightManagerError

    full = np.arange(32, dtype=np.float32).reshape(8, 4)

    def folder(name, rows, data, step):
        d = tmp_path / name
        d.mkdir()
        meta = {"wm.shard.w_part": json.dumps(
            {"tensor": "w", "global_shape": [8, 4], "offset": [rows[0], 0]})}
        save_file({"w_part": np.ascontiguousarray(data[rows[0]:rows[1]])},
                  str(d / "model.safetensors"), metadata=meta)
        if step is not None:
            (d / "version.yaml").write_text(f"step: {step}\n")
        return str(d)

    a = folder("a", (0, 4), full, 1)
    b = folder("b", (4, 8), full + 100, 2)
    same = folder("c", (4, 8), full, 1)
    with Manager(fallback_dir="") as m:
        w = m.allocate("w", np.float32, (8, 4))
        for version in [None, "1", "2"]:
            with pytest.raises(WeightManagerError, match="different versions"):
                m.update([a, b], version=version)
            assert m.status().version is None and not w.any()
        # Folders of one version: the request's version names the update.
        assert m.update([a, same], version="v-one").version == "v-one"
        assert np.array_equal(w, full)
        # A folder without version.yaml beside one that has it: as before,
        # taken when the request names the version (it names none to differ).
        unnamed = folder("d", (4, 8), full + 7, None)
        assert m.update([a, unnamed], version="v-two").version == "v-two"
        assert np.array_equal(w[4:], full[4:] + 7)


@pytest.mark.parametrize("transport", ["ipc", "net"])
def test_a_trainer_rank_killed_mid_update_fails_it_naming_the_rank(tmp_path, transport):
    sessions = sharded_ranks.ENGINE_RANKS * len(VERSIONS)
    procs, addrs = start_trainers(tmp_path, transport, VERSIONS, sessions)
    try:
        # Engine rank 0 updates to step-1, then kills trainer rank 1 once a
        # quarter of step-2 came: rank 1 serves it 8 MiB of "big" in 1 MiB
        # buckets, most of them still to come.
        results = run_engines(transport, addrs, VERSIONS, kill=procs[1].pid, ranks=1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert results[0][0]["ok"], results
    u = results[0][1]
    assert not u["ok"], u
    assert addrs[1] in u["error"], u
    # Atomic: the old version and every old byte stay.
    assert u["state"] == "NORMAL" and u["now"] == VERSIONS[0] and u["matches"], u


def test_the_per_tensor_callback_is_told_which_box_it_holds(tmp_path):
    """A shard handed to on_tensor comes with its place in the global
    tensor; a two-argument callback still gets (name, array)."""
    import threading

    from weight_manager import Manager, Placement, Publisher

    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sock = str(tmp_path / "shard.sock")
    seen, plain = [], []
    with Publisher(sock) as pub:
        pub.add_shard("w", np.ascontiguousarray(full[4:8]), (8, 6), (4, 0))
        pub.add("b", np.ones(3, np.float32))
        pub.set_version("v1")
        pub.publish()
        server = threading.Thread(target=pub.serve, kwargs={"engines": 2, "timeout": 30})
        server.start()
        with Manager(fallback_dir="") as m:
            m.update(sock, source="ipc", in_place=True,
                     on_tensor=lambda name, a, where: seen.append((name, a.copy(), where)))
            m.update(sock, source="ipc", in_place=True,
                     on_tensor=lambda name, a: plain.append(name))
        server.join(timeout=30)
    by_name = {n: (a, w) for n, a, w in seen}
    assert by_name["w"][1] == Placement((8, 6), (4, 0))
    assert np.array_equal(by_name["w"][0], full[4:8])
    assert by_name["b"][1] == Placement((3,), (0,))
    assert sorted(plain) == ["b", "w"]
