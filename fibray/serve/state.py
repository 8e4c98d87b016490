"""Where a running service is: its state file, the local Ray head it may have started, and how to
join it. Starts and stops only the head recorded in its own state file (never `ray stop`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from fibray.serve.config import NAMESPACE, state_dir
from fibray.sweep.config import ConfigError

HEAD_START_DEADLINE_S = 120.0
"""`ray start --head` must say it is up within this long."""
HEAD_STOP_GRACE_S = 15.0
"""After SIGTERM, a head's process group gets this long before SIGKILL."""


class ServiceError(ConfigError):
    """The service cannot be started, found or stopped as asked; the message says which and why
    (a ConfigError, so the sweep's command prints it as one line)."""


@dataclass
class ServiceState:
    """What `python -m fibray.serve` leaves behind for the commands that join its service."""

    name: str
    address: str
    """Ray address of the cluster the service runs on."""
    auth_mode: str
    """RAY_AUTH_MODE a process joining it needs (token when the head checks a token)."""
    head_pid: Optional[int] = None
    """Pid (and process group) of the `ray start --head --block` this service started; None when it joined."""
    temp_dir: Optional[str] = None
    started_at: float = 0.0
    http_url: Optional[str] = None

    def head_alive(self) -> bool:
        if self.head_pid is None:
            return True  # a cluster we joined: only joining it tells
        try:
            return b"ray" in Path(f"/proc/{self.head_pid}/cmdline").read_bytes()
        except OSError:
            return False


def state_path(name: str, directory: Optional[str] = None) -> Path:
    return state_dir(directory) / f"{name}.json"


def read_state(name: str, directory: Optional[str] = None) -> Optional[ServiceState]:
    path = state_path(name, directory)
    try:
        return ServiceState(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ServiceError(f"{path}: not a fibray service state file ({e}); remove it") from None


def write_state(state: ServiceState, directory: Optional[str] = None) -> Path:
    path = state_path(state.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)
    return path


def remove_state(name: str, directory: Optional[str] = None) -> None:
    state_path(name, directory).unlink(missing_ok=True)


def auth_mode() -> str:
    """The auth mode a `ray start` head started from this environment enforces (Ray >= 2.60
    checks a token when one is configured), which is what its clients must set."""
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"]
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return "token" if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file() else "disabled"


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


def use_auth(auth: Optional[str]) -> None:
    """Make this process join with `auth` (token or disabled). Ray reads RAY_AUTH_MODE once, when it
    is imported: set before that, it is set here; after, a mismatch is a clear error instead of
    twenty seconds of refused connections."""
    if not auth:
        return
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", auth)
        return
    from ray._raylet import AuthenticationMode, get_authentication_mode

    current = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
    if current != auth:
        raise ServiceError(f"the service's cluster has RAY_AUTH_MODE={auth} but this process imported Ray with "
                           f"{current}; start it with RAY_AUTH_MODE={auth} in its environment")


def join(address: str, auth: Optional[str] = None, log_to_driver: bool = False) -> None:
    """Connect this process to the service's cluster (unless it is connected already)."""
    use_auth(auth)
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)


def find_coordinator(name: str, address: Optional[str] = None, directory: Optional[str] = None,
                     log_to_driver: bool = False) -> Optional[Any]:
    """The running service's coordinator actor, or None when there is none to be found. Joins
    the cluster it lives on if this process is not in one yet: the one at `address` (or
    RAY_ADDRESS), or the one the service's state file names; with neither, returns None at once."""
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        state = read_state(name, directory)
        if not address:
            if state is None or not state.head_alive():
                return None
            address = state.address
        join(address, state.auth_mode if state is not None and state.address == address else None, log_to_driver)
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
