"""Every LLM operator family, every solution, through the real sweep; summarised per family.

    python benchmarks/llm_families.py [--store DIR] [--workloads N] [--trials 3] [--skip-sweep]

Runs `python -m fibray.sweep` over datasets/llm (the GPU-size set on a GPU machine, which
must have been generated: `python -m fibray.generate --out datasets/llm --set gpu`;
the cpu_small set otherwise), at most N workloads per definition, then reads the store
(pyarrow) and prints per definition and solution: passed/total, median latency, geomean
speedup over the definition's reference, and the ratio of each solution's latency to the
PyTorch solution's on the same workloads (baseline: the `_torch` solution, PyTorch's own
kernels). Then the best solution per family, and every failure with its reason.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from _sweep_cli import run_sweep_cli

REPO = Path(__file__).resolve().parents[1]


def _sweep(store: Path, workload_set: str, workloads: int, trials: int, extra: list[str]) -> None:
    run = run_sweep_cli(
        [f"dataset.root={REPO / 'datasets' / 'llm'}", f"dataset.workload_set={workload_set}",
         f"dataset.max_workloads_per_definition={workloads}", "solutions.roots=[]", f"store.root={store}",
         "sweep.name=llm_families", "eval.warmup=10", "eval.iterations=50", f"eval.trials={trials}", *extra],
        log=store.with_name(store.name + ".log"))
    print(f"{run.summary}\ntime: {run.breakdown}", flush=True)


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarise(store: Path) -> None:
    from fibray.store import TraceStore

    rows = TraceStore(store).read(sweep="llm_families", columns=[
        "op_type", "definition", "solution", "language", "workload_uuid", "status", "reason", "latency_ms",
        "speedup", "log"]).to_pylist()
    by_sol: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        by_sol[(r["definition"], r["solution"])].append(r)
    torch_ms: dict[tuple[str, str], float] = {}
    for (d, s), rs in by_sol.items():
        if s.endswith("_torch"):
            for r in rs:
                if r["status"] == "PASSED":
                    torch_ms[(d, r["workload_uuid"])] = r["latency_ms"]
    print(f"\n{'definition':<46}{'solution':<58}{'lang':<8}{'passed':>8}{'median_ms':>11}{'speedup':>9}{'vs_torch':>9}")
    best: dict[str, tuple[float, str, str]] = {}
    op_of = {r["definition"]: r["op_type"] for r in rows}
    for (d, s), rs in sorted(by_sol.items()):
        ok = [r for r in rs if r["status"] == "PASSED"]
        med = statistics.median(r["latency_ms"] for r in ok) if ok else float("nan")
        vs = [torch_ms[(d, r["workload_uuid"])] / r["latency_ms"] for r in ok if (d, r["workload_uuid"]) in torch_ms]
        vs_torch = _geomean(vs)
        print(f"{d:<46}{s:<58}{rs[0]['language']:<8}{len(ok):>4}/{len(rs):<3}{med:>11.4f}"
              f"{_geomean([r['speedup'] for r in ok]):>8.2f}x{vs_torch:>8.2f}x")
        if ok and len(ok) == len(rs) and not s.endswith("_torch") and vs:
            fam = op_of[d]
            if fam not in best or vs_torch > best[fam][0]:
                best[fam] = (vs_torch, d, s)
    print("\nbest non-PyTorch solution per family (all workloads PASSED), geomean latency ratio PyTorch / it:")
    for fam, (ratio, d, s) in sorted(best.items()):
        print(f"  {fam:<12} {s:<58} {ratio:.2f}x")
    fails = [r for r in rows if r["status"] != "PASSED"]
    total = len(rows)
    print(f"\n{total - len(fails)}/{total} PASSED; failures by (solution, status, reason):")
    counts: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in fails:
        counts[(r["solution"], r["status"], r["reason"] or "")].append(r)
    for (s, st, why), rs in sorted(counts.items()):
        first = (rs[0]["log"] or "").strip().splitlines()
        print(f"  {s:<58} {st:<20} {why:<24} x{len(rs)}  {first[-1][:160] if first else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/fibray-llm-families"))
    ap.add_argument("--workload-set", default=None, help="default: gpu on a GPU machine, else cpu_small")
    ap.add_argument("--workloads", type=int, default=4, help="workloads per definition")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--skip-sweep", action="store_true", help="only summarise the store")
    ap.add_argument("override", nargs="*", help="extra fibray.sweep overrides (key=value)")
    args = ap.parse_args()
    if not args.skip_sweep:
        import torch

        wset = args.workload_set or ("gpu" if torch.cuda.is_available() else "cpu_small")
        _sweep(args.store, wset, args.workloads, args.trials, args.override)
    summarise(args.store)


if __name__ == "__main__":
    main()
