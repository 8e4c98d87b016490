"""`python -m fibray.sweep` as its own process, the way a user runs it, for the benchmark scripts."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SweepRun:
    wall_s: float
    """Process start to exit: imports, Ray, slots, every job, shutdown."""
    summary: str
    """The `sweep '...': N jobs, ...` line."""
    breakdown: str
    """The `time:` line without its prefix: where the slots' time went."""
    setup_s: float = 0.0
    """Dataset, Ray, compiling ahead (from the `time:` line)."""
    start_s: float = 0.0
    """Slots starting, until the first job was sent."""
    window_s: float = 0.0
    """First job sent to last result."""


def run_sweep_cli(overrides: list[str], *, log: Path, env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> SweepRun:
    """Run a sweep with these Hydra overrides; its whole output goes to `log`. Exits with the
    output's tail when the sweep fails."""
    cmd = [sys.executable, "-m", "fibray.sweep", "sweep.progress=false", *overrides]
    t0 = time.monotonic()
    with open(log, "w") as out:  # written as it runs: a benchmark stopped at its limit keeps what the sweep said
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - t0
    output = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"fibray.sweep failed (rc={proc.returncode}); log {log}:\n" + output[-3000:])
    lines = output.splitlines()
    breakdown = next((ln.removeprefix("time: ") for ln in lines if ln.startswith("time: ")), "")
    m = re.match(r"setup ([\d.]+)s, slot start-up ([\d.]+)s; jobs: \d+ slot\(s\) x (?:\d+ lane\(s\) x )?([\d.]+)s", breakdown)
    setup, start, window = (float(g) for g in m.groups()) if m else (0.0, 0.0, 0.0)
    return SweepRun(wall_s=wall, summary=next((ln for ln in lines if ln.startswith("sweep ")), ""),
                    breakdown=breakdown, setup_s=setup, start_s=start, window_s=window)
