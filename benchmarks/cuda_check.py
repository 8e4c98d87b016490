"""Run fibray's CUDA solutions on a GPU: status, error and latency against the PyTorch reference.

    python benchmarks/cuda_check.py                      # every cuda/cpp solution in datasets/llm/solutions
    python benchmarks/cuda_check.py --only gemm_n4096_k4096_cuda_mma_c_abi --json out.json

Each solution is built with fibray's builder (torch extension or c_abi; artifacts in
FIBRAY_BUILD_CACHE or a temp folder), bound to its definition, and run on a few
deterministic workloads generated here (small and large, and for paged attention, ragged
and empty requests). Outputs are judged like fibray judges them (|y - ref| <= atol + rtol |ref|,
equal non-finite values allowed; atol = rtol = 1e-2 unless the definition's check says
otherwise) against the definition's reference; the solution, the reference and a vendor
baseline (cuBLAS / torch kernels, where one exists) are timed with CUDA events after an L2
flush. It needs a GPU and never writes outside its temp folder (and --json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fibray.compile import BuildError, bind, builder_for  # noqa: E402
from fibray.schema import Definition, Solution  # noqa: E402
from fibray.timing.timer import flush_bytes  # noqa: E402

Case = dict[str, Any]  # input name -> tensor / scalar, plus "_axes" (var-axis values)


@dataclass
class Row:
    solution: str
    definition: str
    axes: dict[str, int]
    status: str
    max_abs_error: Optional[float] = None
    latency_ms: Optional[float] = None
    reference_ms: Optional[float] = None
    vendor_ms: Optional[float] = None
    speedup_vs_reference: Optional[float] = None
    speedup_vs_vendor: Optional[float] = None
    log: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- workloads ---------------------------------------------------------------------------
def _rmsnorm_cases(dev: torch.device) -> list[Case]:
    g = torch.Generator(device=dev).manual_seed(0)
    return [{"hidden_states": torch.randn(b, 4096, generator=g, device=dev).to(torch.bfloat16),
             "weight": torch.randn(4096, generator=g, device=dev).to(torch.bfloat16), "_axes": {"batch_size": b}}
            for b in (1, 7, 128, 1024, 8192)]


def _gemm_cases(dev: torch.device) -> list[Case]:
    g = torch.Generator(device=dev).manual_seed(0)
    b = torch.randn(4096, 4096, generator=g, device=dev).to(torch.float16)
    return [{"A": torch.randn(m, 4096, generator=g, device=dev).to(torch.float16), "B": b, "_axes": {"M": m}}
            for m in (1, 16, 64, 100, 512, 1024, 4096, 8192)]


def _gqa_cases(dev: torch.device) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    lens_list = [[73], [8192], [1, 100, 1000, 33], [0, 5, 0, 300],
                 torch.randint(1, 2048, (16,), generator=g).tolist(), torch.randint(1, 512, (64,), generator=g).tolist(),
                 torch.randint(512, 4096, (128,), generator=g).tolist()]
    cases = []
    for lens in lens_list:
        total = sum(lens)
        pages = total + 37
        indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.randperm(pages, generator=g)[:total].to(torch.int32)
        gd = torch.Generator(device=dev).manual_seed(len(lens) * 7919 + total)
        cases.append({
            "q": torch.randn(len(lens), 32, 128, generator=gd, device=dev).to(torch.bfloat16),
            "k_cache": torch.randn(pages, 1, 8, 128, generator=gd, device=dev).to(torch.bfloat16),
            "v_cache": torch.randn(pages, 1, 8, 128, generator=gd, device=dev).to(torch.bfloat16),
            "kv_indptr": indptr.to(dev), "kv_indices": indices.to(dev), "sm_scale": 1.0 / math.sqrt(128),
            "_axes": {"batch_size": len(lens), "num_pages": pages, "len_indptr": len(lens) + 1, "num_kv_indices": total},
        })
    return cases


CASES: dict[str, Callable[[torch.device], list[Case]]] = {
    "rmsnorm_h4096": _rmsnorm_cases,
    "gemm_n4096_k4096": _gemm_cases,
    "gqa_paged_decode_h32_kv8_d128_ps1": _gqa_cases,
}

VENDOR: dict[str, Callable[..., Any]] = {
    "rmsnorm_h4096": lambda hidden_states, weight: torch.nn.functional.rms_norm(hidden_states, (4096,), weight, 1e-5),
    "gemm_n4096_k4096": lambda A, B: torch.matmul(A, B.T),
}


# -- timing and judging -------------------------------------------------------------------
def bench(fn: Callable[[], Any], warmup: int, iterations: int, dev: torch.device) -> float:
    """Median latency (ms) of fn(), CUDA events around each call, L2 flushed before each."""
    flush = torch.empty(flush_bytes(dev), dtype=torch.uint8, device=dev)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(iterations):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def judge(outputs: list[torch.Tensor], refs: list[torch.Tensor], atol: float, rtol: float) -> tuple[bool, float, str]:
    worst, message = 0.0, ""
    for i, (o, r) in enumerate(zip(outputs, refs)):
        if o.shape != r.shape or o.dtype != r.dtype:
            return False, math.nan, f"output {i}: {tuple(o.shape)} {o.dtype}, expected {tuple(r.shape)} {r.dtype}"
        of, rf = o.float(), r.float()
        same_nonfinite = ~torch.isfinite(rf) & (of == rf)
        diff = torch.where(same_nonfinite, torch.zeros_like(of), (of - rf).abs())
        diff = torch.nan_to_num(diff, nan=math.inf)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        bad = diff > atol + rtol * torch.nan_to_num(rf.abs(), posinf=0.0)
        if bool(bad.any()):
            message = f"output {i}: {int(bad.sum())}/{bad.numel()} elements beyond atol={atol}, rtol={rtol}"
            return False, worst, message
    return True, worst, message


def reference_fn(definition: Definition) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__name__": f"_ref_{definition.name}"}
    exec(compile(definition.reference, f"<reference {definition.name}>", "exec"), namespace)
    return namespace["run"]


def as_outputs(result: Any, definition: Definition) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def empty_outputs(definition: Definition, axes: dict[str, int], dev: torch.device) -> list[torch.Tensor]:
    from fibray.evaluate.inputs import torch_dtype

    outs = []
    for spec in definition.outputs.values():
        t = torch.empty(definition.shape_of(spec, axes) or (), dtype=torch_dtype(spec.dtype), device=dev)
        t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(-1)
        outs.append(t)
    return outs


def check_solution(solution: Solution, definition: Definition, args: argparse.Namespace, workdir: Path,
                   dev: torch.device) -> list[Row]:
    rows: list[Row] = []
    cases = CASES[definition.name](dev)
    try:
        runnable = bind(builder_for(solution.spec.language.value)(solution, workdir / solution.hash[:24]), definition)
    except BuildError as e:
        return [Row(solution.name, definition.name, c["_axes"], f"COMPILE_ERROR:{e.reason}", log=str(e)[-2000:]) for c in cases[:1]]
    ref = reference_fn(definition)
    atol = definition.check.atol if definition.check and definition.check.atol is not None else 1e-2
    rtol = definition.check.rtol if definition.check and definition.check.rtol is not None else 1e-2
    names = list(definition.inputs)
    for case in cases:
        axes = case["_axes"]
        inputs = [case[n] for n in names]
        row = Row(solution.name, definition.name, axes, "PASSED")
        rows.append(row)
        with torch.no_grad():
            refs = as_outputs(ref(*inputs), definition)
            refs = [r.to(dev) for r in refs]
            try:
                outs = empty_outputs(definition, axes, dev)
                runnable(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs], *outs)
                torch.cuda.synchronize(dev)
            except Exception as e:  # noqa: BLE001  (a candidate may raise anything; it is reported)
                row.status, row.log = "RUNTIME_ERROR", "".join(traceback.format_exception(e))[-2000:]
                continue
            ok, row.max_abs_error, msg = judge(outs, refs, atol, rtol)
            if not ok:
                row.status, row.log = "INCORRECT_NUMERICAL", msg
                continue
            row.latency_ms = bench(lambda: runnable(*inputs, *outs), args.warmup, args.iterations, dev)
            if not args.skip_reference:
                row.reference_ms = bench(lambda: ref(*inputs), 1, args.reference_iterations, dev)
                row.speedup_vs_reference = row.reference_ms / row.latency_ms
            vendor = VENDOR.get(definition.name)
            if vendor is not None:
                row.vendor_ms = bench(lambda: vendor(*inputs), args.warmup, args.iterations, dev)
                row.speedup_vs_vendor = row.vendor_ms / row.latency_ms
            if definition.name == "gemm_n4096_k4096":
                row.extra["tflops"] = round(2 * axes["M"] * 4096 * 4096 / (row.latency_ms * 1e-3) / 1e12, 1)
    return rows


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--solutions", type=Path, default=REPO / "datasets" / "llm" / "solutions")
    p.add_argument("--definitions", type=Path, default=REPO / "datasets" / "llm" / "definitions")
    p.add_argument("--only", nargs="*", default=None, help="solution names")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--reference-iterations", type=int, default=5)
    p.add_argument("--skip-reference", action="store_true", help="do not time the (slow) references")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the environment here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device; this script needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    definitions = {d.name: d for d in (Definition.model_validate_json(f.read_text()) for f in args.definitions.rglob("*.json"))}
    solutions = [Solution.model_validate_json(f.read_text()) for f in sorted(args.solutions.rglob("*.json"))]
    solutions = [s for s in solutions if s.spec.language.value in ("cuda", "cpp") and (args.only is None or s.name in args.only)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fibray-cuda-check-") as tmp:
        for sol in solutions:
            if sol.definition not in definitions or sol.definition not in CASES:
                print(f"skip {sol.name}: no workloads here for definition {sol.definition!r}", file=sys.stderr)
                continue
            for row in check_solution(sol, definitions[sol.definition], args, Path(tmp), dev):
                rows.append(row)
                axes = ",".join(f"{k}={v}" for k, v in row.axes.items())
                print(f"{row.solution:48s} {axes:62s} {row.status:24s} err={_fmt(row.max_abs_error, '.2e'):9s} "
                      f"sol={_fmt(row.latency_ms, '.4f'):>9s}ms ref={_fmt(row.reference_ms, '.3f'):>9s}ms "
                      f"vendor={_fmt(row.vendor_ms, '.4f'):>9s}ms x_ref={_fmt(row.speedup_vs_reference, '.1f'):>7s} "
                      f"x_vendor={_fmt(row.speedup_vs_vendor, '.2f'):>5s} {row.extra or ''}", flush=True)
                if row.log and row.status != "PASSED":
                    print("    " + row.log.strip().replace("\n", "\n    ")[-1500:], flush=True)
    passed = sum(r.status == "PASSED" for r in rows)
    print(f"\n{passed}/{len(rows)} PASSED on {torch.cuda.get_device_name(dev)}")
    if args.json:
        env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(dev),
               "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
        args.json.write_text(json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=2))
    expected_failures = {r.solution for r in rows if r.solution.endswith("_compile_error") and r.status.startswith("COMPILE_ERROR")}
    return 0 if all(r.status == "PASSED" or r.solution in expected_failures for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
