"""The promotion sanitizer and shared-memory poison gates over GPU fault candidates: which flags each.

    python benchmarks/sanitizer_gate.py [--workloads 1] [--parallel 4] [--only NAME,...] [--tools memcheck,...]

Runs every candidate of tests/sanitizer_expectations_gpu.json (honest controls and deliberate
faults: an illegal address, a one-element out-of-bounds write, a shared-memory race, a read of
uninitialised shared memory masked out of the result and one that reaches it, a divergent
barrier, a read of an unwritten global buffer) on rmsnorm_h4096's GPU workloads under memcheck,
racecheck, initcheck and synccheck and through the smem_poison gate, each run in its own
sandboxed process with its own deadline (fibray.promote.sanitizer, fibray.promote.smem_poison),
and prints per candidate what each gate said, which flagged it and whether that is what it was
built to show (a gate that could not run here is not judged). First it prints the runtime (GPU,
driver, CUDA, compute-sanitizer) and whether the sanitizer works here. --only takes full names or
their ends (cuda_uninit_shared for sanitizer_cuda_uninit_shared).
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
_SMEM_CELL = {"same": "clean", "changes": "flagged"}
"""smem_poison verdict -> the cell the sanitizer tools' outcomes use (the others are shown as they are)."""


def _pick(expected: list[str], only: str | None) -> list[str]:
    """The candidates --only names, by full name or by its end after an underscore."""
    if not only:
        return list(expected)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(n == w or n.endswith("_" + w) for n in expected)]
    if unknown:
        raise SystemExit(f"--only: no candidate named {', '.join(unknown)} (candidates: {', '.join(expected)})")
    return [n for n in expected if any(n == w or n.endswith("_" + w) for w in wanted)]


def main() -> int:
    from fibray.dataset import load_dataset
    from fibray.promote.artifact import driver_version
    from fibray.promote.sanitize_runner import SanitizeJob
    from fibray.promote.sanitizer import find_sanitizer, sanitizer_gates, unavailable
    from fibray.promote.smem_poison import smem_poison_gate
    from fibray.store.promotions import SANITIZER_GATES, Gate

    gates = [*SANITIZER_GATES, Gate.SMEM_POISON]
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", type=int, default=1, help="GPU workloads of rmsnorm_h4096 per candidate")
    ap.add_argument("--parallel", type=int, default=4, help="sanitizer (and smem_poison) runs at once")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="deadline of one run")
    ap.add_argument("--only", help="comma-separated candidate names (or their ends: cuda_uninit_shared)")
    ap.add_argument("--tools", help=f"comma-separated gates (default: all of {','.join(g.value for g in gates)})")
    args = ap.parse_args()
    expected: dict[str, list[str]] = json.loads((REPO / "tests" / "sanitizer_expectations_gpu.json").read_text())
    names = _pick(list(expected), args.only)
    picked = args.tools.split(",") if args.tools else [g.value for g in gates]
    if unknown := sorted(set(picked) - {g.value for g in gates}):
        raise SystemExit(f"--tools: unknown {', '.join(unknown)} (gates: {', '.join(g.value for g in gates)})")
    tools = [g for g in gates if g.value in picked]
    sanitizers = [g for g in tools if g in SANITIZER_GATES]

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
    exe, why_not = None, "not asked for (--tools)"
    if sanitizers:
        exe, why_not = unavailable()
        print(f"sanitizer usable here: {'yes' if exe else 'no: ' + str(why_not)} (probe {time.monotonic() - t0:.1f}s)")
    print()

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
        results = {}
        if sanitizers:
            results.update(sanitizer_gates(jobs, deadline_s=args.deadline_s, parallel=args.parallel, executable=exe,
                                           why_not=why_not))
        if Gate.SMEM_POISON in tools:
            results[Gate.SMEM_POISON] = smem_poison_gate(jobs, deadline_s=args.deadline_s, parallel=args.parallel)
        cells, flagged, judged = [], [], []
        for g in tools:
            r = results[g]
            runs = r.evidence.get("runs", [])
            if g is Gate.SMEM_POISON:
                outcomes = sorted({_SMEM_CELL.get(run["verdict"], run["verdict"]) for run in runs})
            else:
                outcomes = sorted({run["outcome"] for run in runs})
            cells.append("/".join(outcomes) or r.outcome.value)
            if runs:  # it ran here: judged
                judged.append(g.value)
            if "flagged" in outcomes:
                flagged.append(g.value)
        want = [t for t in expected[name] if t in judged]
        if not judged:
            ok = "not_run"
        else:
            honest_ok = not want and all(c == "clean" for g, c in zip(tools, cells) if g.value in judged)
            ok = "ok" if (set(want) <= set(flagged) and (want or honest_ok)) else "MISMATCH"
            bad += ok == "MISMATCH"
        shown = [t for t in expected[name] if t in {g.value for g in tools}]
        print(f"{name:38s} " + " ".join(f"{c:13s}" for c in cells)
              + f" {','.join(flagged) or '-':24s} {','.join(shown) or 'clean':12s} {ok}  ({time.monotonic() - t1:.0f}s)")
        for g in tools:
            r = results[g]
            if g is Gate.SMEM_POISON:
                what = r.reason if r.outcome.value == "not_run" else f"{r.outcome.value}: {r.reason}"
                print(f"    smem_poison: {what[:600]}")
                for run in r.evidence.get("runs", [])[:1]:
                    print(f"    {run['probe'] or 'smem_poison probe: no line (the runner stopped before it)'}")
            elif ok == "MISMATCH":
                for run in r.evidence.get("runs", []):
                    if run["outcome"] != "clean":
                        tail = " | ".join(run["report"].strip().splitlines()[-6:])
                        print(f"    {g.value} on {run['workload']}: {run['outcome']} (exit {run['returncode']}): {tail[-600:]}")
    print(f"\nmismatches: {bad}; wall {time.monotonic() - t0:.0f}s")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
