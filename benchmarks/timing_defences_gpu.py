"""The timing defences of issue 14 on a GPU: the persisting-L2 reset, the roofline floor, the
supervisor's bound, and CUDA-graph replay caught by the checks (the lead runs it on an H200).

    python benchmarks/timing_defences_gpu.py

Prints, and exits 1 if any line says FAIL:
- the slot's measured HBM bandwidth and bf16 throughput (the roofline's device capabilities);
- a 24 MB read timed by fibray's timer without an access-policy window, with a persisting
  window and the reset (must be within 10% of no window), and with the window but the reset
  switched off (shows what the attack gains on this device);
- the honest torch RMSNorm on 16384 x 4096 (PASSED, its latency over its floor), and the same
  kernel with its timer rebound to report 20x less in one process (below_roofline);
- tests/candidates_gpu/persisting_l2 (PASSED, latency against the honest control) and
  graph_replay_cheaper (INCORRECT_NUMERICAL: the replayed graph is a checked call too);
- a GPU slot with executors: the slot's calibrated overhead, tests/candidates/timer_rebinding
  (timing_below_observed) and its honest twin (PASSED, >= 20 ms).
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def persisting_l2() -> None:
    import ctypes

    import torch

    import fibray.timing.timer as timer

    sol = json.loads((REPO / "tests" / "candidates_gpu" / "persisting_l2.json").read_text())
    ns: dict = {}
    exec(compile(sol["sources"][0]["content"], "persisting_l2", "exec"), ns)  # the candidate's _persist
    x = torch.randn(12 << 20, device="cuda", dtype=torch.bfloat16)  # 24 MB: fits the set-aside
    out = torch.empty((), device="cuda", dtype=torch.float32)

    def plain(t):
        torch.sum(t, 0, dtype=torch.float32, out=out)  # torch 2.11: out= needs the dim overload

    def windowed(t):
        ns["_persist"](t)
        torch.sum(t, 0, dtype=torch.float32, out=out)

    def median(fn) -> float:
        t = timer.time_calls(fn, [[x]], warmup=5, iterations=200, device=torch.device("cuda"), sync_device=False)
        return sorted(t.samples_ms)[len(t.samples_ms) // 2] * 1e3

    base = median(plain)
    defended = median(windowed)
    keep = timer.reset_persisting_l2, timer.persisting_l2_bytes
    timer.reset_persisting_l2, timer.persisting_l2_bytes = (lambda: False), (lambda: 0)
    try:
        undefended = median(windowed)
    finally:
        timer.reset_persisting_l2, timer.persisting_l2_bytes = keep
    ctypes.CDLL("libcuda.so.1").cuCtxResetPersistingL2Cache()
    print(f"persisting L2, 24 MB read: no window {base:.2f} us, window + reset {defended:.2f} us, "
          f"window without reset {undefended:.2f} us ({undefended / base:.2f}x of no window)")
    check(defended >= 0.9 * base, "with the reset, a persisting window buys no more than 10%")


def _rmsnorm_job(sol, batch: int, settings=None):
    from fibray.dataset import load_dataset
    from fibray.schema import EvalSettings, Job, Workload

    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=["rmsnorm_h4096_torch"], workload_set="gpu")
    w = Workload.model_validate({"uuid": f"bench-{batch}", "axes": {"batch_size": batch},
                                 "inputs": {"hidden_states": {"type": "random"}, "weight": {"type": "random"}}})
    sol = sol or ds.solutions["rmsnorm_h4096_torch"]
    return Job(job_id=f"defences-{sol.name}-{batch}", sweep="bench", definition=ds.definitions["rmsnorm_h4096"],
               workload=w, solution=sol, settings=settings or EvalSettings(warmup=5, iterations=30, trials=2),
               dataset_root=str(ds.root))


def _solution(path: Path, drop: str = ""):
    from fibray.schema import Solution

    raw = json.loads(path.read_text())
    if drop:
        raw["sources"][0]["content"] = "\n".join(l for l in raw["sources"][0]["content"].splitlines() if drop not in l)
        raw["name"] += "_nosleep"
    return Solution.model_validate(raw)


def roofline_and_candidates() -> None:
    import torch

    from fibray.evaluate import Evaluator
    from fibray.timing.roofline import device_caps, floor_ms

    caps = device_caps(torch.device("cuda"))
    print(f"device {caps.name}: copy {caps.hbm_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {caps.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
    ev = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-def-")))
    job = _rmsnorm_job(None, 16384)
    honest = ev.evaluate(job)
    floor = floor_ms(job.definition, job.workload.axes, caps)
    lat = honest.performance.latency_ms if honest.performance else float("nan")
    print(f"rmsnorm 16384x4096 torch: {honest.status.value} {lat * 1e3:.1f} us, floor {floor * 1e3:.1f} us ({lat / floor:.2f}x)")
    check(honest.status.value == "PASSED", "the honest kernel passes above its floor")
    small = _rmsnorm_job(None, 1024)
    control = ev.evaluate(small)
    for name, status in (("persisting_l2", "PASSED"), ("graph_replay_cheaper", "INCORRECT_NUMERICAL")):
        sol = _solution(REPO / "tests" / "candidates_gpu" / f"{name}.json")
        r = ev.evaluate(_rmsnorm_job(sol, 1024))
        extra = ""
        if r.performance and control.performance:
            extra = f", {r.performance.latency_ms / control.performance.latency_ms:.2f}x the honest control"
        print(f"candidates_gpu/{name}: {r.status.value} {r.reason}{extra}")
        check(r.status.value == status, f"{name} is {status}")
    cheat = _solution(REPO / "tests" / "candidates" / "timer_rebinding.json", drop="time.sleep")
    import fibray.evaluate.candidate as candidate
    import fibray.timing as timing

    keep = candidate.time_calls, timing.time_calls
    try:
        r = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-def-"))).evaluate(_rmsnorm_job(cheat, 16384))
    finally:
        candidate.time_calls, timing.time_calls = keep
    print(f"rmsnorm 16384x4096, timer rebound to report 20x less, one process: {r.status.value} {r.reason}")
    check((r.status.value, r.reason) == ("RUNTIME_ERROR", "below_roofline"), "a latency below the floor is below_roofline")


def supervisor_bound() -> None:
    from fibray.evaluate import now_iso
    from fibray.schema import EvalSettings
    from fibray.workers.slot import GpuSlot
    from fibray.workers.spec import SlotSpec
    from _sweep_helpers import reachable_tmpdir

    slot = GpuSlot(SlotSpec("defences", workdir=str(reachable_tmpdir("fibray-def-")), standby=False, spare_isolated=1))
    try:
        slot.info()
        for key, o in slot.overheads.items():
            print(f"slot calibration {key}: fixed {o.fixed_s * 1e3:.2f} ms, per call {o.per_call_s * 1e6:.1f} us")
        s = EvalSettings(warmup=3, iterations=10, trials=2)
        cheat = _solution(REPO / "tests" / "candidates" / "timer_rebinding.json")
        r = slot.evaluate(_rmsnorm_job(cheat, 1024, s), "persistent", now_iso()).evaluation
        print(f"slot, timer_rebinding: {r.status.value} {r.reason}")
        check(r.reason == "timing_below_observed", "a rebound timer in an executor is timing_below_observed")
        twin = _solution(REPO / "tests" / "candidates" / "timer_rebinding.json")
        src = twin.sources[0].content
        raw = twin.model_dump(mode="json")
        raw["name"] = "honest_slow"
        raw["sources"][0]["content"] = "import time\n\nimport torch\n" + src[src.index("\ndef run("):]
        from fibray.schema import Solution

        r = slot.evaluate(_rmsnorm_job(Solution.model_validate(raw), 1024, s), "persistent", now_iso()).evaluation
        lat = r.performance.latency_ms if r.performance else float("nan")
        print(f"slot, its honest twin: {r.status.value} {r.reason} {lat:.2f} ms")
        check(r.status.value == "PASSED" and lat >= 20.0, "the honest 20 ms kernel passes with its latency")
    finally:
        slot.shutdown()


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("timing_defences_gpu.py needs a GPU")
        return 2
    for section in (persisting_l2, roofline_and_candidates, supervisor_bound):
        try:
            section()
        except Exception as e:  # one broken section is reported; the others still run
            traceback.print_exc()
            check(False, f"{section.__name__} raised {type(e).__name__}: {str(e)[:200]}")
    print("FAILED: " + "; ".join(failures) if failures else "all timing defences held")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
