"""Where a slot's time goes: one GpuSlot driven in this process (no Ray), a sweep's jobs, under cProfile.

    python benchmarks/profile_slot.py [--workloads-per-definition 8] [--workload-set gpu]
                                      [--top 30] [--out slot.pstats] [--override eval.iterations=50 ...]

The jobs are the sweep's (`python -m fibray.sweep` with the same overrides: dataset/core, 10/50/3 by
default), grouped by solution and ordered as the worker pool orders them, with the pool's prewarm of
the groups ahead (in a thread, as the slot actor takes it beside a job). Prints the wall, the jobs'
phases summed, and the supervisor's functions by own time and by cumulative time (the calling thread
only: the executors are other processes). A baseline measured in the same run: the slot's jobs' own
phase clocks against the wall, so what the profile adds shows as the gap.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time
from collections import Counter, defaultdict
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    import torch

    from fibray.evaluate.phases import now_iso
    from fibray.sweep.__main__ import compose_config
    from fibray.sweep.config import validate_config
    from fibray.sweep.driver import load_sweep_dataset, make_jobs, pool_options
    from fibray.sweep.pool import job_groups
    from fibray.workers.slot import GpuSlot
    from fibray.workers.spec import PREWARM_AHEAD, distinct_shapes

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads-per-definition", type=int, default=8)
    ap.add_argument("--workload-set", default="gpu" if torch.cuda.is_available() else "cpu_small")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="write the pstats here")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="more fibray.sweep overrides")
    args = ap.parse_args()

    raw = compose_config([f"dataset.root={REPO / 'datasets' / 'core'}", f"dataset.workload_set={args.workload_set}",
                          f"dataset.max_workloads_per_definition={args.workloads_per_definition}",
                          f"solutions.roots=[{REPO / 'solutions'}]", "eval.warmup=10", "eval.iterations=50", "eval.trials=3", "sweep.name=profile_slot",
                          *args.override])
    cfg = validate_config(raw)
    ds = load_sweep_dataset(cfg)
    jobs = make_jobs(ds, cfg)
    groups = job_groups(jobs)

    opts = pool_options(cfg, 1, os.cpu_count() or 1, None)
    t0 = time.perf_counter()
    slot = GpuSlot(opts.slot_spec("profile"))
    info = slot.info()
    started = time.perf_counter() - t0
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device {device}; torch {torch.__version__}; {len(jobs)} jobs in {len(groups)} groups; "
          f"slot started in {started:.2f}s; lanes {info.get('lanes')}, standby {opts.standby}", flush=True)

    phases: defaultdict[str, float] = defaultdict(float)
    statuses: Counter[str] = Counter()
    keys = list(groups)
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    prof.enable()
    try:
        for i, key in enumerate(keys):
            if opts.prewarm is not False:
                ahead = [distinct_shapes(groups[k]) for k in islice(keys, i + 1, i + 1 + PREWARM_AHEAD)]
                for shapes in ahead:
                    threading.Thread(target=slot.prewarm, args=(shapes,), daemon=True).start()
            for job in groups[key]:
                result = slot.evaluate(job, "persistent", now_iso())
                statuses[result.evaluation.status.value] += 1
                for name, seconds in result.phases.items():
                    phases[name] += seconds
    finally:
        prof.disable()
        wall = time.perf_counter() - t1
        slot.shutdown()

    top = sum(v for k, v in phases.items() if "." not in k)
    print(f"jobs wall {wall:.2f}s; statuses {dict(statuses)}; phases {top:.2f}s "
          f"({top / wall:.2f}x of the wall), the rest {wall - top:.2f}s", flush=True)
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {seconds:8.3f}s  {seconds / len(jobs) * 1e3:8.2f} ms/job")
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(args.top)
        print(f"--- by {order} ---")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])
    if args.out:
        prof.dump_stats(str(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
