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
