"""One honest evaluation: build, materialise inputs, reference, check, time -> Evaluation.

`Evaluator` holds what a worker keeps warm between jobs (builds, blobs, reference outputs
and reference latency per workload). A candidate's failure becomes an Evaluation with a
status and a reason; only a fault of fibray itself raises.
"""

from __future__ import annotations

import platform
import sys
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

from fibray import __version__
from fibray.build import BuildCache, BuildError, Runnable, build_reference, prepare_triton
from fibray.check import CheckResult, Tolerance, checker_for
from fibray.inputs import BlobCache, InputError, allocate_outputs, clone_args, materialize, torch_dtype
from fibray.schema import (
    Correctness, Definition, Environment, EvalSettings, Evaluation, EvaluationStatus, Job, Performance, Workload,
)
from fibray.timing import LatencyStats, time_calls

Status = EvaluationStatus


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def bound_log(text: str, limit: int) -> str:
    """Keep the head and the tail of a long log (the tail holds the exception)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head - 40
    return f"{text[:head]}\n... [{len(text) - head - tail} chars cut] ...\n{text[-tail:]}"


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def environment(device: torch.device) -> Environment:
    """Hardware name and library versions of this process."""
    import triton

    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    libs = {
        "fibray": __version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.version.cuda:
        libs["cuda"] = torch.version.cuda
    return Environment(hardware=hw, libs=libs)


def normalize_outputs(result: Any, definition: Definition) -> list[Any]:
    """Turn a value-returning result (tensor, tuple, list, dict, scalar) into outputs in order."""
    names = list(definition.outputs)
    if isinstance(result, dict):
        missing = [n for n in names if n not in result]
        if missing:
            raise _WrongOutputs(f"returned dict lacks outputs {missing}")
        return [result[n] for n in names]
    if isinstance(result, (tuple, list)):
        if len(result) != len(names):
            raise _WrongOutputs(f"returned {len(result)} values, definition has {len(names)} outputs {names}")
        return list(result)
    if len(names) != 1:
        raise _WrongOutputs(f"returned one value, definition has {len(names)} outputs {names}")
    if isinstance(result, (bool, int, float)):
        spec = definition.outputs[names[0]]
        return [torch.tensor(result, dtype=torch_dtype(spec.dtype))]
    return [result]


class _WrongOutputs(Exception):
    pass


@dataclass
class _WorkloadState:
    """Inputs and reference outputs of one workload, kept on the worker."""

    inputs: list[list[Any]]
    refs: list[list[torch.Tensor]]
    ref_stats: Optional[LatencyStats] = None
    nbytes: int = 0


class Evaluator:
    """Evaluates jobs on one device, keeping builds and references warm."""

    def __init__(self, workdir: Path, device: Optional[torch.device] = None, cache_bytes: int = 2 << 30) -> None:
        prepare_triton()  # before anything imports triton
        self.workdir = Path(workdir)
        self.device = device or default_device()
        self.builds = BuildCache(self.workdir / "builds")
        self.blobs = BlobCache()
        self.env = environment(self.device)
        self._refs: dict[str, Any] = {}
        self._workloads: OrderedDict[tuple, _WorkloadState] = OrderedDict()
        self._cache_bytes = cache_bytes

    # -- build -------------------------------------------------------------------------
    def build(self, job: Job) -> Optional[BuildError]:
        """Build the job's solution (cached); returns the BuildError if it failed."""
        try:
            self.builds.get(job.solution)
            return None
        except BuildError as e:
            return e

    # -- one evaluation ------------------------------------------------------------------
    def evaluate(self, job: Job) -> Evaluation:
        """Run a job to a verdict."""
        s = job.settings
        try:
            runnable = self.builds.get(job.solution)
        except BuildError as e:
            return self._fail(Status.COMPILE_ERROR, e.reason, str(e), s)
        try:
            state = self._workload_state(job)
        except InputError as e:
            return self._fail(Status.RUNTIME_ERROR, "bad_workload_input", str(e), s)

        check = job.definition.check
        tol = Tolerance(
            atol=check.atol if check and check.atol is not None else s.atol,
            rtol=check.rtol if check and check.rtol is not None else s.rtol,
            matched_ratio=check.matched_ratio if check and check.matched_ratio is not None else s.matched_ratio,
        )
        checker = checker_for(check.kind if check else "elementwise")
        names = list(job.definition.outputs)
        verdict = CheckResult()
        timed_args: list[list[Any]] = []
        for trial, (inputs, refs) in enumerate(zip(state.inputs, state.refs)):
            args = clone_args(inputs)
            outcome = self._call(runnable, job, args)
            if isinstance(outcome, Evaluation):
                return outcome
            outputs, call_args = outcome
            for i, (before, after) in enumerate(zip(inputs, args)):
                if isinstance(before, torch.Tensor) and not torch.equal(before, after):
                    name = list(job.definition.inputs)[i]
                    return self._fail(Status.INCORRECT_NUMERICAL, "mutated_inputs", f"input {name!r} was modified by the call", s, correctness=True)
            for o_name, out in zip(names, outputs):
                if isinstance(out, torch.Tensor) and any(
                    isinstance(a, torch.Tensor) and a.numel() and out.numel() and _overlaps(out, a) for a in args
                ):
                    return self._fail(Status.INCORRECT_NUMERICAL, "output_aliases_input", f"output {o_name!r} shares memory with an input", s, correctness=True)
            verdict.merge(checker(outputs, refs, names, tol))
            if not verdict.ok:
                break
            timed_args.append(call_args)
        correctness = Correctness(max_absolute_error=verdict.max_abs, max_relative_error=verdict.max_rel, extra=verdict.extra or None)
        if not verdict.ok:
            corr = correctness if verdict.status == Status.INCORRECT_NUMERICAL else None
            return Evaluation(status=verdict.status, reason=verdict.reason, log=bound_log(verdict.message, s.log_limit),
                              correctness=corr, environment=self.env, timestamp=now_iso())

        try:
            timing = time_calls(runnable, timed_args, warmup=s.warmup, iterations=s.iterations, device=self.device,
                                flush_l2=s.flush_l2, sync_device=s.sync_device)
        except Exception as e:  # a candidate that passed checks can still fail when called repeatedly
            return self._fail(Status.RUNTIME_ERROR, "failed_during_timing", _format_exc(e), s)
        stats = LatencyStats.of(timing.samples_ms)
        ref_ms = self._reference_latency(job, state).median_ms if s.time_reference else 0.0
        perf = Performance(
            latency_ms=stats.median_ms, reference_latency_ms=ref_ms,
            speedup_factor=ref_ms / stats.median_ms if stats.median_ms > 0 and ref_ms > 0 else 0.0,
            latency_p95_ms=stats.p95_ms, latency_mean_ms=stats.mean_ms, latency_cv=stats.cv, n_samples=stats.n,
            timing_mode=timing.mode,
        )
        return Evaluation(status=Status.PASSED, correctness=correctness, performance=perf, environment=self.env, timestamp=now_iso())

    # -- helpers -------------------------------------------------------------------------
    def _call(self, runnable: Runnable, job: Job, args: list[Any]):
        """Call the candidate once; (outputs, call args) or a failed Evaluation."""
        s = job.settings
        try:
            with torch.no_grad():
                if runnable.destination_passing_style:
                    outs = allocate_outputs(job.definition, job.workload.axes, self.device)
                    runnable(*args, *outs)
                    result, call_args = outs, [*args, *outs]
                else:
                    result = normalize_outputs(runnable(*args), job.definition)
                    call_args = args
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except _WrongOutputs as e:
            return self._fail(Status.INCORRECT_SHAPE, "wrong_output_count", str(e), s)
        except (Exception, SystemExit, KeyboardInterrupt) as e:
            reason = {SystemExit: "system_exit", KeyboardInterrupt: "keyboard_interrupt"}.get(type(e), "exception")
            if isinstance(e, torch.cuda.OutOfMemoryError):
                reason = "out_of_memory"
            return self._fail(Status.RUNTIME_ERROR, reason, _format_exc(e), s)
        return result, call_args

    def _fail(self, status: Status, reason: str, log: str, s: EvalSettings, correctness: bool = False) -> Evaluation:
        corr = Correctness(max_absolute_error=float("nan"), max_relative_error=float("nan")) if correctness else None
        return Evaluation(status=status, reason=reason, log=bound_log(log, s.log_limit), correctness=corr,
                          environment=self.env, timestamp=now_iso())

    def _reference(self, definition: Definition):
        key = definition.name + ":" + str(hash(definition.reference))
        if key not in self._refs:
            self._refs[key] = build_reference(definition.reference, definition.name, self.workdir / "references")
        return self._refs[key]

    def _workload_state(self, job: Job) -> _WorkloadState:
        s = job.settings
        key = (job.definition.name, hash(job.definition.reference), job.workload.uuid, s.seed, s.trials, job.dataset_root)
        state = self._workloads.get(key)
        if state is not None:
            self._workloads.move_to_end(key)
            return state
        ref = self._reference(job.definition)
        inputs, refs = [], []
        for trial in range(s.trials):
            args = materialize(job.definition, job.workload, root=Path(job.dataset_root), seed=s.seed, trial=trial,
                               device=self.device, blobs=self.blobs)
            with torch.no_grad():
                out = normalize_outputs(ref(*clone_args(args)), job.definition)
            refs.append([
                torch.as_tensor(o).to(self.device, torch_dtype(spec.dtype))
                for o, spec in zip(out, job.definition.outputs.values())
            ])
            inputs.append(args)
        nbytes = sum(t.numel() * t.element_size() for group in (*inputs, *refs) for t in group if isinstance(t, torch.Tensor))
        state = _WorkloadState(inputs=inputs, refs=refs, nbytes=nbytes)
        self._workloads[key] = state
        while len(self._workloads) > 1 and sum(w.nbytes for w in self._workloads.values()) > self._cache_bytes:
            self._workloads.popitem(last=False)
        return state

    def _reference_latency(self, job: Job, state: _WorkloadState) -> LatencyStats:
        if state.ref_stats is None:
            s = job.settings
            ref = self._reference(job.definition)
            arg_sets = [clone_args(a) for a in state.inputs]
            with torch.no_grad():
                timing = time_calls(ref, arg_sets, warmup=s.warmup, iterations=s.iterations, device=self.device,
                                    flush_l2=s.flush_l2, sync_device=s.sync_device)
            state.ref_stats = LatencyStats.of(timing.samples_ms)
        return state.ref_stats


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the storages behind two tensors overlap."""
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))
