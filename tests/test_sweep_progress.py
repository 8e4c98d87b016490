"""The sweep's progress: a rich bar with elapsed, ETA and counts per status on a terminal, plain
lines with the same facts when the output is a file or a pipe."""

from __future__ import annotations

import io
import os
import re
import select

from fibray.sweep.console import Progress


def test_progress_is_plain_lines_with_elapsed_eta_and_counts_off_a_terminal():
    out = io.StringIO()
    progress = Progress(3, enabled=True, stream=out)
    for status in ("PASSED", "PASSED", "TIMEOUT"):
        progress.update(status)
    progress.close()
    last = out.getvalue().strip().splitlines()[-1]
    assert re.fullmatch(r"\[3/3\] elapsed 0:\d\d eta 0:00 [\d.]+ eval/s  PASSED=2 TIMEOUT=1", last), last
    assert "\x1b" not in out.getvalue()  # no terminal control codes in a log file


def test_progress_is_a_bar_on_a_terminal():
    master, slave = os.openpty()
    with open(slave, "w", closefd=True) as tty:
        progress = Progress(4, enabled=True, stream=tty)
        for _ in range(4):
            progress.update("PASSED")
        progress.close()
        tty.flush()
    chunks = []
    while select.select([master], [], [], 0.5)[0]:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert "4/4" in text and "elapsed" in text and "eta" in text and "PASSED=4" in text
    assert "\x1b[" in text  # drawn in place with terminal control codes, not printed line by line
