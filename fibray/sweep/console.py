"""What a sweep shows while it runs: start-up phases, a progress bar, fibray's log lines.

On a terminal a rich progress bar (elapsed, ETA, counts per status) stays below the log
lines; otherwise plain lines, one every few seconds. It never prints Ray's own chatter
unless asked (`sweep.verbose`, `cluster.log_to_driver`). Output goes to stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from typing import Optional, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

PLAIN_EVERY_S = 5.0
"""Seconds between progress lines when the output is not a terminal."""

_console: Optional[Console] = None


def console() -> Console:
    """The console every sweep line goes through (stderr; a terminal or not)."""
    global _console
    if _console is None:
        _console = Console(stderr=True, highlight=False, soft_wrap=True)
    return _console


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class Progress:
    """Progress over a sweep's jobs: a rich bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool, stream: Optional[TextIO] = None) -> None:
        self.total, self.enabled = total, enabled
        self.counts: Counter[str] = Counter()
        self.t0 = self._last = time.monotonic()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._bar: Optional[RichProgress] = None
        self._task = None
        if enabled and self.tty:
            self._bar = RichProgress(
                TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[counts]}"),
                console=console() if self.stream is sys.stderr else Console(file=self.stream, highlight=False),
                transient=False,
            )
            self._task = self._bar.add_task("sweep", total=total, counts="")
            self._bar.start()

    def _counts(self) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))

    def update(self, status: str) -> None:
        self.counts[status] += 1
        done = sum(self.counts.values())
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, counts=self._counts())
            return
        now = time.monotonic()
        if now - self._last >= PLAIN_EVERY_S or done == self.total:
            self._last = now
            elapsed = now - self.t0
            eta = elapsed / done * (self.total - done) if done else 0.0
            print(f"[{done}/{self.total}] elapsed {_elapsed(elapsed)} eta {_elapsed(eta)} "
                  f"{done / max(elapsed, 1e-9):.1f} eval/s  {self._counts()}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class ConsoleHandler(logging.Handler):
    """fibray's log records as short lines (time since start, level word for warnings) on the console."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__(logging.DEBUG if verbose else logging.INFO)
        self.t0 = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
            line = f"{time.monotonic() - self.t0:6.1f}s  {level}{record.getMessage()}"
            if record.exc_info and record.levelno >= logging.ERROR:
                line += "\n" + logging.Formatter().formatException(record.exc_info)
            console().print(line, markup=False, highlight=False)
        except Exception:  # a log line must never end the sweep
            self.handleError(record)


def setup_logging(verbose: bool = False) -> None:
    """Route fibray's log records to the console as short lines."""
    fibray = logging.getLogger("fibray")
    fibray.handlers[:] = [ConsoleHandler(verbose)]
    fibray.setLevel(logging.DEBUG if verbose else logging.INFO)
    fibray.propagate = False


def quiet_ray(quiet: bool) -> None:
    """Keep Ray's own log messages (its token notice, INFO lines) out of the sweep's output; call it
    after importing ray, whose import configures its logger."""
    logging.getLogger("ray").setLevel(logging.ERROR if quiet else logging.INFO)
