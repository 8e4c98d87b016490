"""Latency of the example decoder block with and without apply() (GPU: Llama-3-8B shapes; CPU: tiny).

Traces the block on sample batches, sweeps its candidates with the real Ray sweep into a
store (skipped with --reuse when the store exists), enables apply and times one block
forward per batch size: plain PyTorch, apply with a NaN/Inf check on every substituted call
(the default), and apply with the check on each solution's first 16 calls only.

    python benchmarks/apply_block.py --workdir /tmp/fibray-block            # on the GPU machine
    python benchmarks/apply_block.py --config tiny --iters 5                # anywhere

Prints ms per forward (median of --iters, device synchronised), the ratio to plain
PyTorch, the counters and the winning solution of each definition.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from examples.llama_block.pipeline import (  # noqa: E402
    CI_EVAL, batches, sweep, sweep_in_process, trace_block, winners,
)
from fibray.apply import ApplyConfig, build_runtime, disable_apply  # noqa: E402

GPU_EVAL = {"warmup": 5, "iterations": 20, "trials": 2}
SCENARIOS = {
    "llama3_8b": {"decode-like 16x1": [1] * 16, "prefill 4x128": [128] * 4, "prefill 2x1024": [1024, 1024]},
    "tiny": {"decode-like 8x1": [1] * 8, "prefill 2x16": [16, 16]},
}
"""Batches timed per config (prompt lengths); each is traced, so apply hits its measured keys."""


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--config", default="llama3_8b" if cuda else "tiny", choices=sorted(CONFIGS))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fibray-apply-block"))
    parser.add_argument("--reuse", action="store_true", help="reuse the workdir's traced dataset and store")
    parser.add_argument("--in-process", action="store_true",
                        help="judge candidates in this process, not the Ray sweep (where Ray cannot run)")
    parser.add_argument("--iters", type=int, default=50 if cuda else 5)
    parser.add_argument("--warmup", type=int, default=10 if cuda else 2)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    config = CONFIGS[args.config]
    device = torch.device("cuda") if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    scenarios = SCENARIOS[args.config]
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.workdir.chmod(0o755)  # the sweep may run candidates as an unprivileged user
    dataset, store = args.workdir / "dataset", args.workdir / "store"

    block = DecoderBlock(config).to(device)
    inputs = dict(zip(scenarios, batches(config, list(scenarios.values()))))
    if not (args.reuse and store.is_dir()):
        write_dataset(dataset, config)
        trace_block(block, dataset, list(inputs.values()))
        t0 = time.monotonic()
        settings = GPU_EVAL if cuda else CI_EVAL
        if args.in_process:
            counts = sweep_in_process(dataset, store, f"apply_block_{args.config}", settings)
        else:
            counts = sweep(dataset, store, f"apply_block_{args.config}", settings).counts
        print(f"sweep ({'in process' if args.in_process else 'Ray'}): {counts} in {time.monotonic() - t0:.0f}s",
              file=sys.stderr)

    every_call = build_runtime(store, dataset, config=ApplyConfig(workdir=str(args.workdir / "builds")))
    first_calls = build_runtime(store, dataset, config=ApplyConfig(workdir=str(args.workdir / "builds"),
                                                                    finite_check_calls=16))
    hw = torch.cuda.get_device_name() if cuda else f"cpu-{platform.machine()}"
    print(f"apply_block: {args.config} {config}, {hw}, torch {torch.__version__}, "
          f"median of {args.iters} forwards after {args.warmup} warm-up")
    print(f"{'batch':18s} {'plain ms':>10s} {'apply ms':>10s} {'ratio':>7s} {'apply(check 16) ms':>19s} {'ratio':>7s} "
          f"{'max |diff|':>11s}")
    results = {}
    with torch.inference_mode():
        for name, batch in inputs.items():
            plain = median_ms(lambda: block(*batch), args.iters, args.warmup, sync)
            reference = block(*batch)
            timed = []
            for rt in (every_call, first_calls):
                rt.activate()
                timed.append(median_ms(lambda: block(*batch), args.iters, args.warmup, sync))
                out = block(*batch)
                disable_apply()
            diff = (out.float() - reference.float()).abs().max().item()
            results[name] = {"plain_ms": plain, "apply_ms": timed[0], "apply_first16_ms": timed[1],
                             "max_abs_diff": diff}
            print(f"{name:18s} {plain:10.3f} {timed[0]:10.3f} {timed[0] / plain:7.3f} {timed[1]:19.3f} "
                  f"{timed[1] / plain:7.3f} {diff:11.3g}")
    s = every_call.stats()
    print(f"counters (every-call check runtime): hits={s.hits} bucketed={s.bucketed} misses={s.misses} "
          f"fallbacks={s.fallbacks} switched_off={s.switched_off} dropped_builds={s.dropped_builds}")
    print("winners:", json.dumps(winners(every_call), indent=1))
    summary = {"config": args.config, "hardware": hw, "torch": torch.__version__, "results": results}
    (args.workdir / "apply_block.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
