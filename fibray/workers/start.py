"""A slot's start-up that needs no torch: count the GPUs, make the slot's directories and spawn
its first executors, so they warm up while the slot actor imports torch. Imports nothing of the
slot itself (fibray.workers.slot imports this), so the two never import each other.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fibray.workers.process import sandbox
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
    """A slot's private directories and its first executors, started before torch is imported."""

    base: Path
    policy: sandbox.SandboxPolicy
    device: str
    persistent: list = field(default_factory=list)
    standbys: list = field(default_factory=list)

    @classmethod
    def begin(cls, spec: SlotSpec, device: Optional[str] = None) -> "SlotStart":
        sandbox.become_subreaper()
        root = Path(spec.workdir) if spec.workdir else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=f"fibray-{spec.name}-", dir=root))
        os.chmod(base, 0o755)
        start = cls(base=base, policy=spec.sandbox, device=device or guess_device())
        start._spawn_first(spec.lanes, int(spec.standby))
        return start

    def _spawn_first(self, lanes: int, standbys: int) -> None:
        self.persistent = [self.spawn(single_use=False) for _ in range(lanes)]
        self.standbys = [self.spawn(single_use=False) for _ in range(standbys)]

    def restart_on(self, device: str) -> None:
        """The guess was wrong (torch sees another device): the first executors start again on `device`."""
        lanes, standbys = len(self.persistent), len(self.standbys)
        for ex in (*self.persistent, *self.standbys):
            sandbox.retire(ex)
        self.device = device
        self._spawn_first(lanes, standbys)

    def spawn(self, single_use: bool) -> sandbox.Executor:
        return sandbox.spawn(self.device, self.base, self.policy, single_use)
