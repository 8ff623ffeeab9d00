"""Rank processes for test_sharded_transfer.py: a trainer rank that serves
its row shards of every global tensor (as FSDP holds them), and an engine
rank whose params are TP pieces (a column split, a fused QKV, a range of
stacked experts). Both derive the tensors of a version from its name, so
the engine checks every byte it received against the full tensors.

    python sharded_ranks.py trainer RANK RANKS ipc|net WHERE VERSIONS ENGINES_SESSIONS
    python sharded_ranks.py engine RANK ipc|net|snapshot LOCATIONS VERSIONS [--kill PID]

(--kill: the engine kills process PID once a quarter of the last version's
bytes came.)

The trainer prints its address on its first line once it listens; the
engine prints one JSON line per update."""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from weight_manager import Manager, Piece, Publisher, WeightManagerError  # noqa: E402

ENGINE_RANKS = 2
# name: global shape. Every tensor is row-sharded over the trainer ranks.
GLOBALS = {
    "o": (16, 12),          # engine: column split (TP) along dim 1
    "q": (8, 6),            # engine: fused into qkv, each row-split by TP
    "k": (4, 6),
    "v": (4, 6),
    "experts": (8, 4, 6),   # engine: each rank holds a range of experts
    "big": (8192, 1024),    # engine: row split; many buckets, so a killed trainer dies mid-stream
}


def tensors(version: str) -> dict:
    seed = sum(version.encode())
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in GLOBALS.items()}


def row_chunk(n: int, rank: int, ranks: int):
    """PyTorch's chunk rule: ceil(n / ranks) rows per rank, the last ones shorter."""
    step = -(-n // ranks)
    start = min(n, rank * step)
    return start, min(n, start + step) - start


def trainer(rank: int, ranks: int, transport: str, where: str, versions: list, sessions: int):
    secret = os.environ.get("WM_NET_SECRET")
    pub = (Publisher(where, bucket_size=1 << 20) if transport == "ipc"
           else Publisher(net=where, secret=secret, bucket_size=1 << 20))
    with pub:
        for v in versions:
            pub.clear()
            for name, full in tensors(v).items():
                start, n = row_chunk(full.shape[0], rank, ranks)
                offset = (start,) + (0,) * (full.ndim - 1)
                pub.add_shard(name, np.ascontiguousarray(full[start:start + n]), full.shape, offset)
            pub.set_version(v)
            pub.publish()
        print(pub.address, flush=True)
        pub.serve(engines=sessions, timeout=60)


def layout(rank: int) -> dict:
    """This engine rank's params: {name: (shape, pieces, expected(full tensors))}."""
    g = GLOBALS
    half = lambda n: (n // ENGINE_RANKS * rank, n // ENGINE_RANKS)  # noqa: E731
    o0, on = half(g["o"][1])
    q0, qn = half(g["q"][0])
    k0, kn = half(g["k"][0])
    v0, vn = half(g["v"][0])
    e0, en = half(g["experts"][0])
    b0, bn = half(g["big"][0])
    return {
        "o.tp": ((16, on), [Piece.narrow("o", g["o"], 1, o0, on)],
                 lambda t: t["o"][:, o0:o0 + on]),
        "qkv.tp": ((qn + kn + vn, 6),
                   [Piece.narrow("q", g["q"], 0, q0, qn),
                    Piece.narrow("k", g["k"], 0, k0, kn, at=(qn, 0)),
                    Piece.narrow("v", g["v"], 0, v0, vn, at=(qn + kn, 0))],
                   lambda t: np.concatenate([t["q"][q0:q0 + qn], t["k"][k0:k0 + kn],
                                             t["v"][v0:v0 + vn]])),
        "experts.ep": ((en, 4, 6), [Piece.narrow("experts", g["experts"], 0, e0, en)],
                       lambda t: t["experts"][e0:e0 + en]),
        "big.tp": ((bn, g["big"][1]), [Piece.narrow("big", g["big"], 0, b0, bn)],
                   lambda t: t["big"][b0:b0 + bn]),
    }


def engine(rank: int, transport: str, locations: list, versions: list, kill: int):
    params = {}
    # 1 MiB network buckets, at most 2 in flight: a trainer rank killed at
    # the first progress report still has most of its bytes to send.
    with Manager(rank, ENGINE_RANKS, fallback_dir="", net_bucket_size=1 << 20) as m:
        for name, (shape, pieces, _) in layout(rank).items():
            params[name] = m.allocate(name, np.float32, shape, pieces=pieces)
        param_bytes = sum(a.nbytes for a in params.values())
        for v in versions:
            killed = []

            def progress(p):
                # The kill comes in the last update, once a quarter of its
                # bytes came: every trainer rank is sending by then (its
                # UCX connection set up), none is done.
                if kill and v == versions[-1] and not killed and 4 * p.bytes_done >= p.bytes_total:
                    os.kill(kill, signal.SIGKILL)
                    killed.append(kill)

            out = {"version": v}
            try:
                kw = {"version": v}
                stats = m.update(locations if transport != "snapshot" else locations[0],
                                 source="ipc" if transport == "ipc" else
                                 "rdma" if transport == "net" else "snapshot",
                                 progress=progress if kill else None, **kw)
                out.update(ok=True, bytes=stats.bytes, param_bytes=param_bytes,
                           source_bytes=list(stats.source_bytes), plan_reused=stats.plan_reused)
            except WeightManagerError as e:
                out.update(ok=False, code=e.code.name, error=str(e))
            st = m.status()
            out["state"], out["now"] = st.state.name, st.version
            # Every byte against the full tensors of the version now held.
            full = tensors(st.version) if st.version else None
            out["matches"] = full is not None and all(
                np.array_equal(params[n], expect(full)) for n, (_, _, expect) in layout(rank).items())
            print(json.dumps(out), flush=True)


def main(argv):
    role = argv[0]
    if role == "trainer":
        rank, ranks, transport, where, versions, sessions = argv[1:7]
        trainer(int(rank), int(ranks), transport, where, versions.split(","), int(sessions))
    else:
        rank, transport, locations, versions = argv[1:5]
        kill = int(argv[6]) if len(argv) > 6 and argv[5] == "--kill" else 0
        engine(int(rank), transport, locations.split(","), versions.split(","), kill)


if __name__ == "__main__":
    main(sys.argv[1:])
