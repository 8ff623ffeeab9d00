#!/usr/bin/env python3
"""The library beside PyTorch doing the same job, in the same process and
the same state, alternating, and the median of the per-pair ratios: the
comparison that cannot flatter either side (unlike a figure taken while one
side's process holds more memory than the other's).

    .venv/bin/python scripts/torch_side_by_side.py [--gib 1] [--pairs 10]

Sections:
- snapshot, in place: one bf16 safetensors file in the page cache, the same
  pre-faulted torch params (registered with `Manager.register_module`);
  PyTorch: `safetensors.torch.load_file(path)` then `param.copy_()` each;
  ours: `Manager.update(dir, in_place=True)`. Floor beside it: the file
  mapped (`np.memmap`) and copied into the params by torch (`copy_()`).
- publish: the trainer's steady publish, its buffers made ahead on both
  sides. Ours: `Publisher.prepare()` once, then `publish()` per version
  (one copy into shared memory that engines read in place). PyTorch: the
  same tensors copied with `copy_()` into tensors made shared ahead with
  `share_memory_()` (what a `torch.multiprocessing` trainer does). Floor:
  the same copies into plain pre-faulted tensors. Two rows: without
  checksums (the same job as torch's copy) and with them (the default:
  every tensor also hashed so engines can verify, work torch's copy does
  not do).
- ipc: the engine's side of a same-node update from a version published
  ahead: ours `Manager.update(socket, source="ipc", in_place=True)`;
  PyTorch: the trainer's tensors shared with `share_memory_()`, received
  once through a torch.multiprocessing queue, then `copy_()` into the
  same params. The first of each (mapping) is not timed.
- network: a trainer process holding the tensors serves them both ways
  over loopback. Ours: `Manager.update(addr, source="rdma", in_place=True,
  deltas=False)` (UCX, direct receive, checksums verified, every byte moved:
  the same version is served each time, which deltas would send empty)
  into the engine's torch params. PyTorch: `torch.distributed.broadcast` (gloo) of each tensor
  straight into the same params. The first of each is not timed.
- signal: two rank processes keep in step: ours `broadcast_signal` per
  step (NORMAL: one shared-memory read on each rank); PyTorch: a gloo
  `broadcast` of the control word per step.
- quant: FP8 E4M3 128x128 blocks are measured by `wm bench quant` (the
  library's quantizer has no Python binding yet).

Prints one line per figure: ours, theirs, floor, and `ours / theirs` (above
1: ours is faster). No figure is asserted: this is a benchmark.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import warnings

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def alternate(pairs: int, ours, theirs):
    """Run ours and theirs `pairs` times, the order flipping each pair;
    the median of theirs/ours (speedup) and each side's best time."""
    ratios, best_o, best_t = [], float("inf"), float("inf")
    for k in range(pairs):
        if k % 2 == 0:
            o, t = _timed(ours), _timed(theirs)
        else:
            t, o = _timed(theirs), _timed(ours)
        ratios.append(t / o)
        best_o, best_t = min(best_o, o), min(best_t, t)
    return statistics.median(ratios), best_o, best_t


def snapshot(gib: float, pairs: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from weight_manager import Manager

    layer = (4096, 8192)  # 64 MiB of bf16
    count = max(1, int(gib * 16))
    with tempfile.TemporaryDirectory() as d:
        g = torch.Generator().manual_seed(1)
        tensors = {f"layers.{i}.w": torch.randn(layer, generator=g).to(torch.bfloat16) for i in range(count)}
        path = Path(d) / "model_state.tp0.0.safetensors"
        save_file(tensors, str(path))
        (Path(d) / "version.yaml").write_text("step: 1\n")
        del tensors
        total = path.stat().st_size
        with open(path, "rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
        params = torch.nn.Module()
        for i in range(count):
            p = torch.nn.Parameter(torch.ones(layer, dtype=torch.bfloat16), requires_grad=False)
            params.register_parameter(f"p{i}", p)
        m = Manager(fallback_dir=None)
        m.register_module(params, name_map=lambda n: f"layers.{n[1:]}.w")
        live = [getattr(params, f"p{i}") for i in range(count)]

        def theirs():
            loaded = load_file(str(path))
            with torch.no_grad():
                for i, p in enumerate(live):
                    p.copy_(loaded[f"layers.{i}.w"])

        def ours():
            m.update(d, in_place=True)

        # The floor: the file mapped, each tensor's bytes copied into its
        # param by torch (its threads), with no parsing or allocation.
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r").view(np.uint8))
        meta = _header(path)
        spans = [(header + meta[f"layers.{i}.w"]["data_offsets"][0], p) for i, p in enumerate(live)]

        def floor():
            with torch.no_grad():
                for at, p in spans:
                    n = p.numel() * p.element_size()
                    p.view(-1).view(torch.uint8).copy_(mapped[at: at + n])

        ratio, o, t = alternate(pairs, ours, theirs)
        _, _, fl = alternate(max(3, pairs // 2), floor, floor)
        print(f"snapshot in place, {total / 2**30:.2f} GiB bf16, {torch.get_num_threads()} torch threads: "
              f"wm {total / o / 1e9:.2f} GB/s, torch load_file + copy_() {total / t / 1e9:.2f} GB/s, "
              f"mapped file + copy floor {total / fl / 1e9:.2f} GB/s; "
              f"wm / torch {ratio:.2f} (median of {pairs} alternating pairs), wm / floor {fl / o:.2f}")
        m.close()


def publish(gib: float, pairs: int) -> None:
    import torch
    from weight_manager import Publisher

    layer = (4096, 8192)  # 64 MiB of bf16
    count = max(1, int(gib * 16))
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(layer, generator=g).to(torch.bfloat16) for _ in range(count)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    shared = [torch.empty_like(t).share_memory_().fill_(1) for t in tensors]
    plain = [torch.empty_like(t).fill_(1) for t in tensors]
    for checksums in (False, True):
        _publish_row(tensors, shared, plain, total, pairs, checksums)


def _publish_row(tensors, shared, plain, total, pairs, checksums: bool) -> None:
    """One publish row: without checksums the publish does what torch's copy
    does (the same job); with them it also hashes every tensor for the
    engines to verify, which torch's copy does not."""
    import torch
    from weight_manager import Publisher

    with tempfile.TemporaryDirectory() as d, \
            Publisher(str(Path(d) / "p.sock"), checksums=checksums) as p:
        for i, t in enumerate(tensors):
            p.add_torch(f"layers.{i}.w", t)
        prepare_s = _timed(p.prepare)
        step = iter(range(10**9))

        def ours():
            p.set_version(f"v{next(step)}")
            p.publish()

        def theirs():
            with torch.no_grad():
                for s, t in zip(shared, tensors):
                    s.copy_(t)

        def floor():
            with torch.no_grad():
                for s, t in zip(plain, tensors):
                    s.copy_(t)

        ours()  # the first publish after prepare: no buffer is created
        ratio, o, t = alternate(pairs, ours, theirs)
        _, _, fl = alternate(max(3, pairs // 2), floor, floor)
        what = "with checksums (also hashes every tensor)" if checksums else \
            "without checksums (the same job as torch's copy)"
        print(f"trainer publish {what}, {total / 2**30:.2f} GiB bf16, buffers made ahead "
              f"(prepare {prepare_s:.2f} s): wm {total / o / 1e9:.2f} GB/s, "
              f"torch copy_() into share_memory_() tensors {total / t / 1e9:.2f} GB/s, "
              f"copy into plain tensors floor {total / fl / 1e9:.2f} GB/s; "
              f"wm / torch {ratio:.2f} (median of {pairs} alternating pairs), wm / floor {fl / o:.2f}")


def _engine_params(m, count: int):
    """`count` bf16 [4096, 8192] torch params of an engine module,
    registered with `m` as the trainer's "layers.{i}.w": the params and
    their bytes."""
    import torch
    params = torch.nn.Module()
    for i in range(count):
        params.register_parameter(f"p{i}", torch.nn.Parameter(
            torch.ones((4096, 8192), dtype=torch.bfloat16), requires_grad=False))
    m.register_module(params, name_map=lambda n: f"layers.{n[1:]}.w")
    live = [getattr(params, f"p{i}") for i in range(count)]
    return live, sum(p.numel() * p.element_size() for p in live)


def _ipc_trainer(sock: str, shared_out, commands, gib: float) -> None:
    """The trainer process of the IPC section: a wm publisher of a
    published version on `sock`, and the same tensors made shared for
    torch.multiprocessing and handed over once; on "wm" it serves one
    engine session, on "stop" it ends."""
    import torch
    from weight_manager import Publisher
    layer, count = (4096, 8192), max(1, int(gib * 16))
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(layer, generator=g).to(torch.bfloat16) for _ in range(count)]
    with Publisher(socket_path=sock) as p:
        for i, t in enumerate(tensors):
            p.add_torch(f"layers.{i}.w", t)
        p.prepare()
        p.set_version("1")
        p.publish()
        shared = [t.clone().share_memory_() for t in tensors]
        shared_out.put(shared)
        while True:
            cmd = commands.recv()
            if cmd == "wm":
                p.serve(1, timeout=120)
            else:
                break


def ipc(gib: float, pairs: int) -> None:
    """The engine's side of a same-node update, the trainer's version
    published ahead on both sides: ours `Manager.update(socket,
    source="ipc", in_place=True)` into the engine's torch params (one
    session: manifest, plan, the published buffer mapped once and kept,
    one copy); PyTorch: the trainer's tensors made shared
    (`share_memory_()`) and received once through a torch.multiprocessing
    queue, then `copy_()` into the same params. The first of each is not
    timed (mapping)."""
    import torch
    import torch.multiprocessing as tmp
    from weight_manager import Manager
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as d:
        sock = str(Path(d) / "trainer.sock")
        trainer = ctx.Process(target=_ipc_trainer, args=(sock, queue, cmd_recv, gib))
        trainer.start()
        try:
            shared = queue.get(timeout=300)
            m = Manager(fallback_dir=None)
            live, total = _engine_params(m, len(shared))

            def ours():
                cmd_send.send("wm")
                m.update(sock, source="ipc", in_place=True)

            def theirs():
                with torch.no_grad():
                    for p, t in zip(live, shared):
                        p.copy_(t)

            ours()
            assert all(torch.equal(p, t) for p, t in zip(live, shared)), "wm updated other bytes"
            theirs()
            ratio, o, t = alternate(pairs, ours, theirs)
            print(f"IPC engine update (published version), {total / 2**30:.2f} GiB bf16: "
                  f"wm {total / o / 1e9:.2f} GB/s, torch.multiprocessing shared tensors + copy_() "
                  f"{total / t / 1e9:.2f} GB/s; wm / torch {ratio:.2f} (median of {pairs} alternating pairs)")
            m.close()
        finally:
            cmd_send.send("stop")
            trainer.join(timeout=120)


def _net_trainer(port: int, wm_port_out, commands, gib: float, secret: str) -> None:
    """The trainer process of the network section: gloo rank 0 and a wm
    network publisher of the same tensors; on "wm" it serves one engine
    session from the live tensors (hashing them first, as for a new
    training step), on "gloo" it broadcasts every tensor, on "stop" it
    ends."""
    import torch
    import torch.distributed as dist
    from weight_manager import Publisher
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    layer, count = (4096, 8192), max(1, int(gib * 16))
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(layer, generator=g).to(torch.bfloat16) for _ in range(count)]
    with Publisher(net="127.0.0.1:0", secret=secret) as p:
        for i, t in enumerate(tensors):
            p.add_torch(f"layers.{i}.w", t)
        p.set_version("1")
        # Live tensors, not a published copy: each serve call hashes them
        # for its manifest, as a training step's new weights must be, while
        # gloo broadcasts them with no preparation (a published copy hashed
        # once, untimed, left that cost out of every timed step).
        wm_port_out.send(p.address)
        while True:
            cmd = commands.recv()
            if cmd == "wm":
                p.serve(1, timeout=120)
            elif cmd == "gloo":
                for t in tensors:
                    dist.broadcast(t, src=0)
            else:
                break
    dist.destroy_process_group()


def network(gib: float, pairs: int) -> None:
    """rdma over UCX (direct, checksums verified) into the engine's torch
    params, beside gloo broadcasting the same tensors straight into the
    same params, over the same loopback, from the same trainer process."""
    import multiprocessing as mp
    import socket
    import torch
    import torch.distributed as dist
    from weight_manager import Manager
    os.environ.setdefault("UCX_TLS", "tcp")
    secret = "side-by-side-secret-0123456789"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    addr_recv, addr_send = ctx.Pipe(duplex=False)
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    trainer = ctx.Process(target=_net_trainer, args=(port, addr_send, cmd_recv, gib, secret))
    trainer.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
        addr = addr_recv.recv()
        m = Manager(fallback_dir=None, net_secret=secret)
        live, total = _engine_params(m, max(1, int(gib * 16)))

        def ours():
            cmd_send.send("wm")
            # Whole, as gloo moves it: the trainer serves the same version
            # every time, which deltas (on by default over the network)
            # would send as empty deltas.
            m.update(addr, source="rdma", in_place=True, deltas=False)

        def theirs():
            cmd_send.send("gloo")
            for p in live:
                dist.broadcast(p.data, src=0)

        ours()  # connects, plans, maps: the first session is not timed
        theirs()
        ratio, o, t = alternate(pairs, ours, theirs)
        print(f"network (loopback, UCX_TLS={os.environ['UCX_TLS']}), {total / 2**30:.2f} GiB bf16: "
              f"wm rdma direct verified {total / o / 1e9:.2f} GB/s, "
              f"torch gloo broadcast into the params {total / t / 1e9:.2f} GB/s; "
              f"wm / torch {ratio:.2f} (median of {pairs} alternating pairs)")
        m.close()
    finally:
        cmd_send.send("stop")
        trainer.join(timeout=120)
        if dist.is_initialized():
            dist.destroy_process_group()


def _signal_rank(port: int, group: str, cell: str, commands) -> None:
    """Rank 1 of the signal section: on ("wm", n) n broadcast_signal
    steps, on ("gloo", n) n gloo broadcasts of the control word."""
    import torch
    import torch.distributed as dist
    from weight_manager import Manager
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    word = torch.zeros(1, dtype=torch.int32)
    with Manager(1, 2, group=group, control_cell=cell, fallback_dir=None) as m:
        while True:
            cmd, n = commands.recv()
            if cmd == "wm":
                for _ in range(n):
                    m.broadcast_signal()
            elif cmd == "gloo":
                for _ in range(n):
                    dist.broadcast(word, src=0)
            else:
                break
    dist.destroy_process_group()


def signal(steps: int, pairs: int) -> None:
    """The per-step signal of 2 ranks: `broadcast_signal` (NORMAL: a
    shared-memory read, the ranks in step) beside a gloo broadcast of the
    control word per step, as a torch.distributed engine would keep its
    ranks in step."""
    import multiprocessing as mp
    import socket
    import torch
    import torch.distributed as dist
    from weight_manager import Manager
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group, cell = f"wm_sbs_g_{os.getpid()}", f"wm_sbs_c_{os.getpid()}"
    ctx = mp.get_context("spawn")
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    rank1 = ctx.Process(target=_signal_rank, args=(port, group, cell, cmd_recv))
    rank1.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        word = torch.zeros(1, dtype=torch.int32)
        with Manager(0, 2, group=group, control_cell=cell, fallback_dir=None) as m:
            def ours():
                cmd_send.send(("wm", steps))
                for _ in range(steps):
                    m.broadcast_signal()

            def theirs():
                cmd_send.send(("gloo", steps))
                for _ in range(steps):
                    dist.broadcast(word, src=0)

            ours()
            theirs()
            ratio, o, t = alternate(pairs, ours, theirs)
            print(f"signal, 2 ranks, {steps} steps: wm broadcast_signal {o / steps * 1e6:.2f} us/step, "
                  f"torch gloo broadcast of the word {t / steps * 1e6:.2f} us/step; "
                  f"wm / torch {ratio:.2f} (median of {pairs} alternating pairs)")
            cmd_send.send(("stop", 0))
    finally:
        rank1.join(timeout=60)
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            os.unlink(f"/dev/shm/{cell}")
        except OSError:
            pass


def _header(path: Path) -> dict:
    import json
    raw = path.read_bytes()[:8]
    n = int.from_bytes(raw, "little")
    with open(path, "rb") as f:
        f.seek(8)
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def main() -> None:
    # np.memmap is read-only; torch warns once when it wraps it (it is only read).
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pairs", type=int, default=10)
    a = ap.parse_args()
    snapshot(a.gib, a.pairs)
    publish(a.gib, a.pairs)
    ipc(a.gib, a.pairs)
    network(a.gib, a.pairs)
    signal(2000, a.pairs)


if __name__ == "__main__":
    main()
