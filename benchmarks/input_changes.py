"""What the change made to a timed call's inputs costs, against a random draw per element and
against an rmsnorm of the same input.

    python benchmarks/input_changes.py [--device cuda] [--rows 1 64 1024 8192]

Before each timed call the executor changes its input set (fibray.evaluate.memory.InputChanges:
one mantissa bit of a random half of every float input flips). That work is in the supervisor's
window around the timing request and in no sample, so the timing bound has to allow for it; where
it outweighs the kernel, a lie about the kernel's latency hides behind it. Prints, per input of
`rows` x 4096 bf16 (and a 4096 weight, as rmsnorm has): InputChanges.apply (a window of a pool of
random bits: an AND and an XOR), the per-element draw it replaced (`random_`, a multiply, an XOR:
the baseline, measured here in the same run), and an rmsnorm of the input (the kernel it must not
outweigh); ratios against the baseline. On a CPU, one thread, as an executor has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fibray.evaluate.memory import InputChanges  # noqa: E402


class PerElementDraw:
    """The baseline: a fresh random draw for every element of every float input, every call."""

    def __init__(self, args: list[torch.Tensor]) -> None:
        self.parts = []
        for a in args:
            bits = a.view(torch.int16)
            flips = torch.full_like(bits, 1 << 4)  # bf16: the mantissa bit worth 2**-3
            self.parts.append((bits, flips, torch.empty_like(bits)))
        self.gen = torch.Generator(device=args[0].device)

    def apply(self, seed: int) -> None:
        self.gen.manual_seed(seed)
        for bits, flips, draw in self.parts:
            draw.random_(0, 2, generator=self.gen)
            draw.mul_(flips)
            bits.bitwise_xor_(draw)


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)


def per_call_us(fn, device: torch.device, calls: int) -> float:
    """Median over 5 runs of `calls` calls, microseconds a call (the device's queue drained in each)."""
    runs = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs[1:])  # the first warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 1024, 8192])
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'one thread'}), "
          f"torch {torch.__version__}, {a.calls} calls a run, median of 5 runs")
    print(f"{'input':>14} {'per-element draw':>17} {'InputChanges':>13} {'rmsnorm':>9} {'draw / changes':>15} "
          f"{'changes / rmsnorm':>18}")
    for rows in a.rows:
        x = torch.randn(rows, 4096, device=device).to(torch.bfloat16)
        w = torch.randn(4096, device=device).to(torch.bfloat16)
        ours = InputChanges([x, w])
        base = PerElementDraw([x, w])
        t_base = per_call_us(lambda i: base.apply(1000 + i), device, a.calls)
        t_ours = per_call_us(lambda i: ours.apply(1000 + i), device, a.calls)
        t_kernel = per_call_us(lambda i: rmsnorm(x, w), device, a.calls)
        print(f"{f'{rows} x 4096':>14} {t_base:>14.1f} us {t_ours:>10.1f} us {t_kernel:>6.1f} us "
              f"{t_base / t_ours:>14.2f}x {t_ours / t_kernel:>17.2f}x")


if __name__ == "__main__":
    main()
