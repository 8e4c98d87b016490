"""The end-to-end example: trace a decoder block -> real Ray sweep -> apply -> same outputs as plain PyTorch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def shared_workdir():
    """A temp folder other users can traverse: the sweep may run candidates unprivileged (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="fibray-example-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_llama_block_example_substitutes_verified_kernels_and_matches_plain_pytorch(shared_workdir, tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.llama_block",
         "--workdir", str(shared_workdir / "work"), "--json", str(report_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["traced_workloads"] > 0
    assert set(report["sweep_counts"]) <= {"PASSED", "INCORRECT_NUMERICAL", "INCORRECT_DTYPE"}, report["sweep_counts"]
    assert report["within_tolerance"] and report["fallbacks"] == 0
    assert report["hits"] > 0 and report["bucketed"] > 0      # traced batches hit; the unseen one is bucketed
    assert sum(report["solution_calls"].values()) == report["hits"] + report["bucketed"]
    failing = {k: v for k, v in report["sweep_counts"].items() if k != "PASSED"}
    assert failing, "the bundled failing candidates must be swept and rejected"
    assert len(report["winners"]) == report["definitions"]   # every kernel of the block has a verified winner
    chosen = {s for names in report["winners"].values() for s in names}
    # the traced batches hold multi-token sequences, where every one of these candidates fails
    assert not any(s.endswith(("_big_eps", "_fp32_out", "_not_causal")) for s in chosen)
