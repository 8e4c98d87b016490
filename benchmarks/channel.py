"""How fast a reply's tensors travel from an executor to its supervisor.

    python benchmarks/channel.py [--mb 2 32 128 256] [--repeats 5]

A child process stands in for an executor: asked over a socket, it replies with one tensor of
the given size that lives on this machine's device (GPU if present, else CPU), the way an
executor returns a candidate's output. The supervisor receives it onto its own device. Two
channels, measured in one run: `socket` (tensor bytes written to the socket beside the pickle;
the baseline) and `arena` (bytes copied into shared memory that both processes map, pinned for
DMA on a GPU). Prints the median round trip per size and the ratio socket / arena.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection


def _child(fd: int, arena_fd: int, arena_bytes: int, device: str) -> None:
    import torch

    from fibray.workers.process.channel import Arena, Reply, recv, send

    conn = Connection(fd)
    arena = Arena(arena_fd, arena_bytes) if arena_fd >= 0 else None
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        if arena is not None:
            arena.pin(1)
    cache: dict[int, torch.Tensor] = {}
    while True:
        req = recv(conn, None, trusted=True)
        if req.op == "exit":
            return
        n = req.trial
        if n not in cache:
            cache[n] = torch.randn(n // 2, device=device).to(torch.bfloat16)
        send(conn, Reply(True, [cache[n]]), arena)


def _measure(sizes: list[int], repeats: int, use_arena: bool, device: str) -> dict[int, float]:
    import torch

    from fibray.workers.process.channel import Arena, Request, recv, send

    ours, theirs = socket.socketpair()
    arena = Arena.create(max(sizes) * 2) if use_arena else None
    fds = [theirs.fileno(), *([arena.fd] if arena else [])]
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(theirs.fileno()), str(arena.fd if arena else -1),
                             str(arena.size if arena else 0), device], pass_fds=fds)
    theirs.close()
    conn = Connection(ours.detach())
    out = {}
    try:
        for n in sizes:
            times = []
            for i in range(repeats + 1):  # the first round trip allocates and pins: not counted
                t0 = time.perf_counter()
                send(conn, Request("trial", trial=n))
                (t,) = recv(conn, time.monotonic() + 120, arena).value
                if t.is_cuda:
                    torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
                assert t.numel() * t.element_size() == n
            out[n] = statistics.median(times)
        send(conn, Request("exit"))
    finally:
        proc.wait(30)
        conn.close()
        if arena is not None:
            arena.close()
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[2, 32, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.zeros(1, device=device)
    sizes = [mb << 20 for mb in args.mb]
    sock = _measure(sizes, args.repeats, False, device)
    arena = _measure(sizes, args.repeats, True, device)
    print(f"device {torch.cuda.get_device_name() if device != 'cpu' else 'cpu'}; torch {torch.__version__}; "
          f"median of {args.repeats} round trips; baseline: socket")
    print(f"{'MB':>6}{'socket_ms':>12}{'arena_ms':>11}{'socket/arena':>14}{'arena_GB/s':>12}")
    for n in sizes:
        print(f"{n >> 20:>6}{sock[n] * 1e3:>12.2f}{arena[n] * 1e3:>11.2f}{sock[n] / arena[n]:>13.2f}x"
              f"{n / arena[n] / 1e9:>12.2f}")


if __name__ == "__main__":
    main()
