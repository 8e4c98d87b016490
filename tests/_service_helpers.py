"""A real fibray service for tests: `python -m fibray.serve` in a subprocess, with its own state
directory and a local Ray head in its own process group; stopped with `--stop`, and killed by
its recorded process group if that fails, so no cluster or detached actor outlives a test."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from _sweep_helpers import REPO

START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A running service and the environment that joins it."""

    name: str
    state_dir: Path
    env: dict[str, str]
    store: Path
    http_url: Optional[str] = None
    overrides: list[str] = field(default_factory=list)

    start_env: Optional[dict[str, str]] = None
    """The environment of the start command (the head's auth mode); others use `env`."""

    def cli(self, *args: str, timeout: float = 300, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fibray.serve", *args, f"service.name={self.name}"],
                              env=env or self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / f"{self.name}.json").read_text())

    def stop(self) -> None:
        """--stop; whatever it leaves (it failed, or timed out) is killed by its process group."""
        head = temp = None
        try:
            state = self.state()
            head, temp = state.get("head_pid"), state.get("temp_dir")
        except (OSError, ValueError):
            pass
        try:
            self.cli("--stop", timeout=240)
        except subprocess.TimeoutExpired:
            pass
        if head:
            try:
                os.killpg(head, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def start_service(tmp: Path, *overrides: str, http: bool = False, token: bool = False) -> Service:
    """Start a service of 2 logical GPUs (no spares: a 2-core CI machine) and wait for it.

    By default its head and everyone who joins it run without a token (the test process imported
    Ray without one). With `token`, the head checks a token of its own and the commands that join it
    are not told the auth mode: they must read it from the service's state file."""
    name = f"t{os.getpid()}-{int(time.time() * 1000) % 100000}"
    state_dir = Path(tempfile.mkdtemp(prefix="fibray-state-", dir="/tmp"))
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env = {**base, "FIBRAY_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO)}
    if token:
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        start_env = {**env, "RAY_AUTH_MODE": "token"}
    else:
        env["RAY_AUTH_MODE"] = "disabled"
        start_env = env
    store = tmp / "service-store"
    args = ["cluster.num_gpus=2", "cluster.num_cpus=2", f"store.root={store}", "runner.spare_isolated=0",
            f"dataset.root={REPO / 'datasets' / 'core'}", "dataset.workload_set=cpu_small", *overrides]
    svc = Service(name, state_dir, env, store, overrides=list(args), start_env=start_env)
    if http:
        args += ["service.http.enabled=true", f"service.http.port={free_port()}"]
    try:
        proc = svc.cli(*args, timeout=START_TIMEOUT_S, env=start_env)
    except subprocess.TimeoutExpired:
        svc.stop()
        raise
    if proc.returncode != 0:
        svc.stop()
        raise RuntimeError(f"python -m fibray.serve failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    svc.http_url = svc.state().get("http_url")
    return svc
