"""A GPU slot in one process (no Ray): healthy executors are kept, a killed active executor is
replaced by the warm standby at once, isolated jobs get fresh processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fibray.dataset import load_dataset
from fibray.evaluate import now_iso
from fibray.schema import EvalSettings, Job, Solution
from fibray.workers.slot import GpuSlot
from fibray.workers.process import sandbox
from fibray.workers.spec import SlotSpec, distinct_shapes
from _sweep_helpers import REPO, inline_solution, reachable_tmpdir

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes


def _jobs(solution: str = "rmsnorm_h4096_torch") -> list[Job]:
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=[solution], workload_set="cpu_small")
    d, sol = ds.definitions["rmsnorm_h4096"], ds.solutions[solution]
    s = EvalSettings(warmup=1, iterations=2, trials=1)
    return [Job(job_id=f"j{i}", sweep="t", definition=d, workload=w, solution=sol, settings=s, dataset_root=str(ds.root))
            for i, w in enumerate(ds.workloads["rmsnorm_h4096"])]


@pytest.fixture(scope="module")
def slot():
    s = GpuSlot(SlotSpec("test", workdir=str(reachable_tmpdir("fibray-slot-")), standby=True, spare_isolated=1))
    s.info()
    yield s
    s.shutdown()


def test_healthy_executor_serves_many_jobs_without_replacement(slot):
    pid = slot.active.pid
    before = dict(slot.counters)
    for job in _jobs():
        result = slot.evaluate(job, "auto", now_iso())
        assert result.evaluation.status.value == "PASSED"
        # where the job's time went, phase by phase, all of it measured
        assert {"build", "inputs_reference", "trials", "check", "timing_prep", "timing", "timing.check",
                "timing.recheck", "reference_timing", "finish", "health", "strays"} <= set(result.phases)
        assert all(v >= 0 for v in result.phases.values())
    assert slot.active.pid == pid
    assert slot.counters == before


def test_descendants_and_children_walk_the_same_tree_as_a_full_process_scan(monkeypatch):
    import subprocess

    from fibray.workers.process import sandbox

    proc = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & wait) & wait"])  # bash: sleep, subshell: sleep
    try:
        deadline = time.monotonic() + 10
        while len(sandbox.descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        walked, direct = sandbox.descendants(proc.pid), sandbox.children(proc.pid)
        monkeypatch.setattr(sandbox, "_HAS_CHILDREN_FILES", False)
        scanned = sandbox.descendants(proc.pid)
        assert len(walked) == 3 and sorted(walked) == sorted(scanned)
        # the stray reap's view: bash's own two children (a sleep, a subshell), not the subshell's sleep
        assert len(direct) == 2 and sorted(direct) == sorted(sandbox.children(proc.pid))
    finally:
        sandbox.kill_tree(proc.pid, None)
        proc.wait()


def test_standby_takes_over_when_the_active_executor_dies(slot):
    standby = slot._ready(slot.standbys[0]).pid
    os.kill(slot.active.pid, signal.SIGKILL)
    job = _jobs()[0].model_copy(update={"job_id": "after-kill"})
    result = slot.evaluate(job, "auto", now_iso())
    # the dead executor is found before the job (the kernel says it is ending as soon as the kill
    # returns, before the fork server reports its end): the standby runs the job, unescalated
    assert result.evaluation.status.value == "PASSED"
    assert result.isolation == "persistent" and not result.escalated
    assert slot.active.pid == standby
    assert slot.counters["promotions"] >= 1


def test_isolated_jobs_run_in_fresh_processes(slot):
    retired = slot.counters["retired"]
    for job in _jobs()[:2]:
        result = slot.evaluate(job.model_copy(update={"job_id": job.job_id + "-iso"}), "isolated", now_iso())
        assert result.isolation == "isolated" and result.evaluation.status.value == "PASSED"
    assert slot.counters["retired"] == retired + 2


def test_an_isolated_job_gets_a_new_executor_when_the_spares_died_while_warm(slot):
    """Spares that died before their job (killed, out of memory at start) are not the job's
    fault: new executors are started for it, and the start failure says how the spare ended."""
    slot.spare_isolated = 2
    try:
        with slot._lock:
            while len(slot.fresh) < 2:
                slot.fresh.append(slot._spawn(single_use=True))
            spares = list(slot.fresh)
        slot._ready(spares[0])  # one has said it is ready (its hello read), the other's hello may be unread
        for ex in spares:
            os.kill(ex.pid, signal.SIGKILL)
        for ex in spares:
            while ex.alive():
                time.sleep(0.01)
        for i, job in enumerate(_jobs()[:2]):  # two jobs: each finds a dead spare first
            result = slot.evaluate(job.model_copy(update={"job_id": f"iso-after-dead-spares-{i}"}), "isolated", now_iso())
            assert result.isolation == "isolated" and result.evaluation.status.value == "PASSED", result.evaluation
        assert all(ex.alive() for ex in slot.fresh)
    finally:
        slot.spare_isolated = 1


def test_a_start_failure_names_how_the_executor_ended(slot):
    with slot._lock:
        ex = slot._spawn(single_use=True)
    os.kill(ex.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"executor {ex.pid} failed to start \(ChannelClosed; killed_by_signal: "
                                           r"executor killed by SIGKILL\)"):
        slot._ready(ex)


_BREAKS_THE_CANARY = '''import torch


def run(hidden_states, weight, output):
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
    torch.Tensor.sum = lambda self, *a, **k: torch.zeros((), device=self.device)  # leaves its process broken
'''


def test_executor_failing_its_health_check_is_retired_before_the_next_job(slot):
    job = _jobs()[0]
    poisoner = inline_solution("breaks_canary", _BREAKS_THE_CANARY)
    # the lane's executor serves another solution first (whatever earlier tests left in the lane)
    first = slot.evaluate(job.model_copy(update={"job_id": "before-canary"}), "auto", now_iso())
    assert first.evaluation.status.value == "PASSED", first.evaluation.log[-300:]
    served_another = [e for e in slot.idle if e.solution == job.solution.hash]  # none if that job's executor was retired
    before = dict(slot.counters)
    slot.evaluate(job.model_copy(update={"job_id": "breaks-canary", "solution": poisoner}), "auto", now_iso())
    # an executor that served another solution is retired, never handed to the poisoner; the canary's
    # known answer came out wrong, so the poisoner's executor is retired too; a standby takes the lane each time
    changes = slot.counters["solution_changes"] - before["solution_changes"]
    assert changes == len(served_another), (first.escalated, first.evaluation.log[-300:])
    assert slot.counters["retired"] == before["retired"] + 1
    assert not any(e.solution == poisoner.hash for e in slot._executors())
    assert slot.counters["promotions"] == before["promotions"] + 1 + changes
    after = slot.evaluate(job.model_copy(update={"job_id": "after-canary"}), "auto", now_iso())
    assert after.evaluation.status.value == "PASSED" and not after.escalated


_HANGS_WHEN_TIMED = '''import time

import torch

_calls = [0]


def run(hidden_states, weight, output):
    _calls[0] += 1
    if _calls[0] > 2:  # its correctness call passes; the timing loop's calls hang
        time.sleep(600)
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
'''


def test_a_candidate_that_hangs_while_timed_is_a_timeout_and_its_executor_is_killed(slot):
    job = _jobs()[0]
    hangs = inline_solution("hangs_when_timed", _HANGS_WHEN_TIMED)
    settings = job.settings.model_copy(update={"run_deadline_s": 4})
    active = slot._ready(slot.active).pid
    result = slot.evaluate(job.model_copy(update={"job_id": "hangs-timed", "solution": hangs, "settings": settings}),
                           "auto", now_iso())
    ev = result.evaluation
    assert (ev.status.value, ev.reason) == ("TIMEOUT", "run_timeout"), ev.log[-300:]
    assert result.escalated and slot.active.pid != active  # the hung executor is gone, not waited for


_STALLS_ITS_CHANNEL = '''import os
import struct
import sys
import time


def run(hidden_states, weight, output):
    fd = int(sys.argv[sys.argv.index("--fd") + 1])  # the executor's channel to its supervisor
    os.write(fd, struct.pack("!i", 1 << 20) + bytes(16))  # a reply of 1 MiB announced, 16 bytes sent
    time.sleep(600)
'''


def test_a_candidate_that_stops_halfway_through_a_reply_is_a_timeout_not_a_stuck_lane(slot):
    """Its first bytes wake the supervisor, which must not then wait for the rest past the deadline."""
    job = _jobs()[0]
    stalls = inline_solution("stalls_its_channel", _STALLS_ITS_CHANNEL)
    settings = job.settings.model_copy(update={"run_deadline_s": 4})
    t0 = time.monotonic()
    result = slot.evaluate(job.model_copy(update={"job_id": "stalls", "solution": stalls, "settings": settings}),
                           "auto", now_iso())
    ev = result.evaluation
    assert (ev.status.value, ev.reason) == ("TIMEOUT", "run_timeout"), ev.log[-300:]
    assert time.monotonic() - t0 < 60


_RUNS_OUT_OF_MEMORY_WHEN_TIMED = '''import torch

_calls = [0]


def run(hidden_states, weight, output):
    _calls[0] += 1
    if _calls[0] > 2:  # its correctness call passes; a timed call raises
        raise MemoryError()
    x = hidden_states.float()
    output.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(output.dtype))
'''


def test_a_failure_while_timed_keeps_the_executors_status_reason_and_log(slot):
    """The executor classified the candidate's exception (out_of_memory) and sent its traceback:
    the verdict is that, not a generic failed_during_timing with the supervisor's repr of it."""
    job = _jobs()[0]
    oom = inline_solution("oom_when_timed", _RUNS_OUT_OF_MEMORY_WHEN_TIMED)
    result = slot.evaluate(job.model_copy(update={"job_id": "oom-timed", "solution": oom}), "auto", now_iso())
    ev = result.evaluation
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "out_of_memory"), (ev.reason, ev.log[-300:])
    assert "Traceback" in ev.log and "MemoryError" in ev.log and not result.escalated


def _candidate_jobs(name: str) -> list[Job]:
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "tests" / "candidates"],
                      solutions=[name], workload_set="cpu_small")
    d, sol = ds.definitions["rmsnorm_h4096"], ds.solutions[name]
    s = EvalSettings(warmup=1, iterations=2, trials=1)
    return [Job(job_id=f"{name}{i}", sweep="t", definition=d, workload=w, solution=sol, settings=s, dataset_root=str(ds.root))
            for i, w in enumerate(ds.workloads["rmsnorm_h4096"])]


@pytest.mark.parametrize("offender", ["offender_patches_torch", "offender_leaves_thread"])
def test_what_a_solution_leaves_in_its_executor_never_reaches_the_next_solution(slot, offender):
    pid = slot.active.pid
    bad = slot.evaluate(_candidate_jobs(offender)[0], "auto", now_iso())
    verdict = (bad.evaluation.status.value, bad.evaluation.reason)
    if offender == "offender_leaves_thread":  # its thread is counted from /proc, below the PID namespace's relay
        assert verdict == ("RUNTIME_ERROR", "work_left_running"), bad.evaluation.log[-500:]
    else:
        assert verdict == ("PASSED", None)  # correct itself: the harm is to whoever comes next
    time.sleep(2.0)  # the thread's patch lands after its job and health check
    for job in _jobs()[:2]:
        # a sweep of their own: earlier tests' faults of this solution would send them to fresh processes
        result = slot.evaluate(job.model_copy(update={"sweep": f"after-{offender}"}), "auto", now_iso())
        assert result.evaluation.status.value == "PASSED", result.evaluation.log[-500:]
        assert result.isolation == "persistent" and not result.escalated
    assert slot.active.pid != pid  # one executor, one solution: retired, not reused
    assert slot.counters["solution_changes" if offender == "offender_patches_torch" else "retired"] >= 1


def test_jobs_sent_ahead_of_a_solutions_faults_run_isolated_then_are_quarantined(tmp_path):
    """The driver learns of a fault only when its job returns; jobs of the same solution already
    waiting in the slot must not each pay a persistent executor and an escalation, and must stop
    once the slot has seen spec.quarantine_after faults of it."""
    s = GpuSlot(SlotSpec("quarantine", workdir=str(reachable_tmpdir("fibray-slot-q-")), standby=False, spare_isolated=1,
                         quarantine_after=2))
    try:
        s.info()
        jobs = _candidate_jobs("offender_os_exit")
        assert len(jobs) >= 3
        results = [s.evaluate(job, "auto", now_iso()) for job in jobs[:3]]
        first, second, third = (r.evaluation for r in results)
        assert results[0].escalated and results[0].isolation == "isolated"  # ran persistent, faulted, escalated
        assert not results[1].escalated and results[1].isolation == "isolated"  # isolated at once: the slot saw a fault
        assert first.reason == second.reason == "crashed", (first.reason, second.reason)
        assert (third.status.value, third.reason, results[2].isolation) == ("RUNTIME_ERROR", "quarantined", "none")
        assert "quarantined after 2 faults" in third.log
    finally:
        s.shutdown()


def test_a_process_hosting_a_slot_keeps_its_own_children(slot):
    """The stray reap kills what candidates left (they run as other uids), not the host process's
    own children: a slot in a pytest or notebook process that started a local Ray must not kill
    its raylet (the driver then exits at once, with no word)."""
    import subprocess

    if not slot.spec.sandbox.drop_privileges or os.geteuid() != 0:
        pytest.skip("executors run as our own uid here: every child of ours is a suspect")
    own = subprocess.Popen(["sleep", "60"])
    try:
        result = slot.evaluate(_jobs()[0].model_copy(update={"job_id": "own-child"}), "auto", now_iso())
        assert result.evaluation.status.value == "PASSED", result.evaluation.log[-300:]
        assert own.poll() is None, "the slot killed a child of its host process"
    finally:
        own.kill()
        own.wait()


def test_each_change_of_solution_takes_a_warm_standby_and_a_new_one_starts(tmp_path):
    """spec.standby warm executors: a lane whose executor served another solution gets the oldest
    of them at once (started ahead, not after the change), and the slot keeps that many warm."""
    s = GpuSlot(SlotSpec("standbys", workdir=str(reachable_tmpdir("fibray-slot-sb-")), standby=2, spare_isolated=0))
    try:
        s.info()
        assert len(s.standbys) == 2
        for ex in s.standbys:
            s._ready(ex)
        for solution in ("rmsnorm_h4096_torch", "rmsnorm_h4096_triton", "rmsnorm_h4096_torch"):
            warm = [ex.pid for ex in s.standbys]
            result = s.evaluate(_jobs(solution)[0].model_copy(update={"job_id": f"sb-{solution}-{len(warm)}"}), "auto",
                                now_iso())
            assert result.evaluation.status.value == "PASSED", result.evaluation.log[-300:]
            if s.counters["solution_changes"]:
                assert s.active.pid == warm[0] and s.standbys[0].pid == warm[1]  # the oldest took the lane
            assert len(s.standbys) == 2 and all(ex.alive() for ex in s.standbys)
        assert s.counters["solution_changes"] == 2 and s.counters["promotions"] == 2
    finally:
        s.shutdown()


def test_a_change_of_solution_does_not_wait_for_the_retired_executor_to_end():
    """The executor that served another solution is killed as the lane changes hands; the wait for its
    end, its cleanup and its uid's release run beside the next job (held up here by a drain of its
    output that takes a second: the retirement joins it for up to OUTPUT_DRAIN_S). Taking the lane does
    not wait for it, its processes are not counted as strays, and the job's timed window opens only
    once it is done (nothing of it runs beside a timing)."""
    import threading

    from fibray import deadlines

    s = GpuSlot(SlotSpec("retire-soon", workdir=str(reachable_tmpdir("fibray-slot-rs-")), standby=1, spare_isolated=0))
    try:
        s.info()
        first = s.evaluate(_jobs("rmsnorm_h4096_torch")[0], "auto", now_iso())
        assert first.evaluation.status.value == "PASSED", first.evaluation.log[-300:]
        old = s.active
        old.drainer = threading.Thread(target=time.sleep, args=(2 * deadlines.OUTPUT_DRAIN_S,), daemon=True)
        old.drainer.start()
        strays = s.counters["strays_killed"]
        second = s.evaluate(_jobs("rmsnorm_h4096_triton")[0], "auto", now_iso())
        assert second.evaluation.status.value == "PASSED", second.evaluation.log[-300:]
        assert s.counters["solution_changes"] == 1 and s.active is not old
        assert second.phases["executor_wait"] < deadlines.OUTPUT_DRAIN_S / 2, second.phases  # the lane at once
        assert second.phases["timing.quiesce"] >= deadlines.OUTPUT_DRAIN_S / 2, second.phases  # the window waited
        assert not s._retiring and not old.alive() and not old.workdir.exists()
        assert s.counters["strays_killed"] == strays
    finally:
        s.shutdown()


_RMSNORM_DPS = """import torch


def run(hidden_states, weight, output):  # KEY
    x = hidden_states.float()
    output.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float())
"""


def test_an_executor_keeps_its_job_region_for_its_next_jobs_and_loses_it_when_retired(slot, monkeypatch):
    """A persistent executor's jobs share one region (a new one, on both sides, per job cost ~20 ms on a
    GPU): made once, sent once as a descriptor, named by later jobs; replaced by a larger one when a job
    needs more. Each job still finds its inputs, guards and poison as on a new region (an honest verdict
    every time; a candidate that checks its output buffers hold poison passes job after job). The region
    is closed with its executor: the next solution's executor gets one of its own, made at once as large as
    the largest its definition needed, so its later, larger workloads need no other."""
    made, real = [], slot.judge.regions
    monkeypatch.setattr(slot.judge, "_kept_sizes", {})  # what the slot's earlier jobs of this definition needed

    def counted(size, device):
        made.append(real(size, device))
        return made[-1]

    monkeypatch.setattr(slot.judge, "regions", counted)
    attaches = []
    from fibray.workers import remote

    ask = remote.RemoteCalls._ask

    def noted(self, req, *a, **kw):
        if req.op == "attach":
            attaches.append(req.region)
            assert req.layout.size == self.kept.region.size  # the executor maps (or holds) the whole region
        return ask(self, req, *a, **kw)

    monkeypatch.setattr(remote.RemoteCalls, "_ask", noted)
    jobs = _jobs()  # batch 1, 7 and 33: growing regions
    sol = inline_solution("keeps_region", _RMSNORM_DPS.replace("KEY", "keeps its region"))
    first = slot.evaluate(jobs[1].model_copy(update={"job_id": "kr-a", "solution": sol}), "auto", now_iso())
    assert first.evaluation.status.value == "PASSED", first.evaluation.log[-500:]
    ex = slot.active
    assert ex.solution == sol.hash and len(made) == 1 and attaches == ["keep"]
    for i, job in enumerate([jobs[1], jobs[0], jobs[1]]):
        r = slot.evaluate(job.model_copy(update={"job_id": f"kr-b{i}", "solution": sol}), "auto", now_iso())
        assert r.evaluation.status.value == "PASSED", r.evaluation.log[-500:]
    assert slot.active is ex and len(made) == 1 and attaches == ["keep", "kept", "kept", "kept"]
    bigger = slot.evaluate(jobs[2].model_copy(update={"job_id": "kr-c", "solution": sol}), "auto", now_iso())
    assert bigger.evaluation.status.value == "PASSED", bigger.evaluation.log[-500:]
    assert len(made) == 2 and attaches[-1] == "keep" and made[0].size < made[1].size
    with pytest.raises(AssertionError, match="closed"):
        made[0].bytes()  # the smaller one is gone from this side
    # every job on a kept region finds its output buffers poisoned (not the answers of the job before)
    # (a candidate that fails loudly otherwise passes job after job)
    checks = inline_solution("finds_poison", _RMSNORM_DPS.replace("# KEY", """# finds poison
    if not torch.isnan(output).all():
        raise RuntimeError("an output buffer held something else than poison")"""))
    for i, job in enumerate([jobs[2], jobs[2], jobs[1]]):
        job = job.model_copy(update={"job_id": f"kr-p{i}", "solution": checks,
                                     "settings": job.settings.model_copy(update={"seed": 100 + i})})
        r = slot.evaluate(job, "auto", now_iso())
        assert r.evaluation.status.value == "PASSED", r.evaluation.log[-500:]
    assert attaches[-3:] == ["keep", "kept", "kept"]
    # a region kept larger than the job that first attaches it (its first job never reached the executor)
    sol2 = inline_solution("keeps_a_larger_region", _RMSNORM_DPS.replace("KEY", "keeps a larger region"))
    first2 = slot.evaluate(jobs[0].model_copy(update={"job_id": "kr-l0", "solution": sol2}), "auto", now_iso())
    assert first2.evaluation.status.value == "PASSED", first2.evaluation.log[-500:]
    kept = slot.active.region
    kept.close()
    kept.lend(made[1].size).close()  # made for a larger job, never attached
    for i in range(2):
        r = slot.evaluate(jobs[0].model_copy(update={"job_id": f"kr-l{i + 1}", "solution": sol2}), "auto", now_iso())
        assert r.evaluation.status.value == "PASSED", r.evaluation.log[-500:]
    assert attaches[-2:] == ["keep", "kept"] and kept.region.size == made[1].size
    slot._retired()
    with pytest.raises(AssertionError, match="closed"):
        made[1].bytes()  # retired with its executor
    assert ex.region is None and slot.active is not ex
    # the next solution's executor: its first, smallest job gets a region as large as the definition's largest
    # job needed, and its larger jobs after it fit in that one
    sol3 = inline_solution("sized_at_once", _RMSNORM_DPS.replace("KEY", "sized at once"))
    before = len(made)
    for i, job in enumerate([jobs[0], jobs[1], jobs[2]]):
        r = slot.evaluate(job.model_copy(update={"job_id": f"kr-s{i}", "solution": sol3}), "auto", now_iso())
        assert r.evaluation.status.value == "PASSED", r.evaluation.log[-500:]
    assert len(made) == before + 1 and made[-1].size == made[1].size and attaches[-3:] == ["keep", "kept", "kept"]


def test_an_executor_asked_for_a_kept_region_it_does_not_hold_refuses_and_the_job_runs_elsewhere(slot):
    """The executor maps a "kept" region only if it holds one large enough: a supervisor and executor
    that disagree (here the supervisor is told the region is mapped before it ever was) end in the
    executor's retirement and the job's escalation to a fresh process, never in a job on other memory."""
    sol = inline_solution("kept_mismatch", _RMSNORM_DPS.replace("KEY", "kept mismatch"))
    job = _jobs()[0].model_copy(update={"job_id": "km-0", "solution": sol})
    ex = slot._take_persistent(sol.hash)
    slot._give_back(ex)
    ex.region = slot.judge.keeper()
    ex.region.lend(1 << 20).close()
    ex.region.mapped = True  # it never was
    retired = slot.counters["retired"]
    r = slot.evaluate(job, "auto", now_iso())
    assert r.evaluation.status.value == "PASSED" and r.escalated and r.isolation == "isolated", r.evaluation.log[-500:]
    slot._retired()
    assert slot.counters["retired"] > retired and slot.active is not ex and ex.region is None


def test_a_workloads_reference_is_timed_once_and_later_jobs_take_no_gpu_for_it(slot):
    job = _jobs()[0]
    job = job.model_copy(update={"settings": job.settings.model_copy(update={"seed": 4242})})  # a workload state of its own
    first = slot.evaluate(job, "auto", now_iso())
    second = slot.evaluate(job.model_copy(update={"job_id": job.job_id + "-again"}), "auto", now_iso())
    assert first.evaluation.status.value == second.evaluation.status.value == "PASSED"
    assert first.phases.get("reference_timing", 0.0) > 0.0
    assert "reference_timing" not in second.phases  # no exclusive hold: the other executors were not stopped for it
    p1, p2 = first.evaluation.performance, second.evaluation.performance
    assert p2.reference_latency_ms == p1.reference_latency_ms and p2.reference_job_id == p1.reference_job_id == job.job_id


@pytest.fixture(scope="module")
def warm_slot():
    s = GpuSlot(SlotSpec("prewarm", workdir=str(reachable_tmpdir("fibray-slot-pw-")), standby=1, spare_isolated=0,
                         prewarm=True))  # a CPU slot readies executors only when asked to
    s.info()
    yield s
    s.shutdown()


def _prewarmed(s: GpuSlot, job):
    """Ask `s` to ready an executor for the solution of `job` (or of a list of its jobs); its record once
    the warm-up has ended."""
    jobs = job if isinstance(job, list) else [job]
    s.prewarm(jobs)
    warm = s.warm[jobs[0].solution.hash]
    assert warm.done.wait(120), "the warm-up did not end"
    return warm


def test_a_standby_readied_for_the_next_solution_takes_the_lane_when_its_job_comes(warm_slot):
    s = warm_slot
    first = s.evaluate(_jobs("rmsnorm_h4096_torch")[0], "auto", now_iso())
    assert first.evaluation.status.value == "PASSED", first.evaluation.log[-300:]
    served, before = s.active.pid, dict(s.counters)
    job = _jobs("rmsnorm_h4096_triton")[0].model_copy(update={"job_id": "pw-triton"})
    warm = _prewarmed(s, job)
    assert warm.ok and warm.ex.solution == job.solution.hash
    assert warm.ex.pid in {e.pid for e in s._executors()}  # one of the slot's: every timed window stops it
    taken = s._take_persistent(job.solution.hash)  # what the job's lane gets
    assert taken is warm.ex and taken not in s.idle  # the lane's alone: no other lane may take it meanwhile
    s._give_back(taken)
    result = s.evaluate(job, "auto", now_iso())
    assert result.evaluation.status.value == "PASSED", result.evaluation.log[-300:]
    # the breakdown's parts: the executor's own call, timer and preparation of the timing, the window's quiescing
    assert {"trials.executor_call", "timing.executor_timer", "timing.quiesce", "timing_prep.executor_changes",
            "timing_prep.executor_views"} <= set(result.phases), result.phases
    assert s.active.pid == warm.ex.pid != served  # the readied executor took the lane; the torch one was retired
    assert s.counters["prewarmed"] == before["prewarmed"] + 1
    assert s.counters["solution_changes"] == before["solution_changes"] + 1
    assert job.solution.hash not in s.warm
    s.prewarm([job])  # the lane already serves that solution: nothing to ready
    assert job.solution.hash not in s.warm


def test_a_readied_executor_has_its_kept_region_made_and_mapped_before_its_first_job(warm_slot):
    """The region its solution's jobs will need (as large as its definition's jobs needed here) is made and
    mapped while it is readied: its first job makes none and sends no descriptor (on an H100 the two cost a
    new executor's first job ~26 ms)."""
    s = warm_slot
    first = s.evaluate(_jobs("rmsnorm_h4096_torch")[0].model_copy(update={"job_id": "ahead-0"}), "auto", now_iso())
    assert first.evaluation.status.value == "PASSED", first.evaluation.log[-300:]
    job = _variant(_jobs("rmsnorm_h4096_torch")[0], "ahead").model_copy(update={"job_id": "ahead-1"})
    warm = _prewarmed(s, job)
    assert warm.ok
    ahead = warm.ex.region
    assert ahead is not None and ahead.mapped and ahead.region.size >= s.judge.kept_size(job.definition.name) > 0
    made, sent = ahead.region, []
    real_share = type(made).share
    type(made).share = lambda self: (sent.append(self), real_share(self))[1]
    try:
        result = s.evaluate(job, "auto", now_iso())
    finally:
        type(made).share = real_share
    assert result.evaluation.status.value == "PASSED", result.evaluation.log[-300:]
    assert s.active.pid == warm.ex.pid and s.active.region.region is made
    assert sent == []  # the job's attach named the kept region: no descriptor went


def test_an_executor_whose_warm_up_call_left_a_thread_is_not_kept_for_the_job(warm_slot):
    """A call judged by nobody must not become a place to start work unseen: the thread would be in the
    job's baseline, and the job would pass. The warm-up is retired; the job runs on an unused executor
    and its first call's thread is caught as always."""
    s = warm_slot
    job = _candidate_jobs("offender_leaves_thread")[0].model_copy(update={"job_id": "pw-thread"})
    before = dict(s.counters)
    real_retire, lock_free = sandbox.retire, []

    def retire(ex, *a, **k):  # whether whoever puts the executor down holds the slot's lock meanwhile
        lock_free.append(not s._lock._is_owned())
        return real_retire(ex, *a, **k)

    sandbox.retire = retire
    try:
        warm = _prewarmed(s, job)
        s._retired()
    finally:
        sandbox.retire = real_retire
    assert not warm.ok and not warm.ex.alive()
    # put down off the lock (every lane's job needs it) and once: ~0.15 s a retirement on a GPU host
    assert lock_free == [True]
    assert s.counters["prewarm_discarded"] == before["prewarm_discarded"] + 1
    result = s.evaluate(job, "auto", now_iso())
    assert (result.evaluation.status.value, result.evaluation.reason) == ("RUNTIME_ERROR", "work_left_running")
    assert s.counters["prewarmed"] == before["prewarmed"]


def _variant(job: Job, tag: str, prelude: str = "") -> Job:
    """`job` with a solution of its own (same code, another comment, `prelude` run as its module loads):
    a solution no executor serves yet."""
    raw = job.solution.model_dump(mode="json")
    raw["name"] = f"{raw['name']}_{tag}"
    raw["sources"][0]["content"] = f"# {tag}\n{prelude}" + raw["sources"][0]["content"]
    return job.model_copy(update={"solution": Solution.model_validate(raw), "job_id": f"{job.job_id}-{tag}"})


def _no_readied(s: GpuSlot) -> None:
    with s._lock:
        for solution in list(s.warm):
            sandbox.retire(s.warm.pop(solution).ex)


def test_a_readied_executor_waits_for_its_job_while_the_next_guesses_are_readied(warm_slot):
    """The driver names the groups ahead as it sends the next group's first job, which may not have
    reached its lane yet: the executor readied for it must stay; only the oldest guess gives way."""
    from fibray.workers.slot import _READIED

    s = warm_slot
    _no_readied(s)
    jobs = [_variant(_jobs("rmsnorm_h4096_torch")[0], f"guess{i}") for i in range(_READIED + 1)]
    readied = [_prewarmed(s, job) for job in jobs[:_READIED]]
    assert all(w.ok for w in readied) and set(s.warm) == {j.solution.hash for j in jobs[:_READIED]}
    last = _prewarmed(s, jobs[-1])
    assert last.ok and set(s.warm) == {j.solution.hash for j in jobs[1:]}
    assert not readied[0].ex.alive() and all(w.ex.alive() for w in readied[1:])


def test_prewarm_auto_readies_nothing_on_a_cpu_slot_and_false_nothing_anywhere(warm_slot):
    """runner.prewarm=auto (the default) readies executors on GPU slots only: a CPU slot interprets
    Triton, so a warm-up would only take cores from the jobs; false never readies one."""
    import dataclasses

    s, spec = warm_slot, warm_slot.spec
    job = _jobs("rmsnorm_h4096_triton_big_eps")[0].model_copy(update={"job_id": "pw-auto"})
    assert job.solution.hash not in s.warm and all(e.solution != job.solution.hash for e in s.persistent)
    try:
        for mode in ("auto", False):
            s.spec = dataclasses.replace(spec, prewarm=mode)
            s.prewarm([job])
            assert job.solution.hash not in s.warm, mode
    finally:
        s.spec = spec
    with pytest.raises(ValueError, match="SlotSpec.prewarm"):
        SlotSpec("bad", prewarm="yes")


def test_a_readied_executor_calls_its_solution_on_each_distinct_shape_of_its_jobs(warm_slot):
    """Triton compiles again per specialisation of its integer arguments, so the warm-up calls the
    solution once per distinct workload shape the driver named. A candidate that fails on the third
    shape only is refused as a whole; warmed on the first shape alone, it would have been kept."""
    s = warm_slot
    jobs = _jobs("rmsnorm_h4096_torch")
    raw = jobs[0].solution.model_dump(mode="json")
    raw["name"] = "rmsnorm_fails_above_batch_8"
    raw["sources"] = [{"path": "main.py", "content": (
        "import torch\n\n\ndef run(hidden_states, weight):\n"
        "    if hidden_states.shape[0] > 8:\n        raise RuntimeError('not this shape')\n"
        "    x = hidden_states.float()\n"
        "    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(hidden_states.dtype)\n")}]
    sol = Solution.model_validate(raw)
    named = [j.model_copy(update={"solution": sol, "job_id": f"pw-shapes-{i}"}) for i, j in enumerate(jobs)]
    assert [j.workload.axes["batch_size"] for j in named] == [1, 7, 33]
    assert distinct_shapes(named + named) == named  # each shape once, in order
    first_two = _prewarmed(s, named[:2])
    assert first_two.ok  # shapes 1 and 7: fine
    s.warm.pop(sol.hash)
    sandbox.retire(first_two.ex)
    warm = _prewarmed(s, named)
    assert not warm.ok and sol.hash not in s.warm and not warm.ex.alive()


def test_the_slot_readies_several_named_solutions_at_once(warm_slot):
    """A warm-up (build, Triton's JIT per shape) can outlast a group that fails fast: the slot readies
    the groups the driver names ahead at once, each on a standby of its own, not one after another."""
    from fibray.workers.spec import PREWARM_AHEAD

    s = warm_slot
    _no_readied(s)
    slow_build = "import time as _time\n_time.sleep(5)\n"  # each warm-up outlasts the calls below
    jobs = [_variant(_jobs("rmsnorm_h4096_torch")[0], f"ahead{i}", slow_build) for i in range(PREWARM_AHEAD)]
    for job in jobs:
        s.prewarm([job])  # back to back: none has ended its warm-up yet
    readied = [s.warm[job.solution.hash] for job in jobs]
    assert sum(not w.done.is_set() for w in readied) >= 2  # at least two warming at once
    assert all(w.done.wait(120) and w.ok for w in readied)


def test_a_window_on_a_busy_gpu_ends_the_executor_whose_work_it_was_and_fails_its_job(warm_slot, monkeypatch):
    """The decision of a GPU window that finds another process's work on the GPU (the probe itself needs
    a GPU, and is shown on the H200 by gpu_offender_slows_the_reference): executors that ran candidate
    code are ended one at a time, the job's own first, until the GPU is free; if it was the job's own,
    the job fails with work_left_running; another's is only ended (its job is run again isolated)."""
    from fibray.evaluate.run import GpuWorkLeftRunning

    s = warm_slot
    _no_readied(s)
    own = _prewarmed(s, _variant(_jobs("rmsnorm_h4096_torch")[0], "own")).ex
    other = _prewarmed(s, _variant(_jobs("rmsnorm_h4096_torch")[0], "other")).ex
    pristine = s.standbys[0]

    def running(pid: int) -> bool:  # its context (and the work on the GPU) lasts as long as its process
        try:
            return sandbox.stat_fields(pid)[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return False

    for culprit in (own, other):
        monkeypatch.setattr(s, "_gpu_shared", lambda pid=culprit.executor_pid(): running(pid))
        if culprit is own:
            with pytest.raises(GpuWorkLeftRunning, match="still running after its calls had returned"):
                s._gpu_to_itself("reference_timing", [own, other, pristine], own)
            assert not running(own.executor_pid()) and other.alive()
        else:
            s._gpu_to_itself("timing", [other, pristine], own)
            assert not running(other.executor_pid())
    assert pristine.alive()  # never ran candidate code: never a suspect
    # busy with something outside the slot: nobody blamed, said once, and nobody ended for it again
    monkeypatch.setattr(s, "_gpu_shared", lambda: True)
    first = _prewarmed(s, _variant(_jobs("rmsnorm_h4096_torch")[0], "first")).ex
    pristine, first_pid = s.standbys[0], first.executor_pid()  # readying took the earlier standby
    s._gpu_to_itself("timing", [first, pristine], None)
    assert not running(first_pid) and pristine.alive() and s._busy_outside
    later = _prewarmed(s, _variant(_jobs("rmsnorm_h4096_torch")[0], "later")).ex
    pristine = s.standbys[0]
    s._gpu_to_itself("timing", [later, pristine], None)
    assert later.alive() and pristine.alive()
    monkeypatch.setattr(s, "_gpu_shared", lambda: False)
    s._gpu_to_itself("timing", [later, pristine], None)
    assert not s._busy_outside and later.alive()
    _no_readied(s)


def test_a_busy_gpu_in_a_window_ends_a_daemon_a_candidate_left_behind(warm_slot, monkeypatch):
    """GPU work of a process outside every executor's tree (a daemon re-parented to the slot) is not
    taken for a neighbour's outside the slot: the slot's left-behind processes are killed, and the GPU is free."""
    import subprocess

    s = warm_slot
    daemon = subprocess.Popen(["sleep", "60"], user=65534)  # a child of the slot's process, of another uid
    try:
        monkeypatch.setattr(s, "_gpu_shared", lambda: daemon.poll() is None)
        s._gpu_to_itself("reference_timing", list(s.standbys), None)
        assert daemon.wait(10) is not None and not s._busy_outside
        assert all(e.alive() for e in s.standbys)
    finally:
        if daemon.poll() is None:
            daemon.kill()


def test_an_executor_that_died_while_idle_gives_its_lane_to_a_standby(warm_slot):
    """A window's GPU check (or the OOM killer) can end an idle lane's executor: its solution's next job
    gets a live one (_ready finds it ended), not a failure on the dead one and a re-run isolated."""
    s = warm_slot
    jobs = _jobs("rmsnorm_h4096_torch")
    first = s.evaluate(jobs[0].model_copy(update={"job_id": "dead-idle-0"}), "auto", now_iso())
    assert first.evaluation.status.value == "PASSED", first.evaluation.log[-300:]
    dead = s.active
    sandbox.kill_executor(dead)
    dead.proc.wait(10)
    again = s.evaluate(jobs[1].model_copy(update={"job_id": "dead-idle-1"}), "auto", now_iso())
    assert again.evaluation.status.value == "PASSED", again.evaluation.log[-300:]
    assert not again.escalated and again.isolation == "persistent" and s.active is not dead
