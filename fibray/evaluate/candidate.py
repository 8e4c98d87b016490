"""The candidate side of an evaluation: build, call the candidate on inputs in its job's region,
time it, re-check it.

This module runs in the process that executes untrusted code, so nothing it says is a fact a
verdict rests on: the candidate reads its inputs from, and writes (or this module copies) its
outputs into, memory the supervisor owns (fibray.evaluate.memory), and the supervisor verifies
inputs, guard bytes and outputs there. What this side reports can only fail the candidate
(an exception, a wrong kind of output, an output that aliases an input), never pass it.
"""

from __future__ import annotations

import errno
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from fibray.compile import BuildCache, BuildError, DeviceRequired, Runnable, bind, format_raised, raised_type
from fibray.check import collect_draws, draw_plan
from fibray.evaluate.inputs import allocate_outputs, materialize, torch_dtype
from fibray.evaluate.memory import InputChanges, JobMemory, Layout, LocalRegion, Region, args_of, outputs_of, plan_layout
from fibray.evaluate.phases import Phases
from fibray.schema.reasons import Reason
from fibray.schema import Definition, EvaluationStatus, Job, SafetensorsInput
from fibray.timing import time_calls

_copy = torch.Tensor.copy_
_storage = torch.Tensor.untyped_storage
_storage_ptr = torch.UntypedStorage.data_ptr
_storage_nbytes = torch.UntypedStorage.nbytes
_sync = torch.cuda.synchronize
_isinstance = isinstance
_type = type
_change_inputs = InputChanges.apply
_Tensor = torch.Tensor


FAILING_STATUSES = frozenset(s.value for s in EvaluationStatus if s is not EvaluationStatus.PASSED)
"""What an executor may say of its candidate: it can fail itself, never pass itself."""
REASONS = frozenset(r.value for r in Reason)


class CandidateFailure(BaseModel):
    """The candidate raised or misbehaved in a way its own process can tell (it can only fail itself).
    Validated again wherever it arrives (an unpickled instance is not checked as it is rebuilt)."""

    model_config = ConfigDict(revalidate_instances="always")
    status: str
    reason: str
    log: str

    @field_validator("status", "reason")
    @classmethod
    def _allowed(cls, v: str, info: ValidationInfo) -> str:
        allowed, what = (FAILING_STATUSES, "a failing status") if info.field_name == "status" else (REASONS, "a reason")
        if v not in allowed:
            raise ValueError(f"not {what}: {v[:40]!r}")
        return v


class TrialOutput(BaseModel):
    """What one call left besides its outputs (which are in the job's region)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    failure: Optional[CandidateFailure] = None
    draws: Optional[torch.Tensor] = None
    """[n, batch] first outputs of repeated calls, for checkers that judge many draws (sampling)."""


class TimeResult(BaseModel):
    """A timing's samples as the executor took them, or why the timed calls failed."""

    samples_ms: list[float] = []
    mode: str = "wall_clock"
    """wall_clock | stream_events | device_sync, +adaptive (see fibray.timing)."""
    sync_overhead_ms: float = 0.0
    called: list[int] = []
    """Indices of the timed calls made, in order (an adaptive timing stops early; its device-wide
    pass numbers on from the planned count). The supervisor replays the input changes of exactly
    these calls and judges what they left: a false list fails the job."""
    failure: Optional[CandidateFailure] = None


class TimingPlan(BaseModel):
    """What the supervisor decides about a timing before it starts: calls per input set, and how many
    timed calls (both passes: calls_after_warmup) it plans. The secret seed of the change each timed
    call makes to its set first (fibray.evaluate.memory.InputChanges) comes only with the timing
    request itself, new for each attempt: no candidate code runs between the seeds' arrival and the
    supervisor's clock, and a timing run again changes its inputs in a way the first did not show."""

    iterations: int
    calls: int


WARM_PATH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The input and output types whose job-path operations an executor runs once as it starts (warm_job_path)."""


def warm_job_path(device: torch.device) -> None:
    """Run once, on a small region of this process's own, what a job makes this side do around a
    candidate's calls: its input sets' changes (flip masks, the random pool, the XOR) for every
    WARM_PATH_DTYPES input, and the copy of a returned result into its buffers. On a GPU the first use
    of each of those operations in a process loads its module (CUDA's lazy loading) and grows the
    caching allocator: here, as the executor starts, rather than in its first job's timing. Raises
    RuntimeError if a change left a floating-point input as it was (nothing is timed here: nobody
    would have seen it otherwise)."""
    sets = [[torch.randn(64, device=device).to(dt) for dt in WARM_PATH_DTYPES]
            + [torch.arange(8, device=device, dtype=torch.int32)] for _ in range(2)]
    specs = [(dt, (64,)) for dt in WARM_PATH_DTYPES]
    layout = plan_layout("local", str(device), sets, specs, 1, False, 1, False)
    region = LocalRegion(layout.size, device)
    mem = JobMemory(region, layout, device)
    for i, values in enumerate(sets):
        mem.write_inputs(i, values)
    changes = InputChanges.of_layout(layout, region)
    for seed, change in enumerate(changes, start=1):
        change.apply(seed)
        change.apply(seed + 7)
    for k in (layout.scratch, *layout.timed):
        for dst, src in zip(outputs_of(region, layout.outputs[k]), args_of(region, layout.inputs[0])):
            _copy(dst, src)
    if device.type == "cuda":
        _sync(device)
    for s, values in enumerate(sets):
        for was, now in zip(values, args_of(region, layout.inputs[s])):
            if was.is_floating_point() and torch.equal(was, now):
                raise RuntimeError(f"the job path's warm-up: input set {s}'s {was.dtype} input did not change")


def _failure(status: str, reason: str, log: str) -> TrialOutput:
    return TrialOutput(failure=CandidateFailure(status=status, reason=reason, log=log))


@dataclass
class _Drawn:
    """One private call's outputs, for the draws of a sampling checker."""

    outputs: list[Any]
    failure: Optional[CandidateFailure] = None


@dataclass
class _Plan:
    runnable: Runnable
    arg_sets: list[list[Any]]
    iterations: int
    calls: int
    changes: list[InputChanges]
    """One per input set."""
    seeds: list[int]
    """Set by each timing request."""
    outs: list[list[torch.Tensor]]
    snaps: list[list[torch.Tensor]]


class _TimedCallFailed(Exception):
    def __init__(self, failure: CandidateFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""A write past the executor's scratch (fibray.workers.process.launch) or a file-size limit."""


def classify_exception(e: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception a candidate raised; an exception that cannot even be looked
    at (its attributes or message raise) is a plain RUNTIME_ERROR exception."""
    try:
        return _classify(e)
    except BaseException:  # noqa: BLE001 - a candidate's exception can raise anything when looked at
        return "RUNTIME_ERROR", Reason.EXCEPTION


def _text(e: BaseException) -> str:
    try:
        text = str(e)
        return text if type(text) is str else ""
    except BaseException:  # noqa: BLE001
        return ""


def _classify(e: BaseException) -> tuple[str, str]:
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
    if any(_isinstance(x, OSError) and getattr(x, "errno", None) in _FULL for x in chain):
        return "RUNTIME_ERROR", Reason.SCRATCH_FULL
    names = {raised_type(x).rpartition(".")[2] for x in chain}
    text = " ".join(_text(x) for x in chain).lower()
    if "CompilationError" in names or _raised_in_triton_frontend(chain):
        return "COMPILE_ERROR", Reason.TRITON_COMPILE_ERROR
    if "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text:
        return "RUNTIME_ERROR", Reason.OUT_OF_MEMORY
    if "illegal memory access" in text or "misaligned address" in text:
        return "RUNTIME_ERROR", Reason.ILLEGAL_MEMORY_ACCESS
    if "device-side assert triggered" in text:  # not torch's hint on every CUDA error ("...device-side assertions")
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






def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = _storage(a), _storage(b)
    a0, b0 = _storage_ptr(sa), _storage_ptr(sb)
    return a0 < b0 + _storage_nbytes(sb) and b0 < a0 + _storage_nbytes(sa)


def _placed(definition: Definition, args: list[Any], outputs: list[Any], dsts: list[torch.Tensor]) -> Optional[CandidateFailure]:
    """Copy a value-returning call's outputs into the supervisor's buffers, after checking each is a
    plain tensor of the declared shape, dtype and device that shares no memory with an input."""
    for name, o, dst in zip(definition.outputs, outputs, dsts):
        if not _isinstance(o, _Tensor):
            return CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.NOT_A_TENSOR,
                                    log=f"output {name!r}: got {_type(o).__name__}, expected a tensor")
        if _type(o) is not _Tensor:
            return CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.NOT_A_PLAIN_TENSOR,
                                    log=f"output {name!r} is a {_type(o).__name__}, not a plain torch.Tensor")
        if tuple(o.shape) != tuple(dst.shape):
            return CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.WRONG_SHAPE,
                                    log=f"output {name!r}: shape {tuple(o.shape)}, expected {tuple(dst.shape)}")
        if o.dtype != dst.dtype:
            return CandidateFailure(status="INCORRECT_DTYPE", reason=Reason.WRONG_DTYPE,
                                    log=f"output {name!r}: dtype {o.dtype}, expected {dst.dtype}")
        if o.device != dst.device and not (o.dim() == 0 and o.device.type == "cpu"):
            return CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.WRONG_DEVICE,
                                    log=f"output {name!r} is on {o.device}, expected {dst.device}")
        if o.numel() and any(_isinstance(a, _Tensor) and a.numel() and _overlaps(o, a) for a in args):
            return CandidateFailure(status="INCORRECT_NUMERICAL", reason=Reason.OUTPUT_ALIASES_INPUT,
                                    log=f"output {name!r} shares memory with an input")
        _copy(dst, o)
    return None


class CandidateRunner:
    """Runs one candidate's calls in this process on views of its job's region; reports failures, not verdicts."""

    def __init__(self, workdir: Path, device: torch.device) -> None:
        self.device = device
        self.builds = BuildCache(Path(workdir) / "builds")
        self._regions: dict[str, tuple[Layout, Region]] = {}
        self._plans: dict[str, _Plan] = {}
        self.clock = Phases()
        """Seconds in the call itself and the copies after it, since the caller last took them."""

    def build(self, job: Job) -> Optional[BuildError]:
        try:
            self.builds.get(job.solution)
            return None
        except BuildError as e:
            return e

    def attach(self, job: Job, layout: Layout, region: Region) -> None:
        """The job's region, mapped in this process (the supervisor filled it)."""
        self._regions[job.job_id] = (layout, region)

    def _views(self, job: Job, s: int, k: int) -> tuple[list[Any], list[torch.Tensor]]:
        layout, region = self._regions[job.job_id]
        return args_of(region, layout.inputs[s]), outputs_of(region, layout.outputs[k])

    def call(self, runnable: Runnable, job: Job, args: list[Any], outs: list[torch.Tensor]) -> TrialOutput:
        """Call the candidate once; its outputs end in `outs` (the supervisor's buffers)."""
        clock = self.clock
        try:
            with clock("executor_call"), torch.no_grad():
                result = runnable(*args, *outs) if runnable.destination_passing_style else runnable(*args)
                if self.device.type == "cuda":
                    _sync(self.device)
            if not runnable.destination_passing_style:
                with clock("executor_verify"):
                    failure = _placed(job.definition, args, normalize_outputs(result, job.definition), outs)
                    if self.device.type == "cuda":
                        _sync(self.device)
                if failure is not None:
                    return TrialOutput(failure=failure)
        except WrongOutputs as e:
            return _failure("INCORRECT_SHAPE", Reason.WRONG_OUTPUT_COUNT, str(e))
        except BaseException as e:  # the candidate may raise anything, SystemExit included
            status, reason = classify_exception(e)
            return _failure(status, reason, format_raised(e))
        return TrialOutput()

    def _private_call(self, runnable: Runnable, job: Job, args: list[Any], axes: dict[str, int]) -> _Drawn:
        """A call on inputs this side made (the tiled draws of a sampling checker), outputs kept here."""
        try:
            with torch.no_grad():
                if runnable.destination_passing_style:
                    outs = allocate_outputs(job.definition, axes, self.device)
                    runnable(*args, *outs)
                else:
                    outs = normalize_outputs(runnable(*args), job.definition)
                if self.device.type == "cuda":
                    _sync(self.device)
            return _Drawn(outputs=list(outs))
        except WrongOutputs as e:
            return _Drawn([], CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.WRONG_OUTPUT_COUNT, log=str(e)))
        except BaseException as e:
            status, reason = classify_exception(e)
            return _Drawn([], CandidateFailure(status=status, reason=reason, log=format_raised(e)))

    def warm(self, job: Job) -> Optional[CandidateFailure]:
        """One call, judged by nobody, on inputs this side draws (a seed of its own, never the job's), so
        that the candidate's first-call costs (Triton's JIT, a library's handles) fall before its job is
        sent, while other jobs run: its trials then start warm. Nothing of it is kept. A workload whose
        inputs come from files is not warmed (None: nothing to say)."""
        if any(isinstance(src, SafetensorsInput) for src in job.workload.inputs.values()):
            return None
        runnable = bind(self.builds.get(job.solution), job.definition)  # a BuildError is the reply's
        args = materialize(job.definition, job.workload, root=Path(job.dataset_root), seed=secrets.randbits(62),
                           trial=0, device=self.device, key="warm")
        return self._private_call(runnable, job, args, job.workload.axes).failure

    def trial(self, job: Job, trial: int) -> TrialOutput:
        """One call on trial `trial`'s input set, into its output set."""
        try:
            runnable = bind(self.builds.get(job.solution), job.definition)
        except BuildError as e:
            return _failure("COMPILE_ERROR", e.reason, str(e))
        args, outs = self._views(job, trial, trial)
        out = self.call(runnable, job, args, outs)
        plan = draw_plan(job.definition, args)
        if out.failure is None and plan is not None:  # a stochastic output is judged over many calls
            drawn = collect_draws(job.definition, plan, args, job.workload.axes,
                                  lambda a, ax: self._private_call(runnable, job, a, ax))
            if not _isinstance(drawn, torch.Tensor):
                return TrialOutput(failure=drawn.failure)
            out.draws = drawn
        return out

    def prepare_time(self, job: Job, timing: TimingPlan) -> None:
        """Views for every timed call (its input set, the columns to change, its own output buffers),
        made while the GPU is shared so that the exclusive section holds only the calls. It returns
        with its GPU work done: none of it may still run when another lane's timing starts."""
        layout, region = self._regions[job.job_id]
        runnable = bind(self.builds.get(job.solution), job.definition)
        calls = timing.calls
        with self.clock("executor_changes"):  # its share of the timing's preparation, by part
            changes = InputChanges.of_layout(layout, region)
        with self.clock("executor_views"):
            arg_sets = [args_of(region, row) for row in layout.inputs]
            outs = [outputs_of(region, layout.outputs[k]) for k in layout.timed]
            snaps = [outputs_of(region, layout.outputs[k]) for k in layout.snapshots]
            if runnable.destination_passing_style:
                scratch = outputs_of(region, layout.outputs[layout.scratch])
                arg_sets = [[*a, *scratch] for a in arg_sets]
        self._plans[job.job_id] = _Plan(runnable, arg_sets, timing.iterations, calls, changes, [], outs, snaps)
        if self.device.type == "cuda":
            with self.clock("executor_sync"):
                _sync(self.device)

    def time(self, job: Job, seeds: list[int], step: Any = None, end_only: bool = False) -> TimeResult:
        """Time the candidate: before timed call i (untimed) its input set changes (InputChanges, from
        `seeds[i]`, one per planned call, sent with this request) and its own output buffers go in
        place; as call i+1 is prepared, call i's outputs are copied where the supervisor reads them (a
        value-returning call's result; a DPS call's buffers into their snapshot, on a CPU), so that
        what the supervisor judges is what existed at the end mark. `step`: the supervisor clocks every
        timed call (a CPU timing: fibray.timing.steps); it then changes the inputs and takes a DPS call's
        snapshot itself, between the steps (fibray.evaluate.memory.SupervisorSteps), and sends no seeds.
        `end_only`: `step` makes only its end step, once every call is over and handed over (and the device
        synchronised): the supervisor copies the outputs it judges then (a GPU timing)."""
        plan = self._plans[job.job_id]  # kept: a timing the supervisor doubts is run again
        end_step, step = (step, None) if end_only else (None, step)
        if step is None and len(seeds) != plan.calls:
            raise ValueError(f"a timing request carries {len(seeds)} seeds for {plan.calls} planned calls")
        plan.seeds = list(seeds)
        s, dps, k = job.settings, plan.runnable.destination_passing_style, len(plan.outs)
        n_in, n_sets = len(job.definition.inputs), len(plan.arg_sets)
        last: list[Any] = [None]
        called: list[int] = []

        def store(i: int) -> None:
            b = i % k
            if dps:
                if plan.snaps and step is None:
                    for src, dst in zip(plan.outs[b], plan.snaps[b]):
                        _copy(dst, src)
                return
            try:
                failure = _placed(job.definition, plan.arg_sets[i % n_sets], normalize_outputs(last[0], job.definition),
                                  plan.outs[b])
            except WrongOutputs as e:
                failure = CandidateFailure(status="INCORRECT_SHAPE", reason=Reason.WRONG_OUTPUT_COUNT, log=str(e))
            last[0] = None
            if failure is not None:
                raise _TimedCallFailed(failure)

        def before_each(i: int) -> None:
            if called:
                store(called[-1])
            called.append(i)
            if step is None:
                _change_inputs(plan.changes[i % n_sets], plan.seeds[i])
            if dps:
                plan.arg_sets[i % n_sets][n_in:] = plan.outs[i % k]

        def keep(*args: Any) -> None:
            last[0] = plan.runnable(*args)

        def after_last() -> None:
            if called:
                store(called[-1])

        try:
            with self.clock("executor_timer"), torch.no_grad():
                timing = time_calls(plan.runnable if dps else keep, plan.arg_sets, warmup=s.warmup,
                                    iterations=plan.iterations, device=self.device, flush_l2=s.flush_l2,
                                    sync_device=s.sync_device, before_each=before_each,
                                    adaptive=s.timing == "adaptive", step=step, after_last=after_last)
                if self.device.type == "cuda":
                    _sync(self.device)
            if end_step is not None:
                end_step.end()
        except _TimedCallFailed as e:
            return TimeResult(failure=e.failure)
        return TimeResult(samples_ms=timing.samples_ms, mode=timing.mode, sync_overhead_ms=timing.sync_overhead_ms,
                          called=called)

    def recheck(self, job: Job) -> TrialOutput:
        """A call on the first input set after the supervisor wrote new values into it in place:
        a candidate that caches by buffer address or a weak fingerprint returns a stale answer."""
        runnable = bind(self.builds.get(job.solution), job.definition)
        layout, _ = self._regions[job.job_id]
        args, outs = self._views(job, 0, layout.recheck)
        return self.call(runnable, job, args, outs)

    def finish(self, job: Job) -> None:
        """Drop what was kept for this job (the region is unmapped by whoever mapped it)."""
        self._plans.pop(job.job_id, None)
        self._regions.pop(job.job_id, None)
