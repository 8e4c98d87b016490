"""The candidate side of an evaluation: build, call on each trial's inputs, time, re-check.

This module runs in the process that executes untrusted code. It never sees a reference
output and never decides a verdict: it returns what the candidate produced (outputs, its
inputs after the call, guard-byte and aliasing facts) for the judge to check elsewhere.
Functions it relies on are captured at import, before any candidate code can patch them.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from fibray.compile import BuildCache, BuildError, DeviceRequired, Runnable, bind
from fibray.check import collect_draws, draw_plan
from fibray.evaluate.inputs import FP8_DTYPES, BlobCache, job_inputs, poison_, torch_dtype
from fibray.schema import Definition, Job
from fibray.evaluate.phases import Phases
from fibray.timing import Timing, time_calls
from fibray.timing.timer import calls_after_warmup
from fibray.schema.reasons import Reason

_equal = torch.equal
_clone = torch.Tensor.clone
_storage = torch.Tensor.untyped_storage
_storage_ptr = torch.UntypedStorage.data_ptr
_storage_nbytes = torch.UntypedStorage.nbytes
_sync = torch.cuda.synchronize
_foreach_add = torch._foreach_add_
_isinstance = isinstance
_GUARD_BYTES = 4096
_GUARD_PATTERN = 0xA5
_TIMING_BUDGET_BYTES = 1 << 30  # distinct input sets kept for timing: at most this many bytes...
_TIMING_MAX_SETS = 16           # ...and this many sets; revisited sets are perturbed before each call


@dataclass
class CandidateFailure:
    """The candidate raised or misbehaved in a way its own process can tell."""

    status: str
    reason: str
    log: str


@dataclass
class TrialOutput:
    """What one call produced, for the judge."""

    outputs: list[Any] = field(default_factory=list)
    failure: Optional[CandidateFailure] = None
    draws: Optional[torch.Tensor] = None
    """[n, batch] first outputs of repeated calls, for checkers that judge many draws (sampling)."""


@dataclass
class _TimingPlan:
    runnable: Runnable
    arg_sets: list[list[Any]]
    iterations: int
    bumps: list[list[tuple[list[torch.Tensor], Any]]]
    """Per timed call: groups of one-element views of the call's inputs and what to add to them."""


def _bumps(arg_sets: list[list[Any]], calls: int) -> list[list[tuple[list[torch.Tensor], Any]]]:
    """For timed call i (on set i % n): element 0 and element (i * 7919) mod size of each of the
    set's floating-point inputs, grouped by dtype so that one fused add per group changes them.
    fp8 has no arithmetic in torch: its values change through their bytes (+1 in the lowest bits)."""
    flats = [[a.view(-1) if a.dtype not in FP8_DTYPES else a.view(-1).view(torch.uint8)
              for a in args if _isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()]
             for args in arg_sets]
    plan = []
    for i in range(calls):
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for flat in flats[i % len(arg_sets)]:
            k = (i * 7919) % flat.numel()
            groups.setdefault(flat.dtype, []).extend((flat.narrow(0, 0, 1),) if k == 0 else
                                                     (flat.narrow(0, 0, 1), flat.narrow(0, k, 1)))
        plan.append([(views, 1 if dtype == torch.uint8 else 1.0) for dtype, views in groups.items()])
    return plan


def classify_exception(e: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception a candidate raised."""
    if _isinstance(e, SystemExit):
        return "RUNTIME_ERROR", Reason.SYSTEM_EXIT
    if _isinstance(e, KeyboardInterrupt):
        return "RUNTIME_ERROR", Reason.KEYBOARD_INTERRUPT
    if _isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):
        return "RUNTIME_ERROR", Reason.OUT_OF_MEMORY
    if _isinstance(e, DeviceRequired):
        return "RUNTIME_ERROR", Reason.DEVICE_REQUIRED
    chain, cur = [], e
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    names = {type(x).__name__ for x in chain}
    text = " ".join(str(x) for x in chain).lower()
    if "CompilationError" in names or _raised_in_triton_frontend(chain):
        return "COMPILE_ERROR", Reason.TRITON_COMPILE_ERROR
    if "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text:
        return "RUNTIME_ERROR", Reason.OUT_OF_MEMORY
    if "illegal memory access" in text or "misaligned address" in text:
        return "RUNTIME_ERROR", Reason.ILLEGAL_MEMORY_ACCESS
    if "device-side assert" in text:
        return "RUNTIME_ERROR", Reason.DEVICE_ASSERT
    if "cuda error" in text or "acceleratorerror" in text.replace(" ", ""):
        return "RUNTIME_ERROR", Reason.CUDA_ERROR
    return "RUNTIME_ERROR", Reason.EXCEPTION


def _raised_in_triton_frontend(chain: list[BaseException]) -> bool:
    """A Triton semantic error (raised inside triton.language while tracing the kernel)."""
    for exc in chain:
        tb = exc.__traceback__
        last = None
        while tb is not None:
            last = tb.tb_frame.f_code.co_filename
            tb = tb.tb_next
        if last and "/triton/language/" in last and "InterpreterError" in {type(x).__name__ for x in chain}:
            return True
    return False



def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = _storage(a), _storage(b)
    a0, b0 = _storage_ptr(sa), _storage_ptr(sb)
    return a0 < b0 + _storage_nbytes(sb) and b0 < a0 + _storage_nbytes(sa)


class _Guarded:
    """Destination buffers with guard bytes on both sides and a poisoned (NaN/max) body."""

    def __init__(self, definition: Definition, axes: dict[str, int], device: torch.device) -> None:
        self.buffers: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        for spec in definition.outputs.values():
            dtype = torch_dtype(spec.dtype)
            shape = definition.shape_of(spec, axes) or ()
            numel = math.prod(shape)
            g = _GUARD_BYTES // torch.empty((), dtype=dtype).element_size()
            buf = torch.empty(numel + 2 * g, dtype=dtype, device=device)
            buf.view(torch.uint8).fill_(_GUARD_PATTERN)
            self.buffers.append(buf)
            self.outputs.append(poison_(buf[g:g + numel].view(shape)))

    def intact(self) -> bool:
        for buf, out in zip(self.buffers, self.outputs):
            raw = buf.view(torch.uint8)
            g = _GUARD_BYTES
            expected = torch.full((g,), _GUARD_PATTERN, dtype=torch.uint8, device=buf.device)
            if not (_equal(raw[:g], expected) and _equal(raw[raw.numel() - g:], expected)):
                return False
        return True


def normalize_outputs(result: Any, definition: Definition) -> list[Any]:
    """Turn a value-returning result (tensor, tuple, list, dict, scalar) into outputs in order."""
    names = list(definition.outputs)
    if _isinstance(result, dict):
        missing = [n for n in names if n not in result]
        if missing:
            raise WrongOutputs(f"returned dict lacks outputs {missing}")
        return [result[n] for n in names]
    if _isinstance(result, (tuple, list)):
        if len(result) != len(names):
            raise WrongOutputs(f"returned {len(result)} values, definition has {len(names)} outputs {names}")
        return list(result)
    if len(names) != 1:
        raise WrongOutputs(f"returned one value, definition has {len(names)} outputs {names}")
    if _isinstance(result, (bool, int, float)):
        return [torch.tensor(result, dtype=torch_dtype(definition.outputs[names[0]].dtype))]
    return [result]


class WrongOutputs(Exception):
    """A value-returning candidate returned the wrong number or kind of outputs."""


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


class CandidateRunner:
    """Runs one candidate's calls in this process and reports facts, not verdicts."""

    def __init__(self, workdir: Path, device: torch.device) -> None:
        self.device = device
        self.builds = BuildCache(Path(workdir) / "builds")
        self.blobs = BlobCache()
        self._sets: dict[str, list[list[Any]]] = {}
        self._plans: dict[str, _TimingPlan] = {}
        self.clock = Phases()
        """Seconds in inputs, the call itself and the checks of it, since the caller last took them."""

    def build(self, job: Job) -> Optional[BuildError]:
        try:
            self.builds.get(job.solution)
            return None
        except BuildError as e:
            return e

    def _inputs(self, job: Job, trial: int) -> list[Any]:
        return job_inputs(job, trial, self.device, self.blobs)

    def call(self, runnable: Runnable, job: Job, args: list[Any], axes: Optional[dict[str, int]] = None) -> TrialOutput:
        """Call the candidate once on args (kept alive by the caller). Inputs are compared with
        a copy taken before the call here, with functions captured at import: sending them back
        to the judge would cost a device-to-host round trip of every input on every call."""
        clock = self.clock
        with clock("executor_verify"):
            before = [(i, _clone(a)) for i, a in enumerate(args) if _isinstance(a, torch.Tensor)]
        try:
            with clock("executor_call"), torch.no_grad():
                if runnable.destination_passing_style:
                    guarded = _Guarded(job.definition, axes or job.workload.axes, self.device)
                    runnable(*args, *guarded.outputs)
                    outputs = guarded.outputs
                else:
                    guarded = None
                    outputs = normalize_outputs(runnable(*args), job.definition)
                if self.device.type == "cuda":
                    _sync(self.device)
        except WrongOutputs as e:
            return TrialOutput(failure=CandidateFailure("INCORRECT_SHAPE", Reason.WRONG_OUTPUT_COUNT, str(e)))
        except BaseException as e:  # the candidate may raise anything, SystemExit included
            status, reason = classify_exception(e)
            return TrialOutput(failure=CandidateFailure(status, reason, _format_exc(e)))
        with clock("executor_verify"):
            return self._verify(job, args, outputs, guarded, before)

    def _verify(self, job: Job, args: list[Any], outputs: list[Any], guarded: Optional[_Guarded],
                before: list[tuple[int, torch.Tensor]]) -> TrialOutput:
        """Facts about a call that returned: guard bytes intact, no output aliasing an input, inputs unchanged."""
        if guarded is not None and not guarded.intact():
            return TrialOutput(failure=CandidateFailure("INCORRECT_NUMERICAL", Reason.OUT_OF_BOUNDS_WRITE,
                                                        "bytes around an output buffer were overwritten"))
        names = list(job.definition.outputs)
        for name, out in zip(names, outputs):
            if _isinstance(out, torch.Tensor) and out.numel() and any(
                _isinstance(a, torch.Tensor) and a.numel() and _overlaps(out, a) for a in args
            ):
                return TrialOutput(failure=CandidateFailure("INCORRECT_NUMERICAL", Reason.OUTPUT_ALIASES_INPUT,
                                                            f"output {name!r} shares memory with an input"))
        inputs = list(job.definition.inputs)
        for i, copy in before:
            after = args[i]
            if not _isinstance(after, torch.Tensor) or after.shape != copy.shape or not _equal(after, copy):
                return TrialOutput(failure=CandidateFailure("INCORRECT_NUMERICAL", Reason.MUTATED_INPUTS,
                                                            f"input {inputs[i]!r} was modified by the call"))
        return TrialOutput(outputs=list(outputs))

    def trial(self, job: Job, trial: int) -> TrialOutput:
        """Fresh inputs for this trial (kept for timing), one call."""
        try:
            runnable = bind(self.builds.get(job.solution), job.definition)
        except BuildError as e:
            return TrialOutput(failure=CandidateFailure("COMPILE_ERROR", e.reason, str(e)))
        with self.clock("executor_inputs"):
            args = self._inputs(job, trial)
        self._sets.setdefault(job.job_id, []).append(args)
        out = self.call(runnable, job, args)
        plan = draw_plan(job.definition, args)
        if out.failure is None and plan is not None:  # a stochastic output is judged over many calls
            drawn = collect_draws(job.definition, plan, args, job.workload.axes,
                                  lambda a, ax: self.call(runnable, job, a, ax))
            if not _isinstance(drawn, torch.Tensor):
                return drawn
            out.draws = drawn
        return out

    def prepare_time(self, job: Job) -> None:
        """Everything timing needs that is not the timed calls (further input sets, output buffers,
        the values to change between calls), made while the GPU is shared so that the exclusive
        section holds only the calls themselves. It returns with its GPU work done, like a trial
        call: none of it may still run when another lane's timing starts."""
        self._plans[job.job_id] = self._timing_plan(job)
        if self.device.type == "cuda":
            _sync(self.device)

    def _timing_plan(self, job: Job) -> _TimingPlan:
        runnable = bind(self.builds.get(job.solution), job.definition)
        s = job.settings
        sets = self._sets.get(job.job_id) or [self._inputs(job, 0)]
        per_set = sum(a.numel() * a.element_size() for a in sets[0] if _isinstance(a, torch.Tensor)) or 1
        extra = min(s.iterations * len(sets), _TIMING_MAX_SETS, _TIMING_BUDGET_BYTES // per_set) - len(sets)
        base = s.trials + 1  # trial indices past the checked ones and the re-check
        arg_sets = [list(a) for a in sets] + [self._inputs(job, base + i) for i in range(max(0, extra))]
        iterations = max(1, -(-s.iterations * len(sets) // len(arg_sets)))
        bumps = _bumps(arg_sets, calls_after_warmup(iterations, len(arg_sets), self.device, s.sync_device))
        if runnable.destination_passing_style:
            outs = [_Guarded(job.definition, job.workload.axes, self.device).outputs for _ in arg_sets]
            arg_sets = [[*a, *o] for a, o in zip(arg_sets, outs)]
        return _TimingPlan(runnable, arg_sets, iterations, bumps)

    def time(self, job: Job) -> Timing:
        """Time the candidate over rotating input sets. Every set was seen before (in the trials
        or the warm-up) or is revisited, so each timed call first changes a few values of every
        floating-point input: no call sees inputs it has seen."""
        plan = self._plans.pop(job.job_id, None) or self._timing_plan(job)
        s, bumps = job.settings, plan.bumps

        def before_each(i: int) -> None:
            for views, one in bumps[i]:
                _foreach_add(views, one)

        with torch.no_grad():
            return time_calls(plan.runnable, plan.arg_sets, warmup=s.warmup, iterations=plan.iterations,
                              device=self.device, flush_l2=s.flush_l2, sync_device=s.sync_device, before_each=before_each,
                              adaptive=s.timing == "adaptive")

    def recheck(self, job: Job) -> TrialOutput:
        """Write a fresh trial's values into the first input buffers in place and call again:
        a candidate that caches by buffer address or a weak fingerprint returns a stale answer."""
        runnable = bind(self.builds.get(job.solution), job.definition)
        sets = self._sets.get(job.job_id)
        with self.clock("executor_inputs"):
            fresh = self._inputs(job, job.settings.trials)
            if sets:
                args = sets[0]
                for i, (old, new) in enumerate(zip(args, fresh)):
                    if _isinstance(old, torch.Tensor):
                        old.copy_(new)
                    else:
                        args[i] = new
        return self.call(runnable, job, args if sets else fresh)

    def finish(self, job: Job) -> None:
        """Drop what was kept for this job."""
        self._sets.pop(job.job_id, None)
        self._plans.pop(job.job_id, None)
