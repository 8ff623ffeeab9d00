"""Ctrl-C during a blocking call into the library.

A ctypes call holds the main thread until it returns, and Python runs its
SIGINT handler (raising KeyboardInterrupt) only between bytecodes: an
update waiting on a silent trainer, or a serve() waiting for engines, would
hold Ctrl-C until its own timeout (600 s by default). While such a call
runs on the main thread with Python's default SIGINT handler in place,
`on_ctrl_c` has Python's C-level handler wake a watcher thread (through
`signal.set_wakeup_fd`), which runs `stop` at once: the caller closes its
handle there (a manager's close() cancels the call within about 50 ms, a
publisher's stops its serve), so the call returns and KeyboardInterrupt is
raised from it. The handle is closed then, as close() leaves it.

Elsewhere nothing changes: on other threads (signals reach only the main
thread), under a SIGINT handler of the program's own (it decides), or where
a wakeup fd is set already (asyncio's), the call runs as before.
"""

import os
import signal
import threading
from contextlib import contextmanager


@contextmanager
def on_ctrl_c(stop):
    """Run the body; SIGINT meanwhile runs `stop()` on another thread at
    once, then raises KeyboardInterrupt once the body returned."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed, installed = [], False
    fds, watcher, old = (), None, None
    try:
        try:
            # Our handler only notes it: a KeyboardInterrupt raised between
            # two steps of the clean-up below would leak the pipe or the
            # thread.
            signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
            installed = True
            fds = os.pipe()
            os.set_blocking(fds[1], False)
            old = signal.set_wakeup_fd(fds[1], warn_on_full_buffer=False)
            if old != -1:
                signal.set_wakeup_fd(old)  # someone else's: theirs stays
            else:
                t = threading.Thread(target=_watch, args=(fds[0], stop), name="wm-ctrl-c",
                                     daemon=True)
                t.start()
                watcher = t
        except (OSError, ValueError, RuntimeError):
            pass  # no watcher: Ctrl-C is raised once the call returned, as before
        yield
    finally:
        if old == -1:
            signal.set_wakeup_fd(-1)
        if fds:
            os.close(fds[1])  # the watcher reads the end and returns
            if watcher is not None:
                watcher.join(10)
            os.close(fds[0])
        if installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if pressed:
            raise KeyboardInterrupt


def _watch(r: int, stop) -> None:
    while True:
        try:
            got = os.read(r, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGINT in got:
            stop()
            return
