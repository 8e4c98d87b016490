"""Wait until a Ray cluster has the nodes and GPUs a sweep expects, then exit 0 (1 on the deadline).

Batch jobs start Ray on every node and run the sweep right after; a sweep started before the
workers joined would see too few GPUs and use fewer slots. This script only waits; it starts nothing.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

import ray


def _gcs_listening(address: str) -> bool:
    """Whether HOST:PORT accepts a TCP connection (True for `auto` and URLs: ray.init finds those)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return True
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="auto", help="Ray address (default: auto, or RAY_ADDRESS)")
    p.add_argument("--nodes", type=int, default=1, help="alive nodes to wait for")
    p.add_argument("--gpus", type=float, default=1, help="GPUs (logical or real) to wait for")
    p.add_argument("--timeout", type=float, default=600, help="seconds before giving up")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    while not _gcs_listening(args.address):  # ray.init itself retries far past any deadline of ours
        if time.monotonic() > deadline:
            print(f"wait_for_cluster: no Ray cluster at {args.address} after {args.timeout:g}s",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(2)
    while True:
        try:
            ray.init(address=args.address, log_to_driver=False, configure_logging=False)
            break
        except ConnectionError as e:  # the head is still starting
            if time.monotonic() > deadline:
                print(f"wait_for_cluster: no Ray cluster at {args.address} after {args.timeout:g}s: {e}",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(2)
    try:
        while True:
            nodes = sum(1 for n in ray.nodes() if n["Alive"])
            gpus = ray.cluster_resources().get("GPU", 0)
            if nodes >= args.nodes and gpus >= args.gpus:
                print(f"wait_for_cluster: {nodes} nodes, {gpus:g} GPUs ready", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"wait_for_cluster: only {nodes}/{args.nodes} nodes and {gpus:g}/{args.gpus:g} GPUs "
                      f"after {args.timeout:g}s", file=sys.stderr, flush=True)
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
