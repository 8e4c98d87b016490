"""Where a slot's time goes: one GpuSlot driven in this process (no Ray), a sweep's jobs, under cProfile.

    python benchmarks/profile_slot.py [--workloads-per-definition 8] [--workload-set gpu]
                                      [--top 30] [--out slot.pstats] [--override eval.iterations=50 ...]
                                      [--wrap [--sync]]

The jobs are the sweep's (`python -m fibray.sweep` with the same overrides: dataset/core, 10/50/3 by
default), grouped by solution and ordered as the worker pool orders them, with the pool's prewarm of
the groups ahead (in a thread, as the slot actor takes it beside a job). Prints the wall, the jobs'
phases summed, and the supervisor's functions by own time and by cumulative time (the calling thread
only: the executors are other processes). A baseline measured in the same run: the slot's jobs' own
phase clocks against the wall, so what the profile adds shows as the gap.

`--wrap` replaces cProfile (whose figures mix the slot's threads on Python 3.12) by clocks around the
supervisor's own functions on the job's path (WRAPPED): each function's inclusive wall time and calls, the
outermost call per thread only. `--sync` also waits for the GPU as each of them returns, so that GPU work
is charged to the function that queued it rather than to the next one that waits for it (slower overall).
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
    ap.add_argument("--wrap", action="store_true", help="clocks around the supervisor's functions instead of cProfile")
    ap.add_argument("--sync", action="store_true", help="with --wrap: wait for the GPU as each wrapped function returns")
    ap.add_argument("--also", nargs="*", default=[], metavar="MODULE:QUALNAME",
                    help="with --wrap: more functions to clock, as module:qualname")
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
    clocks = _wrap([*WRAPPED, *args.also], args.sync and torch.cuda.is_available()) if args.wrap else None
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    if clocks is None:
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
    if clocks is not None:
        print(f"--- wrapped functions (inclusive wall, outermost call per thread{'; the GPU waited for at each return' if args.sync else ''}) ---")
        for name, (n, seconds) in sorted(clocks.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:48s} {n:6d} calls {seconds:8.3f}s  {seconds / max(n, 1) * 1e3:8.2f} ms/call")
        return 0
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(args.top)
        print(f"--- by {order} ---")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])
    if args.out:
        prof.dump_stats(str(args.out))
    return 0


WRAPPED = [
    "fibray.evaluate.judge:Judge.state", "fibray.evaluate.judge:Judge.open", "fibray.evaluate.judge:Judge.check_call",
    "fibray.evaluate.judge:Judge.unchanged_sets", "fibray.evaluate.judge:Judge.check_timed", "fibray.evaluate.judge:Judge._timed",
    "fibray.evaluate.judge:Judge.passed", "fibray.evaluate.judge:Judge.reference_latency", "fibray.evaluate.judge:_timed_verdicts",
    "fibray.evaluate.memory:timed_output_bytes", "fibray.evaluate.memory:final_copies", "fibray.evaluate.memory:JobMemory.settle",
    "fibray.evaluate.memory:JobMemory.guards_intact_many", "fibray.evaluate.memory:JobMemory.prepare_outputs",
    "fibray.evaluate.memory:JobMemory.write_inputs", "fibray.evaluate.memory:JobMemory.close",
    "fibray.workers.remote:RemoteCalls.build", "fibray.workers.remote:RemoteCalls.attach", "fibray.workers.remote:RemoteCalls.trial",
    "fibray.workers.remote:RemoteCalls.prepare_time", "fibray.workers.remote:RemoteCalls.time", "fibray.workers.remote:RemoteCalls.recheck",
    "fibray.workers.remote:RemoteCalls.resume", "fibray.workers.slot:GpuSlot._reap_strays", "fibray.workers.slot:GpuSlot._healthy",
    "fibray.workers.slot:GpuSlot._run", "fibray.workers.slot:GpuSlot._take_persistent", "fibray.workers.slot:GpuSlot._alone",
    "fibray.workers.slot:GpuSlot._gpu_to_itself", "fibray.workers.slot:GpuSlot.evaluate", "fibray.workers.slot:GpuSlot._evaluate",
    "fibray.workers.slot:GpuSlot._give_back", "fibray.workers.slot:GpuSlot._discard", "fibray.workers.slot:GpuSlot._left_behind",
    "fibray.workers.slot:GpuSlot._overhead_for", "fibray.evaluate.run:run_job", "fibray.evaluate.judge:Judge.fail",
    "fibray.evaluate.judge:Judge.failed",
]
"""module:qualname of the supervisor's functions that --wrap clocks."""


def _wrap(names: list[str], sync: bool) -> dict[str, list]:
    """Replace each function by one that clocks it (inclusive wall, outermost call per thread); module-level
    functions are replaced too where another fibray module imported them by name. Returns name -> [calls, s]."""
    import functools
    import importlib

    import torch

    clocks: dict[str, list] = {}
    local = threading.local()

    def clocked(name: str, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            depth = getattr(local, name, 0)
            setattr(local, name, depth + 1)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if sync:
                    torch.cuda.synchronize()
                setattr(local, name, depth)
                if depth == 0:
                    entry = clocks.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0
        return inner

    for spec in names:
        mod_name, qual = spec.split(":")
        mod = importlib.import_module(mod_name)
        *owner_path, attr = qual.split(".")
        owner = mod
        for part in owner_path:
            owner = getattr(owner, part)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        wrapped = clocked(qual, original)
        setattr(owner, attr, wrapped)
        if not owner_path:  # imported by name elsewhere
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("fibray.") and getattr(other, attr, None) is original:
                    setattr(other, attr, wrapped)
    return clocks


if __name__ == "__main__":
    sys.exit(main())
