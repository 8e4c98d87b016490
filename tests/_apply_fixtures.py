"""A toy dataset for the apply and tracing tests: small definitions and real candidate solutions.

Each definition isolates one behaviour. Candidates that must rank in a known order differ by
a sleep (a real, measured latency), never by a hard-coded number. Fault candidates pass
the sweep (random N(0,1) inputs) and fail only on production-like inputs, as real kernels do.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import torch

H = 64
WORKLOAD_SIZES = (2, 32)
"""Measured values of the var axis n of every toy definition."""
MISSING_DEP_ENV = "FIBRAY_TEST_MISSING_DEP"
"""When set, the `portable_h64_needs_dep` candidate fails to import (a dependency this host lacks)."""
TOY_EVAL = {"warmup": 0, "iterations": 3, "trials": 1, "flush_l2": False}

SCALE_REFERENCE = "import torch\n\ndef run(x, w):\n    return x * w\n"


def _definition(name: str, reference: str = SCALE_REFERENCE) -> dict[str, Any]:
    return {
        "name": name, "op_type": "scale",
        "description": "y = x * w over rows of width 64 (fibray apply tests).",
        "axes": {"n": {"type": "var"}, "h": {"type": "const", "value": H}},
        "inputs": {"x": {"shape": ["n", "h"], "dtype": "float32"}, "w": {"shape": ["h"], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["n", "h"], "dtype": "float32"}},
        "reference": reference,
    }


def _solution(definition: str, suffix: str, body: str, *, dps: bool = False, author: str = "fibray-tests",
              header: str = "import time\nimport torch\n") -> dict[str, Any]:
    signature = "def run(x, w, y):" if dps else "def run(x, w):"
    source = header + "\n\n" + signature + "\n" + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ")
    return {
        "name": f"{definition}_{suffix}", "definition": definition, "author": author,
        "spec": {"language": "python", "target_hardware": ["cpu", "cuda"], "entry_point": "main.py::run",
                 "destination_passing_style": dps},
        "sources": [{"path": "main.py", "content": source}],
    }


SOLUTIONS = [
    # scale_h64: hit / miss / guards / DPS / tolerance / compatibility
    _solution("scale_h64", "torch", "return x * w"),
    _solution("scale_h64", "dps", "torch.mul(x, w, out=y)", dps=True),
    _solution("scale_h64", "approx", "return (x.half() * w.half()).float()"),
    _solution("scale_h64", "wrong", "return x * w * 1.1", author="agent-x"),
    # bucket_h64: the fastest solution differs between n=2 and n=32
    _solution("bucket_h64", "slow_small", "if x.shape[0] <= 8:\n    time.sleep(0.005)\nreturn x * w"),
    _solution("bucket_h64", "slow_large", "time.sleep(0.005 if x.shape[0] > 8 else 0.001)\nreturn x * w"),
    # ...and one that is fastest at n=2 but wrong beyond n=8 (fails the sweep at n=32)
    _solution("bucket_h64", "small_only", "return x * w if x.shape[0] <= 8 else x * w * 2", author="agent-x"),
    # fragile_h64: the winner raises on inputs the sweep never drew; the runner-up is slower
    _solution("fragile_h64", "raises",
              "if x.abs().max() > 100:\n    raise ValueError('range not supported')\nreturn x * w"),
    _solution("fragile_h64", "steady", "time.sleep(0.002)\nreturn x * w"),
    # overflow_h64: the winner overflows to inf in fp16 on large inputs; the runner-up is slower
    _solution("overflow_h64", "fp16", "return (x.half() * w.half()).float()"),
    _solution("overflow_h64", "steady", "time.sleep(0.002)\nreturn x * w"),
    # portable_h64: the winner needs a dependency that a serving host may lack
    _solution("portable_h64", "needs_dep", "return x * w", header=(
        "import os\nimport time\nimport torch\n\n"
        f"if os.environ.get({MISSING_DEP_ENV!r}):\n"
        "    raise ImportError('simulated: a dependency this host lacks')\n")),
    _solution("portable_h64", "plain", "time.sleep(0.002)\nreturn x * w"),
]
DEFINITIONS = sorted({s["definition"] for s in SOLUTIONS})


def write_toy_dataset(root: Path) -> Path:
    """The toy dataset (definitions, solutions, workloads n in WORKLOAD_SIZES) under root."""
    root = Path(root)
    for name in DEFINITIONS:
        _write(root / "definitions" / "scale" / f"{name}.json", _definition(name))
        lines = [json.dumps({"definition": name, "solution": None, "evaluation": None, "workload": {
            "uuid": f"{name}-n{n}", "axes": {"n": n}, "inputs": {"x": {"type": "random"}, "w": {"type": "random"}}}})
            for n in WORKLOAD_SIZES]
        path = root / "workloads" / "toy" / "scale" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for sol in SOLUTIONS:
        _write(root / "solutions" / sol["definition"] / f"{sol['name']}.json", sol)
    return root


def _write(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def sweep_toy(dataset: Path, store: Path, sweep: str = "toy") -> dict[str, int]:
    """Run the real Ray sweep of the toy dataset into a store; returns counts per status."""
    from fibray.sweep import run_sweep, validate_config

    cfg = validate_config({
        "dataset": {"root": str(dataset), "workload_set": "toy"}, "store": {"root": str(store)},
        "sweep": {"name": sweep, "progress": False}, "cluster": {"num_gpus": 1}, "eval": TOY_EVAL,
    })
    return dict(run_sweep(cfg).counts)


def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The known-good implementation every toy definition falls back to."""
    return x * w


def scale_into(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Destination-passing known-good implementation."""
    return torch.mul(x, w, out=y)


def inputs(n: int, *, magnitude: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, 64] and w [64], float32, |values| around `magnitude`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=gen) * magnitude, torch.randn(H, generator=gen) * magnitude


RAGGED = {
    "name": "ragged_center_h8", "op_type": "gqa_ragged",
    "description": "Subtract each sequence's mean (ragged rows bounded by indptr); a stand-in for attention.",
    "axes": {"total_q": {"type": "var"}, "len_indptr": {"type": "var"}, "h": {"type": "const", "value": 8}},
    "inputs": {"x": {"shape": ["total_q", "h"], "dtype": "float32"},
               "qo_indptr": {"shape": ["len_indptr"], "dtype": "int32"},
               "scale": {"shape": None, "dtype": "float32"}},
    "outputs": {"y": {"shape": ["total_q", "h"], "dtype": "float32"}},
    "reference": (
        "import torch\n\ndef run(x, qo_indptr, scale):\n    y = torch.empty_like(x)\n"
        "    b = qo_indptr.tolist()\n    for i in range(len(b) - 1):\n"
        "        seg = x[b[i]:b[i + 1]]\n        y[b[i]:b[i + 1]] = (seg - seg.mean(0)) * scale\n    return y\n"
    ),
}
"""A ragged definition (indptr axis) for the tracing tests."""


def ragged_center(x: torch.Tensor, qo_indptr: torch.Tensor, scale: float) -> torch.Tensor:
    """Known-good implementation of RAGGED."""
    y = torch.empty_like(x)
    b = qo_indptr.tolist()
    for i in range(len(b) - 1):
        seg = x[b[i]:b[i + 1]]
        y[b[i]:b[i + 1]] = (seg - seg.mean(0)) * scale
    return y


def ragged_inputs(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """x [sum(lengths), 8], int32 indptr, scale."""
    gen = torch.Generator().manual_seed(seed)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(sum(lengths), 8, generator=gen), indptr, 0.5
