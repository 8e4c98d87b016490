"""What the pool's job order costs: jobs grouped by solution (main) against grouped by workload.

    python benchmarks/grouping.py [--repeat 1] [--experiment smoke] [override ...]

An executor serves one solution and is then retired (the integrity issue: nothing one candidate
patched, started or left in memory reaches the next). Grouped by workload, a slot moves to another
solution at nearly every job and pays a fresh executor each time; grouped by solution it pays one
per solution. Both runs are the same sweep (`+experiment=smoke` unless told otherwise, a fresh
store each, the same secret input salt) in this process, the baseline first; the workload order is
put back by passing the old `group_of` to `WorkerPool.run`. Per run it prints the wall, the jobs'
window, evaluations/s over the window, the slots' executor counters (`solution_changes`:
executors retired because the next job was another solution's) and the verdicts, then the ratio
solution/workload and whether every (solution, workload) verdict is the same.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from functools import partialmethod
from pathlib import Path

import ray

from fibray.store import TraceStore, scan
from fibray.sweep import run_sweep
from fibray.sweep.__main__ import compose_config
from fibray.sweep.config import validate_config
from fibray.sweep.pool import WorkerPool



def _config(store: Path, experiment: str, overrides: list[str]):
    raw = compose_config([f"+experiment={experiment}", *overrides])
    raw["store"]["root"] = str(store)
    raw["sweep"]["progress"] = False
    return validate_config(raw)


def _one(label: str, store: Path, experiment: str, overrides: list[str], by_workload: bool, salt: str | None):
    original = WorkerPool.run
    if by_workload:
        WorkerPool.run = partialmethod(original, group_of=lambda j: (j.definition.name, j.workload.uuid))
    try:
        cfg = _config(store, experiment, overrides)
        if salt is not None:
            TraceStore(store).sweep_salt(cfg.sweep.name, adopt=salt)
        t0 = time.monotonic()
        report = run_sweep(cfg)
        wall = time.monotonic() - t0
    finally:
        WorkerPool.run = original
        if ray.is_initialized():
            ray.shutdown()
    df = scan(store).collect()
    verdicts = {(r["solution"], r["workload_uuid"]): (r["status"], r["reason"]) for r in df.iter_rows(named=True)}
    changes = sum(s.get("solution_changes", 0) for s in report.slot_stats)
    window = report.run_s or wall
    rate = report.total_jobs / window if window else float("nan")
    passed = sum(1 for v in verdicts.values() if v[0] == "PASSED")
    print(f"{label:>9}: wall {wall:6.1f} s, jobs' window {window:6.1f} s, {report.total_jobs} jobs, {rate:5.2f} eval/s, "
          f"executors retired for another solution {changes}, waiting for an executor "
          f"{report.phases.get('executor_wait', 0.0):.1f} slot-s, PASSED {passed}/{len(verdicts)}", flush=True)
    return rate, verdicts, TraceStore(store).sweep_salt(cfg.sweep.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="smoke")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both runs, e.g. runner.lanes=2")
    args = ap.parse_args()
    import torch

    print(f"host: {platform.node()} ({platform.processor() or platform.machine()}), python {platform.python_version()}, "
          f"torch {torch.__version__}, ray {ray.__version__}; experiment {args.experiment} {' '.join(args.overrides)}")
    base = Path(tempfile.mkdtemp(prefix="fibray-grouping-", dir="/tmp"))
    base.chmod(0o755)
    try:
        for i in range(args.repeat):
            old, old_v, salt = _one("workload", base / f"w{i}", args.experiment, args.overrides, True, None)
            new, new_v, _ = _one("solution", base / f"s{i}", args.experiment, args.overrides, False, salt)
            same = old_v == new_v
            print(f"ratio solution/workload {new / old:.2f}x eval/s; verdicts identical: {same}"
                  + ("" if same else f" ({sum(old_v[k] != new_v.get(k) for k in old_v)} differ)"), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
