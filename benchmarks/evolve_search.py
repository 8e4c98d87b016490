"""The built-in search of the agent loop against the hand-written Triton solutions of datasets/llm.

    python benchmarks/evolve_search.py [--rounds 40] [--candidates 4] [--store DIR] [--cpu] [--loop-timeout S]
                                       [--warmup 10 --iterations 50 --trials 3] [hydra.override=value ...]

Runs `python -m fibray.evolve +experiment=evolve_search` (the built-in search) from the deliberately
untuned templates in examples/evolve/ on an rmsnorm, a GEMM and a GQA paged-decode definition, then `python -m fibray.sweep`
of each definition's hand-written `_triton` solution with the same evaluation settings on the same
workloads. Prints, per definition: the best public speedup per round, rounds per minute, evaluations
per GPU-second, the hand-written solution's speedup on the same (public) workloads, and whether the
search came within 10% of it within 40 rounds (and in which round); then the public -> hidden gap.
On a GPU it uses the gpu workload set (generated for these definitions if missing); `--cpu` runs small
settings on the cpu_small set (Triton interpreted) to check the script end to end.

While a loop runs, its own progress lines (one per definition and finished round: candidates by status,
best public speedup so far, elapsed seconds) are echoed as they come, and its whole output is written to
a log as it runs: a run stopped at its limit has printed every finished round. A loop that fails or runs
past --loop-timeout, or a script stopped by SIGTERM/SIGINT, still gets the summary of what the store holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from _sweep_cli import run_sweep_cli

REPO = Path(__file__).resolve().parents[1]
LLM = REPO / "datasets" / "llm"
GPU_GROUPS = [(LLM, None, ["rmsnorm_h4096", "gemm_n4096_k4096", "gqa_paged_decode_h32_kv8_d128_ps16"])]
"""(dataset, extra solutions root holding the hand-written `_triton` solutions, definitions)."""
CPU_GROUPS = [(REPO / "datasets" / "core", REPO / "solutions", ["rmsnorm_h4096", "gemm_n128_k2048"]),
              (LLM, None, ["gqa_paged_decode_h32_kv8_d128_ps16"])]
"""The interpreter pays per program and loop step: the untuned GEMM on datasets/llm's N=K=2048 takes
minutes per call there, so the CPU run uses the bundled N=128 GEMM."""
GOAL_ROUNDS, GOAL_GAP = 40, 0.10
GPU_RUN_DEADLINE_S = 30.0
"""eval.run_deadline_s of the loops and sweeps on a GPU (unless overridden): a search candidate whose
compilation and calls take longer is no candidate, and a round waits for its slowest job (120 s by
default, twice with the isolated re-run of a timeout)."""
RAY_START_TRIES = 3
"""A local Ray that times out starting (a loaded machine) is tried again; the loop resumes its run."""
ECHOED = re.compile(r"\[[^\]\s]+\] round \d+/\d+: |fibray\.evolve: error: ")
"""The lines of `python -m fibray.evolve` (stderr) echoed as they come: its per-round progress, its error."""


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _ensure_gpu_workloads(definitions: list[str]) -> None:
    missing = [d for d in definitions if not list((LLM / "workloads" / "gpu").glob(f"*/{d}.jsonl"))]
    if missing:
        print(f"generating the gpu workload set for {missing} ...", flush=True)
        subprocess.run([sys.executable, "-m", "fibray.generate", "--out", str(LLM), "--set", "gpu", "--only", *missing],
                       check=True, cwd=REPO)


def _run_loop(cmd: list[str], log: Path, timeout_s: float | None) -> tuple[int | None, str, str]:
    """Run `python -m fibray.evolve`, writing its output to `log` and echoing its progress lines (flushed)
    as they come. Returns (exit status, None when it ran past `timeout_s` and was stopped; stdout; stderr).
    An interrupt stops it too, and is raised again."""
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    lock = threading.Lock()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace", bufsize=1)

        def pump(stream, name: str) -> None:
            for line in stream:
                with lock:
                    if f.closed:
                        return
                    out[name].append(line)
                    f.write(line)
                    f.flush()
                    if name == "stderr" and ECHOED.match(line):
                        print(line.rstrip(), flush=True)

        pumps = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
        for t in pumps:
            t.start()
        rc = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # past its time, or this script interrupted: stop it (the store keeps its rounds)
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for t in pumps:
                t.join(timeout=10)  # a process it left behind may hold the pipes open
            with lock:
                f.close()
    return rc, "".join(out["stdout"]), "".join(out["stderr"])


def _interrupted(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the script at once
    raise KeyboardInterrupt


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}x"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds per definition (default 40; 3 with --cpu)")
    p.add_argument("--candidates", type=int, default=None, help="candidates per round (default 4; 2 with --cpu)")
    p.add_argument("--store", type=Path, default=Path("/tmp/fibray-evolve-search"), help="trace store (a new run each time)")
    p.add_argument("--definitions", nargs="+", default=None, help="definitions of datasets/llm to search")
    p.add_argument("--workloads", type=int, default=8, help="workloads per definition (public + hidden)")
    p.add_argument("--cpu", action="store_true", help="small settings on the cpu_small set (also chosen without a GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search")
    p.add_argument("--stamp", default=None, help="resume the runs of an earlier invocation (its printed stamp)")
    p.add_argument("--loop-timeout", type=float, default=None,
                   help="seconds per fibray.evolve run before it is stopped (its finished rounds are kept)")
    p.add_argument("--warmup", type=int, default=None, help="timing warm-up calls (default 10 on a GPU, 0 on a CPU)")
    p.add_argument("--iterations", type=int, default=None, help="timed calls per trial (default 50 on a GPU, 2 on a CPU)")
    p.add_argument("--trials", type=int, default=None, help="trials (default 3 on a GPU, 1 on a CPU)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the loops and sweeps, e.g. runner.lanes=2")
    a = p.parse_args()
    gpus = _gpus()
    cpu = a.cpu or gpus == 0
    rounds, cands = a.rounds or (3 if cpu else GOAL_ROUNDS), a.candidates or (2 if cpu else 4)
    groups = [(LLM, None, a.definitions)] if a.definitions else (CPU_GROUPS if cpu else GPU_GROUPS)
    wset = "cpu_small" if cpu else "gpu"
    if not cpu:
        _ensure_gpu_workloads([d for root, _, defs in groups if root == LLM for d in defs])
    timing = dict(zip(("warmup", "iterations", "trials"), (0, 2, 1) if cpu else (10, 50, 3)))
    timing.update({k: v for k, v in (("warmup", a.warmup), ("iterations", a.iterations), ("trials", a.trials)) if v is not None})
    evals = [f"eval.{k}={v}" for k, v in timing.items()]
    if not cpu and not any(o.startswith("eval.run_deadline_s=") for o in a.overrides):
        evals.append(f"eval.run_deadline_s={GPU_RUN_DEADLINE_S:g}")
    stamp = a.stamp or time.strftime("%Y%m%dT%H%M%S")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} stamp {stamp}, {'CPU (interpreted Triton)' if cpu else f'{gpus} GPU(s)'}: "
          f"{rounds} rounds x {cands} candidates on {[d for _, _, defs in groups for d in defs]} ({wset})", flush=True)
    from fibray.store import TraceStore

    store = TraceStore(a.store)
    cols = ["definition", "solution", "workload_uuid", "status", "speedup", "round", "split", "started_at", "finished_at"]
    runs: list[tuple[str, list[str], float]] = []  # (run_id, definitions, wall seconds of its loop)
    gaps, hand_summaries, problems = [], [], []
    signal.signal(signal.SIGTERM, _interrupted)  # stopped at a limit: still summarise what the store holds
    try:
        for i, (root, sols, defs) in enumerate(groups):
            run_id = f"evolve_search_{stamp}_{i}"
            common = [f"dataset.root={root}", f"dataset.workload_set={wset}",
                      f"dataset.max_workloads_per_definition={a.workloads}", f"dataset.definitions=[{','.join(defs)}]",
                      f"store.root={a.store}", *evals, *([f"cluster.num_gpus={gpus}"] if gpus else []), *a.overrides]
            cmd = [sys.executable, "-m", "fibray.evolve", "+experiment=evolve_search", *common,
                   f"evolve.run_id={run_id}", f"evolve.budget.max_rounds={rounds}", f"evolve.budget.candidates={cands}",
                   f"evolve.generator.seed={a.seed}"]
            log = a.store.with_name(a.store.name + f".{run_id}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"\n{time.strftime('%H:%M:%S')} loop {run_id} on {defs}; log {log}", flush=True)
            t0 = time.monotonic()
            try:
                for _ in range(RAY_START_TRIES):  # a rerun of the same run_id resumes where it stopped
                    rc, out, err = _run_loop(cmd, log, a.loop_timeout)
                    if rc == 0 or "did not start" not in err:
                        break
                    print("Ray did not start (an overloaded machine?); trying again", flush=True)
            finally:
                runs.append((run_id, defs, time.monotonic() - t0))
            if rc is None:
                problems.append(f"{run_id}: stopped after --loop-timeout {a.loop_timeout:g}s; log {log}")
                print(problems[-1], flush=True)
            elif rc != 0:
                problems.append(f"{run_id}: fibray.evolve failed (rc={rc}); log {log}")
                print(f"fibray.evolve failed (rc={rc}); log {log}:\n" + (out + err)[-3000:], flush=True)
            else:
                print(out.strip(), flush=True)
                gap = re.search(r"(?ms)^definition .*", out)
                gaps.append(gap.group(0) if gap else "")
            hand = [f"{d}_triton" for d in defs]
            for attempt in range(RAY_START_TRIES):
                try:
                    sweep = run_sweep_cli([*common, f"solutions.roots=[{sols or ''}]",
                                           f"solutions.names=[{','.join(hand)}]", f"sweep.name={run_id}_hand"],
                                          log=a.store.with_name(a.store.name + f".{run_id}_hand.log"))
                    hand_summaries.append(sweep.summary)
                    break
                except SystemExit as e:
                    if "did not start" not in str(e) or attempt == RAY_START_TRIES - 1:
                        print(e, flush=True)
                        problems.append(f"{run_id}_hand: " + str(e).splitlines()[0])
                        break
                    print("Ray did not start (an overloaded machine?); trying again", flush=True)
    except KeyboardInterrupt:
        problems.append(f"stopped by a signal during {runs[-1][0] if runs else 'the start'}; the rest did not run")
        print(f"\n{problems[-1]}", flush=True)
    loop_rows, hand_rows, splits, definitions = [], [], {}, []
    loop_s = 0.0
    for run_id, defs, wall in runs:
        definitions += defs
        loop_s += wall
        rows = [r for r in store.read(sweep=run_id, columns=cols).to_pylist() if r["round"] is not None]  # loop rows only
        if rows:  # a resumed run: its evaluations span more than this invocation's wall time
            span = (max(r["finished_at"] for r in rows) - min(r["started_at"] for r in rows)).total_seconds()
            loop_s += max(0.0, span - wall)
        loop_rows += rows
        hand = {f"{d}_triton" for d in defs}
        hand_rows += [r for r in store.read(sweep=f"{run_id}_hand", columns=cols).to_pylist() if r["solution"] in hand]
        meta = a.store / "_evolve" / run_id / "run.json"  # written before the loop's first round
        if meta.is_file():
            splits.update(json.loads(meta.read_text())["split"])
    n_loop_rounds = 0
    print(f"\n{'definition':<38}{'round':>6}{'best so far':>13}")
    verdicts = []
    for d in definitions:
        if d not in splits:
            verdicts.append(f"{d}: no round recorded")
            continue
        public = set(splits[d]["public"])
        by_sol: dict[str, list[dict]] = defaultdict(list)
        for r in loop_rows:
            if r["definition"] == d and r["split"] == "public":
                by_sol[r["solution"]].append(r)
        per_round: dict[int, float] = {}
        for rs in by_sol.values():
            if len(rs) == len(public) and all(r["status"] == "PASSED" for r in rs):
                per_round[rs[0]["round"]] = max(per_round.get(rs[0]["round"], 0.0), _geomean([r["speedup"] for r in rs]) or 0.0)
        last_round = max((r["round"] for rs in by_sol.values() for r in rs), default=0)
        n_loop_rounds += last_round
        hrows = [r for r in hand_rows if r["definition"] == d and r["workload_uuid"] in public]
        hand_speedup = _geomean([r["speedup"] for r in hrows]) if hrows and all(r["status"] == "PASSED" for r in hrows) else None
        best, first_within = 0.0, None
        for rnd in range(1, last_round + 1):
            best = max(best, per_round.get(rnd, 0.0))
            if hand_speedup and first_within is None and best >= (1 - GOAL_GAP) * hand_speedup:
                first_within = rnd
            print(f"{d:<38}{rnd:>6}{_fmt(best or None):>13}")
        ok = first_within is not None and first_within <= GOAL_ROUNDS
        ratio = f"{100 * best / hand_speedup:.0f}%" if hand_speedup and best else "-"
        verdicts.append(f"{d}: best {_fmt(best or None)} vs hand-written Triton {_fmt(hand_speedup)} ({ratio}); "
                        + (f"within {100 * GOAL_GAP:.0f}% in round {first_within}: {'YES' if ok else 'NO'}" if first_within
                           else f"NOT within {100 * GOAL_GAP:.0f}% in {last_round} rounds"))
    gpu_s = max(loop_s, 1e-9) * max(gpus, 1)
    busy = sum((r["finished_at"] - r["started_at"]).total_seconds() for r in loop_rows)
    print(f"\nloop: {len(loop_rows)} evaluations, {n_loop_rounds} definition-rounds in {loop_s:.0f}s wall: "
          f"{60 * n_loop_rounds / max(loop_s, 1e-9):.2f} rounds/min, {len(loop_rows) / gpu_s:.3f} evaluations per "
          f"{'GPU' if gpus else 'CPU-slot'}-second of wall time ({len(loop_rows) / busy if busy else 0:.3f} per busy second)")
    print("hand-written sweeps: " + ("; ".join(hand_summaries) or "-"))
    print("\n".join(verdicts))
    print("\npublic -> hidden (from fibray.evolve):\n" + ("\n".join(g for g in gaps if g) or "-"))
    if problems:
        print("\nincomplete (the numbers above are what the store holds):\n" + "\n".join(problems), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
