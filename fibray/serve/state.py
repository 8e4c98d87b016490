"""The local Ray head a service may start: `ray start --head --block` in its own process group,
stopped by that group (never `ray stop`, which would stop every Ray on the host). Where a service
is and how to join it lives in fibray.sweep.service (sweeps find services too).
"""

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
from typing import Optional

from fibray.sweep.service import ServiceError, auth_mode

HEAD_START_DEADLINE_S = 120.0
"""`ray start --head` must say it is up within this long."""
HEAD_STOP_GRACE_S = 15.0
"""After SIGTERM, a head's process group gets this long before SIGKILL."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEAD_START_TRIES = 3
"""Ray gives its raylet a fixed 30 s to register; on a loaded machine a try can miss it."""


def start_head(num_gpus: int, num_cpus: Optional[int], log_path: Path) -> tuple[int, str, str]:
    """`ray start --head --block` in its own process group, so it outlives this command and is
    stopped as one group; returns (pid, address, temp dir)."""
    for attempt in range(HEAD_START_TRIES):
        try:
            return _start_head(num_gpus, num_cpus, log_path)
        except ServiceError:
            if attempt == HEAD_START_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _start_head(num_gpus: int, num_cpus: Optional[int], log_path: Path) -> tuple[int, str, str]:
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="fibray-serve-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head", "--block",
           f"--port={port}", f"--num-gpus={num_gpus}", "--include-dashboard=false", "--disable-usage-stats",
           f"--temp-dir={temp}", *([f"--num-cpus={num_cpus}"] if num_cpus else [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": auth_mode()})
    deadline = time.monotonic() + HEAD_START_DEADLINE_S
    while time.monotonic() < deadline:
        if b"block forever" in log_path.read_bytes():
            return proc.pid, f"127.0.0.1:{port}", temp
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop_head(proc.pid)
    shutil.rmtree(temp, ignore_errors=True)
    raise ServiceError(f"ray start --head did not come up within {HEAD_START_DEADLINE_S:g}s; see {log_path}:\n"
                       + log_path.read_text(errors="replace")[-2000:])


def stop_head(pid: int) -> None:
    """Stop the head this service started: SIGTERM to its process group, SIGKILL after a grace period."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + HEAD_STOP_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


