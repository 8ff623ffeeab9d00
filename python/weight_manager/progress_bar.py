"""The progress display of `Manager.update(progress=True)`: a bar redrawn in
place on a terminal, one plain final line otherwise (logs stay readable).
No dependency: it is fed by the library's progress callback."""

import sys
import time

WIDTH = 30
REDRAW_S = 0.1  # redraw at most this often: the callback fires per bucket


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def render_bar(done: int, total: int, tensors_done: int, tensors_total: int, elapsed_s: float) -> str:
    """One line of the bar: [#####.....]  42%  1.20/2.80 GB  3.10 GB/s  12/40 tensors."""
    frac = done / total if total else 1.0
    filled = min(WIDTH, int(frac * WIDTH))
    rate = done / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
    return (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {frac * 100:3.0f}%  "
            f"{done / 1e9:.2f}/{_gb(total)}  {rate:.2f} GB/s  {tensors_done}/{tensors_total} tensors")


def render_final(version: str, tensors: int, nbytes: int, total_s: float) -> str:
    """The line printed once the update is done."""
    rate = nbytes / total_s / 1e9 if total_s > 0 else 0.0
    return f"updated to {version or '(no version)'}: {tensors} tensors, {_gb(nbytes)} in {total_s:.2f} s ({rate:.2f} GB/s)"


class ProgressBar:
    """Feed `on_progress` from the update's callback, then call `finish`
    (success) or `abort` (failure)."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.drawn = False

    def on_progress(self, p) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        last = p.bytes_done >= p.bytes_total
        if not last and now - self.last_draw < REDRAW_S:
            return
        self.last_draw = now
        line = render_bar(p.bytes_done, p.bytes_total, p.tensors_done, p.tensors_total, now - self.start)
        self.stream.write("\r" + line)
        self.stream.flush()
        self.drawn = True

    def finish(self, stats) -> None:
        prefix = "\n" if self.drawn else ""
        self.stream.write(prefix + render_final(stats.version, stats.tensors, stats.bytes, stats.total_s) + "\n")
        self.stream.flush()

    def abort(self) -> None:
        if self.drawn:  # end the bar's line so the error starts on its own
            self.stream.write("\n")
            self.stream.flush()
