"""Throughput against flashinfer-bench 0.1.2: the same dataset, the same settings, one GPU, one run.

    python benchmarks/vs_flashinfer_bench.py [--dataset datasets/core --workload-set gpu
        --solutions solutions] [--warmup 10 --iterations 50 --trials 3] [--work DIR]
        [--workloads-per-definition N] [--fibray-override runner.lanes=2 ...]
    python benchmarks/vs_flashinfer_bench.py --only fibray --lanes 1 4 --workloads-per-definition 40
        (lanes equivalence: statuses identical and median latency ratio lanes=4 / lanes=1 within 2%
        over >= 300 PASSED pairs; printed as `lanes equivalence: OK`)

Both tools get one FlashInfer Trace folder, written here from a fibray dataset (definitions,
the workloads of one set, solutions): flashinfer-bench through `TraceSet.from_path` and its
`Benchmark` with the persistent runner (its default), fibray through `python -m fibray.sweep`
with the same warm-up, iterations, trials and tolerances. Each runs as its own process, with
its own empty Triton cache; wall time counts from process start to exit (imports, start-up,
compilation and every evaluation). Baseline: flashinfer-bench. Prints wall time, evaluations
per second, the ratio, whether the two agree on every (solution, workload) status, the
median ratio of their latencies where both passed, fibray's breakdown of where its time went, and
the measurement floor: the GPU time that the timed calls alone take at these settings (every
PASSED candidate's and every timed reference's median latency times its timed calls, plus one
L2 flush per call), which no tool of equal rigour can go below on one GPU.
`--workloads-per-definition N` makes the dataset larger, as a sweep of many input shapes is: each
definition gets N workloads, its own plus new ones whose variable axes are drawn log-uniformly
between the smallest and largest values its workloads have (random inputs only; fixed seed).
flashinfer-bench's runner needs CUDA; `--only fibray` runs fibray's half on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _sweep_cli import run_sweep_cli

REPO = Path(__file__).resolve().parents[1]


# -- the shared dataset ----------------------------------------------------------------------
def more_workloads(name: str, workloads: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`workloads` (JSON dicts) plus new ones up to n: variable axes drawn log-uniformly within the
    range the given workloads span, inputs as the first one's (only random/scalar inputs)."""
    import math
    import random
    import uuid

    if len(workloads) >= n or not workloads:
        return workloads[:n] if workloads else workloads
    kinds = {spec.get("type") for w in workloads for spec in w["inputs"].values()}
    if not kinds <= {"random", "scalar"}:
        raise SystemExit(f"--workloads-per-definition: {name} has {sorted(kinds - {'random', 'scalar'})} inputs; "
                         "only definitions with random or scalar inputs can get new workloads")
    rng = random.Random(f"{seed}:{name}")
    ranges = {a: (min(w["axes"][a] for w in workloads), max(w["axes"][a] for w in workloads)) for a in workloads[0]["axes"]}
    seen = {tuple(sorted(w["axes"].items())) for w in workloads}
    out = list(workloads)
    for _ in range(100 * n):
        if len(out) >= n:
            break
        axes = {a: round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for a, (lo, hi) in ranges.items()}
        key = tuple(sorted(axes.items()))
        if key in seen:
            continue
        seen.add(key)
        out.append({**workloads[0], "axes": axes, "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"fibray-bench/{name}/{key}"))})
    return out


def prepare_dataset(dataset: Path, workload_set: str | None, solution_roots: list[Path], out: Path,
                    definitions: list[str] | None = None, solutions: list[str] | None = None,
                    languages: tuple[str, ...] = ("python", "triton"), workloads_per_definition: int | None = None,
                    ) -> dict[str, int]:
    """Write a FlashInfer Trace folder (definitions/, workloads/, solutions/, blobs) that both tools load.

    Files are written as fibray's loader validated them, so both tools see the same contracts.
    Only solutions in `languages` are kept (flashinfer-bench 0.1.2 cannot load fibray's c_abi CUDA ones).
    """
    from fibray.dataset import load_dataset

    ds = load_dataset(dataset, definitions=definitions, solution_roots=solution_roots, solutions=solutions,
                      workload_set=workload_set)
    if out.exists():
        shutil.rmtree(out)
    counts = {"definitions": 0, "workloads": 0, "solutions": 0}
    for name, d in sorted(ds.definitions.items()):
        op = d.op_type
        (out / "definitions" / op).mkdir(parents=True, exist_ok=True)
        (out / "definitions" / op / f"{name}.json").write_text(json.dumps(d.to_json_dict(), indent=1))
        counts["definitions"] += 1
        workloads = [w.to_json_dict() for w in ds.workloads.get(name, [])]
        if workloads_per_definition:
            workloads = more_workloads(name, workloads, workloads_per_definition)
        rows = [{"definition": name, "solution": None, "workload": w, "evaluation": None} for w in workloads]
        (out / "workloads" / op).mkdir(parents=True, exist_ok=True)
        (out / "workloads" / op / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts["workloads"] += len(rows)
        for sol in ds.solutions_for(name):
            if sol.spec.language.value not in languages:
                continue
            (out / "solutions" / op / name).mkdir(parents=True, exist_ok=True)
            (out / "solutions" / op / name / f"{sol.name}.json").write_text(json.dumps(sol.to_json_dict(), indent=1))
            counts["solutions"] += 1
    if (Path(ds.root) / "blob").is_dir():  # safetensors inputs are named relative to the dataset root
        (out / "blob").symlink_to((Path(ds.root) / "blob").resolve())
    return counts


# -- the two runs ----------------------------------------------------------------------------
def _fib_child(args: argparse.Namespace) -> None:
    """flashinfer-bench's half, in its own process: Benchmark.run_all with the persistent runner."""
    t0 = time.monotonic()
    from flashinfer_bench.bench import Benchmark, BenchmarkConfig
    from flashinfer_bench.data import TraceSet

    ts = TraceSet.from_path(str(args.fib_child))
    cfg = BenchmarkConfig(warmup_runs=args.warmup, iterations=args.iterations, num_trials=args.trials,
                          atol=args.atol, rtol=args.rtol, log_dir=str(Path(args.work) / "fib-logs"))
    t1 = time.monotonic()
    bench = Benchmark(ts, cfg)
    try:
        result = bench.run_all(dump_traces=False)
    finally:
        bench.close()
    t2 = time.monotonic()
    rows = []
    for traces in result.traces.values():
        for t in traces:
            ev = t.evaluation
            perf = ev.performance
            rows.append({"solution": t.solution, "workload_uuid": t.workload.uuid, "status": ev.status.value,
                         "latency_ms": perf.latency_ms if perf is not None else None})
    Path(args.fib_out).write_text(json.dumps({"rows": rows, "load_s": t1 - t0, "run_s": t2 - t1}))


def run_flashinfer_bench(data: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "fib-result.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(work / "fib-triton-cache")}
    cmd = [sys.executable, __file__, "--fib-child", str(data), "--fib-out", str(out), "--work", str(work),
           *_settings_argv(args)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (work / "fib.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"flashinfer-bench run failed (rc={proc.returncode}); log {work / 'fib.log'}:\n"
                         + (proc.stdout + proc.stderr)[-3000:])
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    res["after_setup_s"] = res["run_s"]
    return res


_SALT = os.urandom(32)
"""One secret input salt for all of this invocation's fibray runs."""


LANES_MIN_PAIRS = 300
"""(solution, workload) pairs PASSED under both lane settings that the lanes-equivalence check needs."""
LANES_TOLERANCE = 0.02
"""How far the median latency ratio lanes=N / lanes=1 may be from 1."""


def _lanes(text: str) -> int | str:
    """A --lanes value: a positive number, or `auto` (runner.lanes' default)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of lanes (at least 1) or auto")
    return int(text)


def run_fibray(data: Path, work: Path, args: argparse.Namespace, lanes: int | str, address: str | None = None) -> dict[str, Any]:
    from fibray.store import TraceStore

    tag = f"{lanes}-cluster" if address else str(lanes)
    store = work / f"fibray-store-{tag}"
    cache = work / f"fibray-triton-cache-{tag}"
    for d in (store, cache):
        shutil.rmtree(d, ignore_errors=True)
    # every fibray run of this comparison draws the same inputs (lanes=N against lanes=1: issue 15.3)
    TraceStore(store).sweep_salt("vs_flashinfer_bench", adopt=_SALT)
    run = run_sweep_cli(
        [f"dataset.root={data}", "solutions.roots=[]", f"store.root={store}", "sweep.name=vs_flashinfer_bench",
         f"eval.warmup={args.warmup}", f"eval.iterations={args.iterations}", f"eval.trials={args.trials}",
         f"eval.atol={args.atol}", f"eval.rtol={args.rtol}", f"runner.lanes={lanes}", *args.fibray_override],
        log=work / f"fibray-{tag}.log", cwd=work,
        env={**os.environ, "TRITON_CACHE_DIR": str(cache), **({"RAY_ADDRESS": address} if address else {})})
    rows = TraceStore(store).read(sweep="vs_flashinfer_bench",
                                  columns=["solution", "workload_uuid", "status", "reason", "latency_ms",
                                           "reference_latency_ms"]).to_pylist()
    return {"rows": rows, "wall_s": run.wall_s, "breakdown": run.breakdown, "summary": run.summary,
            "after_setup_s": run.start_s + run.window_s, "window_s": run.window_s}


@contextlib.contextmanager
def _ray_head(work: Path):
    """A local Ray head (`ray start --head`), as a cluster a sweep is submitted to; stopped afterwards."""
    from fibray.workers.start import visible_gpu_count

    ray_bin = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
    gpus = visible_gpu_count() or 1  # a logical GPU on a machine without one
    proc = subprocess.run([*ray_bin, "start", "--head", "--disable-usage-stats", "--include-dashboard=false",
                           f"--num-gpus={gpus}", f"--temp-dir={work / 'ray-head'}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ray start failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    try:
        yield "auto"
    finally:
        subprocess.run([*ray_bin, "stop", "--force"], capture_output=True)


def _settings_argv(args: argparse.Namespace) -> list[str]:
    return ["--warmup", str(args.warmup), "--iterations", str(args.iterations), "--trials", str(args.trials),
            "--atol", str(args.atol), "--rtol", str(args.rtol)]


# -- comparison ------------------------------------------------------------------------------
def compare(fibray_rows: list[dict], fib_rows: list[dict]) -> dict[str, Any]:
    """Status agreement per (solution, workload) and latency ratios where both passed."""
    ours = {(r["solution"], r["workload_uuid"]): r for r in fibray_rows}
    theirs = {(r["solution"], r["workload_uuid"]): r for r in fib_rows}
    both = sorted(set(ours) & set(theirs))
    def status(r: dict) -> str:
        return r["status"] + (f" ({r['reason']})" if r.get("reason") else "")

    disagree = [(k, status(ours[k]), status(theirs[k])) for k in both if ours[k]["status"] != theirs[k]["status"]]
    ratios = [ours[k]["latency_ms"] / theirs[k]["latency_ms"] for k in both
              if ours[k]["status"] == theirs[k]["status"] == "PASSED"
              and ours[k]["latency_ms"] and theirs[k]["latency_ms"]]
    return {"pairs": len(both), "only_fibray": sorted(set(ours) - set(theirs)),
            "only_fib": sorted(set(theirs) - set(ours)), "disagree": disagree, "latency_ratios": ratios}


def _versions() -> str:
    import importlib.metadata as md

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    names = ("torch", "triton", "ray", "flashinfer-bench", "fibray")
    vers = []
    for n in names:
        try:
            vers.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            vers.append(f"{n} -")
    return f"{gpu}; python {sys.version.split()[0]}; " + ", ".join(vers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", type=Path, default=REPO / "datasets" / "core")
    ap.add_argument("--workload-set", default="gpu")
    ap.add_argument("--solutions", type=Path, nargs="*", default=[REPO / "solutions"])
    ap.add_argument("--definitions", nargs="*", default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--atol", type=float, default=1e-2)
    ap.add_argument("--rtol", type=float, default=1e-2)
    ap.add_argument("--workloads-per-definition", type=int, default=None,
                    help="grow (or cut) each definition's workloads to this many; new ones get new axis values")
    ap.add_argument("--languages", nargs="+", default=["python", "triton"], help="solution languages to compare")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fibray-vs-fib"))
    ap.add_argument("--only", choices=("fibray", "flashinfer-bench"), default=None)
    ap.add_argument("--lanes", type=_lanes, nargs="+", default=[1],
                    help="fibray runs, one per runner.lanes value (a number, or auto: fibray's default)")
    ap.add_argument("--existing-cluster", action="store_true",
                    help="one more fibray run (last --lanes value) joining a Ray head started before the clock starts")
    ap.add_argument("--fibray-override", nargs="*", default=[], help="extra fibray.sweep overrides (key=value)")
    ap.add_argument("--fib-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--fib-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fib_child:
        _fib_child(args)
        return
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "dataset"
    counts = prepare_dataset(args.dataset, args.workload_set, args.solutions, data, definitions=args.definitions,
                             languages=tuple(args.languages), workloads_per_definition=args.workloads_per_definition)
    print(_versions())
    print(f"dataset {args.dataset} (workload set {args.workload_set}): {counts['definitions']} definitions, "
          f"{counts['workloads']} workloads, {counts['solutions']} solutions; warm-up {args.warmup}, "
          f"iterations {args.iterations}, trials {args.trials}, atol {args.atol}, rtol {args.rtol}")
    res: dict[str, dict] = {}
    if args.only in (None, "flashinfer-bench"):
        f = res["flashinfer-bench"] = run_flashinfer_bench(data, work, args)
        print(f"flashinfer-bench: {len(f['rows'])} evaluations, wall {f['wall_s']:.1f} s, Benchmark.run_all "
              f"{f['run_s']:.1f} s", flush=True)
    if args.only in (None, "fibray"):
        for lanes in args.lanes:
            r = res[f"fibray lanes={lanes}"] = run_fibray(data, work, args, lanes)
            print(f"fibray lanes={lanes}: {len(r['rows'])} evaluations, wall {r['wall_s']:.1f} s; {r['summary']}\n"
                  f"  time: {r['breakdown']}", flush=True)  # now: a run stopped later keeps this one
        if args.existing_cluster:  # the sweep as a batch job on a Ray cluster that is already up
            with _ray_head(work) as address:
                res[f"fibray lanes={args.lanes[-1]} on a running cluster"] = run_fibray(data, work, args, args.lanes[-1], address)
    print(f"\n{'tool':<18}{'evals':>7}{'wall_s':>9}{'eval/s':>9}{'after_setup_s':>15}{'eval/s':>9}")
    for name, r in res.items():
        n = len(r["rows"])
        after = r["after_setup_s"]
        print(f"{name:<18}{n:>7}{r['wall_s']:>9.1f}{n / r['wall_s']:>9.2f}{after:>15.1f}{n / after:>9.2f}")
    print("(after setup: flashinfer-bench's Benchmark.run_all, which starts its runner; fibray's slot start-up "
          "and jobs, without dataset loading and Ray's start)")
    for name, r in res.items():
        if name.startswith("fibray"):
            print(f"{name}: {r['summary']}\n{name} time: {r['breakdown']}")
    runs = [name for name in res if name.startswith("fibray")]
    for name in runs[1:]:  # lanes must not change what is measured
        c = compare(res[name]["rows"], res[runs[0]]["rows"])
        r = c["latency_ratios"]
        med = statistics.median(r) if r else float("nan")
        print(f"{name} vs {runs[0]}: statuses {c['pairs'] - len(c['disagree'])}/{c['pairs']} agree; latency ratio "
              f"median {med:.3f} over {len(r)} pairs")
        for (sol, uuid), ours, theirs in c["disagree"]:
            print(f"  disagree: {sol} {uuid[:8]}: {name} {ours}, {runs[0]} {theirs}")
        ok = not c["disagree"] and len(r) >= LANES_MIN_PAIRS and abs(med - 1) <= LANES_TOLERANCE
        print(f"lanes equivalence (issue 15.3: statuses identical, median latency ratio within "
              f"{LANES_TOLERANCE:.0%} over >= {LANES_MIN_PAIRS} PASSED pairs): {'OK' if ok else 'NOT MET'}"
              + ("" if len(r) >= LANES_MIN_PAIRS else f" (only {len(r)} pairs: use --workloads-per-definition 40)"))
    if "flashinfer-bench" in res:
        f = res["flashinfer-bench"]
        print(f"flashinfer-bench: import+load {f['load_s']:.1f}s, Benchmark.run_all {f['run_s']:.1f}s")
        for name in runs:
            _report_pair(name, res[name], f)
    if runs:
        _report_floor(res[runs[0]]["rows"], args, res.get("flashinfer-bench"))


def _flush_ms() -> float:
    """The median time of one L2 flush as fibray's timer writes it (CUDA events, this GPU)."""
    import torch

    from fibray.timing.timer import _flush_buffer

    buf = _flush_buffer(torch.device("cuda"))
    times = []
    for _ in range(60):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        buf.zero_()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[10:])


def measurement_floor(rows: list[dict], timed_calls: int, flush_ms: float) -> dict[str, float]:
    """Seconds of GPU time the timed calls alone need: PASSED candidates, and the reference once
    per workload that one was timed for, each `timed_calls` times at its median latency, with a flush."""
    cand = [r["latency_ms"] for r in rows if r["status"] == "PASSED" and r["latency_ms"]]
    refs = {r["workload_uuid"]: r["reference_latency_ms"] for r in rows
            if r["status"] == "PASSED" and r.get("reference_latency_ms")}
    kernels = timed_calls * (sum(cand) + sum(refs.values())) / 1e3
    flushes = timed_calls * (len(cand) + len(refs)) * flush_ms / 1e3
    return {"candidates": len(cand), "references": len(refs), "kernels_s": kernels, "flushes_s": flushes,
            "floor_s": kernels + flushes}


def _report_floor(rows: list[dict], args: argparse.Namespace, fib: dict | None) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    flush = _flush_ms()
    fl = measurement_floor(rows, args.iterations * args.trials, flush)
    print(f"\nmeasurement floor ({args.iterations * args.trials} timed calls each, L2 flush {flush * 1e3:.1f} us): "
          f"{fl['candidates']} PASSED candidates + {fl['references']} references: kernels {fl['kernels_s']:.2f}s + "
          f"flushes {fl['flushes_s']:.2f}s = {fl['floor_s']:.2f}s of exclusive GPU time")
    if fib is not None:
        print(f"flashinfer-bench's Benchmark.run_all {fib['run_s']:.1f}s is {fib['run_s'] / fl['floor_s']:.2f}x the floor: "
              f"the most any equally rigorous tool could gain on it with one GPU, after setup")


def _report_pair(name: str, a: dict, b: dict) -> None:
    rate = lambda r, s: len(r["rows"]) / r[s]  # noqa: E731
    print(f"\n{name} / flashinfer-bench (eval/s; baseline flashinfer-bench): end to end "
          f"{rate(a, 'wall_s') / rate(b, 'wall_s'):.2f}x, after setup {rate(a, 'after_setup_s') / rate(b, 'after_setup_s'):.2f}x")
    c = compare(a["rows"], b["rows"])
    agree = c["pairs"] - len(c["disagree"])
    print(f"statuses: {agree}/{c['pairs']} (solution, workload) pairs agree; "
          f"only in fibray {len(c['only_fibray'])}, only in flashinfer-bench {len(c['only_fib'])}")
    for (sol, uuid), ours, theirs in c["disagree"]:
        print(f"  disagree: {sol} {uuid[:8]}: fibray {ours}, flashinfer-bench {theirs}")
    if c["latency_ratios"]:
        q = statistics.quantiles(c["latency_ratios"], n=4) if len(c["latency_ratios"]) > 1 else c["latency_ratios"] * 3
        print(f"latency fibray / flashinfer-bench where both PASSED ({len(c['latency_ratios'])} pairs): "
              f"median {statistics.median(c['latency_ratios']):.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}")


if __name__ == "__main__":
    main()
