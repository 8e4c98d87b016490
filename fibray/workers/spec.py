"""The one typed spec of a GPU slot: what the driver (fibray.sweep.pool) asks of a slot actor.

It crosses the process boundary to the actor as one frozen value (no positional arguments, no
dict): RunnerConfig -> PoolOptions -> SlotSpec, in that direction only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

from fibray.workers.process.sandbox import SandboxPolicy

if TYPE_CHECKING:
    from fibray.schema import Job

__all__ = ["PREWARM_AHEAD", "PREWARM_SHAPES", "SandboxPolicy", "SlotSpec", "distinct_shapes"]


@dataclass(frozen=True)
class SlotSpec:
    """One GPU slot: its executors' sandbox and how many executors it keeps."""

    name: str
    """The slot's name (in its directories and its worker name), e.g. `gpu0.1`."""
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    """Limits and isolation of every executor the slot starts."""
    workdir: Optional[str] = None
    """Where the slot makes its private directories; None: the system temp dir."""
    torch_threads: Optional[int] = None
    """CPU threads of the supervisor's torch (reference and checks); None: torch's default."""
    standby: int = 1
    """Warm standby executors, each ready to take a retired lane's executor's place at once (0: none;
    True counts as 1)."""
    spare_isolated: int = 1
    """Pre-warmed single-use executors for fresh-process isolation (0 when never isolating)."""
    lanes: int = 1
    """Jobs in flight at once, each on its own persistent executor (timing stays exclusive)."""
    lanes_auto: bool = False
    """`lanes` came from `runner.lanes: auto` (the host's CPUs): the slot takes GPU_AUTO_LANES instead on a GPU
    (slot_lanes)."""
    quarantine_after: int = 3
    """Faults of one solution this slot has seen before its further jobs here are not run (quarantined)."""
    prewarm: Union[bool, str] = "auto"
    """Ready a standby for the solution the driver names next (GpuSlot.prewarm): True, False, or "auto"
    (on a GPU, where the first call compiles; on a CPU, Triton is interpreted and a warm-up only takes cores)."""

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ValueError(f"SlotSpec.lanes: must be at least 1, got {self.lanes}")
        if self.standby < 0:
            raise ValueError(f"SlotSpec.standby: must be at least 0, got {self.standby}")
        if self.spare_isolated < 0:
            raise ValueError(f"SlotSpec.spare_isolated: must be at least 0, got {self.spare_isolated}")
        if self.quarantine_after < 1:
            raise ValueError(f"SlotSpec.quarantine_after: must be at least 1, got {self.quarantine_after}")
        if self.prewarm not in (True, False, "auto"):
            raise ValueError(f"SlotSpec.prewarm: must be true, false or 'auto', got {self.prewarm!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"SlotSpec.torch_threads: must be at least 1 or None, got {self.torch_threads}")


GPU_AUTO_LANES = 1
"""The lanes `runner.lanes: auto` gives a slot on a GPU. Every timed window there stops the slot's other
executors (and this process keeps its own GPU work off the GPU), so a second lane's calls and compiles
mostly wait, and its supervisor thread's Python slows the window's own clock readings (bound retries):
on an H100 with 16 CPUs, 224 evaluations took 48.5 s with one lane and 56.0 s with two in one run, 68.4 s
with one and 86.2 s with four in another (benchmarks/RESULTS.md, section 28). Standbys and prewarm, not
lanes, take compilation off the GPU's path there."""


def slot_lanes(spec: "SlotSpec", device_type: str) -> int:
    """The lanes a slot on `device_type` runs: spec.lanes, or GPU_AUTO_LANES on a GPU where they came from `auto`."""
    return GPU_AUTO_LANES if spec.lanes_auto and device_type == "cuda" else spec.lanes


PREWARM_AHEAD = 3
"""Groups (one solution's jobs) the driver names to a slot ahead of the one it starts, each readied at
once by a standby of its own (GpuSlot.prewarm): a warm-up (build, Triton's JIT per shape) outlasts a
group that fails fast, so one warm-up at a time left lanes waiting for it (seen on the H200)."""
PREWARM_SHAPES = 8
"""The most distinct workload shapes a readied executor calls its solution on (GpuSlot.prewarm): Triton
compiles a kernel again for each specialisation its integer arguments fall into (1, multiples of 16, ...)."""


def distinct_shapes(jobs: Sequence["Job"]) -> list["Job"]:
    """The first job of each distinct workload shape (its axes), in order, at most PREWARM_SHAPES."""
    seen: set[tuple] = set()
    out: list["Job"] = []
    for j in jobs:
        key = tuple(sorted(j.workload.axes.items()))
        if key not in seen:
            seen.add(key)
            out.append(j)
            if len(out) == PREWARM_SHAPES:
                break
    return out
