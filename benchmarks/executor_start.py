"""How long an executor takes from spawn to ready, alone and with others starting beside it.

    python benchmarks/executor_start.py [--counts 1 4 8] [--device cuda]

An executor serves one solution (issue 14.3), so a sweep starts one per solution: this is the
cost warm standbys must hide. Prints, first, where a bare interpreter's start goes (python,
`import torch`, the device context, `import triton`, fibray's candidate runner), each measured in
a fresh process; then spawn-to-hello of real sandboxed executors (the sweep's default policy:
their own uid when run as root, network and PID namespaces), `count` at once, each starting its own
interpreter (the baseline) and forked from a warm fork server (fibray.workers.process.forkserver);
and forked with writes confined to a scratch (runner.scratch_gb, the default) against without.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = """
import time, sys
t = [time.perf_counter()]
import torch; t.append(time.perf_counter())
dev = sys.argv[1]
if dev.startswith('cuda'):
    torch.cuda.init(); torch.zeros(1, device='cuda'); torch.cuda.synchronize()
t.append(time.perf_counter())
import triton; t.append(time.perf_counter())
import fibray.evaluate.candidate; t.append(time.perf_counter())
print(' '.join(f'{b - a:.3f}' for a, b in zip(t, t[1:])))
"""


def bare_steps(device: str, repeats: int = 3) -> None:
    rows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", STEPS, device], capture_output=True, text=True, check=True,
                             cwd=REPO).stdout.split()
        rows.append([time.perf_counter() - t0, *map(float, out)])
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"bare interpreter, median of {repeats}: whole {med[0]:.2f} s = import torch {med[1]:.2f} s, "
          f"device context {med[2]:.2f} s, import triton {med[3]:.2f} s, candidate runner {med[4]:.2f} s, "
          f"python start and exit {med[0] - sum(med[1:]):.2f} s", flush=True)


def executors(device: str, counts: list[int]) -> None:
    from fibray.sweep.config import RunnerConfig
    from fibray.sweep.pool import PoolOptions
    from fibray.workers.process import sandbox
    from fibray.workers.slot import GpuSlot

    spec = PoolOptions.from_runner(RunnerConfig(), num_slots=1).slot_spec("start-bench")
    base = Path(tempfile.mkdtemp(prefix="fibray-exstart-"))
    base.chmod(0o755)
    print(f"sandbox: drop_privileges={spec.sandbox.drop_privileges}, network isolated={spec.sandbox.isolate_network}, "
          f"pid namespace={spec.sandbox.pid_namespace}", flush=True)
    ready = GpuSlot._ready

    def batch(n: int, server, policy=spec.sandbox, how: str = "") -> float:
        t0 = time.perf_counter()
        exs = [sandbox.spawn(device, base, policy, single_use=False, server=server) for _ in range(n)]
        spawned = time.perf_counter() - t0
        times = []
        for ex in exs:
            ready(None, ex)  # type: ignore[arg-type]  (no slot state is used)
            times.append(time.perf_counter() - t0)
        for ex in exs:
            sandbox.retire(ex)
        how = how or ("forked" if server is not None else "own interpreter")
        print(f"{how}: {n} executor(s) at once: spawned in {spawned:.2f} s; ready after {min(times):.2f} s (first), "
              f"{max(times):.2f} s (last): {n / max(times):.2f} executors/s", flush=True)
        return n / max(times)

    plain = {n: batch(n, None) for n in counts}  # the baseline: each executor starts its own interpreter
    t0 = time.perf_counter()
    server = sandbox.fork_server(device, base, spec.sandbox)
    server.ready.wait(300)
    print(f"fork server warm after {time.perf_counter() - t0:.2f} s ({'ready' if not server.lost else server.why})",
          flush=True)
    try:
        for n in counts:
            forked = batch(n, server)
            print(f"  {n} at once: forked / own interpreter = {forked / plain[n]:.1f}x executors/s", flush=True)
            if spec.sandbox.scratch_bytes and spec.sandbox.drop_privileges:  # what confining writes costs a start
                loose = batch(n, server, dataclasses.replace(spec.sandbox, scratch_bytes=None), "forked, writes anywhere")
                print(f"  {n} at once: writes confined to a scratch / anywhere = {forked / loose:.2f}x executors/s",
                      flush=True)
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees a GPU)")
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    bare_steps(device)
    executors(device, args.counts)


if __name__ == "__main__":
    main()
