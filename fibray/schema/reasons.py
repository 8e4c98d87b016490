"""The one catalogue of failure reasons (the refinement of an Evaluation's status).

Every reason fibray writes is a member of `Reason`, with a one-line docstring that README's
table of reasons repeats (a test checks). A member equals its string, so stored rows are plain
strings. The groups the workers act on are defined here so that every module reads the same sets.
"""

from __future__ import annotations

import ast
import inspect
from enum import StrEnum
from functools import cache

from fibray.schema.trace import EvaluationStatus as Status

__all__ = ["FAULT_REASONS", "POISONING_REASONS", "GeneratorReason", "Reason", "Status", "describe", "is_fault",
           "quarantined"]


class Reason(StrEnum):
    """Why a job did not pass; its status (one of FlashInfer Trace's seven) says which kind of failure."""

    # -- build (COMPILE_ERROR) ---------------------------------------------------------------
    BUILD_FAILED = "build_failed"
    """The solution could not be built, for no more specific reason."""
    SYNTAX_ERROR = "syntax_error"
    """A python or triton source does not parse."""
    IMPORT_ERROR = "import_error"
    """Importing the solution's entry module raised."""
    BAD_ENTRY_POINT = "bad_entry_point"
    """`spec.entry_point` names a file of the wrong kind for the language."""
    MISSING_ENTRY_SYMBOL = "missing_entry_symbol"
    """The entry point's symbol is missing, not callable or not exported."""
    UNSUPPORTED_LANGUAGE = "unsupported_language"
    """No builder or ahead-of-time compiler exists for `spec.language`."""
    UNSUPPORTED_BINDING = "unsupported_binding"
    """`spec.binding` is one fibray cannot load (tvm-ffi, ...)."""
    BAD_SPEC = "bad_spec"
    """The spec contradicts itself (a c_abi solution that is not destination-passing)."""
    BAD_CUDA_ARCH = "bad_cuda_arch"
    """`FIBRAY_CUDA_ARCH` is not a list of compute capabilities."""
    NVCC_MISSING = "nvcc_missing"
    """A cuda source needs nvcc and none was found."""
    NVCC_ERROR = "nvcc_error"
    """nvcc rejected a cuda source."""
    CXX_ERROR = "cxx_error"
    """The host C++ compiler rejected a source."""
    LINK_ERROR = "link_error"
    """Linking the compiled objects into a library failed."""
    COMPILE_TIMEOUT = "compile_timeout"
    """A compiler did not finish within its deadline (reported, never cached)."""
    LOAD_ERROR = "load_error"
    """A built library or extension could not be loaded."""
    TRITON_COMPILE_ERROR = "triton_compile_error"
    """Triton could not compile the kernel when it was first called."""

    # -- the candidate's call (RUNTIME_ERROR) --------------------------------------------------
    EXCEPTION = "exception"
    """The candidate raised an exception of no more specific kind."""
    SYSTEM_EXIT = "system_exit"
    """The candidate called `sys.exit` (raised SystemExit)."""
    KEYBOARD_INTERRUPT = "keyboard_interrupt"
    """The candidate raised KeyboardInterrupt."""
    OUT_OF_MEMORY = "out_of_memory"
    """The candidate ran out of host or device memory."""
    SCRATCH_FULL = "scratch_full"
    """The candidate filled its writable scratch (runner.scratch_gb), or wrote a file past the host's limit."""
    DEVICE_REQUIRED = "device_required"
    """The solution needs a GPU and the job ran on a CPU."""
    ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
    """The kernel made an illegal or misaligned memory access (poisons the CUDA context)."""
    DEVICE_ASSERT = "device_assert"
    """A device-side assert fired (poisons the CUDA context)."""
    CUDA_ERROR = "cuda_error"
    """Another CUDA error (poisons the CUDA context)."""
    FAILED_DURING_TIMING = "failed_during_timing"
    """The candidate passed its trials, then raised when it was called again to be timed."""
    BAD_WORKLOAD_INPUT = "bad_workload_input"
    """The workload's inputs could not be materialised (a missing or malformed blob)."""
    LEFT_CHILD_PROCESS = "left_child_process"
    """The candidate left processes running after its job; they were killed."""
    WORK_LEFT_RUNNING = "work_left_running"
    """The executor had a thread after a call returned that it did not have once its solution was built (work left running)."""

    # -- the timing, bounded by the supervisor (RUNTIME_ERROR) --------------------------------
    TIMING_BELOW_OBSERVED = "timing_below_observed"
    """The reported latency cannot explain the wall the supervisor's clock saw around the timing."""
    BAD_TIMING_REPORT = "bad_timing_report"
    """The executor's timing report was not a list of finite, non-negative latencies of the calls made."""
    BELOW_ROOFLINE = "below_roofline"
    """The latency is below what the definition's bytes and FLOPs allow on the device's measured bandwidth and throughput."""

    # -- the answer (INCORRECT_SHAPE, INCORRECT_DTYPE, INCORRECT_NUMERICAL) -------------------
    WRONG_OUTPUT_COUNT = "wrong_output_count"
    """The call returned more or fewer outputs than the definition has."""
    NOT_A_TENSOR = "not_a_tensor"
    """An output is not a tensor."""
    NOT_A_PLAIN_TENSOR = "not_a_plain_tensor"
    """A returned output is a subclass of torch.Tensor, not a plain tensor."""
    WRONG_DEVICE = "wrong_device"
    """A returned output is on another device than the job's."""
    WRONG_SHAPE = "wrong_shape"
    """An output's shape differs from the reference's."""
    WRONG_DTYPE = "wrong_dtype"
    """An output's dtype differs from the reference's."""
    NON_FINITE_OUTPUT = "non_finite_output"
    """An output holds NaN or Inf where the reference is finite."""
    TOLERANCE_EXCEEDED = "tolerance_exceeded"
    """Elements differ from the reference by more than atol + rtol*|ref| (or the matched ratio)."""
    TVD_EXCEEDED = "tvd_exceeded"
    """A sampler's draws are further from the exact distribution (TVD) than the bound."""
    MASKED_TOKEN_SAMPLED = "masked_token_sampled"
    """A sampler drew a token outside the vocabulary or one its filter (top-k / top-p) removes."""
    OUT_OF_BOUNDS_WRITE = "out_of_bounds_write"
    """Guard bytes around an output buffer were overwritten."""
    OUTPUT_ALIASES_INPUT = "output_aliases_input"
    """An output shares memory with an input."""
    MUTATED_INPUTS = "mutated_inputs"
    """An input was modified by the call."""
    STALE_OUTPUT = "stale_output"
    """A call on new values in a reused buffer returned a wrong answer (a cached result)."""
    WRONG_WHILE_TIMED = "wrong_while_timed"
    """The outputs of a timed call, judged by the supervisor after the timing, were wrong."""
    OUTPUT_CHANGED_AFTER_RETURN = "output_changed_after_return"
    """A timed call's outputs changed after the call returned (work finished after the end mark)."""
    FAILED = "failed"
    """A check failed without naming a more specific reason."""

    # -- the executor process (TIMEOUT, RUNTIME_ERROR) -----------------------------------------
    BUILD_TIMEOUT = "build_timeout"
    """The build did not finish within `build_deadline_s`; the executor was killed."""
    RUN_TIMEOUT = "run_timeout"
    """Trials, timing and re-check did not finish within `run_deadline_s`; the executor was killed."""
    CRASHED = "crashed"
    """The executor exited (or closed its channel) in the middle of a job."""
    KILLED_BY_SIGNAL = "killed_by_signal"
    """The executor was killed by a signal (a segfault, an abort, a kill)."""
    SANDBOX_FAILED = "sandbox_failed"
    """The executor's sandbox (its network or PID namespace) could not be set up."""
    EXECUTOR_UNAVAILABLE = "executor_unavailable"
    """No executor could be started (or kept alive) for the job, e.g. spares killed as they warmed up."""
    EXECUTOR_ERROR = "executor_error"
    """The executor could not serve a request (an error outside the candidate's call)."""
    BAD_MESSAGE = "bad_message"
    """The executor's reply was not a well-formed reply (a forged or corrupt message)."""

    # -- the scheduler (RUNTIME_ERROR, TIMEOUT) -----------------------------------------------
    WORKER_LOST = "worker_lost"
    """The slot running the job was lost `runner.max_attempts` times; the job was given up."""
    QUARANTINED = "quarantined"
    """The solution faulted `runner.quarantine_after` times and was not run again."""
    SUPERVISOR_ERROR = "supervisor_error"
    """The slot's supervisor raised while it ran the job (a fibray bug or a candidate's doing); the sweep goes on."""


POISONING_REASONS = frozenset({Reason.ILLEGAL_MEMORY_ACCESS, Reason.DEVICE_ASSERT, Reason.CUDA_ERROR})
"""A fault after which the executor's CUDA context cannot be trusted."""

FAULT_REASONS = frozenset({
    Reason.BUILD_TIMEOUT, Reason.RUN_TIMEOUT, Reason.CRASHED, Reason.KILLED_BY_SIGNAL, Reason.ILLEGAL_MEMORY_ACCESS,
    Reason.DEVICE_ASSERT, Reason.CUDA_ERROR, Reason.EXECUTOR_ERROR, Reason.SANDBOX_FAILED, Reason.BAD_MESSAGE,
})
"""A fault of the candidate's process (not of its answer): the job escalates to isolation."""


def is_fault(escalated: bool, reason: object) -> bool:
    """Whether a job's result counts against its solution's process: it runs isolated from then
    on and is quarantined after `quarantine_after` such results (driver, service and slot alike)."""
    return escalated or reason in FAULT_REASONS


def quarantined(faults: int, last: Status) -> tuple[Status, Reason, str]:
    """Status, reason and log of a job not run because its solution was quarantined after
    `faults` faults, the last of status `last` (a hang stays TIMEOUT, anything else RUNTIME_ERROR)."""
    status = Status.TIMEOUT if last == Status.TIMEOUT else Status.RUNTIME_ERROR
    return status, Reason.QUARANTINED, f"solution quarantined after {faults} faults; not run"


@cache
def describe() -> dict[Reason, str]:
    """Each reason's one-line docstring, read from this module's source (attribute docstrings)."""
    tree = ast.parse(inspect.getsource(Reason))
    body = tree.body[0].body
    docs: dict[Reason, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.Assign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[Reason[node.targets[0].id]] = after.value.value
    return docs


class GeneratorReason(StrEnum):
    """Why an agent-loop round got no (or fewer) candidates from its generator (fibray.evolve): the round is
    spent and recorded in the run's round file, and the loop goes on. Not a verdict of any candidate."""

    GENERATOR_TIMEOUT = "generator_timeout"
    """The generator ran past evolve.generator.deadline_s (a shell command is killed with its process group)."""
    GENERATOR_CRASHED = "generator_crashed"
    """The command exited non-zero, or the callable raised."""
    GENERATOR_GARBAGE = "generator_garbage"
    """The output was not JSON (a list, one object, or JSONL) of solution objects."""
    INVALID_SOLUTION = "invalid_solution"
    """A returned item is not a valid Solution of the task's definition (the others still run)."""
    NO_CANDIDATES = "no_candidates"
    """The generator returned an empty list (for the search: every configuration was tried)."""
    OVER_BUDGET = "over_budget"
    """A returned item beyond the round's N (or the run's max_candidates); it is not evaluated."""
