"""benchmarks/promotion_block.py's CPU path: shadow -> canary -> default on the tiny decoder block,
with the deliberately wrong RMSNorm candidate demoted automatically during shadow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_promotion_block_demotes_the_wrong_candidate_and_takes_the_rest_to_default(tmp_path: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="fibray-promotion-block-"))  # reachable by unprivileged candidates
    work.chmod(0o755)
    report = tmp_path / "report.json"
    try:
        proc = subprocess.run(
            [sys.executable, "benchmarks/promotion_block.py", "--config", "tiny", "--in-process", "--iters", "2",
             "--warmup", "1", "--workdir", str(work / "w"), "--json", str(report)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(report.read_text())
    wrong = r["wrong_candidate"]
    assert r["final_stages"][wrong] == "demoted"
    assert r["stages"]["shadow"]["demoted"][wrong].startswith("mismatch")
    assert {v for k, v in r["final_stages"].items() if k != wrong} == {"default"}
    for stage in ("shadow", "canary", "default"):
        for batch in r["stages"][stage]["batches"].values():
            assert batch["ms"] > 0 and batch["max_abs_diff"] < 5e-2  # no stage changed what the block returns
