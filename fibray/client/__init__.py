"""Clients of the evaluation service: submit solutions, get futures of their Evaluations."""

from __future__ import annotations

from fibray.client.client import Client, QueueFull
from fibray.client.request import RequestError, resolve_jobs

__all__ = ["Client", "QueueFull", "RequestError", "resolve_jobs"]
