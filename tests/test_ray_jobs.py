"""A sweep submitted through the Ray Jobs API (jobs/ray_submit.sh) to a running Ray cluster:
the job succeeds and the store holds every job's designed verdict."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from fibray.store import scan
from _sweep_helpers import REPO, designed_verdict

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_sweep_submitted_as_a_ray_job_records_every_verdict(tmp_path: Path) -> None:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    dashboard = _free_port()
    temp = Path(tempfile.mkdtemp(prefix="fibray-rj-", dir="/tmp"))  # short: Ray's socket paths live under it
    # a head of our own, in its own process group (`ray stop` would stop every Ray on the machine)
    head = subprocess.Popen(
        [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head", "--block",
         "--num-cpus=2", "--num-gpus=1", f"--port={_free_port()}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        store = tmp_path / "store"
        job = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the job server answers once the head is up
            job = subprocess.run(
                ["bash", str(REPO / "jobs" / "ray_submit.sh"), str(store), "+experiment=smoke",
                 "dataset.definitions=[rmsnorm_h4096]", "sweep.progress=false"],
                env={**env, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}, capture_output=True, text=True, timeout=600)
            if job.returncode == 0 or "succeeded" in job.stdout + job.stderr or "Job '" in job.stdout + job.stderr:
                break
            time.sleep(2)
        out = job.stdout + job.stderr
        assert job.returncode == 0 and "succeeded" in out, out[-3000:]
        assert "21 evaluated" in out  # the driver ran on the cluster and printed its report back
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        for p in _ours(str(temp)):  # anything of this head's session that left the group
            p.kill()
        shutil.rmtree(temp, ignore_errors=True)
    df = scan(store).collect()
    assert len(df) == 21 and df["job_id"].n_unique() == 21
    for row in df.iter_rows(named=True):
        assert (row["status"], row["reason"]) == designed_verdict(row["solution"], row["definition"]), row["solution"]
