"""What the change made to a timed call's inputs costs, against the ways it was made before and
against an rmsnorm of the same input; and what making a set's flip masks costs (each job, on both sides).

    python benchmarks/input_changes.py [--device cuda] [--rows 1 64 1024 8192] [--inputs 2 3]

Before each timed call the executor changes its input set (fibray.evaluate.memory.InputChanges:
one mantissa bit of a random half of every float input flips). That work is in the supervisor's
window around the timing request and in no sample, so the timing bound has to allow for it; where
it outweighs the kernel, a lie about the kernel's latency hides behind it, and on a GPU its launches
are host time inside each timed call's budget. Prints, per input set of `inputs` tensors in a job
region (`rows` x 4096 bf16 each, the last a 4096 weight, as rmsnorm and fused_add_rmsnorm have):
InputChanges now (the set's span of bytes at once: a window of random words ANDed with the flip
mask, an XOR: three operations a set), the per-input window it replaced (the same two passes input
by input: the baseline, measured here in the same run), the per-element draw before that (`random_`,
a multiply, an XOR), and an rmsnorm of the first input (the kernel it must not outweigh); ratios
against the baseline. On a CPU, one thread, as an executor has.

Then the masks: InputChanges' construction (each job, in the executor as it prepares its timing and in
the supervisor as it replays the changes) decides which elements may flip with integer operations on
their bits (fibray.evaluate.memory.flip_mask); the baseline is the rule on the values it replaced
(2026-12-07: a float32 copy of each input, its flip's, three comparisons), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fibray.evaluate.memory import (  # noqa: E402
    FLIP_WEIGHT, POOL_SPAN, InputChanges, JobMemory, Layout, LocalRegion, args_of, plan_layout, set_span,
)


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


class PerInputWindow:
    """The baseline: the change as it was made until 2026-12-05, input by input (a window of a pool
    of random elements per input shape ANDed with the input's flip mask, an XOR: four operations an
    input, with the window's slice and view)."""

    def __init__(self, args: list[torch.Tensor]) -> None:
        self.parts = []
        for a in args:
            bits = a.view(torch.int16)
            flip = 1 << (7 - FLIP_WEIGHT)  # bf16: 7 mantissa bits
            pool = torch.empty(bits.numel() + POOL_SPAN, dtype=torch.int16, device=a.device).random_()
            self.parts.append((bits, torch.full_like(bits, flip), pool, torch.empty_like(bits)))

    def apply(self, seed: int) -> None:
        for bits, flips, pool, scratch in self.parts:
            at = seed % POOL_SPAN
            torch.bitwise_and(pool[at:at + bits.numel()].view(bits.shape), flips, out=scratch)
            bits.bitwise_xor_(scratch)


def masks_on_values(region, row) -> torch.Tensor:
    """The baseline: a set's flip mask as InputChanges made it until 2026-12-07, from the values."""
    lo, nbytes = set_span(row)
    mask = torch.zeros(nbytes, dtype=torch.uint8, device=region.bytes().device)
    for arg, a in zip(row, args_of(region, row)):
        bits = a.view(torch.int16)
        flip = 1 << (7 - FLIP_WEIGHT)  # bf16: 7 mantissa bits
        value = a.float()
        flipped = torch.bitwise_xor(bits, flip).view(a.dtype).float()
        keep = (value != 0) & value.isfinite() & flipped.isfinite()
        p = arg.place
        mask[p.off - lo:p.off - lo + p.nbytes].view(bits.dtype).view(bits.shape).copy_(keep.to(bits.dtype) * flip)
    return mask


def in_region(args: list[torch.Tensor], device: torch.device) -> tuple[InputChanges, list[torch.Tensor], Layout, LocalRegion]:
    """The set written into a job region as a slot lays it out: its InputChanges, its tensors there,
    the layout and the region."""
    layout = plan_layout("local", str(device), [args], [(args[0].dtype, tuple(args[0].shape))], trials=1, dps=True,
                         timed_buffers=1, snapshots=False)
    region = LocalRegion(layout.size, device)
    JobMemory(region, layout).write_inputs(0, args)
    return InputChanges.of_layout(layout, region)[0], args_of(region, layout.inputs[0]), layout, region


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
    ap.add_argument("--inputs", type=int, nargs="+", default=[2, 3], help="tensors in the set (the last a weight)")
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'one thread'}), "
          f"torch {torch.__version__}, {a.calls} calls a run, median of 5 runs; baseline: per-input window")
    print(f"{'set':>20} {'per-element draw':>17} {'per-input (base)':>17} {'InputChanges':>13} {'rmsnorm':>9} "
          f"{'base / now':>11} {'now / rmsnorm':>14}")
    masks = []
    for n in a.inputs:
        for rows in a.rows:
            args = [torch.randn(rows, 4096, device=device).to(torch.bfloat16) for _ in range(n - 1)]
            args.append(torch.randn(4096, device=device).to(torch.bfloat16))
            ours, placed, layout, region = in_region(args, device)
            draw, base = PerElementDraw(placed), PerInputWindow(placed)
            t_draw = per_call_us(lambda i: draw.apply(1000 + i), device, a.calls)
            t_base = per_call_us(lambda i: base.apply(1000 + i), device, a.calls)
            t_ours = per_call_us(lambda i: ours.apply(1000 + i), device, a.calls)
            t_kernel = per_call_us(lambda i: rmsnorm(placed[0], placed[-1]), device, a.calls)
            print(f"{f'{n - 1} x {rows} x 4096 + w':>20} {t_draw:>14.1f} us {t_base:>14.1f} us {t_ours:>10.1f} us "
                  f"{t_kernel:>6.1f} us {t_base / t_ours:>10.2f}x {t_ours / t_kernel:>13.2f}x")
            masks.append((n, rows, layout, region))
    print(f"\nmaking a set's flip masks (InputChanges' construction); baseline: the rule on values")
    print(f"{'set':>20} {'on values (base)':>17} {'on bits (now)':>14} {'base / now':>11}")
    for n, rows, layout, region in masks:
        t_base = per_call_us(lambda i: masks_on_values(region, layout.inputs[0]), device, max(1, a.calls // 5))
        t_ours = per_call_us(lambda i: InputChanges.of_layout(layout, region), device, max(1, a.calls // 5))
        print(f"{f'{n - 1} x {rows} x 4096 + w':>20} {t_base:>14.1f} us {t_ours:>11.1f} us {t_base / t_ours:>10.2f}x")


if __name__ == "__main__":
    main()
