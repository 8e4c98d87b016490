"""How a sweep finds and uses a running service (python -m fibray.serve): its state file, joining its
cluster with the auth mode Ray needs, and a runner with the WorkerPool's interface that hands the jobs
to the service's coordinator, while the driver still records every result (writer, ledger, resume)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from fibray.schema import Job, JobResult
from fibray.sweep.config import ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "fibray"
"""The Ray namespace of the service's named, detached actors (its coordinator and slots)."""
_CALL_DEADLINE_S = 60.0
"""Deadline of one call to the coordinator."""
_JOIN_LOCK = threading.Lock()
"""One thread at a time imports Ray and joins the cluster."""
_BATCH = 256
"""Most jobs sent in one submission call (the rest follow as the queue makes room)."""


def state_dir(configured: Optional[str] = None) -> Path:
    """Where services started on this machine leave their state files."""
    return Path(configured or os.environ.get("FIBRAY_STATE_DIR") or Path.home() / ".cache" / "fibray" / "serve")


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


def _refresh_ray_auth() -> None:
    """Make Ray's cached config (read from the environment once) see RAY_AUTH_MODE as it is now,
    as Ray itself does when it enables token auth for a local start; a no-op before Ray is loaded."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def use_auth(auth: Optional[str]) -> None:
    """Make this process join with `auth` (token or disabled). Ray caches RAY_AUTH_MODE in its
    config and a local start may set it (token by default), so both are set here unless this
    process is connected already: then a mismatch is a clear error instead of twenty seconds of
    refused connections."""
    if not auth:
        return
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        os.environ["RAY_AUTH_MODE"] = auth
        _refresh_ray_auth()
        return
    from ray._raylet import AuthenticationMode, get_authentication_mode

    current = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
    if current != auth:
        raise ServiceError(f"the service's cluster has RAY_AUTH_MODE={auth} but this process is connected to a Ray "
                           f"with {current}; disconnect (ray.shutdown()) or start it with RAY_AUTH_MODE={auth}")


@contextlib.contextmanager
def auth_kept() -> Iterator[None]:
    """Leave this process's Ray auth mode as it was on entry: joining a service sets it for the
    service's cluster, and a later local Ray (the next sweep in this process) must not inherit it.
    Restored only when Ray is disconnected by then (a connection keeps the mode it was made with)."""
    before = os.environ.get("RAY_AUTH_MODE")
    try:
        yield
    finally:
        ray = sys.modules.get("ray")
        if os.environ.get("RAY_AUTH_MODE") != before and (ray is None or not ray.is_initialized()):
            if before is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = before
            _refresh_ray_auth()


def prepare_auth(name: str, address: Optional[str], directory: Optional[str]) -> None:
    """If this process will join service `name`'s local cluster, set the auth mode it needs now,
    before Ray is imported (a no-op when Ray is imported already or no such service runs here)."""
    if "ray" in sys.modules or address or os.environ.get("RAY_ADDRESS"):
        return
    state = read_state(name, directory)
    if state is not None and state.head_alive():
        use_auth(state.auth_mode)


def join(address: str, auth: Optional[str] = None, log_to_driver: bool = False) -> None:
    """Connect this process to the service's cluster (unless it is connected already)."""
    use_auth(auth)
    import ray

    if not ray.is_initialized():
        log.info("joining the Ray cluster at %s ...", address)  # the sweep then runs there, service or not
        ray.init(address=address, log_to_driver=log_to_driver, configure_logging=False)


def find_coordinator(name: str, address: Optional[str] = None, directory: Optional[str] = None,
                     log_to_driver: bool = False) -> Optional[Any]:
    """The running service's coordinator actor, or None when there is none to be found. Joins
    the cluster it lives on if this process is not in one yet: the one at `address` (or
    RAY_ADDRESS), or the one the service's state file names; with neither, returns None at once."""
    with _JOIN_LOCK:  # several threads may connect at once (clients in threads)
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


class ServiceRunner:
    """Runs a sweep's jobs on the service's slots; calls on_result(job, result) once per job."""

    def __init__(self, coordinator: Any, name: str, status: dict, joined: bool = False) -> None:
        self.coordinator, self.name = coordinator, name
        self.joined = joined
        """Whether finding the service connected this process to its cluster (the driver disconnects after)."""
        self.num_slots = sum(1 for s in status["slots"] if s["phase"] == "ready") or len(status["slots"])
        self.lanes = status["lanes"]
        self.first_dispatch: Optional[float] = None

    def run(self, jobs: list[Job], on_result: Callable[[Job, JobResult], None]) -> None:
        import ray
        from ray.exceptions import RayActorError

        client = f"sweep:{jobs[0].sweep if jobs else '?'}:{socket.gethostname()}:{os.getpid()}"
        rest, waiting, pause = list(jobs), {}, 0.02
        while rest or waiting:
            if rest:
                answer = ray.get(self.coordinator.submit.remote(client, rest[:_BATCH]), timeout=_CALL_DEADLINE_S)
                if answer["tickets"] and self.first_dispatch is None:
                    self.first_dispatch = time.monotonic()
                for ticket, job in zip(answer["tickets"], rest):
                    waiting[self.coordinator.result.remote(ticket)] = job
                rest = rest[len(answer["tickets"]):]
                pause = 0.02 if answer["tickets"] else min(0.5, pause * 2)
            if not waiting:
                time.sleep(pause)
                continue
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=pause if rest else 5.0)
            if ready:
                others = [r for r in waiting if r not in ready]
                ready += ray.wait(others, num_returns=len(others), timeout=0)[0] if others else []
            for ref in ready:
                job = waiting.pop(ref)
                try:
                    result = ray.get(ref)
                except RayActorError as e:
                    raise ServiceError(f"service {self.name!r} was lost during the sweep ({type(e).__name__}); "
                                       "run the sweep again to resume it") from None
                on_result(job, result)

    def slot_stats(self) -> list[dict]:
        import ray

        return ray.get(self.coordinator.slot_stats.remote(), timeout=_CALL_DEADLINE_S)

    def shutdown(self) -> None:
        """The service's slots are not the sweep's: they stay."""


def attach_service(name: Optional[str], address: Optional[str], state_dir: Optional[str],
                   log_to_driver: bool = False) -> Optional[ServiceRunner]:
    """A runner on the service `name` if one is running where this sweep would run, else None
    (the sweep starts private slots). Costs nothing when no service could be there."""
    if not name:
        return None
    connected = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    coordinator = find_coordinator(name, address, state_dir, log_to_driver)  # before Ray is imported: it may set its auth
    if coordinator is None:
        return None
    import ray

    status = ray.get(coordinator.status.remote(), timeout=_CALL_DEADLINE_S)
    if not any(s["phase"] == "ready" for s in status["slots"]):
        log.warning("service %r has no ready slot; the sweep starts its own", name)
        return None
    log.info("sweep runs on service %r (%d slot(s), %d lane(s) each)", name, len(status["slots"]), status["lanes"])
    return ServiceRunner(coordinator, name, status, joined=not connected)
