"""The supervisor's clock bounds a candidate's reported latency: a timer rebound inside the
executor to report short times is a verdict (timing_below_observed), an honest slow kernel is not."""

from __future__ import annotations

import json
import time

import pytest

from fibray.dataset import load_dataset
from fibray.evaluate import now_iso
from fibray.schema import EvalSettings, Job, Solution
from fibray.timing import Timing
from fibray.timing.bound import BOUND_ATTEMPTS, BoundBroken, Overhead, bounded_time, check_report, max_calls
from fibray.workers.slot import GpuSlot
from fibray.workers.spec import SlotSpec
from _sweep_helpers import REPO, reachable_tmpdir

S = EvalSettings(warmup=1, iterations=5, trials=2)
OVERHEAD = Overhead(fixed_s=0.002, per_call_s=20e-6)


def test_an_honest_report_is_within_the_bound():
    calls = S.warmup + S.iterations * S.trials
    check_report(Timing([20.0] * 10, "wall_clock"), calls * 0.0201 + 0.002, S, OVERHEAD, "cpu")


def test_a_report_twenty_times_short_breaks_the_bound():
    calls = S.warmup + S.iterations * S.trials
    with pytest.raises(BoundBroken) as e:
        check_report(Timing([1.0] * 10, "wall_clock"), calls * 0.0201 + 0.002, S, OVERHEAD, "cpu")
    assert e.value.reason == "timing_below_observed"


def test_a_cpu_report_is_held_to_the_calls_it_times():
    """11 calls of 10 ms reported at 1.5 ms: within what 27 calls (max_calls) would explain, not
    within what the 11 the report times do."""
    calls = S.warmup + S.iterations * S.trials
    wall = calls * 0.010 + 0.002
    assert max_calls(S, "cpu") > 2 * calls
    with pytest.raises(BoundBroken) as e:
        check_report(Timing([1.5] * (calls - S.warmup), "wall_clock"), wall, S, OVERHEAD, "cpu")
    assert e.value.reason == "timing_below_observed" and f"over {calls} calls" in e.value.message


def test_an_honest_cpu_report_with_a_long_tail_is_within_the_bound():
    """Calls that fork, on a loaded host: a 10 ms median, two calls of 120 ms; the wall is what they
    report. A bound at the median alone (11 x 10 ms, x2 + 50 ms) would call it a lie."""
    samples = [10.0] * 8 + [120.0] * 2
    wall = (sum(samples) + 10.0) / 1e3 + OVERHEAD.fixed_s + 11 * OVERHEAD.per_call_s
    assert wall > 2 * 11 * 0.010 + 0.05
    check_report(Timing(samples, "wall_clock"), wall, S, OVERHEAD, "cpu")


def test_work_moved_into_one_cpu_sample_is_not_explained_by_it():
    """Every call's answer computed in the first timed call (10 x 10 ms), copies in the rest (0.5 ms):
    the sum of the samples is the wall, the median a copy. A sample explains SAMPLE_CAP medians at most."""
    samples = [100.5] + [0.5] * 9
    wall = (sum(samples) + 0.5) / 1e3 + OVERHEAD.fixed_s + 11 * OVERHEAD.per_call_s
    assert wall <= 2 * (sum(samples) + 0.5) / 1e3 + 0.05  # what the sum alone would explain
    with pytest.raises(BoundBroken) as e:
        check_report(Timing(samples, "wall_clock"), wall, S, OVERHEAD, "cpu")
    assert e.value.reason == "timing_below_observed"


def test_a_calls_own_bytes_explain_the_executors_work_between_calls():
    """Calls of 0.12 ms whose input changes and output copies take 0.5 ms more each (an honest
    value-returning rmsnorm on a CPU, inputs larger than its work): the calibrated per-byte overhead
    explains that work; without it the report breaks the bound, and a report 20x short still does."""
    s, nbytes = EvalSettings(warmup=10, iterations=50, trials=3), 1 << 20
    samples = [0.12] * 150
    overhead = Overhead(fixed_s=0.002, per_call_s=20e-6, per_byte_s=0.5e-3 / nbytes)
    wall = 160 * (0.12e-3 + 0.5e-3 + 20e-6) + 0.002 + 0.01  # and a hiccup
    with pytest.raises(BoundBroken):
        check_report(Timing(samples, "wall_clock"), wall, s, overhead, "cpu")
    check_report(Timing(samples, "wall_clock"), wall, s, overhead, "cpu", nbytes)
    lie_wall = 160 * (2.4e-3 + 0.5e-3 + 20e-6) + 0.002 + 0.01  # 2.4 ms calls reported at 0.12 ms
    with pytest.raises(BoundBroken):
        check_report(Timing(samples, "wall_clock"), lie_wall, s, overhead, "cpu", nbytes)


STEPPED = Overhead(fixed_s=0.002, per_call_s=20e-6, step_ms=0.005, between_ms=0.01, store_ms=0.05,
                   store_byte_ms=0.25 / 65536, reply_ms=0.08)


def _stepped(between: float, n: int = 40) -> Timing:
    """A stepped CPU report of 10 us calls that the supervisor read at 15 us, with `between` ms of the
    executor's CPU after each, and an honest reply."""
    return Timing([0.01] * n, "wall_clock", observed_ms=[0.015] * n, between_ms=[between] * n,
                  reply_ms=STEPPED.reply_ms)


def test_a_stepped_report_holds_the_executors_cpu_between_calls():
    """Calls whose work is done between them, in code of the executor's process (its handling of a
    result, rebound): each call reads as 15 us, and 0.5 ms of CPU lies before each. That CPU is the
    calls'; the stepping's own (between_ms) is not."""
    wall = 0.01  # within the bound on the whole request: the steps decide
    s = EvalSettings(warmup=10, iterations=40, trials=1)
    check_report(_stepped(0.012), wall, s, STEPPED, "cpu")
    with pytest.raises(BoundBroken) as e:
        check_report(_stepped(0.5), wall, s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and not e.value.retry
    assert "after calls" in e.value.message


def test_a_stepped_timing_of_few_calls_is_timed_again_before_its_step_check_is_a_verdict():
    """With few timed calls, the lower quartile of the readings is one of them, and one late reading (a
    supervisor that looked late at an executor whose call slept) moves it: such a timing is timed
    again, and passes once its readings agree with its report; a lie breaks every attempt. Over many
    calls a broken step check is a verdict at once (test_a_stepped_report_holds_...)."""
    s = EvalSettings(warmup=0, iterations=1, trials=1)
    late = Timing([17.5], "wall_clock", observed_ms=[117.4], between_ms=[0.0])
    with pytest.raises(BoundBroken) as e:
        check_report(late, 0.02, s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and e.value.retry
    readings = [late, Timing([17.5], "wall_clock", observed_ms=[17.6], between_ms=[0.0])]
    assert bounded_time(lambda: readings.pop(0), s, STEPPED, "cpu").samples_ms == [17.5] and not readings
    lies = [Timing([1.0], "wall_clock", observed_ms=[17.6], between_ms=[0.0]) for _ in range(BOUND_ATTEMPTS)]
    with pytest.raises(BoundBroken) as e:
        bounded_time(lambda: lies.pop(0), s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and not lies


def test_cpu_after_the_last_call_counts_spread_over_the_calls_and_is_timed_again_first():
    """Work held back while timed and done at once after the calls (or after any one of them) is one
    reading among many, which the lower quartile passes: all the executor's CPU after its calls, beyond
    their hand-overs and an honest reply, spread over the calls, is theirs. One spike of an honest
    executor's CPU breaks it too, so it is timed again first; a lie breaks every attempt."""
    s, n = EvalSettings(warmup=10, iterations=40, trials=1), 40
    honest = _stepped(0.012, n)
    check_report(honest, 0.01, s, STEPPED, "cpu")
    held = _stepped(0.012, n)
    held.between_ms[-1] = 0.5 * n  # 0.5 ms of each call's work, done after the last
    with pytest.raises(BoundBroken) as e:
        check_report(held, 0.03, s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and e.value.retry and "spread over them" in e.value.message
    held.between_ms[-1], held.between_ms[n // 2] = 0.012, 0.5 * n  # or after one call midway
    with pytest.raises(BoundBroken):
        check_report(held, 0.03, s, STEPPED, "cpu")
    past_end = _stepped(0.012, n)
    past_end.reply_ms = STEPPED.reply_ms + 0.5 * n  # or past the end step, before the reply
    with pytest.raises(BoundBroken):
        check_report(past_end, 0.03, s, STEPPED, "cpu")
    slow_reply = _stepped(0.012, n)
    slow_reply.reply_ms = STEPPED.reply_ms + 0.1  # a reply within its slack
    check_report(slow_reply, 0.01, s, STEPPED, "cpu")
    spike = _stepped(0.012, n)
    spike.between_ms[3] = 8.0  # an honest executor's hiccup once: timed again, and then it passes
    attempts = [spike, honest]
    assert bounded_time(lambda: attempts.pop(0), s, STEPPED, "cpu") is honest and not attempts
    lies = []
    for _ in range(BOUND_ATTEMPTS):
        lie = _stepped(0.012, n)
        lie.between_ms[-1] = 0.5 * n
        lies.append(lie)
    with pytest.raises(BoundBroken) as e:
        bounded_time(lambda: lies.pop(0), s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and not lies


def test_the_last_calls_hand_over_moved_past_the_end_step_counts_with_the_calls():
    """One timed call whose work is its hand-over, moved past the end step (where the supervisor reads
    its clocks once the calls are over): the executor's CPU until its reply, beyond the calibrated least
    reply and its slack, is the call's."""
    s = EvalSettings(warmup=0, iterations=1, trials=1)
    one = Timing([0.01], "wall_clock", observed_ms=[0.015], between_ms=[0.012], reply_ms=STEPPED.reply_ms + 0.05)
    check_report(one, 0.01, s, STEPPED, "cpu")
    moved = Timing([0.01], "wall_clock", observed_ms=[0.015], between_ms=[0.012], reply_ms=STEPPED.reply_ms + 0.5)
    with pytest.raises(BoundBroken) as e:
        check_report(moved, 0.01, s, STEPPED, "cpu")
    assert e.value.reason == "timing_below_observed" and e.value.retry


def test_a_value_returning_calls_copy_of_its_result_is_allowed_between_calls():
    """A value-returning call's result is copied into the region between calls (0.3 ms for 64 KiB
    here): allowed for such a call, in proportion to its bytes, and not for a DPS call, which has none."""
    wall, s = 0.01, EvalSettings(warmup=10, iterations=40, trials=1)
    check_report(_stepped(0.3), wall, s, STEPPED, "cpu", returned_bytes=65536)
    with pytest.raises(BoundBroken):
        check_report(_stepped(0.3), wall, s, STEPPED, "cpu", returned_bytes=None)
    with pytest.raises(BoundBroken):
        check_report(_stepped(0.3), wall, s, STEPPED, "cpu", returned_bytes=1024)


GPU = EvalSettings(warmup=10, iterations=50, trials=3)
H200_OVERHEAD = Overhead(fixed_s=0.22e-3, per_call_s=35e-6)  # a slot's calibration on the H200 (RESULTS.md)


def test_an_honest_launch_bound_gpu_report_is_within_the_bound():
    """fibray's GPU timer queues calls behind a delay sized from the candidate's own launch cost:
    a torch candidate of a few ops (8 us on the GPU, 150 us of host time per call) fills the wall
    with host time. Before BOUND_LAUNCH_S such honest candidates were timing_below_observed on the H200."""
    calls = max_calls(GPU, "cuda")
    wall = H200_OVERHEAD.fixed_s + calls * (150e-6 + 8e-6 + H200_OVERHEAD.per_call_s)
    check_report(Timing([0.008] * 150, "cuda_events"), wall, GPU, H200_OVERHEAD, "cuda")


def test_a_gpu_report_twenty_times_short_still_breaks_the_bound():
    calls = max_calls(GPU, "cuda")
    wall = H200_OVERHEAD.fixed_s + calls * (0.5e-3 + H200_OVERHEAD.per_call_s)  # a 0.5 ms kernel, reported 20x short
    with pytest.raises(BoundBroken) as e:
        check_report(Timing([0.025] * 150, "cuda_events"), wall, GPU, H200_OVERHEAD, "cuda")
    assert e.value.reason == "timing_below_observed" and "launch" in e.value.message


@pytest.mark.parametrize("timing", [
    Timing([], "wall_clock"), Timing([float("nan")] * 10, "wall_clock"), Timing([-1.0] * 10, "wall_clock"),
    Timing([1.0] * (max_calls(S, "cpu") + 1), "wall_clock"), [1.0] * 10,
])
def test_a_malformed_report_is_a_bad_timing_report(timing):
    with pytest.raises(BoundBroken) as e:
        check_report(timing, 0.001, S, OVERHEAD, "cpu")
    assert e.value.reason == "bad_timing_report"


def test_a_broken_bound_is_retried_before_it_is_a_verdict():
    """Host hiccups (slow first requests) are not a verdict; the last, honest, request passes."""
    import time

    waits = [0.3] * (BOUND_ATTEMPTS - 1) + [0.0]

    def once() -> Timing:
        time.sleep(waits.pop(0))
        return Timing([0.01] * 10, "wall_clock")

    assert bounded_time(once, S, OVERHEAD, "cpu").samples_ms[0] == 0.01 and not waits



def _time_honest_rmsnorm(tmp_path, side):
    """run_job of the honest torch rmsnorm on a cpu_small workload, in this process, its calls made
    through `side(runner)` (a wrapper that sees or delays them); its evaluation and phase breakdown."""
    from fibray.evaluate.phases import Phases
    from fibray.evaluate.run import Evaluator, run_job

    ev = Evaluator(tmp_path)
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=["rmsnorm_h4096_torch"], workload_set="cpu_small")
    job = _job(ds.solutions["rmsnorm_h4096_torch"])
    phases = Phases()
    try:
        return run_job(job, ev.judge, side(ev.runner), phases, overhead=OVERHEAD), phases
    finally:
        ev.runner.finish(job)


class _Through:
    """Every call of the runner it wraps, unchanged (subclasses override the ones they watch)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_attempts_the_bound_doubted_are_shown_apart_in_the_timing_phase(tmp_path):
    """A retried timing costs its attempts again: the breakdown shows them (`timing.retried`), so a
    slow timing phase can be told from one the bound kept doubting. The retry changes its inputs with
    seeds of its own, and is judged on them (what the first attempt showed is no use to it)."""
    stall = [0.3]
    sent: list[list[int]] = []

    class FirstTimingStalls(_Through):  # the host hiccups once, after the executor's timer stopped
        def time(self, job, seeds):
            sent.append(list(seeds))
            result = self.runner.time(job, seeds)
            time.sleep(stall.pop() if stall else 0.0)
            return result

    result, phases = _time_honest_rmsnorm(tmp_path, FirstTimingStalls)
    assert result.status.value == "PASSED", result.log[-300:]
    assert not stall and 0.3 <= phases["timing.retried"] < phases["timing"]
    assert len(sent) == 2 and len(sent[0]) == len(sent[1]) and not set(sent[0]) & set(sent[1])


def test_no_seed_of_a_timing_reaches_the_executor_before_its_timing_request(tmp_path):
    """The seeds of the input changes arrive with the request that times the calls, under the
    supervisor's clock: a thread of the candidate's that computed the answers from them in the gap
    after prepare_time (unclocked) would find none there."""
    prepared: list[tuple[dict, list[int]]] = []

    class Recorded(_Through):
        def prepare_time(self, job, timing):
            self.runner.prepare_time(job, timing)
            prepared.append((timing.model_dump(), list(self.runner._plans[job.job_id].seeds)))

    result, _ = _time_honest_rmsnorm(tmp_path, Recorded)
    assert result.status.value == "PASSED", result.log[-300:]
    assert prepared and all(set(plan) == {"iterations", "calls"} and not seeds for plan, seeds in prepared)


@pytest.mark.parametrize("window", ["timing", "reference_timing"])
def test_gpu_work_left_running_found_entering_a_window_is_the_jobs_verdict(tmp_path, window):
    """A slot's window that ends the job's own executor for GPU work it left running raises
    GpuWorkLeftRunning entering the window; run_job makes it the job's verdict, whichever window it was."""
    from contextlib import contextmanager

    from fibray.evaluate.phases import Phases
    from fibray.evaluate.run import Evaluator, GpuWorkLeftRunning, run_job

    class Gpu:
        @contextmanager
        def hold(self, phase, name, exclusive=False):
            if exclusive and name == window:
                raise GpuWorkLeftRunning("GPU work of the candidate's process was still running")
            with phase(name):
                yield

    ev = Evaluator(tmp_path)
    job = _job(_honest())
    try:
        result = run_job(job, ev.judge, ev.runner, Phases(), gpu=Gpu())
    finally:
        ev.runner.finish(job)
    assert (result.status.value, result.reason) == ("RUNTIME_ERROR", "work_left_running"), result.log[-300:]


def _job(sol: Solution) -> Job:
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=["rmsnorm_h4096_torch"], workload_set="cpu_small")
    d, w = ds.definitions["rmsnorm_h4096"], ds.workloads["rmsnorm_h4096"][0]
    return Job(job_id=f"bound-{sol.name}", sweep="t", definition=d, workload=w, solution=sol, settings=S,
               dataset_root=str(ds.root))


def _candidate(name: str) -> Solution:
    return Solution.model_validate(json.loads((REPO / "tests" / "candidates" / f"{name}.json").read_text()))


def _honest_twin(sol: Solution) -> Solution:
    """The offender's kernel (20 ms a call) without its rebinding."""
    src = sol.sources[0].content
    kernel = "import time\n\nimport torch\n" + src[src.index("\ndef run("):]
    raw = sol.model_dump(mode="json")
    raw["name"], raw["sources"] = "honest_slow_rmsnorm", [{"path": "main.py", "content": kernel}]
    return Solution.model_validate(raw)


@pytest.fixture(scope="module")
def slot():
    s = GpuSlot(SlotSpec("bound", workdir=str(reachable_tmpdir("fibray-bound-")), standby=True, spare_isolated=1))
    s.info()
    yield s
    s.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["timer_rebinding", "timer_rebinding_fast", "timer_clock", "hides_in_reaped_children",
                                  "works_between_calls", "works_after_its_end_step", "defers_its_work_past_its_calls"])
def test_a_rebound_timer_is_caught_by_the_supervisors_clock(slot, name):
    sol = _candidate(name)
    pid = slot.active.pid
    ev = slot.evaluate(_job(sol), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "timing_below_observed"), ev.log[-800:]
    assert ev.performance is None
    assert slot.active.pid != pid  # the executor whose timer was rebound serves nothing else


def _with_calls(job: Job, sol: Solution, iterations: int, trials: int) -> Job:
    return job.model_copy(update={"job_id": f"bound-{sol.name}-{iterations}x{trials}",
                                  "settings": EvalSettings(warmup=1, iterations=iterations, trials=trials)})


def _honest_work_twin() -> Solution:
    """The 16x float64 rmsnorm the work-moving offenders do, done in the call (about 0.2-0.6 ms here)."""
    sol = _candidate("works_between_calls")
    src = sol.sources[0].content
    kernel = ("import torch\n\n" + src[src.index("\ndef _norm("):src.index("\ndef _normalize_after_the_work(")]
              + "\ndef run(hidden_states, weight):\n    return _norm(hidden_states, weight).to(hidden_states.dtype)\n")
    raw = sol.model_dump(mode="json")
    raw["name"], raw["sources"] = "honest_float64_rmsnorm", [{"path": "main.py", "content": kernel}]
    return Solution.model_validate(raw)


@pytest.mark.slow
@pytest.mark.parametrize("calls", [(1, 1), (1, 2)])
def test_a_rebound_timer_of_few_timed_calls_is_caught_after_its_retries(slot, calls):
    """With one or two timed calls the lower quartile of the readings is the least of them: work moved
    after each call (into its hand-over; past the end step for the last; all of it after the last) is
    still the calls', and an honest twin doing the same work in its calls passes beside them."""
    for name in ("works_between_calls", "works_after_its_end_step", "defers_its_work_past_its_calls"):
        sol = _candidate(name)
        ev = slot.evaluate(_with_calls(_job(sol), sol, *calls), "persistent", now_iso()).evaluation
        assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "timing_below_observed"), (name, ev.log[-800:])
    twin = _honest_work_twin()
    ev = slot.evaluate(_with_calls(_job(twin), twin, *calls), "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("calls", [(1, 1), (5, 2), (30, 2)])
def test_work_deferred_past_the_last_call_is_caught_however_many_calls(slot, calls):
    """offender_defers_its_work_past_its_calls hands nothing over while timed and does every call's work
    after its end step: each call and the CPU after it read cheap but the last, which the lower
    quartile of many calls passes; that CPU spread over the calls is theirs. Its honest twin passes."""
    sol, twin = _candidate("defers_its_work_past_its_calls"), _honest_work_twin()
    ev = slot.evaluate(_with_calls(_job(sol), sol, *calls), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "timing_below_observed"), ev.log[-800:]
    assert "spread over them" in ev.log or calls == (1, 1), ev.log[-800:]
    ev = slot.evaluate(_with_calls(_job(twin), twin, *calls), "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("calls", [(1, 1), (5, 2), (30, 2)])
def test_work_done_after_the_timing_reply_finds_the_executor_stopped(slot, calls):
    """offender_works_after_its_reply does every timed call's work once its reply is sent, racing the
    supervisor's checks of the outputs: with its executor running on, it PASSED at 10 and 64 calls, 2-6x
    under its honest latency; stopped from its reply until the outputs were read, it still PASSED in 4
    runs of 30 beside two busy loops (a supervisor more than 3 ms late to stop it). The outputs judged are
    copied at the end step, while the executor waits: its timed calls are wrong. It runs again for its
    next request: the next job on the slot passes."""
    sol = _candidate("works_after_its_reply")
    ev = slot.evaluate(_with_calls(_job(sol), sol, *calls), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "wrong_while_timed"), ev.log[-800:]
    twin = _honest_work_twin()
    ev = slot.evaluate(_with_calls(_job(twin), twin, *calls), "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("stepped, calls", [(True, (1, 1)), (False, (1, 1))])
def test_work_done_at_once_after_the_timing_reply_is_not_judged(slot, monkeypatch, stepped, calls):
    """offender_works_after_its_reply without its pause: its work starts as soon as its reply is sent, and it
    PASSED whenever it wrote its answers before the supervisor had the reply read and the executor stopped:
    at one timed call (its work within what an honest reply may cost the executor's CPU) it PASSED in six
    runs of six stepped, and in four of four not stepped call by call (as on a GPU, where no CPU clock sees it).
    The outputs judged are copied at the end step, while the executor waits (stopped, where not stepped):
    what it writes after is never read. The GPU twin: gpu_offender_works_at_once_after_its_reply."""
    if not stepped:
        monkeypatch.setattr(slot, "_step_clock", lambda ex: None)  # as on a GPU slot: one end step, no clock
    sol = _candidate("works_after_its_reply")
    raw = sol.model_dump(mode="json")
    src = raw["sources"][0]["content"]
    assert "time.sleep(0.003)" in src
    raw["name"], raw["sources"][0]["content"] = "works_at_once_after_its_reply", src.replace("time.sleep(0.003)", "pass")
    sol = Solution.model_validate(raw)
    for attempt in range(3):
        job = _with_calls(_job(sol), sol, *calls)
        job = job.model_copy(update={"job_id": f"{job.job_id}-{stepped}-{attempt}"})
        ev = slot.evaluate(job, "persistent", now_iso()).evaluation
        assert (ev.status.value, ev.reason) in {("INCORRECT_NUMERICAL", "wrong_while_timed"),
                                                ("RUNTIME_ERROR", "timing_below_observed")}, ev.log[-800:]
    twin = _honest_work_twin()
    ev = slot.evaluate(_with_calls(_job(twin), twin, *calls).model_copy(update={"job_id": f"twin-{stepped}"}),
                       "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]


@pytest.mark.slow
@pytest.mark.parametrize("calls", [(10, 2), (30, 2)])
def test_calls_whose_buffers_are_written_again_are_judged_from_a_secret_sample(slot, monkeypatch, calls):
    """Timed outputs kept in fewer buffers than calls (here forced by a small TIMED_OUTPUT_BYTES): only the
    last call on each buffer was judged, and offender_skips_calls_nobody_judges, which reads its plan,
    did nothing on the others and PASSED at a fraction of its latency. The supervisor's own copies of a
    secret sample of every call's outputs catch it; an honest candidate, DPS or not, passes."""
    import fibray.evaluate.memory as memory

    monkeypatch.setattr(memory, "TIMED_OUTPUT_BYTES", 100_000)  # 3-6 buffers of a 4096-wide row (and guards)
    sol = _candidate("skips_calls_nobody_judges")
    ev = slot.evaluate(_with_calls(_job(sol), sol, *calls), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "wrong_while_timed"), ev.log[-800:]
    assert "secret sample of the timed calls" in ev.log
    for honest in (_honest_work_twin(), _honest("rmsnorm_h4096_triton")):
        ev = slot.evaluate(_with_calls(_job(honest), honest, *calls), "persistent", now_iso()).evaluation
        assert ev.status.value == "PASSED", (honest.name, ev.log[-800:])


@pytest.mark.slow
def test_where_no_step_copies_a_calls_outputs_every_timed_call_gets_buffers_of_its_own(slot, monkeypatch):
    """A GPU slot has no steps, so no secret sample of calls whose buffers a later call writes again
    (TimedSample); there every timed call writes buffers of its own, and a job whose calls would not fit
    them makes fewer calls (Judge.own_buffers). Shown on a CPU slot with the copies switched off, as on a
    GPU: with buffers shared, offender_skips_calls_nobody_judges PASSED at next to nothing; with buffers
    of their own it finds no call to skip and reports the latency of its work."""
    import fibray.evaluate.memory as memory

    monkeypatch.setattr(memory, "TIMED_OUTPUT_BYTES", 100_000)  # 3-6 buffers of a 4096-wide row (and guards)
    monkeypatch.setattr(memory.TimedSample, "take", lambda self, *a, **kw: None)  # as on a GPU: no copies
    sol = _candidate("skips_calls_nobody_judges")
    job = _with_calls(_job(sol), sol, 30, 2)
    shared = slot.evaluate(job, "persistent", now_iso()).evaluation
    assert shared.status.value == "PASSED", shared.log[-800:]  # the attack pays without buffers of their own
    monkeypatch.setattr(slot.judge, "own_buffers", True)
    own = slot.evaluate(job.model_copy(update={"job_id": job.job_id + "-own"}), "persistent", now_iso()).evaluation
    assert own.status.value == "PASSED", own.log[-800:]
    assert own.performance.n_samples < shared.performance.n_samples  # fewer calls, as many as have buffers
    assert own.performance.latency_ms > 5 * shared.performance.latency_ms, (own.performance, shared.performance)


@pytest.mark.slow
def test_a_timing_that_skips_its_end_step_is_a_bad_timing_report(slot):
    """An executor whose end step is rebound to hand the last call over and say nothing: the supervisor
    never read its clocks once the calls were over, so the report is not one it can hold."""
    honest = _honest()
    src = honest.sources[0].content
    raw = honest.model_dump(mode="json")
    raw["name"] = "skips_its_end_step"
    raw["sources"] = [{"path": "main.py", "content": (
        "import fibray.timing.steps as _steps\n\n\n"
        "def _no_end(self, after_last=None):\n    if after_last is not None:\n        after_last()\n\n\n"
        "_steps.StepPipe.end = _no_end\n" + src)}]
    sol = Solution.model_validate(raw)
    ev = slot.evaluate(_job(sol), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "bad_timing_report"), ev.log[-800:]
    assert "end step" in ev.log


@pytest.mark.slow
def test_an_honest_slow_kernel_passes_with_its_true_latency(slot):
    ev = slot.evaluate(_job(_honest_twin(_candidate("timer_rebinding"))), "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]
    assert ev.performance.latency_ms >= 20.0


@pytest.mark.slow
def test_an_honest_kernel_on_inputs_larger_than_its_own_work_between_calls_passes(slot):
    """An honest rmsnorm on 256 x 4096 (value-returning: each timed call's result is copied out, and
    the inputs change densely before it) was judged timing_below_observed on a CPU slot: that work of
    the executor's, in the supervisor's window and in no sample, outweighed the kernel."""
    job = _job(_honest())
    workload = job.workload.model_copy(update={"uuid": "bound-batch-256", "axes": {"batch_size": 256}})
    job = job.model_copy(update={"job_id": "bound-honest-256", "workload": workload,
                                 "settings": EvalSettings(warmup=10, iterations=50, trials=3)})
    ev = slot.evaluate(job, "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]
    overhead = next(iter(slot.overheads.values()))
    assert overhead.per_byte_s > 0, overhead


@pytest.mark.slow
def test_a_broken_bound_beside_processes_left_running_names_those_processes(slot):
    """Processes a candidate leaves running compete with its timed calls (seen in CI: the orphan
    child's interpreters, started once a call, stretched its wall past the bound); the verdict names
    the processes, the root cause, and keeps what the bound saw. A liar that leaves one fails either way."""
    sol = _candidate("timer_rebinding")
    raw = sol.model_dump(mode="json")
    raw["name"] = "liar_with_orphan"
    raw["sources"][0]["content"] = sol.sources[0].content.replace(
        "    time.sleep(0.02)",
        "    import subprocess, sys\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "    time.sleep(0.02)")
    ev = slot.evaluate(_job(Solution.model_validate(raw)), "persistent", now_iso()).evaluation
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "left_child_process"), ev.log[-800:]
    assert "process(es) running" in ev.log and "supervisor observed" in ev.log, ev.log[-800:]


def _honest(name: str = "rmsnorm_h4096_torch") -> Solution:
    return Solution.model_validate(json.loads((REPO / "solutions" / "rmsnorm" / "rmsnorm_h4096" / f"{name}.json").read_text()))


@pytest.mark.slow
def test_a_supervisor_late_to_every_reply_does_not_make_an_honest_report_a_lie(slot, monkeypatch):
    """A supervisor that reads each reply 0.2 s late (a stolen vCPU, a busy core or lock on a CI host:
    an honest offender_fp16_overflow was judged timing_below_observed in CI) leaves an honest
    candidate of ~0.1 ms a call PASSED: its executor, which never slept, is read on its CPU time."""
    import fibray.workers.remote as remote

    real = remote.answer

    def late(*args, **kwargs):
        reply = real(*args, **kwargs)
        time.sleep(0.2)
        return reply

    monkeypatch.setattr(remote, "answer", late)
    ev = slot.evaluate(_job(_honest()), "persistent", now_iso()).evaluation
    assert ev.status.value == "PASSED", ev.log[-800:]
    assert ev.performance.latency_ms < 20.0


@pytest.mark.slow
def test_a_hiccup_while_calibrating_does_not_loosen_the_bound(slot, monkeypatch):
    """A host hiccup in one calibration timing (seen under load: a fixed overhead of a tenth of a
    second, and a 20x lie PASSED on that slot) is outvoted by the repeats; the lie is still caught."""
    from fibray.schema import EvalSettings as Settings
    from fibray.timing.bound import CALIBRATION_ITERATIONS
    from fibray.workers.remote import CalibrationSide

    real, seen = CalibrationSide.time, []

    def hiccup(self, job):
        t = real(self, job)
        seen.append(job.settings.iterations)
        if seen.count(CALIBRATION_ITERATIONS[0]) == 2:  # the first short timing after the warm-up
            time.sleep(0.15)
        return t

    monkeypatch.setattr(CalibrationSide, "time", hiccup)
    monkeypatch.setattr(GpuSlot, "_stopwatch", lambda self, ex: None)  # the wall, which sees the hiccup
    saved = dict(slot.overheads)
    slot.overheads.clear()
    try:
        overhead = slot._overhead_for(Settings())
    finally:
        slot.overheads.clear()
        slot.overheads.update(saved)
    assert seen.count(CALIBRATION_ITERATIONS[0]) > 2 and overhead.fixed_s < 0.05, overhead


def test_adaptive_timing_stops_early_and_says_so_in_its_mode(monkeypatch):
    """A steady kernel (a clock that advances 0.5 ms per call: this host is too loaded for a
    steady wall clock) settles after the minimum of calls; a fixed timing makes all of them."""
    import itertools

    import torch

    import fibray.timing.timer as timer

    ticks = itertools.count(0, 250_000)  # two reads per call: 0.5 ms a call
    monkeypatch.setattr(timer, "_perf_counter_ns", lambda: next(ticks))
    x = torch.ones(64)
    fixed = timer.time_calls(lambda t: None, [[x]], warmup=1, iterations=60, device=torch.device("cpu"))
    adaptive = timer.time_calls(lambda t: None, [[x]], warmup=1, iterations=60, device=torch.device("cpu"), adaptive=True)
    assert fixed.mode == "wall_clock" and len(fixed.samples_ms) == 60
    assert adaptive.mode == "wall_clock+adaptive" and len(adaptive.samples_ms) == timer.ADAPTIVE_MIN_CALLS
    assert not timer._settled([1.0, 2.0] * 10)  # a noisy one does not settle early


def test_adaptive_timing_is_its_own_job_identity_and_row_mode(tmp_path):
    from fibray.evaluate import Evaluator

    job = _job(_honest_twin(_candidate("timer_rebinding")))
    adaptive = job.model_copy(update={"settings": job.settings.model_copy(update={"timing": "adaptive", "iterations": 40})})
    assert Job.make_id(job.definition, job.workload, job.solution, adaptive.settings) != \
        Job.make_id(job.definition, job.workload, job.solution, job.settings.model_copy(update={"iterations": 40}))
    ev = Evaluator(tmp_path).evaluate(adaptive)
    assert ev.status.value == "PASSED" and ev.performance.timing_mode == "wall_clock+adaptive", ev.log[-500:]


def _lying_window(busy: bool):
    """A timing request whose calls take 2 ms each, on a CPU (`busy`) or asleep, reported 20x short."""
    calls = max_calls(GPU, "cuda")

    def once() -> Timing:
        end = time.perf_counter() + calls * 2e-3
        while time.perf_counter() < end:
            if not busy:
                time.sleep(1e-3)
        return Timing([0.1] * 150, "device_sync")

    return once


def test_a_host_bound_gpu_window_keeps_the_latency_the_supervisor_saw():
    """A window whose executor was on a CPU all along (many small launches, or a spin on the GPU)
    cannot be judged a lie by the wall: its timing is kept at the wall's latency, never the report's."""
    timing = bounded_time(_lying_window(busy=True), GPU, H200_OVERHEAD, "cuda", busy=time.process_time)
    median = sorted(timing.samples_ms)[len(timing.samples_ms) // 2]
    assert timing.mode == "device_sync+host_bound"
    assert 1.5 < median < 4.0  # about the 2 ms a call the clock saw, not the 0.1 ms reported


def test_an_idle_executor_behind_a_broken_gpu_bound_is_a_verdict():
    with pytest.raises(BoundBroken) as e:
        bounded_time(_lying_window(busy=False), GPU, H200_OVERHEAD, "cuda", busy=time.process_time)
    assert e.value.reason == "timing_below_observed"


def test_a_busy_cpu_slot_window_is_still_a_verdict():
    """On a CPU slot the clock is the executor's own time already: no host-bound way out."""
    with pytest.raises(BoundBroken):
        bounded_time(_lying_window(busy=True), GPU, H200_OVERHEAD, "cpu", busy=time.process_time)
