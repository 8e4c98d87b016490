"""Check every LLM solution on one GPU against its definition's reference, on GPU-size workloads, without Ray.

    python datasets/llm/kernels/check_gpu.py [--pick largest|all|first] [--budget-s 500] [NAME_PREFIX ...]

Workloads come straight from the generator's drafts (no files written); each solution is built by
fibray's own builder and judged by fibray's checkers (sampling through draw_plan / collect_draws).
Prints one line per (definition, workload, solution): verdict, error and median latency. A tool
for a GPU machine; the CI path is the Ray sweep of the cpu_small set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from fibray.compile import BuildCache, BuildError, build_reference, prepare_triton  # noqa: E402
from fibray.check import Draws, Tolerance, checker_for, collect_draws, draw_plan, wants_draws  # noqa: E402
from fibray.generate._defs import catalogue  # noqa: E402
from fibray.generate import drafts_for  # noqa: E402
from fibray.evaluate.inputs import allocate_outputs, input_seed, random_tensor, torch_dtype  # noqa: E402
from fibray.schema import Definition, Solution  # noqa: E402

LLM = ROOT / "datasets" / "llm"


@dataclass
class _Out:
    outputs: list[Any] = field(default_factory=list)
    failure: Optional[str] = None


def _inputs(d: Definition, draft, device: torch.device) -> list[Any]:
    shapes = d.input_shapes(draft.axes)
    args = []
    for name, spec in d.inputs.items():
        if name in draft.tensors:
            args.append(draft.tensors[name].to(device))
        elif name in draft.scalars:
            args.append(draft.scalars[name])
        else:
            args.append(random_tensor(shapes[name], torch_dtype(spec.dtype), device, input_seed(0, d.name, 0, name)))
    return args


def _size(draft) -> int:
    return sum(int(v) for v in draft.axes.values())


def _call(runnable, d: Definition, args: list[Any], axes: dict[str, int], device) -> _Out:
    try:
        if runnable.destination_passing_style:
            outs = allocate_outputs(d, axes, device)
            runnable(*args, *outs)
        else:
            res = runnable(*args)
            outs = list(res) if isinstance(res, (tuple, list)) else [res]
        torch.cuda.synchronize()
        return _Out(outs)
    except Exception as e:  # a candidate's failure is a result here too
        return _Out(failure=f"{type(e).__name__}: {str(e)[:300]}")


def _median_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefixes", nargs="*")
    parser.add_argument("--pick", default="largest", choices=("largest", "first", "all"))
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--no-time", action="store_true")
    args = parser.parse_args()
    prepare_triton()
    device = torch.device("cuda")
    t0 = time.monotonic()
    builds = BuildCache(Path(tempfile.mkdtemp(prefix="llm_builds")))
    workdir = Path(tempfile.mkdtemp(prefix="llm_refs"))
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for raw in catalogue():
        if args.prefixes and not any(raw["name"].startswith(p) for p in args.prefixes):
            continue
        if time.monotonic() - t0 > args.budget_s:
            print(f"# budget spent before {raw['name']}", flush=True)
            break
        d = Definition.model_validate(raw)
        drafts = drafts_for(raw, "gpu", 0)
        picked = {"largest": [max(drafts, key=_size)], "first": drafts[:1], "all": drafts}[args.pick]
        ref = build_reference(d.reference, d.name, workdir)
        sols = [Solution.model_validate(json.loads(p.read_text()))
                for p in sorted((LLM / "solutions" / d.op_type / d.name).glob("*.json")) if "_cuda" not in p.name]
        c = d.check
        tol = Tolerance(atol=c.atol if c and c.atol is not None else 1e-2, rtol=c.rtol if c and c.rtol is not None else 1e-2,
                        matched_ratio=c.matched_ratio if c else None)
        checker = checker_for(c.kind if c else "elementwise")
        names = list(d.outputs)
        for draft in picked:
            inputs = _inputs(d, draft, device)
            with torch.no_grad():
                r = ref(*[a.clone() if torch.is_tensor(a) else a for a in inputs])
            refs = [torch.as_tensor(x).to(device, torch_dtype(s.dtype)) for x, s in zip(r if isinstance(r, tuple) else [r], d.outputs.values())]
            for sol in sols:
                try:
                    runnable = builds.get(sol)
                except BuildError as e:
                    print(f"{d.name} {draft.axes} {sol.name} COMPILE_ERROR {e.reason}", flush=True)
                    continue
                clone = lambda: [a.clone() if torch.is_tensor(a) else a for a in inputs]  # noqa: E731
                out = _call(runnable, d, clone(), draft.axes, device)
                if out.failure:
                    print(f"{d.name} {draft.axes} {sol.name} RUNTIME_ERROR {out.failure}", flush=True)
                    continue
                samples = None
                if wants_draws(checker):
                    plan = draw_plan(d, inputs)
                    samples = collect_draws(d, plan, inputs, draft.axes, lambda a, ax: _call(runnable, d, a, ax, device))
                    if not torch.is_tensor(samples):
                        print(f"{d.name} {draft.axes} {sol.name} RUNTIME_ERROR {samples.failure}", flush=True)
                        continue
                    res = checker(out.outputs, refs, names, tol, draws=Draws(d, inputs, samples))
                else:
                    res = checker(out.outputs, refs, names, tol)
                ms = float("nan")
                if not args.no_time and res.ok:
                    fixed = clone()
                    dst = allocate_outputs(d, draft.axes, device) if runnable.destination_passing_style else []
                    ms = _median_ms(lambda: runnable(*fixed, *dst))
                extra = {k: round(v, 4) if isinstance(v, float) else v for k, v in res.extra.items()}
                print(f"{d.name} {draft.axes} {sol.name} {res.status.value} {res.reason or ''} max_abs={res.max_abs:.3g} "
                      f"{extra} {ms:.3f}ms {res.message[:160] if not res.ok else ''}", flush=True)
            del inputs, refs
            torch.cuda.empty_cache()
    print(f"# done in {time.monotonic() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
