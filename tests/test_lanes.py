"""Several jobs in flight on one GPU slot: their correctness work overlaps, timing never does,
a candidate's leftover processes are charged to its own job, and a sweep with lanes records
what a sweep without them does."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from fibray.evaluate import now_iso
from fibray.evaluate.phases import Phases, top_level
from fibray.store import scan
from fibray.sweep import run_sweep
from fibray.workers.gpu_lock import GpuLock
from fibray.workers.process.sandbox import SandboxPolicy
from fibray.workers.slot import GpuSlot
from fibray.workers.spec import SlotSpec
from _sweep_helpers import inline_solution, reachable_tmpdir, smoke_config
from test_slot import _jobs


class _Recorder(GpuLock):
    """The slot's GPU lock, logging who held it in which mode from when to when."""

    def __init__(self, alone=None) -> None:
        super().__init__(alone=alone)
        self.log: list[tuple[bool, float, float]] = []
        self._since: dict[int, float] = {}

    def acquire(self, exclusive: bool) -> None:
        super().acquire(exclusive)
        self._since[threading.get_ident()] = time.monotonic()

    def release(self, exclusive: bool) -> None:
        self.log.append((exclusive, self._since.pop(threading.get_ident()), time.monotonic()))
        super().release(exclusive)


def test_the_gpu_lock_shares_work_and_gives_a_waiting_timer_the_gpu_alone():
    lock = GpuLock()
    order: list[str] = []
    lock.acquire(False)
    lock.acquire(False)  # shared holders overlap
    timer = threading.Thread(target=lambda: (lock.acquire(True), order.append("timer"), lock.release(True)))
    timer.start()
    time.sleep(0.1)
    late = threading.Thread(target=lambda: (lock.acquire(False), order.append("late shared"), lock.release(False)))
    late.start()
    time.sleep(0.1)
    assert order == []  # the timer waits for the holders; new shared work waits behind the timer
    lock.release(False)
    lock.release(False)
    timer.join(5)
    late.join(5)
    assert order == ["timer", "late shared"]


def test_shared_work_settles_its_gpu_work_before_a_waiting_timer_gets_the_gpu():
    """Kernels queued under a shared hold are waited for (the slot passes a device synchronise)
    before the hold ends, so none of them still runs inside the next timed section."""
    events: list[str] = []
    lock = GpuLock(settle=lambda: (time.sleep(0.2), events.append("settled")))
    phases = Phases()
    timer = threading.Thread(target=lambda: (lock.acquire(True), events.append("timer"), lock.release(True)))
    with lock.hold(phases, "trials"):
        timer.start()
        time.sleep(0.05)
    timer.join(5)
    assert events == ["settled", "timer"]
    with lock.hold(phases, "timing", exclusive=True):  # a timed section ends synchronised by its own timer
        pass
    assert events == ["settled", "timer"]



def test_a_timed_windows_quiescing_is_its_own_part_of_the_phase():
    """What stopping the other executors costs a timed window is shown apart (`timing.quiesce`, a part
    of `timing`), so a breakdown tells the window's overhead from the timed calls."""
    from contextlib import contextmanager

    @contextmanager
    def alone(name, keep, own):
        time.sleep(0.2)  # settling and stopping the others
        yield

    lock, phases = GpuLock(alone=alone), Phases()
    with lock.hold(phases, "timing", exclusive=True):
        time.sleep(0.1)
    with lock.hold(phases, "check"):
        pass
    assert 0.2 <= phases["timing.quiesce"] < phases["timing"] and "check.quiesce" not in phases
    assert top_level(phases) == phases["timing"] + phases["check"] + phases["gpu_wait"]

_DAEMON = '''import os
import time

import torch


def run(hidden_states, weight, output):
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
    if os.fork() == 0:  # a classic daemon: fork, new session, fork again, the middle process exits
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    os.wait()
'''


@pytest.fixture(scope="module")
def lanes_slot():
    # the tickers below report to a file of the test's, so their writes are not confined to a scratch
    s = GpuSlot(SlotSpec("lanes", workdir=str(reachable_tmpdir("fibray-lanes-")), standby=True, spare_isolated=1, lanes=2,
                         sandbox=SandboxPolicy(scratch_bytes=None)))
    s.gpu = _Recorder(s._alone)
    s.info()
    yield s
    s.shutdown()


def _concurrently(slot, jobs):
    results: dict[str, object] = {}

    def one(job):
        results[job.job_id] = slot.evaluate(job, "auto", now_iso())

    threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.slow
def test_two_lanes_overlap_correctness_work_but_never_timing(lanes_slot):
    slot = lanes_slot
    assert len({e.pid for e in slot.persistent}) == 2
    jobs = [j.model_copy(update={"job_id": f"lane-{i}-{j.job_id}"}) for i in range(2) for j in _jobs()]
    results = _concurrently(slot, jobs)
    assert len(results) == len(jobs) and all(r.evaluation.status.value == "PASSED" for r in results.values())
    log = slot.gpu.log
    timed = [(a, b) for exclusive, a, b in log if exclusive]
    assert len(timed) >= len(jobs)  # each job's timing, and the reference's once per workload
    for exclusive, a, b in log:  # nothing else held the GPU while anything was being timed
        for ta, tb in timed:
            if (a, b) != (ta, tb):
                assert b <= ta or a >= tb
    assert any(w.stopped >= 1 for w in slot.quiet.windows), "no timed window stopped the other lane's executor"
    assert slot.counters["retired"] == 0


_SLOW = '''import time

import torch


def run(hidden_states, weight, output):
    time.sleep(0.3)
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
'''


@pytest.mark.slow
def test_a_daemon_left_by_one_lane_is_charged_to_its_own_job(lanes_slot):
    slot = lanes_slot
    honest, other = _jobs()[:2]
    # the honest job is still running when the daemon's job ends: only the executor that adopted
    # the daemon (not the slot, which cannot tell whose it is) can charge the right job
    results = _concurrently(slot, [honest.model_copy(update={"job_id": "honest-lane", "solution": inline_solution("slow", _SLOW)}),
                                   other.model_copy(update={"job_id": "daemon-lane", "solution": inline_solution("daemonizes", _DAEMON)})])
    assert results["daemon-lane"].evaluation.reason == "left_child_process"
    assert results["honest-lane"].evaluation.status.value == "PASSED"


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray (two logical GPUs) for the module's sweeps."""
    import ray

    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_sweep_with_two_lanes_records_what_one_lane_does(tmp_path, local_ray):
    defs = ["rmsnorm_h4096", "gemm_n128_k2048"]
    one = run_sweep(smoke_config(tmp_path / "one", dataset__definitions=defs, cluster__num_gpus=1))
    two = run_sweep(smoke_config(tmp_path / "two", dataset__definitions=defs, cluster__num_gpus=1, runner__lanes=2))
    a, b = scan(tmp_path / "one").collect(), scan(tmp_path / "two").collect()
    assert one.recorded == two.recorded == len(a) == len(b) == one.total_jobs
    assert b["job_id"].n_unique() == len(b)
    key = ["solution", "workload_uuid"]
    assert sorted(a.select(*key, "status", "reason").rows()) == sorted(b.select(*key, "status", "reason").rows())
    assert two.phases.get("gpu_wait", 0) > 0


@pytest.mark.slow
def test_a_sweep_that_readies_the_next_solutions_executor_records_what_one_without_does(tmp_path, local_ray):
    """runner.prewarm: the driver names each slot's next group, and its jobs take the executor readied for it."""
    off = run_sweep(smoke_config(tmp_path / "off", dataset__definitions=["rmsnorm_h4096"], cluster__num_gpus=1,
                                 runner__prewarm=False))
    on = run_sweep(smoke_config(tmp_path / "on", dataset__definitions=["rmsnorm_h4096"], cluster__num_gpus=1,
                                runner__prewarm=True))
    a, b = scan(tmp_path / "off").collect(), scan(tmp_path / "on").collect()
    assert off.recorded == on.recorded == len(a) == len(b) == off.total_jobs
    key = ["solution", "workload_uuid"]
    assert sorted(a.select(*key, "status", "reason").rows()) == sorted(b.select(*key, "status", "reason").rows())
    assert sum(s["prewarmed"] for s in on.slot_stats) >= 1
    assert sum(s["prewarmed"] for s in off.slot_stats) == 0


@pytest.mark.slow
def test_jobs_sent_ahead_wait_for_a_lane(lanes_slot):
    from datetime import datetime

    slot = lanes_slot
    jobs = [j.model_copy(update={"job_id": f"ahead-{i}-{j.job_id}"}) for i in range(2) for j in _jobs()]
    results = _concurrently(slot, jobs)  # 6 jobs sent at once to 2 lanes
    spans = [(datetime.fromisoformat(r.started_at), datetime.fromisoformat(r.finished_at)) for r in results.values()]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert all(r.evaluation.status.value == "PASSED" for r in results.values())
    assert peak == 2  # the lanes ran together, the rest waited for them


@pytest.mark.slow
def test_isolated_jobs_in_two_lanes_keep_each_others_fresh_executors(lanes_slot):
    # a fresh executor taken by one lane is not in the spare list while it warms up; the other
    # lane's sweep for stray processes must still know it is ours
    slot = lanes_slot
    jobs = [j.model_copy(update={"job_id": f"iso-{i}-{j.job_id}"}) for i in range(2) for j in _jobs()]
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def one(job):
        try:
            results[job.job_id] = slot.evaluate(job, "isolated", now_iso())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[0]
    assert all(r.evaluation.status.value == "PASSED" and r.isolation == "isolated" for r in results.values()), \
        [(r.evaluation.status.value, r.evaluation.reason, r.evaluation.log[:300]) for r in results.values()]


@pytest.mark.slow
def test_every_offender_gets_its_verdict_with_two_lanes(tmp_path, local_ray):
    """The fault-injection suite with two jobs in flight per slot: offenders beside honest jobs,
    each still gets its designed status and reason."""
    from fibray.schema.reasons import FAULT_REASONS
    from test_faults import EXPECTED, PROBE, _config
    from _sweep_helpers import REPO, designed_verdict, expected_verdict, meets_extra

    workdir = reachable_tmpdir("fibray-faults-lanes-")
    try:
        cfg = _config(tmp_path / "store", workdir, [str(REPO / "solutions"), str(REPO / "tests" / "candidates")])
        report = run_sweep(cfg.model_copy(update={"runner": cfg.runner.model_copy(update={"lanes": 2})}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    df = scan(tmp_path / "store").collect()
    assert len(df) == report.total_jobs == 3 * (7 + len(EXPECTED))
    for row in df.iter_rows(named=True):
        name = row["solution"]
        if name == PROBE:  # its verdict depends on the sandbox (tests/test_faults.py checks it)
            continue
        status, reason = expected_verdict(EXPECTED[name]) if name in EXPECTED else designed_verdict(name, row["definition"])
        if row["reason"] == "quarantined":
            assert reason in FAULT_REASONS and row["status"] == status, name
            continue
        assert (row["status"], row["reason"]) == (status, reason), f"{name}: {row['log'][-500:]}"
        assert meets_extra(EXPECTED.get(name, []), row["timing_mode"], row["latency_ms"]), (name, row["latency_ms"])


_TICKER = '''import time

import torch


def run(hidden_states, weight, output):
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
    end = time.time() + 0.25
    with open(TICKS, "a") as f:  # CPU work of this lane (as a JIT compile is), stamped as it goes
        while time.time() < end:
            f.write(f"{time.time()}\\n")
            f.flush()
            time.sleep(0.0005)
'''

_STOPS_ITSELF = '''import ctypes

import torch


def run(hidden_states, weight, output):
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
    open(MARK, "w").close()  # the test starts the honest lane's jobs now
    # a hung neighbour: C code that holds the GIL, so its executor's side channel can ack nothing
    # (a SIGSTOP to itself does not do: as pid 1 of its PID namespace, it ignores it)
    ctypes.PyDLL(None).sleep(15)
'''


_FORK_CHAINS = '''import os
import time

import torch

started = []


def chain(end):
    while time.time() < end:  # tick, fork, and let the parent exit: no pid lives long enough to be listed
        with open(TICKS, "a") as f:
            f.write(f"{time.time()}\\n")
        if os.fork():
            os._exit(0)


def run(hidden_states, weight, output):
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
    if not started:
        started.append(1)
        for _ in range(16):
            if os.fork() == 0:
                chain(time.time() + 6)
                os._exit(0)
    time.sleep(0.25)
'''


def _ticks_inside_windows(slot, ticker_job, honest_jobs, tmp, ticker: str = _TICKER) -> tuple[int, int, list]:
    """Run a ticking candidate beside honest jobs; (ticks, ticks inside windows that stopped the ticker, results)."""
    ticks = tmp / "ticks"
    ticks.touch()
    ticks.chmod(0o666)
    tmp.chmod(0o777)
    source = ticker.replace("TICKS", repr(str(ticks)))
    first = len(slot.quiet.windows)
    jobs = [ticker_job.model_copy(update={"solution": inline_solution("ticker", source)}), *honest_jobs]
    own: set[int] = set()  # the slot knows an executor by the pid it started (the relay, in a PID namespace)
    take = slot._take_persistent

    def recording(solution: str):
        ex = take(solution)
        if solution == jobs[0].solution.hash:
            own.add(ex.pid)
        return ex

    slot._take_persistent = recording
    try:  # the honest lane's jobs start once the ticker ticks, so that their timings overlap its work
        results: dict = {}
        ticking = threading.Thread(target=lambda: results.update(_concurrently(slot, jobs[:1])))
        ticking.start()
        t0 = time.monotonic()
        while not ticks.stat().st_size and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        results.update(_concurrently(slot, jobs[1:]))
        ticking.join(120)
    finally:
        del slot._take_persistent
    stamps = [line.split() for line in ticks.read_text().splitlines() if line.strip()]
    assert own, "the ticker never got an executor"
    times = [float(t) for (t,) in stamps]
    windows = [w for w in list(slot.quiet.windows)[first:] if w.kept not in own]
    inside = sum(1 for t in times for w in windows if w.start < t < w.end)
    stops = sorted(w.stop_s for w in windows if w.stopped)
    if stops:
        print(f"{len(times)} ticks, {inside} inside; {len(stops)} windows stopped others in "
              f"p50 {stops[len(stops) // 2] * 1e3:.2f} ms, max {stops[-1] * 1e3:.2f} ms")
    return len(times), inside, list(results.values())


def _lane_jobs(n: int, tag: str) -> list:
    base = _jobs()
    return [base[i % len(base)].model_copy(update={
        "job_id": f"{tag}-{i}", "settings": base[0].settings.model_copy(update={"iterations": 20, "warmup": 2})})
        for i in range(n)]


@pytest.mark.slow
def test_no_other_lanes_candidate_makes_progress_inside_a_timed_window(lanes_slot):
    tmp = reachable_tmpdir("fibray-ticks-")
    try:
        ticker, *honest = _lane_jobs(5, "stop")
        n, inside, results = _ticks_inside_windows(lanes_slot, ticker, honest, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert all(r.evaluation.status.value == "PASSED" for r in results), [r.evaluation.log[-300:] for r in results]
    assert n > 100  # the ticker did run (and overlapped the honest jobs' unlocked work)
    assert inside == 0


@pytest.mark.slow
def test_a_candidate_forking_without_end_makes_no_progress_inside_a_timed_window(lanes_slot):
    """Chains of processes that fork and exit at once: a list of the executor's processes taken at the
    window's start is stale before it is used; the stop must reach every process of the executor's uid."""
    tmp = reachable_tmpdir("fibray-ticks-")
    try:
        ticker, *honest = _lane_jobs(5, "chains")
        n, inside, results = _ticks_inside_windows(lanes_slot, ticker, honest, tmp, _FORK_CHAINS)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert all(r.evaluation.status.value == "PASSED" for r in results[1:]), [r.evaluation.log[-300:] for r in results]
    assert n > 100
    assert inside == 0


@pytest.mark.slow
def test_without_stopping_another_lanes_candidate_runs_inside_a_timed_window(lanes_slot):
    """The control of the test above: the lanes' candidate work takes no lock, so only the stop keeps it out."""
    tmp = reachable_tmpdir("fibray-ticks-")
    lanes_slot.quiet.enabled = False
    try:
        ticker, *honest = _lane_jobs(5, "nostop")
        n, inside, _ = _ticks_inside_windows(lanes_slot, ticker, honest, tmp)
    finally:
        lanes_slot.quiet.enabled = True
        shutil.rmtree(tmp, ignore_errors=True)
    assert n > 100 and inside > 0


@pytest.mark.slow
def test_a_hung_neighbour_never_holds_up_a_timed_window(lanes_slot):
    from fibray import deadlines

    slot = lanes_slot
    first = len(slot.quiet.windows)
    hung, *honest = _lane_jobs(4, "hung")
    tmp = reachable_tmpdir("fibray-hung-")
    tmp.chmod(0o777)
    mark = tmp / "hung"
    hung = hung.model_copy(update={"solution": inline_solution("stops_itself", _STOPS_ITSELF.replace("MARK", repr(str(mark)))),
                                   "settings": hung.settings.model_copy(update={"run_deadline_s": 20.0})})
    t0 = time.monotonic()
    try:
        results: dict = {}
        neighbour = threading.Thread(target=lambda: results.update(_concurrently(slot, [hung])))
        neighbour.start()
        while not mark.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        assert mark.exists(), "the hung candidate never ran"
        results.update(_concurrently(slot, honest))  # timed while the neighbour holds its GIL
        neighbour.join(120)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert all(results[j.job_id].evaluation.status.value == "PASSED" for j in honest)
    windows = list(slot.quiet.windows)[first:]
    assert any(w.unacked >= 1 for w in windows)  # stopped without its ack ...
    assert max(w.ack_wait_s for w in windows) < deadlines.QUIESCE_ACK_S + 0.5  # ... after the short deadline only
    assert time.monotonic() - t0 < 120


def _reply_while_stopped(slot, quiet, stop_s: float, deadline_s: float):
    """Ask an idle executor for its health while a window stops it for `stop_s`; wait `deadline_s`
    for the answer, crediting stopped time when `quiet` is given. (reply or the exception, seconds)."""
    from fibray.workers.process.channel import Request, recv, send
    from fibray.workers.slot import answer

    with slot._free:
        ex = slot.idle.pop(0)
    ex = slot._ready(ex)  # a standby that took a lane has its hello still unread
    stopped, done = threading.Event(), threading.Event()

    def window() -> None:
        with slot.quiet.window("test", [ex], keep=None):
            stopped.set()
            done.wait(stop_s)

    t = threading.Thread(target=window)
    t.start()
    stopped.wait(5)
    t0 = time.monotonic()
    try:
        send(ex.conn, Request("health"))
        try:
            out = answer(ex, t0 + deadline_s, quiet)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out = e
        elapsed = time.monotonic() - t0
    finally:
        t.join(stop_s + 5)
        if not hasattr(out, "ok"):
            recv(ex.conn, time.monotonic() + 30, ex.arena)  # the late answer, off the channel
        slot._give_back(ex)
    return out, elapsed


@pytest.mark.slow
def test_time_an_executor_is_stopped_is_not_counted_against_its_deadline(lanes_slot):
    reply, elapsed = _reply_while_stopped(lanes_slot, lanes_slot.quiet, stop_s=1.5, deadline_s=0.5)
    assert getattr(reply, "ok", False), reply
    assert elapsed >= 1.4  # it came after the stop, past the 0.5 s the executor's own work had


@pytest.mark.slow
def test_without_the_stopped_time_credit_a_stopped_executor_misses_its_deadline(lanes_slot):
    from fibray.workers.process.channel import DeadlineExceeded

    reply, _ = _reply_while_stopped(lanes_slot, None, stop_s=1.5, deadline_s=0.5)
    assert isinstance(reply, DeadlineExceeded)
