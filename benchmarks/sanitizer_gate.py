"""The promotion sanitizer gate over GPU fault candidates: which compute-sanitizer tool flags each.

    python benchmarks/sanitizer_gate.py [--workloads 1] [--parallel 4] [--only NAME,...] [--tools memcheck,...]

Runs every candidate of tests/sanitizer_expectations_gpu.json (honest controls and deliberate
faults: an illegal address, a one-element out-of-bounds write, a shared-memory race, a read of
uninitialised shared memory, a divergent barrier, a read of an unwritten global buffer) on
rmsnorm_h4096's GPU workloads under memcheck, racecheck, initcheck and synccheck, each run in
its own sandboxed process with its own deadline (fibray.promote.sanitizer), and prints per
candidate what each tool said, which tools flagged it and whether that is what it was built
to show. First it prints the runtime (GPU, driver, CUDA, compute-sanitizer) and whether the
sanitizer works here; where it does not (no GPU, a refused device) every gate is not_run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROOTS = [REPO / "solutions", REPO / "tests" / "candidates_gpu", REPO / "tests" / "candidates_sanitizer"]


def main() -> int:
    from fibray.dataset import load_dataset
    from fibray.promote.artifact import driver_version
    from fibray.promote.sanitize_runner import SanitizeJob
    from fibray.promote.sanitizer import find_sanitizer, sanitizer_gates, unavailable
    from fibray.store.promotions import SANITIZER_GATES

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", type=int, default=1, help="GPU workloads of rmsnorm_h4096 per candidate")
    ap.add_argument("--parallel", type=int, default=4, help="sanitizer runs at once")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="deadline of one run")
    ap.add_argument("--only", help="comma-separated candidate names")
    ap.add_argument("--tools", help="comma-separated tools (default: all four)")
    args = ap.parse_args()
    expected: dict[str, list[str]] = json.loads((REPO / "tests" / "sanitizer_expectations_gpu.json").read_text())
    names = [n for n in expected if not args.only or n in args.only.split(",")]
    tools = [g for g in SANITIZER_GATES if not args.tools or g.value in args.tools.split(",")]

    exe = find_sanitizer()
    version = "-"
    if exe:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
        version = out[-1] if out else "?"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        cuda = torch.version.cuda
        torch_v = torch.__version__
    except ImportError:
        gpu, cuda, torch_v = "?", "?", "not installed"
    print(f"runtime: GPU {gpu}; driver {driver_version()}; torch {torch_v} (CUDA {cuda}); "
          f"compute-sanitizer {exe or 'not found'} ({version})")
    t0 = time.monotonic()
    exe, why_not = unavailable()
    print(f"sanitizer usable here: {'yes' if exe else 'no: ' + str(why_not)} (probe {time.monotonic() - t0:.1f}s)\n")

    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], workload_set="gpu",
                      solution_roots=[str(r) for r in ROOTS[1:]] + [str(ROOTS[0])], require_blobs=False)
    definition = ds.definitions["rmsnorm_h4096"]
    workloads = ds.workloads["rmsnorm_h4096"][: args.workloads]
    header = f"{'candidate':38s} " + " ".join(f"{g.value:13s}" for g in tools) + f" {'flagged by':24s} {'expected':12s} ok"
    print(header)
    bad = 0
    for name in names:
        sol = ds.solutions[name]
        jobs = [SanitizeJob(definition=definition, workload=w, solution=sol, dataset_root=str(ds.root)) for w in workloads]
        t1 = time.monotonic()
        results = sanitizer_gates(jobs, deadline_s=args.deadline_s, parallel=args.parallel, executable=exe,
                                  why_not=why_not)
        cells, flagged = [], []
        for g in tools:
            r = results[g]
            runs = r.evidence.get("runs", [])
            outcomes = sorted({run["outcome"] for run in runs}) or [r.outcome.value]
            cells.append("/".join(outcomes))
            if any(run["outcome"] == "flagged" for run in runs):
                flagged.append(g.value)
        want = [t for t in expected[name] if t in {g.value for g in tools}]
        if exe is None:
            ok = "not_run"
        else:
            honest_ok = not want and all(c == "clean" for c in cells)
            ok = "ok" if (set(want) <= set(flagged) and (want or honest_ok)) else "MISMATCH"
            bad += ok == "MISMATCH"
        print(f"{name:38s} " + " ".join(f"{c:13s}" for c in cells)
              + f" {','.join(flagged) or '-':24s} {','.join(want) or 'clean':12s} {ok}  ({time.monotonic() - t1:.0f}s)")
        if ok == "MISMATCH":
            for g in tools:
                for run in results[g].evidence.get("runs", []):
                    if run["outcome"] != "clean":
                        tail = " | ".join(run["report"].strip().splitlines()[-6:])
                        print(f"    {g.value} on {run['workload']}: {run['outcome']} (exit {run['returncode']}): {tail[-600:]}")
    print(f"\nmismatches: {bad}; wall {time.monotonic() - t0:.0f}s")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
