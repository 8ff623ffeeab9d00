"""The RL loop end to end: starts the PyTorch trainer (trainer.py) and two
ranks of the native C++ engine (rl_engine, built by CMake) as processes,
lets the trainer train and publish K versions, then checks every output the
engine computed against the trainer's outputs at the version it was tagged
with, and prints one line per step.

    python examples/rl/run.py --engine build/examples/rl/rl_engine [--transport rdma] [--steps 8]

Exits non-zero if any step disagrees, if a rank never computed with some
version, or if a rank computed with weights that match no published version
(which is how "never computes with a half-updated model" is checked).
"""

import argparse
import importlib.util
import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RANKS = 2
VOCAB, CONTEXT, PROBES, GENERATE = 64, 32, 2, 24  # model.py's sizes; engine.cpp's Record
RECORD = np.dtype([("version", "S256"), ("logits", "<f4", (PROBES, CONTEXT, VOCAB)),
                   ("continuation", "<i4", (GENERATE,))])
# The engine sums in a different order than PyTorch (its own loops against
# PyTorch's blocked, vectorised kernels), in float32 both: measured logit
# differences are below 1e-6 (logits are O(1)). 1e-5 absolute + 1e-4
# relative leaves an order of magnitude for other CPUs' kernels, while a
# model of another version is far outside it (one AdamW step moves logits by
# ~1e-2; a single head weight off by 1e-3 moves one by ~3e-3).
RTOL, ATOL = 1e-4, 1e-5
# Marks a --work directory as run.py's, so a later run may empty it (and
# never a directory of anything else).
MARK = ".wm-rl-run"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "build" / "examples" / "rl" / "rl_engine"),
                   help="the rl_engine binary (cmake --build build --target rl_engine)")
    p.add_argument("--transport", choices=("ipc", "rdma"), default="ipc",
                   help="ipc: Unix socket + shared memory; rdma: UCX (UCX_TLS=tcp without RDMA hardware)")
    p.add_argument("--steps", type=int, default=8, help="training steps (versions published), at least 2")
    p.add_argument("--weights", choices=("f32", "fp8"), default="f32",
                   help="the engine's weights: float32, or FP8 E4M3 with 128x128 block scales "
                        "(the trainer stays float32; publishers quantize on the wire)")
    p.add_argument("--work", help="a new or empty directory for the outputs (or an earlier run's), kept "
                                   "(default: a temporary one, removed unless the run fails)")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run, seconds")
    args = p.parse_args()
    # The check compares the first step's loss with the last one's.
    if args.steps < 2:
        p.error(f"--steps {args.steps}: at least 2")
    work = Path(args.work) if args.work else None
    if work and work.is_dir() and any(work.iterdir()) and not (work / MARK).is_file():
        p.error(f"--work {work}: not empty and not an earlier run's (give a new or empty directory, "
                f"or one an earlier run.py wrote: only those are emptied)")
    return args


class Child:
    """A child process whose stdout lines are read by a thread, so every
    read has a bound."""

    def __init__(self, name, argv, env):
        self.name = name
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, deadline):
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no output in time") from None
        if line is None:
            raise RuntimeError(f"{self.name}: exited ({self.proc.wait()}) before saying more")
        return line

    def rest(self, deadline):
        """Every remaining line, once it exits (bounded); non-zero exit raises."""
        out = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: did not finish in time") from None
            if line is None:
                break
            out.append(line)
        rc = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if rc != 0:
            raise RuntimeError(f"{self.name} exited with {rc}")
        return out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def child_env(transport):
    env = dict(os.environ)
    if importlib.util.find_spec("weight_manager") is None:  # not installed: the tree's binding
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    if transport == "rdma":
        env.setdefault("UCX_TLS", "tcp")
        env["WM_NET_SECRET"] = secrets.token_hex(16)
        # The C++ engines load UCX as the library does: WM_UCX_LIB, else the
        # system's (refused when older than 1.14). The Python binding points
        # itself at the libucx wheel; the engines get the same here.
        ucx = wheel_ucx()
        if ucx and "WM_UCX_LIB" not in env:
            env["WM_UCX_LIB"] = ucx
    return env


def wheel_ucx():
    """The libucx wheel's libucp, when that wheel is installed (found
    without importing it, as the binding does)."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        libucp = Path(d) / "lib" / "libucp.so.0"
        if libucp.is_file():
            return str(libucp)
    return None


def run_loop(args, work, short_dir, deadline):
    """Runs the processes; returns the trainer's per-step records."""
    tag = f"{os.getpid()}"
    cell, group = f"wm-rl-{tag}.cell", f"wm-rl-{tag}"
    env = child_env(args.transport)
    where = ["--socket", str(short_dir / "weights.sock")] if args.transport == "ipc" else ["--net", "127.0.0.1:0"]
    children = []
    try:
        trainer = Child("trainer", [sys.executable, str(HERE / "trainer.py"), "--cell", cell, *where,
                                    "--out", str(work), "--steps", str(args.steps), "--ranks", str(RANKS),
                                    "--weights", args.weights], env)
        children.append(trainer)
        address = json.loads(trainer.next_line(deadline))["address"]
        for rank in range(RANKS):
            children.append(Child(f"engine rank {rank}", [
                args.engine, "--rank", str(rank), "--world", str(RANKS), "--group", group, "--cell", cell,
                "--source", args.transport, "--location", address, "--out", str(work),
                "--weights", args.weights,
                "--deadline-s", str(max(1, int(deadline - time.monotonic())))], env))
        steps = [json.loads(line) for line in trainer.rest(deadline)]
        for engine in children[1:]:
            for line in engine.rest(deadline):
                print(line)
        return [s for s in steps if "step" in s]
    finally:
        for c in children:
            c.kill()
        for leftover in (f"/dev/shm/{cell}", f"/dev/shm/{cell}.wm_report"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def read_updates(work, rank):
    """version -> (bytes, seconds, staging seconds, pause seconds, tokens
    generated while staging) of each update the rank made."""
    out = {}
    for line in (work / f"rank{rank}.updates").read_text().splitlines():
        version, nbytes, total_ns, _tensors, stage_ns, pause_ns, tokens = line.split()
        out[version] = (int(nbytes), int(total_ns) / 1e9, int(stage_ns) / 1e9, int(pause_ns) / 1e9, int(tokens))
    return out


def check(args, work, steps):
    """Compares every engine output with the trainer's at its version and
    prints the per-step table; returns the problems found."""
    problems = []
    refs = {}
    for s in steps:
        with np.load(work / f"ref-{s['version']}.npz") as z:
            refs[s["version"]] = (z["logits"], z["continuation"])
    outputs = {rank: np.fromfile(work / f"rank{rank}.bin", dtype=RECORD) for rank in range(RANKS)}
    updates = {rank: read_updates(work, rank) for rank in range(RANKS)}
    # Per version: did every output of every rank tagged with it agree?
    verdict = {v: {rank: [] for rank in range(RANKS)} for v in refs}
    worst = 0.0
    for rank, records in outputs.items():
        for i, r in enumerate(records):
            version = r["version"].decode()
            if version not in refs:
                problems.append(f"rank {rank} output {i}: computed with version '{version}', which was never published")
                continue
            logits, continuation = refs[version]
            diff = float(np.max(np.abs(r["logits"] - logits)))
            worst = max(worst, diff)
            same = np.allclose(r["logits"], logits, rtol=RTOL, atol=ATOL) and np.array_equal(r["continuation"], continuation)
            if not same:
                differs = np.flatnonzero(r["continuation"] != continuation)
                tokens = f"greedy token {differs[0]} differs" if differs.size else "same greedy continuation"
                problems.append(f"rank {rank} output {i} tagged {version}: max |logit diff| {diff:.3g} "
                                f"(tolerance {ATOL:g} + {RTOL:g} x |logit|), {tokens}: computed with a model that is not {version}")
            verdict[version][rank].append((same, diff))
    print(f"{'step':>4} {'loss':>7} {'train ms':>8} {'version':>8} {'stage ms':>8} {'pause ms':>8} "
          f"{'tokens':>6} {'bytes':>8} {'max|diff|':>9}  engine agrees")
    for s in steps:
        v = s["version"]
        seen = verdict[v]
        missing = [rank for rank in range(RANKS) if not seen[rank]]
        if missing:
            problems.append(f"{v}: rank(s) {missing} never computed with it")
        agree = not missing and all(ok for rank in seen for ok, _ in seen[rank])
        diff = max((d for rank in seen for _, d in seen[rank]), default=float("nan"))
        nan = (0, float("nan"), float("nan"), float("nan"), 0)
        # Per rank: staging time, pause, tokens generated while staging;
        # the slowest rank's times, the fewest tokens.
        stage_ms = max(updates[rank].get(v, nan)[2] for rank in range(RANKS)) * 1e3
        pause_ms = max(updates[rank].get(v, nan)[3] for rank in range(RANKS)) * 1e3
        tokens = min(updates[rank].get(v, nan)[4] for rank in range(RANKS))
        nbytes = updates[0].get(v, nan)[0]
        print(f"{s['step']:>4} {s['loss']:>7.4f} {s['train_s'] * 1e3:>8.1f} {v:>8} {stage_ms:>8.2f} {pause_ms:>8.2f} "
              f"{tokens:>6} {nbytes:>8} {diff:>9.2e}  {'yes (both ranks)' if agree else 'NO'}", flush=True)
    if len(steps) != args.steps:
        problems.append(f"the trainer finished {len(steps)} of {args.steps} steps")
    elif steps[-1]["loss"] >= steps[0]["loss"]:
        problems.append(f"training loss did not fall: {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}")
    checked = sum(len(o) for o in outputs.values())
    return problems, checked, worst


def main():
    args = parse_args()
    if not os.access(args.engine, os.X_OK):
        sys.exit(f"run.py: no engine binary at {args.engine} (cmake --build build --target rl_engine)")
    deadline = time.monotonic() + args.timeout
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="wm-rl-"))
    if (work / MARK).is_file():  # an earlier run's outputs (parse_args checked)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARK).write_text("outputs of examples/rl/run.py: emptied by the next run given this directory\n")
    # Unix socket paths are short (108 bytes): the socket lives in /tmp.
    short_dir = Path(tempfile.mkdtemp(prefix="wm-rl-"))
    try:
        steps = run_loop(args, work, short_dir, deadline)
        problems, checked, worst = check(args, work, steps)
    except RuntimeError as e:
        sys.exit(f"rl loop: FAILED: {e}")
    finally:
        shutil.rmtree(short_dir, ignore_errors=True)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"rl loop: FAILED ({len(problems)} problems, outputs in {work})")
    weights = " with FP8 weights" if args.weights == "fp8" else ""
    print(f"rl loop: {args.steps} steps, every version agrees over {args.transport}{weights} "
          f"({checked} distinct engine outputs checked, max |logit diff| {worst:.2e})")
    if not args.work:  # kept only when asked for, or to look into a failure
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
