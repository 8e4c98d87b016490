"""apply(): verified kernels from the trace store into a running PyTorch program, safely.

`enable_apply(store, dataset)` builds a dispatch index (PASSED, within tolerance, same
hardware and library versions, fastest per var-axis key) and the winners' builds;
functions wrapped with `@apply(...)` then route their calls to it. A miss, a failed
guard, an exception or a NaN/Inf output goes to the wrapped known-good function.
Reads the store with pyarrow only. With `ApplyConfig(require_promotion=True)` only artifacts
promoted to default, canary or shadow (python -m fibray.promote) serve (fibray.apply.stages).
"""

from fibray.apply.api import apply
from fibray.apply.config import DISABLE_ENV, ApplyConfig
from fibray.apply.index import (
    Candidate,
    DefinitionIndex,
    IndexReport,
    build_index,
    read_rows,
)
from fibray.apply.metrics import prometheus_text
from fibray.apply.runtime import (
    ApplyRuntime,
    ApplyStats,
    ArtifactStats,
    DefinitionStats,
    build_runtime,
    current_runtime,
    disable_apply,
    enable_apply,
    stats,
)

__all__ = [
    "DISABLE_ENV", "ApplyConfig", "ApplyRuntime", "ApplyStats", "Candidate", "DefinitionIndex",
    "ArtifactStats", "DefinitionStats", "IndexReport", "apply", "build_index", "build_runtime", "current_runtime",
    "disable_apply", "enable_apply", "prometheus_text", "read_rows", "stats",
]
