"""Ctrl-C (SIGINT) during a blocking call on the main thread: an update
waiting on a trainer that never answers, and a serve() waiting for engines
that never come, each with a 600 s timeout of its own, end with
KeyboardInterrupt at once, their handle closed; a serve's socket file is
removed. Real processes, real signals."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PACKAGE = str(Path(__file__).resolve().parents[1])

SCRIPT = r"""
import os, socket, sys
import numpy as np
from weight_manager import Manager, Publisher
which, d = sys.argv[1], sys.argv[2]
if which == "update":
    # Accepts and never answers: the engine waits for its manifest.
    s = socket.socket(socket.AF_UNIX)
    s.bind(d + "/silent.sock")
    s.listen(4)
    m = Manager(fallback_dir="")
    m.register("w", np.zeros(4, np.float32))
    print("ready", flush=True)
    try:
        m.update(d + "/silent.sock", source="ipc", timeout=600)
    except KeyboardInterrupt:
        print("interrupted", m._handle is None, flush=True)
        sys.exit(3)
else:
    p = Publisher(d + "/p.sock")
    print("ready", flush=True)
    try:
        p.serve(1, timeout=600)
    except KeyboardInterrupt:
        print("interrupted", p._handle is None, os.path.exists(d + "/p.sock"), flush=True)
        sys.exit(3)
"""


@pytest.mark.parametrize("call", ["update", "serve"])
def test_ctrl_c_ends_a_blocking_call_at_once(tmp_path, call):
    env = dict(os.environ, PYTHONPATH=PACKAGE)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, call, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(0.3)  # into the call
        proc.send_signal(signal.SIGINT)
        # Bounded by the harness, far below the call's own 600 s.
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, (out, err)
    words = out.split()
    assert words[:2] == ["interrupted", "True"], out  # the handle closed
    if call == "serve":
        assert words[2] == "False", out  # the socket file removed
