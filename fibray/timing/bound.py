"""The supervisor's lower bound on a candidate's reported latency: its own clock around a timing.

A timing request makes at most `max_calls` calls of the candidate; each costs at least the
latency the executor reports plus a per-call overhead (L2 flush, events, input changes, the
device-wide pass's synchronise) that a slot calibrates once on an honest copy kernel sent
through the same executor path. A report whose calls, at its own median, cannot fill the wall
the supervisor observed is a lie about latency. Runs only where candidate code never runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol

from fibray.schema import Definition, EvalSettings, Job, Solution, Workload
from fibray.schema.reasons import Reason
from fibray.timing.timer import Timing, device_wide_calls

BOUND_FACTOR = 2.0
"""How many times the wall a report explains (calls x (median + per-call overhead) + fixed
overhead) the observed wall may be before the report breaks the bound. An honest timing is
explained to within its tail (mean over median) and the calibration's noise; a report 20x
short on a kernel that outlasts its per-call overhead is 5-10x off."""
BOUND_SLACK_S = {"cpu": 0.05, "cuda": 0.01}
"""Seconds of wall a report may leave unexplained on top of BOUND_FACTOR, per device type:
scheduler hiccups (a CI host with many jobs per core; a GPU host's executor). A broken bound is
tried BOUND_ATTEMPTS times before it is a verdict, so a hiccup or two never is. With the
H200's ~35 us per call (flush, events), BOUND_LAUNCH_S and 175 calls, a 20x lie is caught on
kernels from about 0.3 ms; shorter ones are left to the roofline floor and to the checks of timed calls."""
BOUND_LAUNCH_S = {"cpu": 0.0, "cuda": 100e-6}
"""Host time per call a report may leave unexplained, per device type, beyond the calibration
kernel's: fibray's GPU timer queues calls behind a delay sized from the candidate's launch cost,
so the wall of an honest launch-bound candidate (a few torch ops per call, each a launch of a few
us) is its host time, not its GPU median; seen on the H200 as honest torch rmsnorm and
fused_add_rmsnorm candidates judged timing_below_observed. On a CPU slot the clock is the
executor's CPU time and the candidate's host time is its latency: no allowance. With this
allowance a 20x lie is caught on GPU kernels from about 0.3 ms."""
HOST_BOUND_SHARE = 0.5
"""On a GPU slot, the share of a broken window's wall that the executor's process spent on a CPU
(the kernel's process CPU-time clock, every thread) from which the window is host-bound. There the
wall cannot tell a lie from an honest candidate whose calls are many small launches (seen on the
H200: a correct side-stream candidate of ~160 torch ops a call, 0.35 ms of GPU time and ~2.6 ms of
host time a call, judged timing_below_observed). Such a timing is kept at the latency the
supervisor's clock shows (host_bound_timing: never below it, whatever the report says), so no
report can gain from it; a broken window with an idle executor (it waited, asleep, for work it
hid or for a timer it slowed) stays a verdict. On a CPU slot the clock is already the executor's
own time and a broken bound is always a verdict."""
SAMPLE_CAP = 4.0
"""On a CPU slot, the most medians of wall one sample explains. An honest tail (a call preempted or
forking on a loaded host) is explained up to it; work moved into a few calls is not: a candidate
that computes every timed call's answer in its first one and copies them in the rest reports the
median of its copies, and the sum of its samples would explain the wall that work took."""
STEP_FACTOR = 2.0
"""On a stepped CPU timing, how many times its own median (plus STEP_SLACK_MS) the executor's report
must reach of the lower quartile of the readings the supervisor took around its calls (less the
calibrated step_ms): the readings are CPU time between two blocked system calls, so a report 20x
short fails it on calls of tens of microseconds, where the bound on the whole request needs tens of
milliseconds. The lower quartile, not the median: a reading now and then carries CPU time of other
threads of the executor (honest fp16 torch gemms of two timed calls, read at 3x their report in one
call of two, were judged lies); a lie is in every reading."""
STEP_SLACK_MS = 0.05
"""Milliseconds a stepped call's reading may exceed STEP_FACTOR times the report's median: calls that
do almost nothing (3 us by their report) read 26 us over the calibrated stepping cost in three calls
of four, under two busy lanes in CI on a two-core virtual machine (waking another process costs
more there than at the calibration). A broken step check over STEP_RETRY_BELOW calls or more is a
verdict at once: it is the lower quartile of every call, which no hiccup of the host moves (the
bound on the whole request, and the check of the CPU after the calls spread over them, are tried
again)."""
STEP_RETRY_BELOW = 8
"""A stepped timing of fewer calls than this is timed again (BOUND_ATTEMPTS) before its broken step
check is a verdict: its lower quartile is one of a few readings, and one late reading moves it. A
reading ends when the supervisor finds the executor blocked again; a supervisor late to look (its own
wait for a core beside a busy neighbour) lengthens the reading of a call whose main thread slept
(multi-threaded): an honest torch bf16 gemm of one timed call, reported at 17.5 ms, read 117 ms, and an
honest Triton top-p sampler likewise, in about one run in five of tests/test_llm_sweep.py (1/0/1 timing,
two CPU slots on two cores). A lie breaks every attempt."""
BETWEEN_SLACK_MS = 0.05
"""Milliseconds of the executor's CPU between two stepped calls, beyond what the calibration allows,
that count for nothing: under load the steps' own system calls cost more than at the calibration (an
honest 1 ms call's neighbour, two busy loops on a two-core host, read 39 us over it; the lazy offender
in CI, 28 us). Work moved between calls is caught from about 0.1 ms a call (with STEP_SLACK_MS)."""
REPLY_SLACK_MS = 0.15
"""Milliseconds of the executor's CPU from its end step until its reply is in, beyond the least the
calibration saw (Overhead.reply_ms), that count for nothing: the reply's own work (the report, its
pickling, the send) varies by ~0.1 ms on a loaded host. Beyond it the CPU is the calls': a last call's
hand-over moved past the end step, or work deferred there."""
STEP_SWITCHES = 2
"""Voluntary context switches a stepped call adds to the executor's main thread (it blocks for the
supervisor's b"b" and b"g")."""
BOUND_ATTEMPTS = 3
"""Timing requests made before a broken bound is a verdict. A lie breaks every one of them; an
honest kernel beside a busy neighbour (two lanes of a two-core CI host) broke two in a row."""
MAX_EXTRA_SETS = 16
"""Most input sets a timing keeps beyond the trials (fibray.evaluate.candidate._TIMING_MAX_SETS):
a timing makes fewer than iterations x trials + this many stream-timed calls."""
CALIBRATION_ITERATIONS = (16, 128)
"""Iterations of the two calibration timings: their difference gives the per-call overhead."""
CALIBRATION_REPEATS = 3
"""Timings at each calibration point, the least kept. With one, a hiccup of a loaded host in the
short one (seen under two busy rivals on a two-core host) made the fixed overhead a tenth of a
second, and a candidate reporting 20x short passed on that slot."""
_clock = time.perf_counter


class BoundBroken(Exception):
    """A timing report the supervisor's observation contradicts; `reason` is its verdict's reason.
    `retry`: a host's hiccup could explain it (one window's reading), so it is timed again first."""

    def __init__(self, reason: str, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.reason, self.message, self.retry = reason, message, retry


@dataclass(frozen=True)
class Overhead:
    """What a timing request costs the supervisor's clock beyond the calls' reported latencies."""

    fixed_s: float
    """Per request (channel round trip, plan, final synchronise), seconds, >= 0."""
    per_call_s: float
    """Per call (flush, events, input changes, device-wide synchronise), seconds, >= 0, on the
    calibration kernel's few bytes."""
    quiet_switches: Optional[int] = None
    """The most voluntary context switches the executor's main thread made in an honest timing
    request of the calibration (Window.switches); None where its stopwatch counts none."""
    step_ms: Optional[float] = None
    """On a stepped CPU timing (fibray.timing.steps), what the supervisor's reading around a call adds
    to the executor's own sample of it (two system calls), ms: the median over the calibration's
    calls. None where calls were not stepped."""
    per_byte_s: float = 0.0
    """Per call and byte of its inputs and outputs, seconds, >= 0: what the work between calls (the
    input change, the copy of the outputs where the supervisor reads them) adds to the window as a
    call's buffers grow. On a CPU that work outweighed an honest rmsnorm's own time, and was judged a
    lie (timing_below_observed)."""
    between_ms: Optional[float] = None
    """On a stepped CPU timing, the executor's CPU time between two DPS calls (it only steps: the
    supervisor changes the inputs and takes the snapshots), ms: the median over the calibration's
    calls. None where calls were not stepped."""
    store_ms: float = 0.0
    """What a value-returning call's copy of its result adds to between_ms, ms, on a few bytes..."""
    store_byte_ms: float = 0.0
    """...and per byte of the result beyond them, ms."""
    reply_ms: Optional[float] = None
    """On a stepped CPU timing, the least CPU time the executor spent from its end step until its reply
    was in, ms, over the calibration's timings. None where calls were not stepped."""

    def between_allowed_ms(self, returned_bytes: Optional[int]) -> float:
        """The executor's CPU time between two stepped calls that their readings do not count (the
        steps, and a value-returning call's copy of its `returned_bytes`; None: a DPS call), ms."""
        allowed = self.between_ms or 0.0
        if returned_bytes is not None:
            allowed += self.store_ms + BYTES_MARGIN * self.store_byte_ms * returned_bytes
        return allowed


@dataclass(frozen=True)
class Window:
    """What a Stopwatch saw of one timing request."""

    wall_s: float
    """The wall around it (on a CPU slot, less the host's run-queue waits: fibray.workers.cpu_clock)."""
    cpu_s: Optional[float] = None
    """The executor's CPU seconds in it (None: not measured)."""
    switches: Optional[int] = None
    """The voluntary context switches of the executor's main thread in it: each sleep or block it made
    (None: not counted)."""

    def less(self, supervisor_s: float) -> "Window":
        """This window without `supervisor_s` seconds of the supervisor's own work between the steps of a
        stepped timing (Timing.supervisor_s): the executor was blocked then, and on a loaded host that
        work (a dense input change, a snapshot, its clock readings) waited for a core, in the wall."""
        return replace(self, wall_s=max(0.0, self.wall_s - supervisor_s)) if supervisor_s > 0 else self

    def reading(self, quiet: Optional[int], steps: int = 0) -> float:
        """The seconds the bound holds against a report: the wall, or the lesser of it and the CPU time
        where the executor slept no more than an honest request (`quiet` switches, and STEP_SWITCHES for
        each of `steps` stepped calls) makes it sleep."""
        if (quiet is not None and self.switches is not None and self.cpu_s is not None
                and self.switches <= quiet + STEP_SWITCHES * steps):
            return min(self.wall_s, self.cpu_s)
        return self.wall_s

    def __str__(self) -> str:
        cpu = "" if self.cpu_s is None else f", {self.cpu_s * 1e3:.1f} ms of executor CPU"
        switches = "" if self.cpu_s is None else f", {'?' if self.switches is None else self.switches} voluntary switches"
        return f"window: {self.wall_s * 1e3:.1f} ms of wall{cpu}{switches}"


class Stopwatch(Protocol):
    """The supervisor's measure of one timing request: `start()` before it, `stop()` after."""

    def start(self) -> None: ...
    def stop(self) -> Window: ...


class WallStopwatch:
    """The wall (time.perf_counter) around the request: a GPU slot's window, which holds the GPU alone."""

    def start(self) -> None:
        self._t0 = _clock()

    def stop(self) -> Window:
        return Window(_clock() - self._t0)


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def max_calls(s: EvalSettings, device_type: str) -> int:
    """The most calls a timing request makes: warm-up, stream-timed, device-wide."""
    timed = s.iterations * s.trials + max(s.trials, MAX_EXTRA_SETS)
    wide = device_wide_calls(timed) if device_type == "cuda" and s.sync_device else 0
    return s.warmup + timed + wide


def _launch_s(device_type: str) -> float:
    return BOUND_LAUNCH_S.get(device_type, BOUND_LAUNCH_S["cpu"])


def calls_held(samples: list, s: EvalSettings, device_type: str) -> int:
    """The calls a report is held to: on a CPU slot the warm-up and one a sample (the CPU timer
    times each call it makes; a report that leaves calls out only tightens its own bound, and one
    that adds some is capped at max_calls); on a GPU slot, whose passes make calls that have no
    sample of their own, max_calls."""
    if device_type == "cuda":
        return max_calls(s, device_type)
    return min(max_calls(s, device_type), s.warmup + len(samples))


def per_call_s(overhead: Overhead, device_type: str, nbytes: int, margin: float) -> float:
    """What a call with `nbytes` of inputs and outputs adds to a timing's wall beyond its latency: the
    calibrated per-call cost, the calibrated per-byte cost (`margin`: BYTES_MARGIN where it may
    explain a wall, 1 where it is taken out of one), the launch allowance."""
    return overhead.per_call_s + margin * overhead.per_byte_s * max(0, nbytes) + _launch_s(device_type)


def explained_s(overhead: Overhead, s: EvalSettings, samples: list[float], device_type: str, nbytes: int = 0) -> float:
    """The longest wall a timing reported as `samples` can honestly take, before the margin. On a
    GPU slot, max_calls calls at the report's median. On a CPU slot, the samples themselves, each up
    to SAMPLE_CAP medians (an honest report's tail is in its wall too: a call that forks, on a loaded
    host, reported a 10 ms median and took 32 ms a call), and the warm-up at their median, over
    calls_held calls: holding a CPU report to max_calls at its median let a 20x lie (11 calls of at
    most 27) pass under load. `nbytes`: a call's inputs and outputs (per_call_s)."""
    median_ms = _median(samples)
    calls = calls_held(samples, s, device_type)
    fixed = overhead.fixed_s + calls * per_call_s(overhead, device_type, nbytes, BYTES_MARGIN)
    if device_type == "cuda":
        return fixed + calls * median_ms / 1e3
    return fixed + (sum(min(v, SAMPLE_CAP * median_ms) for v in samples) + (calls - len(samples)) * median_ms) / 1e3


def check_report(timing: Any, wall_s: float, s: EvalSettings, overhead: Overhead, device_type: str,
                 nbytes: int = 0, returned_bytes: Optional[int] = None) -> None:
    """Raise BoundBroken when a timing report is malformed or below what the wall shows (`nbytes`:
    a call's inputs and outputs; `returned_bytes`: Layout.returned_bytes)."""
    samples = getattr(timing, "samples_ms", None)
    if (not isinstance(timing, Timing) or not isinstance(samples, list) or not samples
            or len(samples) > max_calls(s, device_type)
            or not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in samples)):
        raise BoundBroken(Reason.BAD_TIMING_REPORT, "the executor's timing report is not a list of finite, non-negative "
                                               f"latencies of at most {max_calls(s, device_type)} calls")
    median_ms = _median(samples)
    _check_steps(timing, samples, overhead, returned_bytes)
    explained = explained_s(overhead, s, samples, device_type, nbytes)
    slack = BOUND_SLACK_S.get(device_type, BOUND_SLACK_S["cpu"])
    allowed = BOUND_FACTOR * explained + slack
    if wall_s > allowed:
        raise BoundBroken(Reason.TIMING_BELOW_OBSERVED, (
            f"reported median {median_ms:.4g} ms (mean {sum(samples) / len(samples):.4g} ms) over "
            f"{calls_held(samples, s, device_type)} calls explains {explained * 1e3:.1f} ms of wall (overhead "
            f"{overhead.fixed_s * 1e3:.2f} ms + {per_call_s(overhead, device_type, nbytes, BYTES_MARGIN) * 1e6:.1f} us/call for "
            f"{nbytes} bytes of inputs and outputs, launch included); the supervisor observed "
            f"{wall_s * 1e3:.1f} ms (allowed {allowed * 1e3:.1f} ms: x{BOUND_FACTOR} + {slack * 1e3:.0f} ms)"))


def _check_steps(timing: Timing, samples: list[float], overhead: Overhead, returned_bytes: Optional[int] = None) -> None:
    """A stepped timing's report against the supervisor's reading around each of its calls, each with
    the executor's CPU time after it (until the next call, or the end step), beyond what stepping and a
    value-returning call's copy of its result take (Overhead.between_allowed_ms), and the last with the
    CPU from the end step to the reply beyond an honest reply's (Overhead.reply_ms): work a candidate
    moves out of its calls, into code of its process that runs between them or after them, is the
    calls' work. Then all of that CPU spread over every call: work held back and done at once, after
    the last call or after any one, is one reading among many, which the lower quartile would pass."""
    observed = timing.observed_ms
    if observed is None or overhead.step_ms is None:
        return
    n = len(observed)
    if n != len(samples):
        raise BoundBroken(Reason.BAD_TIMING_REPORT, f"the executor reported {len(samples)} timed calls; the "
                                                    f"supervisor clocked {n}")
    extra = [0.0] * n
    if timing.between_ms is not None and len(timing.between_ms) == n and overhead.between_ms is not None:
        allowed = overhead.between_allowed_ms(returned_bytes)
        extra = [max(0.0, b - allowed - BETWEEN_SLACK_MS) for b in timing.between_ms]
    if timing.reply_ms is not None and overhead.reply_ms is not None:
        extra[-1] += max(0.0, timing.reply_ms - overhead.reply_ms - REPLY_SLACK_MS)
    median_ms = _median(samples)
    limit_ms = median_ms * STEP_FACTOR + STEP_SLACK_MS
    calls = [max(0.0, v - overhead.step_ms) for v in observed]
    seen_ms, moved_ms = sorted((v + e, e) for v, e in zip(calls, extra))[n // 4]
    held_ms = sum(extra) / n
    spread_ms = sorted(calls)[n // 4] + held_ms
    allowance = (f"(less {overhead.step_ms * 1e3:.1f} us of stepping; allowed x{STEP_FACTOR} + "
                 f"{STEP_SLACK_MS * 1e3:.0f} us)")
    if limit_ms < seen_ms:
        moved = f", {moved_ms:.4g} ms of it the executor's CPU after calls beyond their hand-overs" if moved_ms else ""
        raise BoundBroken(Reason.TIMING_BELOW_OBSERVED, (
            f"reported median {median_ms:.4g} ms a call; the supervisor observed at least {seen_ms:.4g} ms around "
            f"three in four of the {n} timed calls on its own clock{moved} {allowance}"),
            retry=n < STEP_RETRY_BELOW)
    if limit_ms < spread_ms:
        raise BoundBroken(Reason.TIMING_BELOW_OBSERVED, (
            f"reported median {median_ms:.4g} ms a call; the supervisor observed at least {spread_ms:.4g} ms a call "
            f"over the {n} timed calls on its own clock, {held_ms:.4g} ms of it the executor's CPU after its calls "
            f"beyond their hand-overs and its reply, spread over them {allowance}"))


def host_bound_timing(timing: Timing, wall_s: float, s: EvalSettings, overhead: Overhead, device_type: str,
                      nbytes: int = 0) -> Timing:
    """`timing` moved up to the per-call latency the supervisor's `wall_s` shows (its calls and
    overheads taken out; the report's spread kept), mode "<mode>+host_bound"."""
    per_call_ms = max(0.0, (wall_s - overhead.fixed_s) / max_calls(s, device_type)
                      - per_call_s(overhead, device_type, nbytes, 1.0)) * 1e3
    median_ms = _median(timing.samples_ms)
    samples = ([v * per_call_ms / median_ms for v in timing.samples_ms] if median_ms > 0
               else [per_call_ms] * len(timing.samples_ms))
    return Timing(samples, f"{timing.mode}+host_bound", timing.sync_overhead_ms, timing.queued)


def bounded_time(time_once: Callable[[], Timing], s: EvalSettings, overhead: Optional[Overhead],
                 device_type: str, prepare: Optional[Callable[[], None]] = None,
                 stopwatch: Optional[Stopwatch] = None, busy: Optional[Callable[[], float]] = None,
                 nbytes: int = 0, returned_bytes: Optional[int] = None) -> Timing:
    """Time through `time_once` under the supervisor's `stopwatch` (the kind the overhead was
    calibrated with: fibray.workers.cpu_clock.ExecutorStopwatch on a CPU slot, else the wall); a
    broken bound is retried (a hiccup of the host is not a verdict), prepared again by `prepare` so
    that the retry's window sees the calls alone, and raised after BOUND_ATTEMPTS, unless on a GPU
    slot every attempt kept the executor's CPU (`busy`, its CPU seconds) busy for HOST_BOUND_SHARE of
    the wall: then the timing at the supervisor's latency (host_bound_timing). `nbytes`: a call's
    inputs and outputs (per_call_s); `returned_bytes`: Layout.returned_bytes. Without an overhead, no bound."""
    watch = stopwatch or WallStopwatch()
    walls: list[float] = []
    shares: list[float] = []
    for attempt in range(BOUND_ATTEMPTS):
        if attempt and prepare is not None:
            prepare()
        b0 = busy() if busy is not None else 0.0
        watch.start()
        timing = time_once()
        window = watch.stop().less(getattr(timing, "supervisor_s", 0.0))
        if overhead is None:
            return timing
        wall = window.reading(overhead.quiet_switches, len(timing.observed_ms or ()))
        try:
            check_report(timing, wall, s, overhead, device_type, nbytes, returned_bytes)
            return timing
        except BoundBroken as e:
            if e.reason != Reason.TIMING_BELOW_OBSERVED:
                raise
            if not e.retry:  # a quantile over many calls: no hiccup of the host moves it
                raise BoundBroken(e.reason, f"{e.message}; {window}") from None
            walls.append(wall)
            shares.append((busy() - b0) / wall if busy is not None and wall > 0 else 0.0)
            if attempt == BOUND_ATTEMPTS - 1:
                if device_type == "cuda" and min(shares) >= HOST_BOUND_SHARE:
                    return host_bound_timing(timing, min(walls), s, overhead, device_type, nbytes)
                raise BoundBroken(e.reason, f"{e.message}; last {window}") from None
    raise AssertionError("unreachable")


# -- calibration -------------------------------------------------------------------------------
class TimingSide(Protocol):
    """What calibration needs of a candidate side: run_job's calls."""

    def build(self, job: Job) -> Any: ...
    def prepare_time(self, job: Job) -> None: ...
    def time(self, job: Job) -> Timing: ...


_CALIBRATION_N = 256
CALIBRATION_BIG_N = 1 << 19
"""Elements (float32) of the calibration copy whose per-call overhead, against the small one's,
gives the overhead per byte of a call's inputs and outputs (2 MiB each way)..."""
CALIBRATION_BIG_ITERATIONS = 8
"""...timed over this many calls (as many input sets of its own: 16 MiB)."""
BYTES_MARGIN = 1.5
"""How many times the calibrated per-byte overhead a call may add: calls whose buffers outgrow the
host's caches cost more per byte than the calibration's 2 MiB."""


def _copy_bytes(n: int) -> int:
    """Bytes of inputs and outputs of one call of the calibration copy of `n` elements."""
    return 2 * 4 * n


def calibration_job(s: EvalSettings, iterations: int, n: int = _CALIBRATION_N, dps: bool = True) -> Job:
    """An honest, known-cost job (a copy of `n` float32, 1 KiB by default) with the timing settings of `s`;
    `dps`: into the output buffer it is given, else returning a new tensor."""
    tag = "" if n == _CALIBRATION_N else f"_{n}"
    d = Definition.model_validate({
        "name": f"fibray_timing_calibration{tag}", "op_type": "copy", "axes": {"n": {"type": "const", "value": n}},
        "inputs": {"x": {"shape": ["n"], "dtype": "float32"}}, "outputs": {"y": {"shape": ["n"], "dtype": "float32"}},
        "reference": "def run(x):\n    return x.clone()\n"})
    w = Workload.model_validate({"uuid": f"fibray-timing-calibration{tag}", "axes": {},
                                 "inputs": {"x": {"type": "random"}}})
    sol = Solution.model_validate({
        "name": "fibray_timing_calibration_copy" if dps else "fibray_timing_calibration_clone", "definition": d.name,
        "author": "fibray",
        "spec": {"language": "python", "target_hardware": ["cuda", "cpu"], "entry_point": "main.py::run",
                 "destination_passing_style": dps},
        "sources": [{"path": "main.py", "content": "def run(x, y):\n    y.copy_(x)\n" if dps
                     else "def run(x):\n    return x.clone()\n"}]})
    settings = s.model_copy(update={"iterations": iterations, "trials": 1, "timing": "fixed"})
    return Job(job_id=f"fibray-timing-calibration{tag}{'' if dps else '-vr'}-{iterations}", sweep="_calibration",
               definition=d, workload=w,
               solution=sol, settings=settings, dataset_root=".")


def _calls_made(s: EvalSettings, device_type: str) -> int:
    """Exactly the calls a calibration timing makes (one trial set, tiny inputs: min(iterations, 16) sets)."""
    sets = min(s.iterations, MAX_EXTRA_SETS)
    timed = -(-s.iterations // sets) * sets
    return s.warmup + timed + (device_wide_calls(timed) if device_type == "cuda" and s.sync_device else 0)


def calibrate(side: TimingSide, s: EvalSettings, device_type: str, finish: Callable[[Job], None],
              stopwatch: Optional[Stopwatch] = None) -> Overhead:
    """Fit fixed, per-call and per-byte overhead from honest timings of a copy kernel through `side`
    (which must be pristine: no candidate has run in it), on the stopwatch the bound will read: the
    least of CALIBRATION_REPEATS timings at each of two iteration counts of a 1 KiB copy, and at the
    first of them of a CALIBRATION_BIG_N copy (a host's hiccup only ever adds, and an overhead it
    inflated would loosen every bound of the slot). On a CPU the big copy returns its result, and a
    small one that does is timed too: a stepped timing's allowance for that copy, between calls
    (Overhead.between_allowed_ms), is fitted on them."""
    watch = stopwatch or WallStopwatch()
    seen: list[list[tuple[int, Window, float, int]]] = []  # calls, window, median (s), calls stepped
    step_ms: list[float] = []
    reply_ms: list[float] = []  # the executor's CPU from its end step to its reply, ms
    between: list[list[float]] = []  # per point: the executor's CPU between stepped calls, ms
    cpu = device_type == "cpu"
    points = [(CALIBRATION_ITERATIONS[0], _CALIBRATION_N, 1, True),  # warms up
              *((i, _CALIBRATION_N, CALIBRATION_REPEATS, True) for i in CALIBRATION_ITERATIONS),
              (CALIBRATION_BIG_ITERATIONS, CALIBRATION_BIG_N, CALIBRATION_REPEATS, not cpu),
              *([(CALIBRATION_ITERATIONS[0], _CALIBRATION_N, CALIBRATION_REPEATS, False)] if cpu else [])]
    for iterations, size, repeats, dps in points:
        job = calibration_job(s, iterations, size, dps)
        err = side.build(job)
        if err is not None:
            raise RuntimeError(f"the timing calibration kernel did not build: {err}")
        seen.append([])
        between.append([])
        for _ in range(repeats):
            side.prepare_time(job)
            watch.start()
            timing = side.time(job)
            window = watch.stop().less(timing.supervisor_s)
            median_s = _median(timing.samples_ms) / 1e3
            observed = timing.observed_ms or []
            seen[-1].append((_calls_made(job.settings, device_type), window, median_s, len(observed)))
            if observed and len(observed) == len(timing.samples_ms) and size == _CALIBRATION_N and dps:
                step_ms.append(_median([o - v for o, v in zip(observed, timing.samples_ms)]))
            between[-1].extend(timing.between_ms or [])
            if timing.reply_ms is not None:
                reply_ms.append(timing.reply_ms)
        finish(job)
    counted = [w.switches - STEP_SWITCHES * n for point in seen for _, w, _, n in point if w.switches is not None]
    quiet = max(0, max(counted)) if counted else None  # a window not counted (a slow host) is read on its wall

    def least(point: list[tuple[int, Window, float, int]]) -> tuple[int, float, float]:
        return min(((c, w.reading(quiet, n), m) for c, w, m, n in point), key=lambda p: p[1] - p[0] * p[2])

    (c1, w1, m1), (c2, w2, m2), (c3, w3, m3) = least(seen[1]), least(seen[2]), least(seen[3])
    per_call = max(0.0, (w2 - c2 * m2 - (w1 - c1 * m1)) / (c2 - c1))
    fixed = max(0.0, w1 - c1 * (m1 + per_call))
    timed3 = c3 - s.warmup  # warm-up calls change no input and copy no output
    extra = w3 - fixed - c3 * (m3 + per_call)  # the big copy's work between calls, beyond the small one's
    per_byte = max(0.0, extra / (max(1, timed3) * (_copy_bytes(CALIBRATION_BIG_N) - _copy_bytes(_CALIBRATION_N))))
    overhead = Overhead(fixed_s=fixed, per_call_s=per_call, quiet_switches=quiet, per_byte_s=per_byte,
                        step_ms=_median(step_ms) if step_ms else None, reply_ms=min(reply_ms) if reply_ms else None)
    small, big, small_returned = [*between[1], *between[2]], between[3], between[4] if cpu else []
    if not (small and big and small_returned):
        return overhead
    steps_ms = _median(small)
    store_ms = max(0.0, _median(small_returned) - steps_ms)
    store_byte_ms = max(0.0, _median(big) - steps_ms - store_ms) / (4 * (CALIBRATION_BIG_N - _CALIBRATION_N))
    return replace(overhead, between_ms=steps_ms, store_ms=store_ms, store_byte_ms=store_byte_ms)
