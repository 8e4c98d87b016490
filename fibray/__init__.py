"""fibray: evaluate GPU kernel candidates at scale and deploy the verified winners.

The package is layered: schema -> dataset -> build/check/timing -> evaluate ->
workers -> sweep -> store -> analysis/apply. Lower layers never import higher ones.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
