"""A slot's start-up that needs no torch: count the GPUs, make the slot's directories and spawn
its first executors, so they warm up while the slot actor imports torch. Imports nothing of the
slot itself (fibray.workers.slot imports this), so the two never import each other.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fibray.workers.process import sandbox
from fibray.workers.process.forkserver import ForkServer
from fibray.workers.process.launch import become_subreaper
from fibray.workers.spec import SlotSpec


def visible_gpu_count() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the node's GPUs as the driver's
    management library (NVML) counts them, narrowed by CUDA_VISIBLE_DEVICES (which CUDA reads up
    to its first invalid entry). 0 where there is no NVIDIA driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
    finally:
        nvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count.value
    listed = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(listed, count.value)


def guess_device() -> str:
    """The device a slot's executors will use, before torch can say (GpuSlot checks the guess)."""
    return "cuda:0" if visible_gpu_count() else "cpu"


@dataclass
class SlotStart:
    """A slot's private directories, its fork server and its first executors, started before torch
    is imported (with a fork server, on a thread: the server warms up while the slot imports torch)."""

    base: Path
    policy: sandbox.SandboxPolicy
    device: str
    persistent: list = field(default_factory=list)
    standbys: list = field(default_factory=list)
    server: Optional[ForkServer] = None
    _first: Optional[threading.Thread] = None
    _failed: Optional[BaseException] = None
    _forks_failed: bool = False

    @classmethod
    def begin(cls, spec: SlotSpec, device: Optional[str] = None) -> "SlotStart":
        become_subreaper()
        root = Path(spec.workdir) if spec.workdir else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=f"fibray-{spec.name}-", dir=root))
        os.chmod(base, 0o755)
        start = cls(base=base, policy=spec.sandbox, device=device or guess_device())
        start._spawn_first(spec.lanes, int(spec.standby))
        return start

    def _spawn_first(self, lanes: int, standbys: int) -> None:
        problem = sandbox.privilege_problem(self.policy, str(self.base))
        if problem is not None:  # at once, as every spawn would
            raise sandbox.PrivilegeError(problem)
        self.server = sandbox.fork_server(self.device, self.base, self.policy)

        def first() -> None:
            try:
                self.persistent = [self.spawn(single_use=False) for _ in range(lanes)]
                self.standbys = [self.spawn(single_use=False) for _ in range(standbys)]
            except BaseException as e:  # noqa: BLE001  (raised where the slot waits for them)
                self._failed = e

        if self.server is None:
            first()
            self.wait_first()
        else:
            self._first = threading.Thread(target=first, name="fibray-first-executors", daemon=True)
            self._first.start()

    def wait_first(self) -> None:
        """The first executors are spawned (not yet warm); raises what stopped them."""
        if self._first is not None:
            self._first.join()
            self._first = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def restart_on(self, device: str) -> None:
        """The guess was wrong (torch sees another device): the first executors start again on `device`."""
        self.wait_first()
        lanes, standbys = len(self.persistent), len(self.standbys)
        for ex in (*self.persistent, *self.standbys):
            sandbox.retire(ex)
        self.close()
        self.device = device
        self._spawn_first(lanes, standbys)

    def spawn(self, single_use: bool) -> sandbox.Executor:
        server = self.server if self.server is not None and not self._forks_failed else None
        return sandbox.spawn(self.device, self.base, self.policy, single_use, server=server)

    def fork_failed(self, why: str) -> None:
        """A forked executor died before it was ready: later executors start their own interpreters
        (the server stays up until the slot ends: the executors it forked are its children)."""
        if self.server is not None and not self._forks_failed:
            print(f"fibray: a forked executor failed to start; executors of this slot now start their own "
                  f"interpreters: {why[-1500:]}", file=sys.stderr, flush=True)
        self._forks_failed = True

    def own_pids(self) -> set[int]:
        """Processes of the slot's own that are not executors (the fork server): never strays."""
        return {self.server.pid} if self.server is not None else set()

    def close(self) -> None:
        """End the fork server (after the executors were retired)."""
        if self.server is not None:
            self.server.close()
            self.server = None
