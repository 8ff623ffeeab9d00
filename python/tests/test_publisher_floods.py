"""A publisher facing connections that are not engines: what they may
cost it is bounded (docs/wire.md, "Handshake"), and a real engine is still
served after them."""

import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from weight_manager import Manager

PACKAGE = str(Path(__file__).resolve().parents[1])

# A publisher with few file descriptors: every connection that came and
# went used to keep one until serve() returned, and accepting failed. (At
# most 64 handshakes run at once, two descriptors each: 256 leaves room;
# running out for a moment makes accept wait, not give up serving.)
_PUBLISHER = """
import resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from weight_manager import Publisher
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
with Publisher(sys.argv[2]) as p:
    p.add("w", np.arange(1024, dtype=np.float32))
    p.set_version("v1")
    print("ready", flush=True)
    stats = p.serve(1, timeout=60)
    print("served", stats.sessions, flush=True)
"""


def _start_publisher(sock: str) -> subprocess.Popen:
    # Its stderr (warnings about connections turned away) goes to a file: a
    # pipe nobody reads would fill and stop the publisher's threads.
    err = open(sock + ".err", "w+")
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, PACKAGE, sock], stdout=subprocess.PIPE,
                            stderr=err, text=True)
    line = proc.stdout.readline().strip()
    err.seek(0)
    assert line == "ready", err.read()
    return proc


def test_connections_that_come_and_go_hold_no_descriptors(tmp_path):
    sock = str(tmp_path / "p.sock")
    proc = _start_publisher(sock)
    try:
        for _ in range(800):  # three times the publisher's descriptors
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock)
            c.sendall(b"\x01")  # a byte of no HELLO: turned away (a silent close is a probe)
            c.close()
        w = np.zeros(1024, np.float32)
        with Manager(fallback_dir="") as m:
            m.register("w", w)
            assert m.update(sock, source="ipc", timeout=30).version == "v1"
        assert (w == np.arange(1024, dtype=np.float32)).all()
        out, _ = proc.communicate(timeout=60)
        log = open(sock + ".err").read()
        assert "served 1" in out, log
        # Turned away: logged at most once a second, not once per connection.
        assert 1 <= log.count("turned a connection away") < 50, log[-2000:]
    finally:
        proc.kill()


def test_probes_that_close_unheard_are_not_logged(tmp_path):
    """A connection closed before its first byte (another publisher
    checking whether one listens, a port check) is no engine turned away:
    nothing logged, and the engine after it is served."""
    sock = str(tmp_path / "p.sock")
    proc = _start_publisher(sock)
    try:
        for _ in range(20):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock)
            c.close()
        w = np.zeros(1024, np.float32)
        with Manager(fallback_dir="") as m:
            m.register("w", w)
            assert m.update(sock, source="ipc", timeout=30).version == "v1"
        out, _ = proc.communicate(timeout=60)
        log = open(sock + ".err").read()
        assert "served 1" in out, log
        assert "turned a connection away" not in log, log[-2000:]
    finally:
        proc.kill()


def test_a_large_frame_before_the_handshake_is_refused_at_once(tmp_path):
    """A HELLO announced as 16 MiB is refused from its length alone (the
    body is never allocated nor waited for), with an ERROR saying why."""
    sock = str(tmp_path / "p.sock")
    proc = _start_publisher(sock)
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock)
        c.settimeout(4)  # under the 5 s handshake timeout
        t = time.monotonic()
        c.sendall(struct.pack("<I", 16 << 20))  # the length alone: nothing left unread
        reply = b""
        while True:
            chunk = c.recv(4096)
            if not chunk:
                break
            reply += chunk
        c.close()
        assert time.monotonic() - t < 4
        assert b"65536 allowed" in reply, reply
        w = np.zeros(1024, np.float32)
        with Manager(fallback_dir="") as m:
            m.register("w", w)
            assert m.update(sock, source="ipc", timeout=30).version == "v1"
        proc.communicate(timeout=60)
    finally:
        proc.kill()
