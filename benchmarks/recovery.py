"""How fast a GPU slot recovers: a warm standby taking over vs a cold start.

    python benchmarks/recovery.py [--repeats 5]

Measured in one run on this machine's device (GPU if present, else CPU):
  standby takeover  - the active executor is SIGKILLed; time until the next job's verdict
                      on the promoted standby (retire + promote + job);
  cold executor     - the same, with no standby: a fresh executor is started for the job;
  cold Ray actor    - a new GpuSlot Ray actor (the unit Ray would restart) until its first verdict.
Baseline: cold executor. Prints medians and the ratio cold / standby.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def _job(seed: int):
    from fibray.dataset import load_dataset
    from fibray.schema import EvalSettings, Job

    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=["rmsnorm_h4096_torch"], workload_set="cpu_small", max_workloads_per_definition=1)
    d = ds.definitions["rmsnorm_h4096"]
    w = ds.workloads["rmsnorm_h4096"][0]
    sol = ds.solutions["rmsnorm_h4096_torch"]
    s = EvalSettings(warmup=1, iterations=3, trials=1, seed=seed, time_reference=False)
    return Job(job_id=f"bench-{seed}", sweep="bench", definition=d, workload=w, solution=sol, settings=s,
               dataset_root=str(ds.root))


def main() -> None:
    import ray

    from fibray.evaluate import now_iso
    from fibray.workers.slot import GpuSlot
    from fibray.workers.spec import SlotSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--actor-repeats", type=int, default=2)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="fibray-recovery-", dir="/tmp")
    os.chmod(workdir, 0o755)

    def measure(standby: bool) -> list[float]:
        slot = GpuSlot(SlotSpec("bench", workdir=workdir, standby=standby, spare_isolated=0))
        slot.info()
        for ex in slot.standbys:
            slot._ready(ex)
        slot.evaluate(_job(0), "persistent", now_iso())  # warm: build and reference cached
        out = []
        for i in range(args.repeats):
            for ex in slot.standbys:
                slot._ready(ex)  # the new standby is warm again before the next failure
            os.kill(slot.active.pid, signal.SIGKILL)
            t0 = time.perf_counter()
            slot._discard(slot.active)
            result = slot.evaluate(_job(0), "persistent", now_iso())
            out.append(time.perf_counter() - t0)
            assert result.evaluation.status.value == "PASSED", result.evaluation.log
        slot.shutdown()
        return out

    import torch

    med = statistics.median
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {dev}; repeats: {args.repeats}; job: rmsnorm_h4096_torch, 1 trial, 3 iterations", flush=True)
    warm = measure(standby=True)
    print(f"standby takeover (kill -> next verdict): median {med(warm):.3f}s  all {[round(x, 3) for x in warm]}", flush=True)
    cold = measure(standby=False)
    print(f"cold executor    (kill -> next verdict): median {med(cold):.3f}s  all {[round(x, 3) for x in cold]}", flush=True)
    print(f"ratio cold executor / standby: {med(cold) / med(warm):.1f}x", flush=True)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_gpus=1 if not _cuda() else None)
    remote = ray.remote(GpuSlot)
    actor_times = []
    for i in range(args.actor_repeats):
        t0 = time.perf_counter()
        a = remote.options(num_gpus=1, num_cpus=0).remote(SlotSpec("bench", workdir=workdir, standby=True, spare_isolated=0))
        r = ray.get(a.evaluate.remote(_job(0), "persistent", now_iso()), timeout=600)
        actor_times.append(time.perf_counter() - t0)
        assert r.evaluation.status.value == "PASSED"
        ray.get(a.shutdown.remote())
        ray.kill(a)
    ray.shutdown()
    print(f"cold Ray actor   (create -> first verdict): median {med(actor_times):.3f}s  all {[round(x, 3) for x in actor_times]}")
    print(f"ratio cold actor / standby: {med(actor_times) / med(warm):.1f}x")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
