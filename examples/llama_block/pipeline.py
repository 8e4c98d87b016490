"""The whole loop on the decoder block: trace -> sweep (Ray) -> apply -> compare with plain PyTorch.

Each step is a function so that the benchmark (benchmarks/apply_block.py) and the test
reuse them; `run_pipeline` chains them into one report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from examples.llama_block.block import BlockConfig, DecoderBlock, pack_prompts, sample_prompts
from examples.llama_block.contracts import definitions, write_dataset
from fibray.apply import ApplyConfig, ApplyRuntime, enable_apply
from fibray.tracing import trace

log = logging.getLogger(__name__)

WORKLOAD_SET = "traced"
TRACE_LENGTHS = [[5, 9, 3], [12, 20]]
"""Prompt lengths of the traced batches (each batch is one workload per definition)."""
UNSEEN_LENGTHS = [[7, 11]]
"""A batch never traced: its calls are served by the nearest measured keys (bucketing)."""

CI_EVAL = {"warmup": 0, "iterations": 2, "trials": 1, "flush_l2": False}
"""Enough to verify and rank on a CPU with Triton interpreted."""


@dataclass
class PipelineReport:
    """What the loop did and how close apply's outputs are to plain PyTorch."""

    dataset: str
    store: str
    definitions: int
    """Kernel contracts of the block."""
    traced_workloads: int
    sweep_counts: dict[str, int]
    sweep_wall_s: float
    hits: int
    bucketed: int
    misses: int
    fallbacks: int
    solution_calls: dict[str, int]
    max_abs_diff: float
    """Largest |apply - plain| over every output element of every batch."""
    within_tolerance: bool
    winners: dict[str, list[str]] = field(default_factory=dict)
    """Definition -> distinct winning solutions over its measured keys."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def batches(config: BlockConfig, lengths: list[list[int]], seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Packed (tokens, indptr, positions) for batches of prompts of the given lengths."""
    return [pack_prompts(sample_prompts(ls, config.vocab, seed + i), device()) for i, ls in enumerate(lengths)]


def trace_block(block: DecoderBlock, dataset: Path,
                inputs: list[tuple[torch.Tensor, ...]]) -> tuple[list[torch.Tensor], int]:
    """Run the block on the inputs while tracing; returns its (plain PyTorch) outputs and new workloads."""
    with torch.inference_mode(), trace(dataset, dataset, workload_set=WORKLOAD_SET) as tracer:
        outputs = [block(*b) for b in inputs]
    return outputs, tracer.stats.written


def sweep(dataset: Path, store: Path, name: str, eval_settings: dict[str, Any], num_gpus: Optional[int] = None):
    """The real Ray sweep of the block's candidates on the traced workloads."""
    from fibray.sweep import run_sweep, validate_config

    cfg = validate_config({
        "dataset": {"root": str(dataset), "workload_set": WORKLOAD_SET},
        "store": {"root": str(store)},
        "sweep": {"name": name, "progress": False},
        "cluster": {"num_gpus": num_gpus or 1},
        "eval": eval_settings,
    })
    return run_sweep(cfg)


def sweep_in_process(dataset: Path, store: Path, name: str, eval_settings: dict[str, Any],
                     workload_set: Optional[str] = WORKLOAD_SET) -> dict[str, int]:
    """The same jobs as `sweep`, judged in this process by fibray.evaluate.Evaluator: no Ray, no sandbox.

    For benchmarks on a machine where the Ray sweep cannot run; the rows are the same kind.
    """
    import tempfile
    from collections import Counter

    from fibray.dataset import load_dataset
    from fibray.evaluate import Evaluator, now_iso
    from fibray.schema import JobResult
    from fibray.store import TraceStore, to_row
    from fibray.sweep import make_jobs, validate_config

    cfg = validate_config({"dataset": {"root": str(dataset), "workload_set": workload_set},
                           "store": {"root": str(store)}, "sweep": {"name": name}, "eval": eval_settings})
    evaluator = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-in-process-")))
    rows, counts = [], Counter()
    for job in make_jobs(load_dataset(dataset, workload_set=workload_set), cfg):
        started = now_iso()
        evaluation = evaluator.evaluate(job)
        counts[evaluation.status.value] += 1
        rows.append(to_row(job, JobResult(job_id=job.job_id, evaluation=evaluation, worker="in-process",
                                          started_at=started, finished_at=now_iso())))
    TraceStore(store).append(rows)
    return dict(counts)


def winners(runtime: ApplyRuntime) -> dict[str, list[str]]:
    """Definition -> the distinct solutions that win at least one measured key."""
    return {
        name: sorted({states[0].name for states in d.ranked.values()})
        for name, d in runtime.dispatchers.items()
    }


def run_pipeline(
    workdir: Path,
    config: BlockConfig,
    *,
    eval_settings: Optional[dict[str, Any]] = None,
    trace_lengths: Optional[list[list[int]]] = None,
    unseen_lengths: Optional[list[list[int]]] = None,
    sweep_name: str = "llama_block",
    apply_config: Optional[ApplyConfig] = None,
    atol: float = 5e-2,
    rtol: float = 5e-2,
) -> PipelineReport:
    """Trace the block, sweep its candidates, enable apply and compare outputs with plain PyTorch."""
    workdir = Path(workdir)
    dataset, store = workdir / "dataset", workdir / "store"
    write_dataset(dataset, config)
    n_definitions = len(definitions(config))
    block = DecoderBlock(config).to(device())
    traced_inputs = batches(config, trace_lengths or TRACE_LENGTHS)
    unseen_inputs = batches(config, unseen_lengths or UNSEEN_LENGTHS, seed=100)

    plain, written = trace_block(block, dataset, traced_inputs)
    with torch.inference_mode():
        plain += [block(*b) for b in unseen_inputs]

    t0 = time.monotonic()
    report = sweep(dataset, store, sweep_name, eval_settings or CI_EVAL)
    sweep_wall = time.monotonic() - t0

    runtime = enable_apply(store, dataset, config=apply_config)
    try:
        with torch.inference_mode():
            applied = [block(*b) for b in traced_inputs + unseen_inputs]
    finally:
        runtime.deactivate()
    stats = runtime.stats()
    diffs = [(a.float() - p.float()).abs().max().item() for a, p in zip(applied, plain)]
    close = all(torch.allclose(a.float(), p.float(), atol=atol, rtol=rtol) for a, p in zip(applied, plain))
    return PipelineReport(
        dataset=str(dataset), store=str(store), definitions=n_definitions, traced_workloads=written,
        sweep_counts=dict(report.counts),
        sweep_wall_s=round(sweep_wall, 1), hits=stats.hits, bucketed=stats.bucketed, misses=stats.misses,
        fallbacks=stats.fallbacks, solution_calls={k: v for k, v in stats.solution_calls.items() if v},
        max_abs_diff=max(diffs), within_tolerance=close, winners=winners(runtime),
    )
