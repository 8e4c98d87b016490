"""fibray: evaluate GPU kernel candidates at scale and deploy the verified winners.

The package is layered: schema -> dataset -> build/check/timing -> evaluate ->
workers -> sweep -> store -> analysis/apply. Lower layers never import higher ones.
`fibray.apply` (decorator) and `fibray.trace` are the runtime entry points.
"""

from __future__ import annotations

__version__ = "0.1.0"

from fibray.apply import ApplyConfig, apply, disable_apply, enable_apply  # noqa: E402
from fibray.tracing import trace  # noqa: E402

__all__ = ["ApplyConfig", "__version__", "apply", "disable_apply", "enable_apply", "trace"]
