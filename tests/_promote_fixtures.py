"""A toy dataset with public and hidden workloads for the split, promotion and stage tests.

`scale_h64` (y = x * w) has public workloads n in PUBLIC_SIZES and hidden ones n in
HIDDEN_SIZES. Its candidates: an honest one, one that is right only on the public shapes
(overfitted, as a generated kernel can be), and a slower honest runner-up.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from _apply_fixtures import H, SCALE_REFERENCE, TOY_EVAL, _definition, _solution, _write

PUBLIC_SIZES = (2, 32)
HIDDEN_SIZES = (4, 48)
DEFINITION = "scale_h64"

SOLUTIONS = [
    _solution(DEFINITION, "torch", "return x * w"),
    _solution(DEFINITION, "overfit", "return x * w if x.shape[0] in (2, 32) else x * w * 1.5", author="agent-x"),
    _solution(DEFINITION, "steady", "time.sleep(0.002)\nreturn x * w"),
]


def uuid(n: int) -> str:
    return f"{DEFINITION}-n{n}"


def write_split_dataset(root: Path, solutions: list[dict] | None = None) -> Path:
    """Definition, workloads (public and hidden) with a splits/ sidecar, and solutions under root."""
    root = Path(root)
    _write(root / "definitions" / "scale" / f"{DEFINITION}.json", _definition(DEFINITION, SCALE_REFERENCE))
    lines = [json.dumps({"definition": DEFINITION, "solution": None, "evaluation": None, "workload": {
        "uuid": uuid(n), "axes": {"n": n}, "inputs": {"x": {"type": "random"}, "w": {"type": "random"}}}})
        for n in (*PUBLIC_SIZES, *HIDDEN_SIZES)]
    path = root / "workloads" / "toy" / "scale" / f"{DEFINITION}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _write(root / "splits" / f"{DEFINITION}.json", {uuid(n): "hidden" for n in HIDDEN_SIZES})
    for sol in solutions if solutions is not None else SOLUTIONS:
        _write(root / "solutions" / sol["definition"] / f"{sol['name']}.json", sol)
    return root


@contextlib.contextmanager
def shared_ray() -> Iterator[None]:
    """One local Ray (one logical GPU) for a test module's sweeps: starting Ray costs seconds."""
    import ray

    for attempt in range(3):  # on a loaded two-core machine Ray's own 30 s start-up wait can run out
        try:
            ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - ray raises a bare Exception for it
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()


def sweep_config(root: Path, store: Path, sweep: str, **sections: dict) -> dict:
    """A sweep config dict for the toy dataset at root (one logical GPU, small timing); sections
    (dataset=..., runner=...) update those of the config."""
    cfg = {
        "dataset": {"root": str(root), "workload_set": "toy"}, "store": {"root": str(store)},
        "sweep": {"name": sweep, "progress": False}, "cluster": {"num_gpus": 1}, "eval": dict(TOY_EVAL),
    }
    for key, values in sections.items():
        cfg.setdefault(key, {}).update(values)
    return cfg


assert H == 64
