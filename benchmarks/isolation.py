"""Cost per evaluation in fresh-process isolation vs a persistent executor, on the same jobs.

    python benchmarks/isolation.py [--jobs 20]

Both modes run in one GpuSlot on this machine's device. Isolated jobs use pre-warmed
single-use executors (started in the background while earlier jobs run). Baseline:
persistent. Prints per-evaluation wall time for each mode and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch

    from fibray.evaluate import now_iso
    from fibray.workers.slot import GpuSlot
    from fibray.workers.spec import SlotSpec
    from recovery import _job

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--spares", type=int, default=2)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="fibray-isolation-", dir="/tmp")
    os.chmod(workdir, 0o755)
    slot = GpuSlot(SlotSpec("bench", workdir=workdir, standby=True, spare_isolated=args.spares))
    slot.info()
    slot.evaluate(_job(10_000), "persistent", now_iso())
    slot.evaluate(_job(10_001), "isolated", now_iso())  # fills the pool of spares
    for ex in slot.fresh:
        slot._ready(ex)
    times = {}
    for mode in ("persistent", "isolated"):
        per = []
        for i in range(args.jobs):
            job = _job(i)  # new seed: new inputs and reference, same work in both modes
            t0 = time.perf_counter()
            r = slot.evaluate(job, mode, now_iso())
            per.append(time.perf_counter() - t0)
            assert r.evaluation.status.value == "PASSED", r.evaluation.log
            assert r.isolation == mode
        times[mode] = per
        print(f"{mode:10s}: median {statistics.median(per):.3f}s/eval  mean {statistics.fmean(per):.3f}s  max {max(per):.3f}s", flush=True)
    slot.shutdown()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    med = statistics.median
    print(f"device: {dev}; {args.jobs} jobs per mode; spares: {args.spares}; job: rmsnorm_h4096_torch, 1 trial, 3 iterations")
    print(f"ratio isolated / persistent: {med(times['isolated']) / med(times['persistent']):.2f}x")


if __name__ == "__main__":
    main()
