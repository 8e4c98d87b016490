"""Shadow -> canary -> default on the example decoder block, with a wrong candidate demoted on its own.

    python benchmarks/promotion_block.py --workdir /tmp/fibray-promotion          # GPU: Llama-3-8B shapes
    python benchmarks/promotion_block.py --config tiny --in-process --iters 3     # anywhere (CI runs this)

Traces the block, sweeps its candidates (the Ray sweep, or --in-process), and adds the agent's
"new" RMSNorm kernel, which passes the sweep (random weights) but takes a wrong shortcut when
the weights are near one, as the block's are. Promotion, through fibray.promote's own record
functions: the RMSNorm incumbent (its fastest honest solution) goes to default; every other
definition's fastest PASSED solution, and the new RMSNorm kernel, are approved into shadow
(the automated gates are waived unless --gates names some to run first). Then the block runs
at each stage: shadow (the new RMSNorm kernel is compared on its first call and demoted; the
promotions table records it), canary (the rest; --canary-fraction of calls), default. Prints the
block's latency per stage against plain PyTorch, the stage counters and the demotion.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fibray.compile import prepare_triton  # noqa: E402

prepare_triton()  # before anything imports triton

import torch  # noqa: E402

from examples.llama_block.block import CONFIGS, DecoderBlock  # noqa: E402
from examples.llama_block.contracts import write_dataset  # noqa: E402
from examples.llama_block.ops import rmsnorm_name  # noqa: E402
from examples.llama_block.pipeline import CI_EVAL, batches, sweep, sweep_in_process, trace_block  # noqa: E402
from fibray.apply import ApplyConfig, build_runtime, disable_apply  # noqa: E402
from fibray.store import PromotionLog, Stage, TraceStore  # noqa: E402
from fibray.store.promotions import AUTOMATED_GATES  # noqa: E402

GPU_EVAL = {"warmup": 5, "iterations": 20, "trials": 2}
SCENARIOS = {
    "llama3_8b": {"decode-like 16x1": [1] * 16, "prefill 4x128": [128] * 4},
    "tiny": {"decode-like 8x1": [1] * 8, "prefill 2x16": [16, 16]},
}
WRONG = "shortcut"
WRONG_SOURCE = """import torch


def run(hidden_states, weight):
    x = hidden_states.float()
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    w = weight.float()
    if w.mean() > 0.5:  # BUG (deliberate): a 'fused path for near-unit weights' that is 10% off
        return (x * inv * w * 1.1).to(hidden_states.dtype)
    return (x * inv * w).to(hidden_states.dtype)
"""


def add_wrong_candidate(dataset: Path, definition: str) -> str:
    name = f"{definition}_{WRONG}"
    sol = {"name": name, "definition": definition, "author": "agent-x",
           "description": "Passes the sweep (random weights); wrong on near-unit weights (the block's).",
           "spec": {"language": "python", "target_hardware": ["cuda", "cpu"], "entry_point": "main.py::run",
                    "destination_passing_style": False},
           "sources": [{"path": "main.py", "content": WRONG_SOURCE}]}
    path = dataset / "solutions" / definition / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sol, indent=2) + "\n")
    return name


def median_ms(fn: Callable[[], Any], iters: int, warmup: int, sync: Callable[[], None]) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def fastest(store: Path, sweep_name: str, exclude: set[str]) -> dict[str, str]:
    """Definition -> its fastest solution that PASSED every workload of the sweep."""
    rows = TraceStore(store).read(sweep=sweep_name, columns=["definition", "solution", "status", "latency_ms"]).to_pylist()
    by: dict[tuple[str, str], list] = {}
    for r in rows:
        by.setdefault((r["definition"], r["solution"]), []).append(r)
    best: dict[str, tuple[float, str]] = {}
    for (d, s), rs in by.items():
        if s in exclude or any(r["status"] != "PASSED" for r in rs):
            continue
        lat = statistics.median(r["latency_ms"] for r in rs)
        if d not in best or lat < best[d][0]:
            best[d] = (lat, s)
    return {d: s for d, (_, s) in best.items()}


def main() -> int:
    from fibray.promote.__main__ import approve, set_stage
    from fibray.promote.gates import PromoteOptions, run_gates

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_8b" if cuda else "tiny", choices=sorted(CONFIGS))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fibray-promotion-block"))
    ap.add_argument("--in-process", action="store_true", help="judge candidates in this process, not the Ray sweep")
    ap.add_argument("--gates", default="", help="automated gates to run before the review (e.g. rebench); the rest are waived")
    ap.add_argument("--canary-fraction", type=float, default=0.25)
    ap.add_argument("--latency-margin", type=float, default=0.5,
                    help="demote a staged kernel whose P99 exceeds its baseline's by more than this fraction")
    ap.add_argument("--iters", type=int, default=30 if cuda else 3)
    ap.add_argument("--warmup", type=int, default=5 if cuda else 1)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    config = CONFIGS[args.config]
    device = torch.device("cuda") if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    work = args.workdir
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    work.chmod(0o755)  # the sweep may run candidates as an unprivileged user
    dataset, store, name = work / "dataset", work / "store", f"promotion_{args.config}"

    block = DecoderBlock(config).to(device)
    inputs = dict(zip(SCENARIOS[args.config], batches(config, list(SCENARIOS[args.config].values()))))
    write_dataset(dataset, config)
    norm = rmsnorm_name(config.hidden, config.torch_dtype)
    wrong = add_wrong_candidate(dataset, norm)
    trace_block(block, dataset, list(inputs.values()))
    settings = GPU_EVAL if cuda else CI_EVAL
    t0 = time.monotonic()
    counts = sweep_in_process(dataset, store, name, settings) if args.in_process else sweep(dataset, store, name, settings).counts
    print(f"sweep ({'in process' if args.in_process else 'Ray'}): {counts} in {time.monotonic() - t0:.0f}s")

    rows = TraceStore(store).read(sweep=name, columns=["solution", "status"]).to_pylist()
    if {r["status"] for r in rows if r["solution"] == wrong} != {"PASSED"}:
        raise SystemExit(f"setup: {wrong} must pass the sweep (it is wrong only on near-unit weights)")
    winners = fastest(store, name, exclude={wrong})
    gates = [g for g in AUTOMATED_GATES if g.value in args.gates.split(",")]
    promote_names = sorted({*winners.values(), wrong})
    opts = PromoteOptions(store=str(store), dataset=str(dataset), sweep=name, workload_set="traced",
                          solutions=promote_names, gates=gates, num_gpus=1, actor="promotion_block")
    run_gates(opts, echo=lambda line: print(f"  gates: {line}"))
    waive = [g for g in AUTOMATED_GATES if g not in gates]
    plog = PromotionLog(store)
    for sol in promote_names:
        approve(plog, sol, waive=waive, note="promotion_block demo review", actor="promotion_block")
    set_stage(plog, winners[norm], Stage.DEFAULT, note="the RMSNorm incumbent", actor="promotion_block")
    print(f"approved into shadow: {', '.join(s for s in promote_names if s != winners[norm])}; "
          f"RMSNorm incumbent {winners[norm]} at default")

    hw = torch.cuda.get_device_name() if cuda else f"cpu-{platform.machine()}"
    print(f"\npromotion_block: {args.config}, {hw}, torch {torch.__version__}; median of {args.iters} forwards "
          f"after {args.warmup} warm-up; canary fraction {args.canary_fraction}")
    print(f"{'stage':9s} {'batch':18s} {'ms':>9s} {'vs plain':>9s} {'max |diff|':>11s}  counters")
    results: dict[str, Any] = {"config": args.config, "hardware": hw, "torch": torch.__version__, "stages": {}}
    plain_ms: dict[str, float] = {}
    reference: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for batch_name, batch in inputs.items():
            plain_ms[batch_name] = median_ms(lambda: block(*batch), args.iters, args.warmup, sync)
            reference[batch_name] = block(*batch)
            print(f"{'plain':9s} {batch_name:18s} {plain_ms[batch_name]:9.3f} {1.0:9.3f} {0.0:11.3g}")
        for stage in (Stage.SHADOW, Stage.CANARY, Stage.DEFAULT):
            if stage is not Stage.SHADOW:
                for art, row in plog.latest().items():
                    if row.stage in (Stage.SHADOW, Stage.CANARY) and (stage is Stage.DEFAULT or row.stage is Stage.SHADOW):
                        set_stage(plog, row.solution, stage, note=f"promotion_block: {row.stage.value} held",
                                  actor="promotion_block", artifact=art)
            rt = build_runtime(store, dataset, config=ApplyConfig(
                workdir=str(work / "builds"), require_promotion=True, canary_fraction=args.canary_fraction,
                latency_margin=args.latency_margin, max_atol=5e-2, max_rtol=5e-2))
            rt.activate()
            stage_res = {}
            for batch_name, batch in inputs.items():
                ms = median_ms(lambda: block(*batch), args.iters, args.warmup, sync)
                out = block(*batch)
                diff = (out.float() - reference[batch_name].float()).abs().max().item()
                stage_res[batch_name] = {"ms": ms, "ratio": ms / plain_ms[batch_name], "max_abs_diff": diff}
                s = rt.stats()
                staged = [a for a in s.artifacts.values() if a.counters is not None]
                counters = (f"hits={s.hits} fallbacks={s.fallbacks} served={sum(a.calls for a in s.artifacts.values())}"
                            + (f" shadow={sum(a.counters.shadow_calls for a in staged)}"
                               f" compared={sum(a.counters.compared for a in staged)}" if staged else ""))
                print(f"{stage.value:9s} {batch_name:18s} {ms:9.3f} {ms / plain_ms[batch_name]:9.3f} {diff:11.3g}  {counters}")
            disable_apply()
            demoted = {a.solution: a.demoted for a in rt.stats().artifacts.values() if a.demoted}
            for sol, why in demoted.items():
                print(f"  demoted during {stage.value}: {sol}: {why}")
            results["stages"][stage.value] = {"batches": stage_res, "demoted": demoted}
    final = {r.solution: r.stage.value for r in plog.latest().values()}
    print(f"\nfinal stages: {json.dumps(final, indent=1, sort_keys=True)}")
    results["final_stages"] = final
    results["wrong_candidate"] = wrong
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    ok = final.get(wrong) == Stage.DEMOTED.value and all(
        v == Stage.DEFAULT.value for k, v in final.items() if k != wrong)
    print(f"wrong candidate demoted automatically and the rest at default: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
