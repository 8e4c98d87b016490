"""`python -m fibray.promote.sanitize_runner JOB.json`: run one candidate once on one workload and exit.

This is the process compute-sanitizer watches (fibray.promote.sanitizer starts it, sandboxed,
under `compute-sanitizer --tool X --error-exitcode N`). Inputs are made on the CPU and copied
to the GPU, so the kernels the sanitizer sees are the candidate's own. It judges nothing:
exit 0 after the candidate's work has synchronised, RUNNER_FAILED with a message otherwise.
`python -m fibray.promote.smem_poison JOB.json` is the same process for that gate (main here, its run).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fibray.schema import Definition, Solution, Workload

RUNNER_FAILED = 3
"""Exit status when the candidate (or its build) raised; the sanitizer's own status is another."""
RUNNER_UNAVAILABLE = 4
"""Exit status when the runner cannot do its work on this machine (RunnerUnavailable): not the candidate's doing."""


class RunnerUnavailable(RuntimeError):
    """The runner cannot do its work here (a gate's instrument, not the candidate, is missing or failed)."""


class SanitizeJob(BaseModel):
    """What the runner runs: one solution on one workload."""

    model_config = ConfigDict(extra="forbid")

    definition: Definition
    """The definition."""
    workload: Workload
    """The workload (safetensors paths relative to dataset_root)."""
    solution: Solution
    """The candidate."""
    dataset_root: str
    """Dataset root, for safetensors blobs."""
    seed: int = 0
    """Seed of random inputs (as the sweep's eval.seed)."""
    device: str = "cuda"
    """Where the candidate runs (cpu only in tests of the runner itself)."""


def prepare(job: SanitizeJob, workdir: Path):
    """(device, the built and bound candidate, its inputs made on the CPU) for a runner's calls."""
    import torch

    from fibray.compile import BuildCache, bind, prepare_triton
    from fibray.evaluate.inputs import materialize

    if job.device == "cpu":
        prepare_triton()
    runnable = bind(BuildCache(workdir / "builds").get(job.solution), job.definition)  # c_abi marshalling
    cpu_args = materialize(job.definition, job.workload, root=Path(job.dataset_root), seed=job.seed, trial=0,
                           device=torch.device("cpu"))
    return torch.device(job.device), runnable, cpu_args


def run(job: SanitizeJob, workdir: Path) -> None:
    """Build the candidate, make its inputs, call it once, synchronise."""
    import torch

    from fibray.evaluate.inputs import allocate_outputs

    device, runnable, cpu_args = prepare(job, workdir)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in cpu_args]
    if runnable.destination_passing_style:
        runnable.fn(*args, *allocate_outputs(job.definition, job.workload.axes, device))
    else:
        runnable.fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str], run_job: Callable[[SanitizeJob, Path], None] = run,
         prog: str = "fibray.promote.sanitize_runner") -> int:
    """`python -m <prog> JOB.json`: run_job(job, JOB.json's folder), its outcome as the exit status."""
    if len(argv) != 1:
        print(f"usage: python -m {prog} JOB.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    job = SanitizeJob.model_validate_json(path.read_text(encoding="utf-8"))
    try:
        run_job(job, path.parent)
    except Exception as e:  # noqa: BLE001 - the candidate's failure is the answer, reported by exit status
        print(f"{prog}: {job.solution.name} on {job.workload.uuid}: {type(e).__name__}: {e}", file=sys.stderr)
        return RUNNER_UNAVAILABLE if isinstance(e, RunnerUnavailable) else RUNNER_FAILED
    print(f"{prog}: {job.solution.name} on {job.workload.uuid}: ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
