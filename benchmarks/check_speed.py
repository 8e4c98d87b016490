"""A timed sample's check on a GPU: output_stats' torch path against the fused Triton kernel, in one run.

    python benchmarks/check_speed.py [--calls 52] [--repeat 5]

For outputs of several sizes and types (a judged sample of `--calls` timed calls, as a GPU job checks
it), prints the wall of each path (median of `--repeat`, read back included, as the judge does), the
ratio torch / fused, whether the two tables are the same bit for bit (they must be: same arithmetic,
no fused multiply-add, correctly rounded division), and how long the kernels' compile ahead took
(fibray.check.fused.warm, what a GPU slot does as it starts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from fibray.check import base
    from fibray.check.fused import fused_rows, warm, wide_type

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=52)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("check_speed: no GPU here (the fused kernel is a GPU's path)")
        return 1
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    warm(dev, (torch.bfloat16, torch.float16, torch.float32))
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; compile ahead (bf16, fp16, fp32) "
          f"{time.perf_counter() - t0:.2f}s")
    tol = base.Tolerance(1e-2, 1e-2)
    print(f"{'outputs':>28} {'MiB':>8} {'torch ms':>9} {'fused ms':>9} {'ratio':>6}  same")
    ratios = []
    for dtype, shape in [(torch.bfloat16, (1, 4096)), (torch.bfloat16, (64, 4096)), (torch.bfloat16, (1024, 4096)),
                         (torch.bfloat16, (4096, 4096)), (torch.float32, (256, 4096)), (torch.float16, (8192, 128))]:
        per = max(1, base.BATCH_ELEMENTS // (shape[0] * shape[1]))
        calls = min(args.calls, per)  # one batch, as output_stats makes them
        refs = [torch.randn(shape, device=dev).to(dtype) for _ in range(calls)]
        outs = [(r.float() + torch.randn(shape, device=dev) * 0.003).to(dtype) for r in refs]
        outs[0].view(-1)[7] = float("nan")
        wide = wide_type(dtype)
        walls = {}
        tables = {}
        for name, fn in [("torch", lambda: base._torch_rows(outs, refs, wide, True, tol)),
                         ("fused", lambda: fused_rows(outs, refs, wide, tol.atol, tol.rtol))]:
            fn().tolist()
            times = []
            for _ in range(args.repeat):
                torch.cuda.synchronize()
                t = time.perf_counter()
                tables[name] = fn()
                tables[name].tolist()
                times.append(time.perf_counter() - t)
            walls[name] = statistics.median(times)
        same = torch.equal(tables["torch"].isnan(), tables["fused"].isnan()) and torch.equal(
            tables["torch"].nan_to_num(), tables["fused"].nan_to_num())
        ratio = walls["torch"] / walls["fused"]
        ratios.append(ratio)
        mib = 2 * calls * shape[0] * shape[1] * dtype.itemsize / 2**20
        print(f"{calls:4d} x {str(dtype).replace('torch.', ''):>8} {str(shape):>12} {mib:8.1f} {walls['torch'] * 1e3:9.2f} "
              f"{walls['fused'] * 1e3:9.2f} {ratio:6.2f}  {same}")
    print(f"torch / fused, median over the sizes: {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
