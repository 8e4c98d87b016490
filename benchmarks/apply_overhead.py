"""Cost per call of apply()'s dispatch against a direct call, in one run (CPU or GPU).

Builds a one-definition dataset whose winning solution has the same body as the direct
function (y = x * w on a [8, 64] tensor), evaluates it in-process into a temporary store,
enables apply from that store and times each path with the same inputs:

    python benchmarks/apply_overhead.py [--calls 2000] [--repeats 51]

Prints ns/call per path, the overhead over the direct call, and the ratio; the promotion
rows (require_promotion) show a promoted default hit, a canary and a shadow artifact. The paths take
turns in every repeat; overhead and ratio are medians over repeats of each path against the
direct call of the same repeat, so a machine that changes speed mid-run (a shared VM) skews
them less than the ns/call column. The goal is a dispatch overhead (hit, no output check)
under 1000 ns/call.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: fibray, examples

import torch

from fibray.apply import ApplyConfig, apply, build_runtime, disable_apply
from fibray.compile import prepare_triton

H, N_MEASURED, N_UNSEEN = 64, 8, 9
DEFINITION = {
    "name": "bench_scale_h64", "op_type": "scale", "description": "y = x * w (apply overhead benchmark).",
    "axes": {"n": {"type": "var"}, "h": {"type": "const", "value": H}},
    "inputs": {"x": {"shape": ["n", "h"], "dtype": "float32"}, "w": {"shape": ["h"], "dtype": "float32"}},
    "outputs": {"y": {"shape": ["n", "h"], "dtype": "float32"}},
    "reference": "import torch\n\ndef run(x, w):\n    return x * w\n",
}


def _solution(suffix: str, source: str, dps: bool) -> dict[str, Any]:
    return {"name": f"bench_scale_h64_{suffix}", "definition": DEFINITION["name"], "author": "benchmark",
            "spec": {"language": "python", "target_hardware": ["cpu", "cuda"], "entry_point": "main.py::run",
                     "destination_passing_style": dps},
            "sources": [{"path": "main.py", "content": source}]}


SOLUTIONS = [
    _solution("value", "def run(x, w):\n    return x * w\n", dps=False),
    _solution("dps", "import torch\n\n\ndef run(x, w, y):\n    torch.mul(x, w, out=y)\n", dps=True),
]


def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The direct call (and the fallback): the same body as the value-returning solution."""
    return x * w


def make_store(root: Path) -> tuple[Path, Path]:
    """A dataset with the definition, its two solutions and one workload, judged into a store in-process."""
    from examples.llama_block.pipeline import sweep_in_process

    dataset, store = root / "dataset", root / "store"
    (dataset / "definitions").mkdir(parents=True)
    (dataset / "definitions" / "bench_scale_h64.json").write_text(json.dumps(DEFINITION))
    (dataset / "solutions").mkdir()
    for sol in SOLUTIONS:
        (dataset / "solutions" / f"{sol['name']}.json").write_text(json.dumps(sol))
    (dataset / "workloads").mkdir()
    workload = {"uuid": "bench-n8", "axes": {"n": N_MEASURED},
                "inputs": {"x": {"type": "random"}, "w": {"type": "random"}}}
    (dataset / "workloads" / "bench.jsonl").write_text(
        json.dumps({"definition": DEFINITION["name"], "workload": workload}) + "\n")
    counts = sweep_in_process(dataset, store, "bench", {"warmup": 1, "iterations": 5, "trials": 1}, workload_set=None)
    if counts != {"PASSED": len(SOLUTIONS)}:
        raise SystemExit(f"benchmark setup: every solution must pass, got {counts}")
    return dataset, store


def promoted_store(root: Path, store: Path, dataset: Path, solution: str, stage: str) -> Path:
    """A copy of the store whose promotions table puts the solution's artifact (here) at `stage`."""
    import shutil

    from fibray.dataset import load_dataset
    from fibray.promote.artifact import artifact_of
    from fibray.store.promotions import Gate, Outcome, PromotionLog, PromotionRecord, Stage

    at = root / f"store-{stage}"
    shutil.copytree(store, at)
    art = artifact_of(load_dataset(dataset, require_blobs=False).solutions[solution])
    PromotionLog(at).append([PromotionRecord(
        artifact_id=art.artifact_id, definition=art.definition, solution=art.solution, solution_hash=art.solution_hash,
        recipe_hash=art.recipe_hash, environment_key=art.environment_key, environment=art.environment,
        stage=Stage(stage), gate=Gate.ROLLOUT, outcome=Outcome.PASSED, actor="benchmark")])
    return at


def time_paths(paths: list[tuple[str, Callable[..., Any], tuple, Any]], calls: int, repeats: int,
               sync: Callable[[], None]) -> list[list[float]]:
    """ns/call of each path in each repeat; the paths take turns in every repeat, so drift hits them alike."""
    samples: list[list[float]] = [[] for _ in paths]
    for repeat in range(repeats + 1):
        for i, (_, fn, args, rt) in enumerate(paths):
            if rt is not None:
                rt.activate()
            n = calls if repeat else max(calls // 10, 100)   # repeat 0 warms up
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn(*args)
            sync()
            if repeat:
                samples[i].append((time.perf_counter_ns() - t0) / n)
            disable_apply()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per path per repeat")
    parser.add_argument("--repeats", type=int, default=51, help="timed repeats (the median is reported)")
    args = parser.parse_args()
    prepare_triton()  # before anything imports triton (the in-process sweep may)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_grad_enabled(False)
    logging.getLogger("fibray.apply").setLevel(logging.ERROR)  # switching off the other solution is expected
    torch.set_num_threads(1)  # the op is tiny; one thread keeps the pool's wake-ups out of the figures

    root = Path(tempfile.mkdtemp(prefix="fibray-apply-overhead-"))
    dataset, store = make_store(root)

    def runtime(keep: str, at: Path = store, **config: Any):
        rt = build_runtime(at, dataset, config=ApplyConfig(workdir=str(root / "builds"), **config))
        for other in SOLUTIONS:
            if other["name"] != keep:
                try:
                    rt.switch_off(other["name"], "not the path being measured")
                except KeyError:  # not built: it was never promoted in that store
                    pass
        return rt

    staged = {stage: promoted_store(root, store, dataset, "bench_scale_h64_value", stage)
              for stage in ("default", "canary", "shadow")}

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N_MEASURED, H, device=device, generator=gen)
    w = torch.randn(H, device=device, generator=gen)
    x_unseen = torch.randn(N_UNSEEN, H, device=device, generator=gen)
    wrapped = apply(DEFINITION["name"])(scale)
    value, dps = "bench_scale_h64_value", "bench_scale_h64_dps"

    paths: list[tuple[str, Callable[..., Any], tuple, Any]] = [
        ("direct call", scale, (x, w), None),
        ("apply idle (nothing enabled)", wrapped, (x, w), None),
        ("hit, no output check", wrapped, (x, w), runtime(value, finite_check_calls=0)),
        ("hit, NaN/Inf check every call", wrapped, (x, w), runtime(value)),
        ("hit, destination-passing winner", wrapped, (x, w), runtime(dps, finite_check_calls=0)),
        ("bucketed hit (unseen n)", wrapped, (x_unseen, w), runtime(value, finite_check_calls=0)),
        ("miss -> fallback", wrapped, (x_unseen, w), runtime(value, on_miss="fallback")),
        ("hit, Python dispatch only", wrapped, (x, w), runtime(value, finite_check_calls=0, compiled_dispatch=False)),
        ("promoted default hit", wrapped, (x, w),
         runtime(value, staged["default"], finite_check_calls=0, require_promotion=True)),
        ("canary (5% served, 10% compared)", wrapped, (x, w),
         runtime(value, staged["canary"], finite_check_calls=0, require_promotion=True, canary_fraction=0.05,
                 canary_compare_fraction=0.1, canary_compare_first=0, latency_window=10**9)),
        ("canary, every call served", wrapped, (x, w),
         runtime(value, staged["canary"], finite_check_calls=0, require_promotion=True, canary_fraction=1.0,
                 canary_compare_fraction=0.0, canary_compare_first=0, latency_window=10**9)),
        ("shadow (every call, compared)", wrapped, (x, w),
         runtime(value, staged["shadow"], finite_check_calls=0, require_promotion=True, latency_window=10**9)),
    ]
    samples = time_paths(paths, args.calls, args.repeats, sync)
    direct_samples = samples[0]
    results = [(label, statistics.median(s), statistics.median(t - d for t, d in zip(s, direct_samples)),
                statistics.median(t / d for t, d in zip(s, direct_samples)), rt)
               for (label, _, _, rt), s in zip(paths, samples)]

    env = f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu-' + platform.machine()}, " \
          f"torch {torch.__version__}, python {platform.python_version()}"
    compiled = paths[2][3].dispatchers[DEFINITION["name"]].compiled
    print(f"apply() dispatch overhead - {env}; {args.calls} calls x {args.repeats} repeats, median; "
          f"x [{N_MEASURED}, {H}] float32 on {device.type}; "
          f"{'compiled hit path' if compiled else 'Python dispatch only (the compiled hit path did not build)'}")
    print(f"{'path':34s} {'ns/call':>9s} {'overhead ns':>12s} {'ratio':>7s}  counters")
    for label, ns, overhead, ratio, rt in results:
        s = rt.stats() if rt is not None else None
        counters = f"hits={s.hits} bucketed={s.bucketed} misses={s.misses} fallbacks={s.fallbacks}" if s else ""
        for a in (s.artifacts.values() if s else ()):
            c = a.counters
            counters += f" [{a.stage}: served={a.calls}" + (
                f" shadow={c.shadow_calls} baseline={c.baseline_calls} compared={c.compared}" if c else "") + (
                f" demoted: {a.demoted}" if a.demoted else "") + "]"
        print(f"{label:34s} {ns:9.0f} {overhead:12.0f} {ratio:7.2f}  {counters}")
    hit = results[2][2]
    print(f"dispatch overhead on a hit (no output check): {hit:.0f} ns/call "
          f"({'meets' if hit < 1000 else 'misses'} the < 1000 ns goal)")


if __name__ == "__main__":
    main()
