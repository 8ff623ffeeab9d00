"""The trainer process of the RL loop: trains model.TinyLM with AdamW on
next-token prediction and, after every optimizer step, publishes the weights
as a new version, asks the engine for an update through its control cell,
waits (bounded) until every rank reports NORMAL, and records the reference
outputs of that version (logits of the probes, greedy continuation).

Protocol with run.py: the first stdout line is {"address": ...} (where the
engines pull from); then one JSON line per step. References go to
OUT/ref-<version>.npz. After the last step it asks the engine to clear,
which is the engine ranks' cue to exit.
"""

import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch

import model as lm
from weight_manager import Controller, Publisher, State, WeightManagerError


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cell", required=True, help="the engine's control cell (/dev/shm name)")
    p.add_argument("--socket", help="IPC: Unix socket to publish on")
    p.add_argument("--net", help="rdma: host:port to publish on (secret from WM_NET_SECRET)")
    p.add_argument("--out", required=True, help="directory for the reference outputs")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="engine ranks that pull each version")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weights", choices=("f32", "fp8"), default="f32",
                   help="what the engines hold: references are computed with the same weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="bound on each serve and each wait, seconds")
    args = p.parse_args()
    if (args.socket is None) == (args.net is None):
        p.error("give exactly one of --socket and --net")
    return args


def emit(record):
    print(json.dumps(record), flush=True)


def train_step(model, optimizer, batch):
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, lm.VOCAB), batch[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


# The report rank 0 writes beside the cell (`crates/core/src/signal/report.rs`,
# `Layout`): seq u64, code u32, rank u32, action i32, pid u32, pid_ns u64,
# then the version (256 bytes) and the message (1024), NUL-padded.
REPORT_HEAD, VERSION_LEN, MESSAGE_LEN = 32, 256, 1024


def report_text(cell):
    """The failing rank and its reason, as the engine's rank 0 left them
    beside the cell."""
    try:
        with open(f"/dev/shm/{cell}.wm_report", "rb") as f:
            raw = f.read(REPORT_HEAD + VERSION_LEN + MESSAGE_LEN)
    except OSError as e:
        return f"(no report: {e})"
    if len(raw) < REPORT_HEAD + VERSION_LEN + MESSAGE_LEN:
        return f"(a report of {len(raw)} bytes)"
    code, rank = int.from_bytes(raw[8:12], "little"), int.from_bytes(raw[12:16], "little")
    message = raw[REPORT_HEAD + VERSION_LEN:].split(b"\0", 1)[0].decode(errors="replace")
    return f"rank {rank} failed (code {code}): {message}"


def wait_normal(controller, cell, version, timeout):
    """Bounded wait until rank 0 writes NORMAL after every rank updated; a
    failed update shows as CLEARED, with the reason in the report."""
    deadline = time.monotonic() + timeout
    while True:
        state = controller.get()
        if state == State.NORMAL:
            return
        if state == State.CLEARED:
            raise RuntimeError(f"engine failed to update to {version}: {report_text(cell)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine did not report NORMAL for {version} within {timeout} s (word: {state.name})")
        time.sleep(0.001)


def fp8_blocks(x):
    """`x` [M, N] through FP8 E4M3 with 128x128 block scales and back, as
    the engine holds it: PyTorch's reference expression (the one
    weight_manager matches bit for bit), then q * scale_inv in float32."""
    m, n = x.shape
    pm, pn = -(-m // 128) * 128, -(-n // 128) * 128
    padded = torch.zeros(pm, pn, dtype=x.dtype)
    padded[:m, :n] = x
    v = padded.view(pm // 128, 128, pn // 128, 128)
    amax = v.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (v.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
    return (q.float() * (amax / 448.0)).view(pm, pn)[:m, :n].contiguous()


@torch.no_grad()
def save_references(model, out, version, weights="f32"):
    if weights == "fp8":
        # What the engines compute with: every 2-D weight quantized.
        model = copy.deepcopy(model)
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(fp8_blocks(p))
    logits = model(lm.probe_inputs()).numpy().astype(np.float32)
    continuation = np.array(lm.greedy_continuation(model), dtype=np.int32)
    np.savez(os.path.join(out, f"ref-{version}.npz"), logits=logits, continuation=continuation)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = lm.TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(args.seed + 1)
    publisher = Publisher(args.socket) if args.socket else Publisher(net=args.net)
    with publisher, Controller(args.cell) as controller:
        emit({"address": publisher.address})
        # Every state_dict tensor by pointer: the optimizer updates them in
        # place and publish() copies them, so adding once is enough.
        publisher.add_state_dict(model.state_dict())
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            loss = train_step(model, optimizer, lm.corpus_batch(data, args.batch))
            train_s = time.monotonic() - t0
            version = f"step-{step}"
            publisher.set_version(version)
            publisher.publish()
            controller.set(State.UPDATING)
            served = publisher.serve(args.ranks, timeout=args.timeout)
            wait_normal(controller, args.cell, version, args.timeout)
            save_references(model, args.out, version, args.weights)
            emit({"step": step, "loss": loss, "version": version, "train_s": train_s,
                  "served_bytes": served.bytes, "sessions": served.sessions})
        outcome = controller.request_clear(timeout=args.timeout)
        emit({"clear": outcome})


if __name__ == "__main__":
    try:
        main()
    except (WeightManagerError, RuntimeError, TimeoutError) as e:
        print(f"trainer: {e}", file=sys.stderr)
        sys.exit(1)
