"""What a judge keeps of its workloads: every byte it holds for one counted (the timing's extra input sets
too), the least recently used out past the cache's bytes, and on a GPU a cache sized from the device, so
that the solutions of a definition, each going through its workloads, find them made."""

from __future__ import annotations

import torch

import fibray.evaluate.memory as memory
from fibray.evaluate.environment import environment
from fibray.evaluate.judge import Judge, _nbytes
from fibray.evaluate.memory import WORKLOAD_CACHE_BYTES, workload_cache_bytes
from fibray.schema import EvalSettings
from test_slot import _jobs

CPU = torch.device("cpu")


def _timing_jobs() -> list:
    s = EvalSettings(warmup=1, iterations=10, trials=1)
    return [j.model_copy(update={"settings": s}) for j in _jobs()]


def _counted(judge: Judge) -> list:
    made = []
    real = judge._materialise

    def materialise(job):
        made.append(job.workload.uuid)
        return real(job)

    judge._materialise = materialise
    return made


def _held(judge: Judge) -> int:
    return sum(w.nbytes for w in judge._workloads.values())


def _open_close(judge: Judge, job) -> None:
    mem, _ = judge.open(job, judge.state(job))
    mem.close()


def test_a_workloads_timing_sets_count_in_what_the_judge_holds(tmp_path):
    judge = Judge(tmp_path, CPU, environment(CPU))
    assert judge._cache_bytes == WORKLOAD_CACHE_BYTES
    job = _timing_jobs()[-1]
    state = judge.state(job)
    before = state.nbytes
    _open_close(judge, job)
    assert len(state.extra) == 9  # 10 calls on 10 distinct sets: the trial's and nine more
    assert state.nbytes == before + sum(map(_nbytes, state.extra)) > before


def test_workloads_within_the_cache_are_made_once_and_past_it_the_least_recently_used_go(tmp_path):
    jobs = _timing_jobs()
    assert len(jobs) >= 3
    sizer = Judge(tmp_path / "sizer", CPU, environment(CPU))
    sizes = []
    for job in jobs:
        _open_close(sizer, job)
        sizes.append(sizer.state(job).nbytes)

    roomy = Judge(tmp_path / "roomy", CPU, environment(CPU), cache_bytes=sum(sizes))
    made = _counted(roomy)
    for solution in range(3):  # each solution goes through the workloads, every other one backwards
        for job in (jobs if solution % 2 == 0 else jobs[::-1]):
            _open_close(roomy, job)
    assert sorted(made) == sorted(j.workload.uuid for j in jobs)  # each made once

    tight = Judge(tmp_path / "tight", CPU, environment(CPU), cache_bytes=sum(sizes) - min(sizes))
    made = _counted(tight)
    for solution in range(2):
        for job in jobs:
            _open_close(tight, job)
            assert _held(tight) <= tight._cache_bytes + sizes[jobs.index(job)]  # at most the newest beyond it
    assert len(made) > len(jobs)  # one workload had to go, and came back
    assert _held(tight) - tight._cache_bytes <= max(sizes)


def test_a_gpus_workload_cache_takes_an_eighth_of_its_memory_a_quarter_of_what_is_free_and_at_least_2_gib(monkeypatch):
    """The arithmetic, with the device's answer to "how much is free" given (no GPU here)."""
    gib = 1 << 30
    assert workload_cache_bytes(CPU) == 2 * gib
    for (free, total), want in [((79 * gib, 80 * gib), 10 * gib), ((139 * gib, 141 * gib), 16 * gib),
                                ((20 * gib, 80 * gib), 5 * gib), ((4 * gib, 80 * gib), 2 * gib)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, _f=free, _t=total: (_f, _t))
        memory._MEMORY_INFO.clear()  # the driver's last answer stands for FREE_MEMORY_TTL_S
        assert workload_cache_bytes(torch.device("cuda", 0)) == want, (free, total)


def test_a_reference_is_timed_once_a_slot_though_the_cache_let_its_workload_go(tmp_path, monkeypatch):
    """Every job of a workload reports the one measurement of its reference and the job that made it, even
    where the workload was made again in between; other timing settings time it again."""
    import fibray.evaluate.judge as judge_module

    timed = []
    real = judge_module.time_calls
    monkeypatch.setattr(judge_module, "time_calls", lambda *a, **k: timed.append(a[0]) or real(*a, **k))
    jobs = _timing_jobs()
    judge = Judge(tmp_path, CPU, environment(CPU), cache_bytes=1)  # holds the newest workload alone
    made = _counted(judge)
    first: dict[str, tuple] = {}
    for solution in range(2):
        for job in jobs:
            job = job.model_copy(update={"job_id": f"{job.job_id}-s{solution}"})
            assert judge.reference_ready(job) == (solution > 0)
            got = judge.reference_latency(job, judge.state(job))
            assert got == first.setdefault(job.workload.uuid, got)
            assert got[1] == f"{job.job_id[:-3]}-s0"
    assert len(made) == 2 * len(jobs) and len(timed) == len(jobs)
    longer = jobs[0].model_copy(update={"settings": jobs[0].settings.model_copy(update={"iterations": 20})})
    assert not judge.reference_ready(longer)
    judge.reference_latency(longer, judge.state(longer))
    assert len(timed) == len(jobs) + 1
