"""The evaluation service: GPU slots kept warm as named, detached Ray actors, a coordinator that
queues and dispatches what sweeps, Python clients and HTTP requests submit. See README "Service"."""

from __future__ import annotations

from fibray.serve.config import ServeConfig, validate_serve_config
from fibray.sweep.service import NAMESPACE
from fibray.sweep.service import ServiceError, find_coordinator

__all__ = ["NAMESPACE", "ServeConfig", "ServiceError", "find_coordinator", "validate_serve_config"]
