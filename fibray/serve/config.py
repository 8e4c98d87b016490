"""The service's typed configuration (conf/serve.yaml), validated before anything starts.

An unknown key or a bad value is one ConfigError naming the key (e.g. `service.max_queue`).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from fibray.schema import EvalSettings
from fibray.sweep.config import ClusterConfig, RunnerConfig, StoreConfig, name_of_at_most, validate_model

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class HttpConfig(_Strict):
    enabled: bool = False
    """Serve POST /evaluate and GET /status through Ray Serve."""
    host: str = "127.0.0.1"
    """Address Ray Serve's proxy listens on."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of Ray Serve's proxy."""
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    """Largest request body accepted (bytes); a larger one gets 413 and nothing is queued."""
    max_workloads: int = Field(default=256, ge=1)
    """Most workloads (jobs) one request may ask for."""
    sweep: str = "http"
    """Sweep name (store partition) of requests that do not name one."""


class ServiceSection(_Strict):
    name: name_of_at_most(64) = "fibray"  # type: ignore[valid-type]
    """The service's name: its coordinator actor in the `fibray` Ray namespace, and its state file."""
    state_dir: Optional[str] = None
    """Where the state file (address, head process) lives; null: $FIBRAY_STATE_DIR or ~/.cache/fibray/serve."""
    max_queue: int = Field(default=4096, ge=1)
    """Jobs waiting for a slot, all clients together; beyond it a submission waits (back-pressure)."""
    max_queue_per_client: int = Field(default=1024, ge=1)
    """Jobs one client may have waiting; dispatch is round-robin between clients."""
    ready_deadline_s: float = Field(default=300.0, gt=0)
    """Deadline for the first slots to be ready after `python -m fibray.serve`, seconds."""
    flush_rows: int = Field(default=64, ge=1)
    """A client sweep's records are published after this many new ones..."""
    flush_interval_s: float = Field(default=1.0, gt=0)
    """...or after this many seconds."""
    writer_idle_s: float = Field(default=30.0, gt=0)
    """A client sweep's writer (and its store lock) is released after this long with nothing pending."""
    restore_interval_s: float = Field(default=5.0, gt=0)
    """How often a lost slot is started again when the cluster has a free GPU for it, seconds."""
    result_ttl_s: float = Field(default=900.0, gt=0)
    """An answer nobody collected (its client left) is dropped after this long; its record stays."""
    http: HttpConfig = Field(default_factory=HttpConfig)


class DatasetRef(_Strict):
    root: Optional[str] = None
    """The dataset HTTP requests name definitions and workloads from (null: inline objects only)."""
    workload_set: Optional[str] = None
    """Read only workloads/<set>/ of it."""


class ServeConfig(_Strict):
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    dataset: DatasetRef = Field(default_factory=DatasetRef)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    service: ServiceSection = Field(default_factory=ServiceSection)


def validate_serve_config(raw: dict[str, Any]) -> ServeConfig:
    """Validate the resolved Hydra config into a ServeConfig; ConfigError names every bad key."""
    return validate_model(ServeConfig, raw, "service")
