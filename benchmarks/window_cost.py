"""What a timed window costs the slot: asking the other executors to settle, stopping them, and
continuing them, with K executors idle beside the timed one.

    python benchmarks/window_cost.py [--counts 1 4 9] [--windows 200] [--device cuda]

Three ways, in one run, on the same executors: `off` (nothing asked or stopped: the floor),
`pids` (each executor and the processes listed below it, SIGSTOPped one by one: what the slot did
before fork chains were stopped), and `uid` (the slot's way: each executor's whole uid, by
kill(-1) from the uid signaller, then one look at /proc). Prints the median and p95 of a
window's entry plus exit and the ratio uid / pids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(quiet, executors, windows: int) -> list[float]:
    out = []
    for _ in range(windows):
        t0 = time.perf_counter()
        with quiet.window("bench", executors, keep=None):
            pass
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 4, 9])
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees a GPU)")
    args = ap.parse_args()
    import torch

    from fibray.sweep.config import RunnerConfig
    from fibray.sweep.pool import PoolOptions
    from fibray.workers.process import sandbox
    from fibray.workers.quiesce import Quiet
    from fibray.workers.slot import GpuSlot

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    spec = PoolOptions.from_runner(RunnerConfig(), num_slots=1).slot_spec("window-bench")
    base = Path(tempfile.mkdtemp(prefix="fibray-windows-"))
    base.chmod(0o755)
    print(f"device {device}; sandbox: drop_privileges={spec.sandbox.drop_privileges}, "
          f"pid namespace={spec.sandbox.pid_namespace}; {args.windows} windows per row", flush=True)
    quiet = Quiet(spec.sandbox)
    server = sandbox.fork_server(device, base, spec.sandbox) if spec.sandbox.fork_server else None
    if server is not None:
        server.ready.wait(300)
    try:
        for k in args.counts:
            exs = [sandbox.spawn(device, base, spec.sandbox, single_use=False, server=server) for _ in range(k)]
            try:
                for ex in exs:
                    GpuSlot._ready(None, ex)  # type: ignore[arg-type]  (no slot state is used)
                rows = {}
                for mode in ("off", "pids", "uid"):
                    quiet.enabled, quiet.by_uid = mode != "off", mode == "uid"
                    measure(quiet, exs, 5)  # the signaller's start, caches
                    t = sorted(measure(quiet, exs, args.windows))
                    rows[mode] = statistics.median(t)
                    print(f"  {k} executor(s), {mode:>4}: median {rows[mode] * 1e3:.2f} ms, "
                          f"p95 {t[int(0.95 * (len(t) - 1))] * 1e3:.2f} ms", flush=True)
                print(f"{k} executor(s): uid / pids = {rows['uid'] / rows['pids']:.2f}x "
                      f"(+{(rows['uid'] - rows['pids']) * 1e3:.2f} ms a window)", flush=True)
            finally:
                for ex in exs:
                    sandbox.retire(ex)
    finally:
        quiet.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
