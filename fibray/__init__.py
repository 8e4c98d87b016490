"""fibray: evaluate GPU kernel candidates at scale and deploy the verified winners.

The package is layered: schema -> dataset/store -> compile/check/timing -> evaluate ->
workers -> sweep/apply/analysis -> evolve/promote. Lower layers never import higher ones
(docs/ARCHITECTURE.md draws them; pyproject.toml's import-linter contracts check them).
`fibray.apply` (decorator) and `fibray.trace` are the runtime entry points.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["ApplyConfig", "__version__", "apply", "disable_apply", "enable_apply", "trace"]

_LAZY = {"ApplyConfig": "fibray.apply", "apply": "fibray.apply", "disable_apply": "fibray.apply",
         "enable_apply": "fibray.apply", "trace": "fibray.tracing"}


def __getattr__(name: str):
    """The runtime entry points load on first use: a candidate executor, which imports only the
    evaluation layers, starts without the store, Polars-free analysis or Ray."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fibray' has no attribute {name!r}")
