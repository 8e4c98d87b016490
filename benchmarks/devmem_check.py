"""GPU self-test of fibray.workers.process.devmem: memory one process allocates, another of another
uid maps through a file descriptor passed over a socket (CUDA VMM), and what the mapping costs.

    python benchmarks/devmem_check.py [--uid 65534] [--sizes-mb 2,64,1024] [--json out.json]

The parent (the supervisor's role) creates a region per size, fills it with a pattern, and sends
the exported descriptor over a socketpair (SCM_RIGHTS) to a child started as `--uid` (the
executor's role, as root only; otherwise the same uid, which the output says). The child imports
and maps the region, checks the pattern on the GPU, writes its answer into the second half, and
reports its timings; the parent checks the answer on its own mapping. Exit status 0 only when
every size round-trips. Needs a GPU; prints a JSON summary (date, GPU, driver, torch, timings).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _child(fd_sock: int, sizes: list[int]) -> None:
    import torch

    from fibray.workers.process.devmem import DeviceRegion

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    sock = socket.socket(fileno=fd_sock)
    out = []
    for size in sizes:
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        t0 = time.perf_counter()
        region = DeviceRegion.open(fds[0], size, device)
        t1 = time.perf_counter()
        raw = region.bytes()
        half = size // 2
        expect = torch.arange(half, device=device, dtype=torch.int64).remainder_(251).to(torch.uint8)
        ok = bool(torch.equal(raw[:half], expect))
        raw[half:].copy_(expect[: size - half].flip(0) if size - half <= half else raw[half:])
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        region.close()
        t3 = time.perf_counter()
        out.append({"size": size, "read_ok": ok, "import_map_ms": (t1 - t0) * 1e3, "check_write_ms": (t2 - t1) * 1e3,
                    "unmap_ms": (t3 - t2) * 1e3, "uid": os.getuid()})
        sock.sendall(b"k")
    sock.sendall(json.dumps(out).encode() + b"\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uid", type=int, default=65534, help="the child's uid when running as root")
    parser.add_argument("--sizes-mb", default="2,64,1024")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, [int(s) for s in args.sizes.split(",")])
        return 0

    import torch

    from fibray.workers.process import devmem

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    why = devmem.available(device)
    if why is not None:
        print(f"CUDA VMM is not usable here: {why}")
        return 1
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    ours, theirs = socket.socketpair()
    as_root = os.getuid() == 0
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", str(theirs.fileno()), "--sizes", ",".join(map(str, sizes))],
        pass_fds=(theirs.fileno(),), user=args.uid if as_root else None, group=args.uid if as_root else None,
        extra_groups=[] if as_root else None, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd="/")
    theirs.close()
    results, ok = [], True
    for size in sizes:
        t0 = time.perf_counter()
        region = devmem.DeviceRegion.create(size, device)
        t1 = time.perf_counter()
        raw = region.bytes()
        half = size // 2
        pattern = torch.arange(half, device=device, dtype=torch.int64).remainder_(251).to(torch.uint8)
        raw[:half].copy_(pattern)
        raw[half:].zero_()
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        socket.send_fds(ours, [b"F"], [region.share()])
        if ours.recv(1) != b"k":
            print("the child did not answer")
            return 1
        t3 = time.perf_counter()
        answer = raw[half:]
        expect = pattern[: size - half].flip(0) if size - half <= half else None
        wrote_ok = expect is None or bool(torch.equal(answer, expect))
        region.close()
        results.append({"size": size, "create_export_map_ms": (t1 - t0) * 1e3, "fill_ms": (t2 - t1) * 1e3,
                        "round_trip_ms": (t3 - t2) * 1e3, "child_write_seen": wrote_ok})
        ok &= wrote_ok
    child_report = json.loads(b"".join(iter(lambda: ours.recv(65536), b"")).decode().strip().splitlines()[-1])
    child.wait(timeout=60)
    for mine, theirs_ in zip(results, child_report):
        mine.update({f"child_{k}": v for k, v in theirs_.items() if k != "size"})
        ok &= bool(theirs_["read_ok"])
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(device),
        "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "parent_uid": os.getuid(),
        "child_uid": child_report[0]["uid"] if child_report else None, "two_uids": as_root,
        "granularity": devmem.granularity(device), "ok": ok, "sizes": results,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
