"""Scheduler scaling: the same sweep of cheap candidates on 1, 2, 4, 8 GPU slots.

    python benchmarks/scaling.py [--workloads 96] [--gpus 1 2 4 8] [--lean]

Each run is a real sweep (`run_sweep`: its own local Ray, one GpuSlot per GPU, a fresh store)
of the bundled `rmsnorm_h4096_torch` over N generated small workloads. On a machine with GPUs
the counts above the number of real GPUs are dropped; on a CPU-only machine the GPUs are
logical (`cluster.num_gpus`), so every slot shares the same CPU cores.

Per run it prints: wall (the whole sweep: dataset, Ray start, slot start, jobs, shutdown),
start (sweep start to the first job dispatched: Ray and slots coming up), window (first job
dispatched to last job finished), evaluations/s over the wall and over the window, speedup vs
the 1-GPU run and efficiency (speedup / GPUs) for both, busy (the sum of each job's
finished_at - started_at from the store: time inside evaluations, as seen by the pool), and
overhead per job = (GPUs x window - busy) / jobs: slot time in the window not spent inside an
evaluation (dispatch, result collection, idle slots at the tail).
"""

from __future__ import annotations

import argparse
import os
import json
import platform
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFINITION, SOLUTION = "rmsnorm_h4096", "rmsnorm_h4096_torch"


def make_dataset(root: Path, workloads: int) -> Path:
    """A dataset folder with the bundled definition and `workloads` small random workloads."""
    src = REPO / "datasets" / "core" / "definitions" / "rmsnorm" / f"{DEFINITION}.json"
    (root / "definitions").mkdir(parents=True)
    shutil.copy(src, root / "definitions" / src.name)
    (root / "workloads").mkdir()
    with open(root / "workloads" / f"{DEFINITION}.jsonl", "w") as f:
        for i in range(workloads):
            wl = {"uuid": str(uuid.uuid5(uuid.NAMESPACE_OID, f"fibray-scaling-{i}")),
                  "axes": {"batch_size": 1 + i % 16},
                  "inputs": {"hidden_states": {"type": "random"}, "weight": {"type": "random"}}}
            f.write(json.dumps({"definition": DEFINITION, "solution": None, "workload": wl, "evaluation": None}) + "\n")
    return root


def run_once(dataset: Path, store: Path, gpus: int, lean: bool) -> dict:
    import pyarrow.compute as pc

    from fibray.store import TraceStore
    from fibray.sweep import run_sweep, validate_config

    cfg = validate_config({
        "dataset": {"root": str(dataset)},
        "solutions": {"roots": [str(REPO / "solutions" / "rmsnorm" / DEFINITION)], "names": [SOLUTION]},
        "store": {"root": str(store)},
        "cluster": {"num_gpus": gpus, "start_deadline_s": 900},
        "sweep": {"name": f"scaling{gpus}", "progress": False, "flush_rows": 1000, "flush_interval_s": 3600},
        "eval": {"warmup": 1, "iterations": 3, "trials": 1},
        "runner": {"standby": not lean, "spare_isolated": 0 if lean else 1},
    })
    t0 = datetime.now(timezone.utc)
    report = run_sweep(cfg)
    table = TraceStore(store).read(sweep=f"scaling{gpus}", columns=["status", "started_at", "finished_at", "worker"])
    assert table.num_rows == report.total_jobs == report.recorded, (table.num_rows, report)
    assert set(table["status"].to_pylist()) == {"PASSED"}, table["status"].value_counts()
    started, finished = table["started_at"], table["finished_at"]
    first, last = pc.min(started).as_py(), pc.max(finished).as_py()
    busy = pc.sum(pc.microseconds_between(started, finished)).as_py() / 1e6
    window = (last - first).total_seconds()
    return {"gpus": gpus, "jobs": table.num_rows, "wall": report.wall_s, "start": (first - t0).total_seconds(),
            "window": window, "busy": busy, "overhead_ms": 1e3 * (gpus * window - busy) / table.num_rows,
            "slots": len(set(table["worker"].to_pylist())), "phases": report.time_breakdown()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=int, default=96, help="jobs per run (one solution per workload)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lean", action="store_true", help="no standby or spare executors (less start-up work per slot)")
    args = ap.parse_args()

    import ray
    import torch

    real = torch.cuda.device_count() if torch.cuda.is_available() else 0
    counts = [g for g in args.gpus if not real or g <= real]
    device = f"{real} x {torch.cuda.get_device_name()}" if real else "CPU only, logical GPUs"
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {device}; {os.cpu_count()} CPU cores; python "
          f"{platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}; "
          f"{args.workloads} x {SOLUTION}; standby/spares: {'off' if args.lean else 'on'}", flush=True)
    header = (f"{'gpus':>4} {'jobs':>5} {'wall_s':>7} {'start_s':>7} {'window_s':>8} {'eval/s':>7} {'speedup':>7} "
              f"{'eff':>5} {'win_ev/s':>8} {'win_spd':>7} {'win_eff':>7} {'busy_s':>7} {'ovh_ms/job':>10}")
    print(header, flush=True)
    base = None
    with tempfile.TemporaryDirectory(prefix="fibray-scaling-", dir="/tmp") as tmp:
        dataset = make_dataset(Path(tmp) / "dataset", args.workloads)
        for gpus in counts:
            r = run_once(dataset, Path(tmp) / f"store{gpus}", gpus, args.lean)
            base = base or r
            speed, win_speed = base["wall"] / r["wall"], base["window"] / r["window"]
            print(f"{r['gpus']:>4} {r['jobs']:>5} {r['wall']:>7.1f} {r['start']:>7.1f} {r['window']:>8.1f} "
                  f"{r['jobs'] / r['wall']:>7.2f} {speed:>7.2f} {speed / gpus:>5.2f} {r['jobs'] / r['window']:>8.2f} "
                  f"{win_speed:>7.2f} {win_speed / gpus:>7.2f} {r['busy']:>7.1f} {r['overhead_ms']:>10.1f}", flush=True)
            print(f"     time: {r['phases']}", flush=True)
            if r["slots"] != gpus:
                print(f"     (only {r['slots']} of {gpus} slots ran jobs)", flush=True)
            time.sleep(1)  # let the previous Ray's processes go before the next starts


if __name__ == "__main__":
    sys.exit(main())
