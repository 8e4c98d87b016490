"""benchmarks/timing_fidelity.py's plumbing on a CPU: every timer runs on every kernel and the summary prints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _sweep_helpers import REPO


@pytest.mark.slow
def test_the_fidelity_script_times_every_kernel_and_prints_its_summary():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "timing_fidelity.py"), "--cpu-smoke"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("rmsnorm_h2048[", "fused_add_rmsnorm_h2048["))]
    assert len(rows) == 4 and not any("error" in r for r in rows), proc.stdout
    assert "goal 1: fibray within 5% of kernel-only" in proc.stdout and "obs. 2" in proc.stdout
