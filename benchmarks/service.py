"""The evaluation service against a cold sweep and flashinfer-bench 0.1.2, in one run.

    python benchmarks/service.py [--dataset datasets/core --workload-set gpu --solutions solutions]
        [--warmup 10 --iterations 50 --trials 3] [--rounds 20] [--clients 4 --candidates 200]
        [--lanes 1] [--work DIR] [--cpu-smoke]

1. The same FlashInfer Trace folder (benchmarks/vs_flashinfer_bench.py's) through flashinfer-bench
   (fresh process; only where CUDA is), a cold `fibray.sweep` (`service=off`: its own Ray and
   slots), and `fibray.sweep` on a warm service (`python -m fibray.serve`, started before the
   clock): wall time, ratios, status agreement per (solution, workload).
2. Start-up: where command-to-first-evaluation goes (interpreter and imports, Ray, slot start-up
   and executor warm-up, the first job), cold and on the service.
3. Round latency: one candidate x 8 workloads submitted through fibray.client to the warm service,
   submit to last verdict, p50/p95 over --rounds rounds of each kind: the same candidate on a new
   seed each round (never answered from the store; inputs and references made again), and a new
   candidate each round on the same settings (an agent loop's round); where a round went: before
   its first job, the jobs and their largest phases, time with no job running, after its last job.
4. Load: --clients clients x --candidates candidates (distinct solutions, one workload each) at
   once, one slot killed (SIGKILL) mid-load: answered, lost, duplicated, throughput against a
   plain cold sweep of the same jobs.
`--cpu-smoke` makes everything small enough for a CPU machine (cpu_small workloads, 1/5/1 timing,
5 rounds, 4 x 12 candidates). Needs no polars (pyarrow only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _sweep_cli import run_sweep_cli
from vs_flashinfer_bench import _versions, compare, prepare_dataset, run_flashinfer_bench

REPO = Path(__file__).resolve().parents[1]


# -- the service -------------------------------------------------------------------------------
class Service:
    """`python -m fibray.serve` with a state dir of its own, stopped (and its head killed) at exit."""

    def __init__(self, work: Path, lanes: int, store: Path) -> None:
        self.name = f"bench{os.getpid()}"
        self.state_dir = Path(tempfile.mkdtemp(prefix="fibray-bench-state-", dir="/tmp"))
        self.env = {**os.environ, "FIBRAY_STATE_DIR": str(self.state_dir)}
        self.env.pop("RAY_ADDRESS", None)
        self.store, self.work, self.lanes = store, work, lanes

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fibray.serve", *args, f"service.name={self.name}"],
                              env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def start(self, extra: list[str]) -> dict[str, float]:
        t0 = time.monotonic()
        proc = self.cli(f"store.root={self.store}", f"runner.lanes={self.lanes}", *extra)
        wall = time.monotonic() - t0
        (self.work / "serve-start.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"python -m fibray.serve failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("start-up: ")), "")
        steps = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)s", line)}
        return {"wall_s": wall, **steps}

    def status(self) -> dict:
        from fibray.client import Client

        return Client("bench-probe", store=self.store, service=self.name, state_dir=str(self.state_dir)).status()

    def stop(self) -> None:
        state = self.state_dir / f"{self.name}.json"
        head = json.loads(state.read_text()).get("head_pid") if state.exists() else None
        try:
            self.cli("--stop", timeout=300)
        finally:
            if head:
                try:
                    os.killpg(head, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(self.state_dir, ignore_errors=True)


# -- 1. the same set, three ways ----------------------------------------------------------------
def _settings_overrides(args: argparse.Namespace) -> list[str]:
    return [f"eval.warmup={args.warmup}", f"eval.iterations={args.iterations}", f"eval.trials={args.trials}",
            f"eval.atol={args.atol}", f"eval.rtol={args.rtol}"]


def run_sweep(data: Path, work: Path, args: argparse.Namespace, tag: str, env: dict, extra: list[str]) -> dict[str, Any]:
    from fibray.store import TraceStore

    store = work / f"store-{tag}"
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.time()
    run = run_sweep_cli([f"dataset.root={data}", "solutions.roots=[]", f"store.root={store}", "sweep.name=service_bench",
                         f"runner.lanes={args.lanes}", *_settings_overrides(args), *extra],
                        log=work / f"sweep-{tag}.log", cwd=work,
                        env={**env, "TRITON_CACHE_DIR": str(work / f"triton-{tag}")})
    rows = TraceStore(store).read(sweep="service_bench", columns=["solution", "workload_uuid", "status", "latency_ms",
                                                                  "started_at", "finished_at"]).to_pylist()
    first = min(r["finished_at"] for r in rows).timestamp() - t0 if rows else float("nan")
    return {"rows": rows, "wall_s": run.wall_s, "breakdown": run.breakdown, "summary": run.summary,
            "setup_s": run.setup_s, "start_s": run.start_s, "window_s": run.window_s, "first_eval_s": first,
            "log": work / f"sweep-{tag}.log"}


def import_seconds(env: dict) -> float:
    """A fresh interpreter importing what `python -m fibray.sweep` imports before it reads its config."""
    code = "import time; t = time.monotonic(); import fibray.sweep.__main__; print(time.monotonic() - t)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def sweep_phases(log: Path) -> dict[str, float]:
    """Seconds (since the sweep's console started) at which its start-up lines appeared."""
    marks = {"dataset": r"loading dataset", "ray": r"starting a local Ray", "slots": r"starting \d+ GPU slot",
             "ready": r"slot \S+ ready"}
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"\s*([\d.]+)s\s+(.*)", line)
        if m:
            for key, pattern in marks.items():
                if key not in out and re.search(pattern, m.group(2)):
                    out[key] = float(m.group(1))
    return out


# -- 3. round latency ----------------------------------------------------------------------------
def round_latency(svc: Service, data: Path, args: argparse.Namespace, rounds: int) -> dict[str, list[float]]:
    """Two kinds of round, `rounds` of each: the same candidate on a new seed each round (new inputs,
    references made and timed again), and a new candidate each round on the same settings, as an
    agent loop's rounds are (its source differs, so it gets its executor, build and first calls of
    its own; the slot has the workloads' inputs, references and reference latencies already)."""
    from fibray.client import Client
    from fibray.dataset import load_dataset

    ds = load_dataset(data)
    name = next(n for n in ds.definitions if len(ds.workloads.get(n, [])) >= 8)
    sol = _honest(ds, name)
    workloads = [w.uuid for w in ds.workloads[name][:8]]
    client = Client("bench-rounds", store=svc.store, service=svc.name, state_dir=str(svc.state_dir), dataset=data)
    timing = {"warmup": args.warmup, "iterations": args.iterations, "trials": args.trials}
    kinds = {
        "same candidate, new seed": lambda r: (sol, {**timing, "seed": 1000 + r}),
        "new candidate, same settings": lambda r: (_variant(sol, r), {**timing, "seed": 999}),
    }
    out: dict[str, list[float]] = {}
    for kind, make in kinds.items():
        times = out[kind] = []
        parts: dict[str, float] = {}
        for r in range(rounds):
            candidate, settings = make(r)
            t0, wall0 = time.monotonic(), time.time()
            futures = client.submit_jobs(client.jobs(candidate, name, workloads=workloads, settings=settings))
            results = [f.result(timeout=600) for f in futures]
            times.append(time.monotonic() - t0)
            statuses = {res.evaluation.status.value for res in results}
            if statuses != {"PASSED"}:
                print(f"  round {r} ({kind}): statuses {sorted(statuses)}")
            for k, v in _round_parts(results, wall0, times[-1]).items():
                parts[k] = parts.get(k, 0.0) + v / rounds
        print(f"round latency ({kind}): {sol.name} x {len(workloads)} workloads of {name} at "
              f"{args.warmup}/{args.iterations}/{args.trials}, {rounds} rounds: p50 {_q(times, 0.5):.3f}s, "
              f"p95 {_q(times, 0.95):.3f}s, min {min(times):.3f}s")
        print("  where a round went (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    return out


def _round_parts(results: list[Any], wall0: float, wall_s: float) -> dict[str, float]:
    """One round's wall split by its jobs' own clocks (the slot's started_at / finished_at, on this
    host's wall clock): before the first job got a lane (submission, queue, dispatch), the jobs
    themselves (summed: lanes overlap them), the time between the first start and the last end with
    no job running, after the last (recording, the answer's way back); then the jobs' largest phases."""
    from datetime import datetime

    spans = sorted((datetime.fromisoformat(r.started_at).timestamp(), datetime.fromisoformat(r.finished_at).timestamp())
                   for r in results)
    jobs = sum(b - a for a, b in spans)
    first, last = spans[0][0], max(b for _, b in spans)
    busy, end = 0.0, first  # the union of the jobs' spans (lanes overlap them)
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    phases: dict[str, float] = {}
    for r in results:
        for k, v in r.phases.items():
            if "." not in k:
                phases[k] = phases.get(k, 0.0) + v
    top = dict(sorted(phases.items(), key=lambda kv: -kv[1])[:8])
    return {"before the first job": first - wall0, "jobs": jobs, "no job running between": last - first - busy,
            "after the last job": wall0 + wall_s - last, **{f"[{k}]": v for k, v in top.items()}}


def _variant(sol: Any, r: int) -> Any:
    """`sol` as another candidate: the same code with a comment of its own (another hash and name)."""
    data = sol.model_dump(mode="json")
    data["name"] = f"{sol.name}_round{r}"
    for src in data["sources"]:
        if src["path"].endswith(".py"):
            src["content"] += f"\n# round {r}\n"
    return type(sol).model_validate(data)


def _honest(ds: Any, definition: str) -> Any:
    """The definition's plain PyTorch solution (`<definition>_torch`), else its first one."""
    sols = ds.solutions_for(definition)
    return next((s for s in sols if s.name == f"{definition}_torch"), sols[0])


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# -- 4. load with a slot killed --------------------------------------------------------------------
def candidates(data: Path, n: int, client_index: int) -> tuple[str, list, Any]:
    """n distinct candidates (a solution whose source differs by a comment) for one definition."""
    from fibray.dataset import load_dataset
    from fibray.schema import Solution

    ds = load_dataset(data)
    name = next(n_ for n_ in ds.definitions if ds.solutions_for(n_))
    base = _honest(ds, name)
    out = []
    for i in range(n):
        d = base.to_json_dict()
        d["name"] = f"{base.name}_c{client_index}_{i}"
        d["sources"] = [{**src, "content": src["content"] + f"\n# candidate {client_index}.{i}\n"} for src in d["sources"]]
        out.append(Solution.model_validate(d))
    return name, out, ds.workloads[name][0]


def load_test(svc: Service, data: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from fibray.client import Client
    from fibray.store import TraceStore

    settings = {"warmup": args.warmup, "iterations": args.iterations, "trials": args.trials}
    per_client = [candidates(data, args.candidates, i) for i in range(args.clients)]
    futures: list = []
    lock = threading.Lock()
    errors: list[str] = []

    def client_run(i: int) -> None:
        name, sols, workload = per_client[i]
        c = Client(f"bench-load-{i}", store=svc.store, service=svc.name, state_dir=str(svc.state_dir), dataset=data)
        for s in sols:
            try:
                fs = c.submit(s, name, workloads=[workload.uuid], settings=settings)
            except Exception as e:  # noqa: BLE001 - counted as lost below
                errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                futures.extend(fs)

    total = args.clients * args.candidates
    t0 = time.monotonic()
    threads = [threading.Thread(target=client_run, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    killed = None
    while killed is None and (any(t.is_alive() for t in threads) or not all(f.done() for f in list(futures))):
        st = svc.status()
        busy = [s for s in st["slots"] if s["phase"] == "ready" and s["inflight"]]
        if busy and st["answered"] >= total // 4:
            killed = busy[0]["pid"]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    for t in threads:
        t.join()
    answered = lost = 0
    for f in futures:
        try:
            f.result(timeout=1800)
            answered += 1
        except Exception as e:  # noqa: BLE001 - a lost request
            errors.append(f"{type(e).__name__}: {e}")
            lost += 1
    wall = time.monotonic() - t0
    Client("bench-probe", store=svc.store, service=svc.name, state_dir=str(svc.state_dir)).flush()  # all published
    rows = [r for r in TraceStore(svc.store).read(columns=["job_id", "sweep", "attempt"]).to_pylist()
            if r["sweep"].startswith("bench-load-")]
    keys = [(r["sweep"], r["job_id"]) for r in rows]
    st = svc.status()
    # the same jobs as a plain sweep: the candidates as a dataset's solutions, one workload each
    plain = work / "load-dataset"
    shutil.rmtree(plain, ignore_errors=True)
    shutil.copytree(data, plain, symlinks=True, ignore=shutil.ignore_patterns("solutions"))
    name = per_client[0][0]
    folder = plain / "solutions" / name
    folder.mkdir(parents=True)
    for _, sols, _ in per_client:
        for s in sols:
            (folder / f"{s.name}.json").write_text(json.dumps(s.to_json_dict()))
    out = {"total": total, "answered": answered, "lost": lost + (total - len(futures)), "rows": len(rows),
           "duplicated": len(keys) - len(set(keys)), "killed_pid": killed, "wall_s": wall,
           "rerun": sum(1 for r in rows if r["attempt"] > 1), "slot_restarts": st["slot_restarts"], "errors": errors[:5]}
    print(f"load: {args.clients} clients x {args.candidates} candidates, slot pid {killed} killed mid-load: answered "
          f"{answered}/{total}, lost {out['lost']}, duplicated {out['duplicated']} (store rows {len(rows)}, re-run "
          f"{out['rerun']}, slot restarts {out['slot_restarts']}); {answered / wall:.2f} eval/s in {wall:.1f}s", flush=True)
    try:
        ref = run_sweep(plain, work, args, "load-plain", {**os.environ}, ["service=off", f"dataset.definitions=[{name}]",
                                                                          "dataset.max_workloads_per_definition=1"])
    except SystemExit as e:  # the comparison is lost, not the load figures
        print(f"the plain sweep of the same jobs failed: {str(e)[-500:]}")
        return out
    out.update(plain_wall_s=ref["wall_s"], plain_rows=len(ref["rows"]))
    return out


# -- the run ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", type=Path, default=REPO / "datasets" / "core")
    ap.add_argument("--workload-set", default="gpu")
    ap.add_argument("--solutions", type=Path, nargs="*", default=[REPO / "solutions"])
    ap.add_argument("--definitions", nargs="*", default=None)
    ap.add_argument("--workloads-per-definition", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--atol", type=float, default=1e-2)
    ap.add_argument("--rtol", type=float, default=1e-2)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--skip", nargs="*", default=[], choices=["flashinfer-bench", "cold", "warm", "rounds", "load"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/fibray-service-bench"))
    ap.add_argument("--cpu-smoke", action="store_true", help="small sizes for a CPU machine")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.workload_set, args.warmup, args.iterations, args.trials = "cpu_small", 1, 5, 1
        args.rounds, args.candidates = min(args.rounds, 5), min(args.candidates, 12)
        args.definitions = args.definitions or ["rmsnorm_h4096", "gemm_n128_k2048"]
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "dataset"
    counts = prepare_dataset(args.dataset, args.workload_set, args.solutions, data, definitions=args.definitions,
                             workloads_per_definition=args.workloads_per_definition)
    print(_versions())
    print(f"dataset {args.dataset} ({args.workload_set}): {counts['definitions']} definitions, {counts['workloads']} "
          f"workloads, {counts['solutions']} solutions; {args.warmup}/{args.iterations}/{args.trials}, lanes {args.lanes}")
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    res: dict[str, dict] = {}
    if cuda and "flashinfer-bench" not in args.skip:
        res["flashinfer-bench"] = run_flashinfer_bench(data, work, args)
    if "cold" not in args.skip:
        res["fibray cold"] = run_sweep(data, work, args, "cold", env, ["service=off"])
    svc = Service(work, args.lanes, work / "service-store")
    try:
        started = svc.start([])
        print("service start-up (before the clock): " + ", ".join(f"{k} {v:.1f}s" for k, v in started.items()))
        svc_env = {**env, "FIBRAY_STATE_DIR": str(svc.state_dir)}
        if "warm" not in args.skip:
            res["fibray on service"] = run_sweep(data, work, args, "warm", svc_env, [f"service.name={svc.name}"])
        _report(res, env)
        if "rounds" not in args.skip:
            round_latency(svc, data, args, args.rounds)
        if "load" not in args.skip:
            ld = load_test(svc, data, work, args)
            if "plain_wall_s" in ld:
                rate, plain = ld["answered"] / ld["wall_s"], ld["plain_rows"] / ld["plain_wall_s"]
                print(f"load throughput {rate:.2f} eval/s vs a plain cold sweep of the same {ld['plain_rows']} jobs "
                      f"{plain:.2f} eval/s in {ld['plain_wall_s']:.1f}s ({rate / plain:.2f}x)")
            for e in ld["errors"]:
                print(f"  load error: {e}")
    finally:
        svc.stop()


def _report(res: dict[str, dict], env: dict) -> None:
    print(f"\n{'run':<20}{'evals':>7}{'wall_s':>9}{'eval/s':>9}{'first_eval_s':>14}")
    for name, r in res.items():
        first = r.get("first_eval_s", float("nan"))
        print(f"{name:<20}{len(r['rows']):>7}{r['wall_s']:>9.1f}{len(r['rows']) / r['wall_s']:>9.2f}{first:>14.1f}")
    for name, r in res.items():
        if name.startswith("fibray"):
            print(f"{name}: {r['summary']}\n  time: {r['breakdown']}")
    imports = import_seconds(env)
    for name, tag in (("fibray cold", "cold"), ("fibray on service", "warm")):
        if name not in res:
            continue
        r, ph = res[name], sweep_phases(r["log"])
        parts = [f"interpreter+imports ~{imports:.1f}s"]
        if "ray" in ph:
            parts.append(f"dataset+ledger {ph['ray'] - ph.get('dataset', 0):.1f}s")
            if "slots" in ph:
                parts.append(f"Ray start {ph['slots'] - ph['ray']:.1f}s")
            if "ready" in ph and "slots" in ph:
                parts.append(f"slot start-up (torch, executors) {ph['ready'] - ph['slots']:.1f}s")
        else:
            parts.append(f"dataset+ledger+joining the service {r['setup_s']:.1f}s")
        print(f"start-up {name}: command to first evaluation {r['first_eval_s']:.1f}s: " + ", ".join(parts)
              + f"; the sweep's own split: setup {r['setup_s']:.1f}s, slot start-up {r['start_s']:.1f}s")
    pairs = [(a, "flashinfer-bench") for a in res if a.startswith("fibray") and "flashinfer-bench" in res]
    if "fibray on service" in res and "fibray cold" in res:
        pairs.append(("fibray on service", "fibray cold"))
    for a, b in pairs:
        c = compare(res[a]["rows"], res[b]["rows"])
        print(f"{a} vs {b}: {res[b]['wall_s'] / res[a]['wall_s']:.2f}x end to end (wall {res[a]['wall_s']:.1f}s vs "
              f"{res[b]['wall_s']:.1f}s); statuses {c['pairs'] - len(c['disagree'])}/{c['pairs']} (solution, workload) "
              f"pairs agree")
        for (sol, uuid), ours, theirs in c["disagree"][:10]:
            print(f"  disagree: {sol} {uuid[:8]}: {a} {ours}, {b} {theirs}")

if __name__ == "__main__":
    main()
