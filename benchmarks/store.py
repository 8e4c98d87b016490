"""Trace store at scale: write N synthetic evaluations (default 1,000,000) and time the queries.

Times, on the same rows: the write through `TraceStore.append`, a leaderboard of one sweep,
a two-sweep comparison, and compaction; then the same write and queries done naively over
FlashInfer Trace JSONL (json + dicts), and prints both with their ratio. The two sides are
checked to give the same answers before any figure is printed. Run from the repo root:

    python benchmarks/store.py [--rows 1000000] [--batch-rows 5000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import polars as pl
import pyarrow as pa
from polars.testing import assert_frame_equal

from fibray.analysis import compare_sweeps, evaluations, leaderboard
from fibray.store import SCHEMA, TraceStore
from fibray.store.compact import compact_partition, partitions

SWEEPS = ("base", "cand")
AUTHORS = ("agent-a", "agent-b", "agent-c", "agent-d", "agent-e")
LANGUAGES = ("triton", "cuda", "python")
OP_TYPES = ("gemm", "rmsnorm", "gqa_paged", "moe")
# (status, reason, weight) of failures; PASSED's share is set per solution.
FAILURES = (("COMPILE_ERROR", "nvcc_error", 3), ("COMPILE_ERROR", "syntax_error", 2), ("RUNTIME_ERROR", "exception", 3),
            ("RUNTIME_ERROR", "illegal_memory_access", 1), ("RUNTIME_ERROR", "crashed", 1),
            ("INCORRECT_NUMERICAL", "tolerance_exceeded", 4), ("INCORRECT_SHAPE", "wrong_shape", 1),
            ("INCORRECT_DTYPE", "wrong_dtype", 1), ("TIMEOUT", "run_timeout", 1))
T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
LIBS = {"torch": "2.13.0", "triton": "3.9.0", "cuda": "13.0", "python": "3.11.7", "fibray": "0.1.0"}
LIBS_JSON = json.dumps(LIBS, sort_keys=True)
SETTINGS_JSON = json.dumps({"atol": 0.01, "iterations": 20, "rtol": 0.01, "seed": 0, "trials": 3, "warmup": 3},
                           sort_keys=True)


@dataclass(frozen=True)
class Shape:
    """How the synthetic rows are laid out: sweeps x definitions x solutions x workloads."""

    definitions: int
    solutions: int
    workloads: int

    @property
    def rows(self) -> int:
        return len(SWEEPS) * self.definitions * self.solutions * self.workloads


def shape_for(rows: int, definitions: int, solutions: int) -> Shape:
    workloads = max(1, round(rows / (len(SWEEPS) * definitions * solutions)))
    return Shape(definitions, solutions, workloads)


def synthetic(shape: Shape, seed: int = 0) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(store row, FlashInfer Trace dict) for every evaluation, sweep by sweep, one definition at a time."""
    rng = random.Random(seed)
    reasons = [(s, r) for s, r, w in FAILURES for _ in range(w)]
    template: dict[str, Any] = dict.fromkeys(SCHEMA.names)
    quality = {(d, s): (rng.uniform(0.2, 0.95), rng.gauss(0.0, 0.5))
               for d in range(shape.definitions) for s in range(shape.solutions)}
    for k, sweep in enumerate(SWEEPS):
        rng = random.Random(seed * 1000 + 7)  # same draws in both sweeps; the candidate sweep then drifts
        drift = random.Random(seed * 1000 + 11 + k)
        for d in range(shape.definitions):
            definition, op_type = f"synth_{d:02d}", OP_TYPES[d % len(OP_TYPES)]
            wls = []
            for w in range(shape.workloads):
                axes = {"M": 2 ** (w % 12), "seq_len": 128 * (1 + (w // 12) % 16)}
                uuid = f"{d:04x}{w:04x}-0000-5000-8000-{w:012x}"
                wl = {"axes": axes, "inputs": {"A": {"type": "random"}, "B": {"type": "random"}}, "uuid": uuid}
                wls.append((uuid, wl, json.dumps(axes, sort_keys=True), json.dumps(wl, sort_keys=True),
                            0.01 * (1 + w % 97)))
            for s in range(shape.solutions):
                solution = f"{definition}_cand{s:02d}"
                author, language = AUTHORS[s % len(AUTHORS)], LANGUAGES[s % len(LANGUAGES)]
                p_pass, mu = quality[(d, s)]
                for w, (uuid, wl, axes_json, wl_json, ref_ms) in enumerate(wls):
                    passed = rng.random() < p_pass
                    speedup = math.exp(rng.gauss(mu, 0.3))
                    failure = reasons[rng.randrange(len(reasons))]
                    if k == 1:  # candidate sweep: small speed drift, a few status flips
                        speedup *= math.exp(drift.gauss(0.0, 0.08))
                        if drift.random() < 0.03:
                            passed = not passed
                    status, reason = ("PASSED", None) if passed else failure
                    finished = T0 + timedelta(days=k, milliseconds=(d * shape.solutions + s) * shape.workloads + w)
                    stamp = finished.isoformat()
                    lat = ref_ms / speedup
                    log = "" if passed else f"{status.lower()}: {reason} in {solution} on M={wl['axes']['M']}"
                    row = template.copy()
                    row.update(
                        definition=definition, sweep=sweep, job_id=f"{d:04d}{s:04d}{w:06d}-{k}", op_type=op_type,
                        workload_uuid=uuid, axes=axes_json, workload=wl_json, solution=solution,
                        solution_hash=f"{d:04d}{s:04d}", author=author, language=language, status=status,
                        reason=reason, log=log, hardware="NVIDIA H200", libs=LIBS_JSON, settings=SETTINGS_JSON,
                        torch_version=LIBS["torch"], triton_version=LIBS["triton"], cuda_version=LIBS["cuda"],
                        python_version=LIBS["python"], fibray_version=LIBS["fibray"], worker=f"gpu{s % 8}",
                        isolation="persistent", attempt=1, started_at=finished - timedelta(milliseconds=5),
                        finished_at=finished, evaluation_timestamp=stamp,
                    )
                    ev: dict[str, Any] = {"status": status, "environment": {"hardware": "NVIDIA H200", "libs": LIBS},
                                          "timestamp": stamp, "log": log, "reason": reason}
                    if passed or status == "INCORRECT_NUMERICAL":
                        row.update(max_abs_error=1e-3, max_rel_error=2e-3)
                        ev["correctness"] = {"max_relative_error": 2e-3, "max_absolute_error": 1e-3}
                    if passed:
                        row.update(latency_ms=lat, latency_p95_ms=lat * 1.05, latency_mean_ms=lat * 1.01,
                                   latency_cv=0.02, n_samples=60, reference_latency_ms=ref_ms, speedup=speedup)
                        ev["performance"] = {"latency_ms": lat, "reference_latency_ms": ref_ms, "speedup_factor": speedup,
                                             "latency_p95_ms": lat * 1.05, "latency_mean_ms": lat * 1.01,
                                             "latency_cv": 0.02, "n_samples": 60}
                    yield row, {"definition": definition, "workload": wl, "solution": solution, "evaluation": ev}


@dataclass
class Took:
    """Wall-clock and CPU seconds (CPU summed over threads: Polars uses several, plain Python one)."""

    wall: float = 0.0
    cpu: float = 0.0

    def __iadd__(self, other: "Took") -> "Took":
        self.wall += other.wall
        self.cpu += other.cpu
        return self

    def __str__(self) -> str:
        return f"{fmt_s(self.wall)} (cpu {fmt_s(self.cpu)})"


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[Took, Any]:
    """(median wall and CPU seconds over `repeat` runs, last result)."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return Took(statistics.median(walls), statistics.median(cpus)), result


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.0f} ms"


# ---------------------------------------------------------------- naive FlashInfer Trace JSONL side

def jsonl_files(root: Path, sweep: str) -> list[Path]:
    return sorted((root / sweep / "traces").glob("**/*.jsonl"))


def naive_units(root: Path, sweep: str) -> dict[tuple[str, str, str], tuple[str, str, float | None]]:
    """(definition, solution, workload uuid) -> (timestamp, status, speedup), the latest of each."""
    latest: dict[tuple[str, str, str], tuple[str, str, float | None]] = {}
    for path in jsonl_files(root, sweep):
        with open(path) as f:
            for line in f:
                t = json.loads(line)
                ev = t["evaluation"]
                key = (t["definition"], t["solution"], t["workload"]["uuid"])
                perf = ev.get("performance")
                value = (ev["timestamp"], ev["status"], perf["speedup_factor"] if perf else None)
                if key not in latest or value[0] > latest[key][0]:
                    latest[key] = value
    return latest


def naive_leaderboard(root: Path, sweep: str, ps: tuple[float, ...] = (0.0, 1.0, 1.5, 2.0)) -> dict[tuple[str, str], dict]:
    """The leaderboard with json and dicts: passed / total, geomean speedup and fast_p per (definition, solution)."""
    units = naive_units(root, sweep)
    workloads: dict[str, set[str]] = defaultdict(set)
    acc: dict[tuple[str, str], dict] = defaultdict(lambda: {"passed": 0, "logs": [], **{p: 0 for p in ps}})
    for (definition, solution, wl), (_, status, speedup) in units.items():
        workloads[definition].add(wl)
        a = acc[(definition, solution)]
        if status == "PASSED":
            a["passed"] += 1
            if speedup:
                a["logs"].append(math.log(speedup))
            for p in ps:
                a[p] += p == 0 or (speedup is not None and speedup > p)
    out = {}
    for (definition, solution), a in acc.items():
        total = len(workloads[definition])
        out[(definition, solution)] = {
            "passed": a["passed"], "total": total,
            "geomean_speedup": math.exp(sum(a["logs"]) / len(a["logs"])) if a["logs"] else None,
            **{f"fast_{p:g}": a[p] / total for p in ps}}
    return out


def naive_compare(root: Path, base: str, cand: str, tolerance: float = 0.05) -> dict[tuple[str, str, str], str]:
    """The two-sweep comparison with json and dicts: unit -> change."""
    b, c = naive_units(root, base), naive_units(root, cand)
    out = {}
    for key in b.keys() | c.keys():
        if key not in b:
            out[key] = "added"
        elif key not in c:
            out[key] = "dropped"
        else:
            (_, sb, xb), (_, sc, xc) = b[key], c[key]
            if sb == "PASSED" and sc != "PASSED":
                out[key] = "broken"
            elif sb != "PASSED" and sc == "PASSED":
                out[key] = "fixed"
            elif sb != "PASSED":
                out[key] = "status_changed" if sb != sc else "unchanged"
            else:
                ratio = xc / xb
                out[key] = ("regression" if ratio < 1 / (1 + tolerance) else
                            "improvement" if ratio > 1 + tolerance else "unchanged")
    return out


# ---------------------------------------------------------------- the run

def du(path: Path) -> tuple[int, int]:
    """(bytes, files) under path."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def write_both(shape: Shape, store_root: Path, jsonl_root: Path, batch_rows: int) -> tuple[Took, Took]:
    """Write every row through TraceStore.append and as JSONL; returns the time spent in each."""
    store = TraceStore(store_root)
    t_store, t_jsonl = Took(), Took()
    handles: dict[Path, Any] = {}
    rows: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []

    def write_jsonl() -> None:
        for r, tr in zip(rows, traces):
            path = jsonl_root / r["sweep"] / "traces" / r["op_type"] / f"{r['definition']}.jsonl"
            if path not in handles:
                path.parent.mkdir(parents=True, exist_ok=True)
                handles[path] = open(path, "a")
            handles[path].write(json.dumps(tr) + "\n")

    def flush() -> None:
        nonlocal t_store, t_jsonl
        t_store += timed(lambda: store.append(rows))[0]
        t_jsonl += timed(write_jsonl)[0]
        rows.clear()
        traces.clear()

    def close_jsonl() -> None:  # fsync, as the store does for each file it publishes
        for f in handles.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()

    for row, trace in synthetic(shape):
        rows.append(row)
        traces.append(trace)
        if len(rows) >= batch_rows:
            flush()
    if rows:
        flush()
    t_jsonl += timed(close_jsonl)[0]
    return t_store, t_jsonl


def check_same(board: pl.DataFrame, naive: dict[tuple[str, str], dict]) -> None:
    """The store's leaderboard and the naive one must agree before their times are compared."""
    assert board.height == len(naive), (board.height, len(naive))
    for r in board.iter_rows(named=True):
        n = naive[(r["definition"], r["solution"])]
        assert (r["passed"], r["total"]) == (n["passed"], n["total"]), (r, n)
        for col in ("fast_0", "fast_1", "fast_1.5", "fast_2"):
            assert math.isclose(r[col], n[col]), (col, r, n)
        assert (r["geomean_speedup"] is None) == (n["geomean_speedup"] is None)
        if n["geomean_speedup"] is not None:
            assert math.isclose(r["geomean_speedup"], n["geomean_speedup"], rel_tol=1e-9)


def small_files(workdir: Path, shape: Shape, flush_rows: int) -> tuple[int, int, Took, Took, Took]:
    """One definition of one sweep written the way the sweep driver flushes (every flush_rows rows).

    Returns (rows, files before, leaderboard before, compaction, leaderboard after).
    """
    root = workdir / "small-files-store"
    store = TraceStore(root)
    one = Shape(1, shape.solutions, shape.workloads)
    rows = [r for r, _ in synthetic(one) if r["sweep"] == "base"]
    for i in range(0, len(rows), flush_rows):
        store.append(rows[i:i + flush_rows])
    files = len(store.files())
    before, _ = timed(lambda: leaderboard(evaluations(root, "base")), repeat=3)
    compact, _ = timed(lambda: compact_partition(store, "synth_00", "base"))
    after, _ = timed(lambda: leaderboard(evaluations(root, "base")), repeat=3)
    return len(rows), files, before, compact, after


def environment() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        rev = "unknown"
    return [f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"machine: {os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}",
            f"versions: python {platform.python_version()}, polars {pl.__version__}, pyarrow {pa.__version__}; "
            f"fibray commit {rev or 'unknown'}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="evaluations to write (default 1,000,000)")
    parser.add_argument("--definitions", type=int, default=20)
    parser.add_argument("--solutions", type=int, default=25, help="solutions per definition")
    parser.add_argument("--batch-rows", type=int, default=5000, help="rows per TraceStore.append call (default 5000)")
    parser.add_argument("--flush-rows", type=int, default=64,
                        help="rows per file in the small-files case (the sweep driver's default flush, 64)")
    parser.add_argument("--keep", type=Path, help="write under this folder and keep it (default: a temp folder, removed)")
    args = parser.parse_args()

    shape = shape_for(args.rows, args.definitions, args.solutions)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fibray-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    store_root, jsonl_root = workdir / "store", workdir / "jsonl"
    for p in (store_root, jsonl_root):
        shutil.rmtree(p, ignore_errors=True)
    try:
        print(f"fibray store benchmark: {shape.rows:,} rows = {len(SWEEPS)} sweeps x {shape.definitions} definitions "
              f"x {shape.solutions} solutions x {shape.workloads:,} workloads; appends of {args.batch_rows:,} rows",
              flush=True)
        print(*environment(), sep="\n", flush=True)
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        w_store, w_jsonl = write_both(shape, store_root, jsonl_root, args.batch_rows)
        gen = time.perf_counter() - t0 - w_store.wall - w_jsonl.wall
        (b_store, f_store), (b_jsonl, f_jsonl) = du(store_root), du(jsonl_root)
        per_sweep = shape.rows // len(SWEEPS)

        lb_first, board = timed(lambda: leaderboard(evaluations(store_root, "cand")))
        lb_store, board = timed(lambda: leaderboard(evaluations(store_root, "cand")), repeat=3)
        cmp_store, cmp = timed(lambda: compare_sweeps(store_root, "base", "cand"), repeat=3)
        lb_naive, naive_board = timed(lambda: naive_leaderboard(jsonl_root, "cand"))
        check_same(board, naive_board)
        cmp_naive, naive_cmp = timed(lambda: naive_compare(jsonl_root, "base", "cand"))
        got = dict(zip(zip(cmp["definition"], cmp["solution"], cmp["workload_uuid"]), map(str, cmp["change"])))
        assert got == naive_cmp, "store and naive comparisons differ"

        store = TraceStore(store_root)
        files_before = len(store.files(sweep="cand"))
        t_compact, _ = timed(lambda: [compact_partition(store, d, s) for d, s in partitions(store, sweep="cand")])
        files_after = len(store.files(sweep="cand"))
        lb_compacted, board_after = timed(lambda: leaderboard(evaluations(store_root, "cand")), repeat=3)
        # Same rows, different summation order: equal up to float rounding.
        assert_frame_equal(board_after, board, check_exact=False, rel_tol=1e-12)
        sf_rows, sf_files, sf_before, sf_compact, sf_after = small_files(workdir, shape, args.flush_rows)

        def ratio(naive: Took, fast: Took) -> str:
            return f"{naive.wall / fast.wall:.1f}x (cpu {naive.cpu / fast.cpu:.1f}x)"

        rows = [
            ("write (all rows)", f"{w_store} {shape.rows / w_store.wall / 1000:.0f}k rows/s",
             f"{w_jsonl} {shape.rows / w_jsonl.wall / 1000:.0f}k rows/s", ratio(w_jsonl, w_store)),
            (f"leaderboard, 1 sweep ({per_sweep:,} rows)", f"{lb_store}; first run {fmt_s(lb_first.wall)}",
             str(lb_naive), ratio(lb_naive, lb_store)),
            (f"two-sweep comparison ({shape.rows:,} rows)", str(cmp_store), str(cmp_naive), ratio(cmp_naive, cmp_store)),
            ("on disk", f"{b_store / 2**20:.0f} MiB in {f_store} files", f"{b_jsonl / 2**20:.0f} MiB in {f_jsonl} files",
             f"{b_jsonl / b_store:.1f}x"),
        ]
        header = ("", "store (Parquet + Polars)", "naive JSONL (json + dicts)", "JSONL / store")
        widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
        print(f"\n(generating the synthetic rows took {gen:.1f} s, not counted; times are medians of 3 runs, "
              "except the first store run and the naive queries, run once)")
        for r in [header, *rows]:
            print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip())
        changes = cmp["change"].cast(pl.String).value_counts(sort=True)
        print(f"\ncomparison found: {', '.join(f'{c} {n:,}' for c, n in changes.iter_rows())}")
        print(f"compaction of sweep 'cand' ({per_sweep:,} rows): {files_before} -> {files_after} files in {t_compact}; "
              f"leaderboard afterwards {lb_compacted}, same answer")
        print(f"small files: {sf_rows:,} rows of one partition in {args.flush_rows}-row flushes (as the sweep driver "
              f"writes) = {sf_files} files, leaderboard {sf_before}; compacted to 1 file in {sf_compact}; "
              f"leaderboard {sf_after}, {sf_before.wall / sf_after.wall:.1f}x faster")
        print("store and naive answers checked equal (leaderboard: passed, total, fast_p, geomean; comparison: "
              "every unit's change)")
        print(f"load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs (wall times stretch on a busy machine; CPU times much less)")
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
