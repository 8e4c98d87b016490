"""Shared test setup: CPU-only Triton runs interpreted; paths to bundled and shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

REPO = Path(__file__).resolve().parents[1]
SHARED_SAMPLE = REPO.parent / "shared" / "fib-trace-sample"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def sample_root() -> Path:
    if not SHARED_SAMPLE.is_dir():
        pytest.fail(f"the shared FlashInfer Trace sample is missing at {SHARED_SAMPLE}")
    return SHARED_SAMPLE
