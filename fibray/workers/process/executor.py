"""`python -m fibray.workers.process.executor`: the sandboxed process that runs candidate code.

It warms up (imports, device context), says it is ready, then answers requests from its
supervisor until told to exit or killed. It holds no reference outputs and decides no
verdicts; see fibray.evaluate.candidate.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

LEAK_BYTES = 256 << 20
"""CUDA memory above the executor's baseline after a job at which the executor counts as leaking
(and is replaced); reference cycles are collected first, so only memory still held counts."""


def arguments(*, channel_fd: int, device: str, workdir: str, quiesce_fd: int, arena_fd: int | None = None,
              arena_bytes: int = 0) -> list[str]:
    """The arguments `main` takes (after the program name), for the launcher and the fork server alike."""
    args = ["--fd", str(channel_fd), "--device", device, "--workdir", workdir, "--quiesce-fd", str(quiesce_fd)]
    if arena_fd is not None:
        args += ["--arena-fd", str(arena_fd), "--arena-bytes", str(arena_bytes)]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fibray.workers.process.executor")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--arena-fd", type=int, default=None, help="shared memory for the tensors of replies")
    parser.add_argument("--arena-bytes", type=int, default=0)
    parser.add_argument("--quiesce-fd", type=int, default=None, help="side channel: synchronise the device and ack")
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    _exit_with(os.getppid())
    from fibray.workers.process.launch import become_subreaper

    become_subreaper()  # a candidate's orphans stay below this process, where its job is charged for them

    import torch

    from fibray.compile import format_raised, prepare_triton

    prepare_triton(args.device)
    from fibray.evaluate.candidate import CandidateRunner, classify_exception, warm_job_path
    from fibray.timing.steps import StepPipe
    from fibray.workers.process.channel import Arena, ChannelClosed, Health, Hello, Op, Reply, Request, recv, recv_fds, send

    device = torch.device(args.device)
    if device.type == "cuda":
        from fibray.timing.timer import _flush_buffer

        torch.cuda.set_device(device)
        _flush_buffer(device)  # the L2-flush buffer lives for the process: part of the memory baseline
        torch.cuda.synchronize(device)
    import triton  # noqa: F401  (warm: the first candidate should not pay for it)

    if device.type == "cuda":
        from fibray.compile.triton_warm import warm_triton

        try:
            warm_triton(device)  # Triton's driver helpers and a launcher: in the warm-up, not in a trial
        except Exception as e:  # noqa: BLE001  (Triton broken here: its candidates will say so themselves)
            print(f"fibray: Triton warm-up failed ({type(e).__name__}: {e}); Triton candidates pay for it", flush=True)

    if args.quiesce_fd is not None:
        _serve_quiesce(args.quiesce_fd, (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None))

    arena = Arena(args.arena_fd, args.arena_bytes) if args.arena_fd is not None else None
    if arena is not None and device.type == "cuda":
        arena.pin(1)  # the first stretch, before the candidate's first reply
    runner = CandidateRunner(Path(args.workdir), device)
    warm_job_path(device)  # the job path's first uses (on a GPU: module loads, allocations) before any job
    # the health canary's too (against what is allocated now: no leak, so no full collection of torch's objects)
    _health(torch, device, torch.cuda.memory_allocated(device) if device.type == "cuda" else 0, Health)
    # torch and triton hold ~10^6 objects; moved out of the collector's reach, the per-job
    # collection below scans only what candidates created (0.1 ms instead of ~100 ms)
    gc.collect()
    gc.freeze()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    regions: dict[str, object] = {}
    """The job regions this executor has mapped, by job id (unmapped at FINISH, but the kept one)."""
    kept = None
    """The region kept mapped from job to job (Request.region), until the supervisor sends another."""
    send(conn, Reply(True, Hello(pid=os.getpid(), uid=os.getuid())), arena)
    while True:
        try:
            req: Request = recv(conn, None, trusted=True)
        except ChannelClosed:
            return
        staged = regions.get(req.job.job_id) if req.job is not None and req.op in _STAGED_OPS else None
        staged = staged if hasattr(staged, "pull") else None
        try:
            if staged is not None:
                staged.pull()
            if req.op == Op.BUILD:
                err = runner.build(req.job)
                reply = Reply(True) if err is None else Reply(False, error=str(err), status="COMPILE_ERROR", reason=err.reason)
            elif req.op == Op.ATTACH:
                if req.region == "kept":
                    if kept is None or kept.size < req.layout.size:
                        raise RuntimeError(f"no region of {req.layout.size} bytes is kept in this executor")
                    region = kept
                else:
                    (fd,) = recv_fds(conn, 1)
                    region = _map(req.layout, fd, device)
                    if req.region == "keep":
                        kept = _replace(kept, region)
                regions[req.job.job_id] = region
                runner.attach(req.job, req.layout, region)
                reply = Reply(True)
            elif req.op == Op.KEEP:
                (fd,) = recv_fds(conn, 1)
                kept = _replace(kept, _map(req.layout, fd, device))
                reply = Reply(True)
            elif req.op == Op.TRIAL:
                reply = Reply(True, runner.trial(req.job, req.trial))
            elif req.op == Op.PREPARE_TIME:
                runner.prepare_time(req.job, req.timing)
                reply = Reply(True)
            elif req.op == Op.TIME:
                step = StepPipe(*recv_fds(conn, 2)) if req.step or req.end_step else None
                try:
                    reply = Reply(True, runner.time(req.job, req.seeds or [], step, end_only=req.end_step))
                finally:
                    if step is not None:
                        step.close()
            elif req.op == Op.WARM:
                failure = runner.warm(req.job)
                reply = Reply(True) if failure is None else Reply(False, error=failure.log, status=failure.status,
                                                                  reason=failure.reason)
            elif req.op == Op.RECHECK:
                reply = Reply(True, runner.recheck(req.job))
            elif req.op == Op.FINISH:
                runner.finish(req.job)
                region = regions.pop(req.job.job_id, None)
                if region is not None and region is not kept:
                    region.close()
                reply = Reply(True)
            elif req.op == Op.HEALTH:
                reply = Reply(True, _health(torch, device, baseline, Health))
            elif req.op == Op.EXIT:
                send(conn, Reply(True), arena)
                return
            else:
                reply = Reply(False, error=f"unknown request {req.op!r}")
        except BaseException as e:  # candidate code can raise anything through our calls
            status, reason = classify_exception(e)
            reply = Reply(False, error=format_raised(e), status=status, reason=reason)
        if staged is not None:
            try:
                staged.push()
            except BaseException as e:  # a poisoned context: the reply says so, the health check retires us
                reply = Reply(False, error=f"copying the job's memory back failed: {e}", status="RUNTIME_ERROR",
                              reason=classify_exception(e)[1])
        reply.spent = runner.clock.take()
        try:
            send(conn, reply, arena)
        except ChannelClosed:
            return


def _serve_quiesce(fd: int, settle) -> None:
    """Answer each byte on the side channel `fd` with the same byte once `settle()` (a device
    synchronise) returned, on a thread of its own: the main thread may be busy in a candidate's call
    or a JIT compile. Cooperation only: the supervisor stops this process whether it acks or not."""
    import socket
    import threading

    side = socket.socket(fileno=fd)

    def loop() -> None:
        while True:
            try:
                data = side.recv(4096)
                if not data:
                    return
                try:
                    settle()
                except Exception:  # noqa: BLE001 - a broken context: the supervisor stops us anyway
                    pass
                side.send(data[-1:])
            except OSError:
                return

    threading.Thread(target=loop, name="fibray-quiesce", daemon=True).start()


def _exit_with(parent: int) -> None:
    """End this process soon after its supervisor ends (it is then re-parented), even while a
    candidate's call hangs: a thread that checks once a second."""
    import threading
    import time

    from fibray.deadlines import PARENT_WATCH_S

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="fibray-parent-watch", daemon=True).start()


_STAGED_OPS = {"trial", "prepare_time", "time", "recheck"}
"""Requests around which a staged region is copied in and out."""


def _map(layout, fd: int, device):
    """The job's region in this process: host shared memory, or the supervisor's CUDA VMM allocation."""
    from fibray.evaluate.memory import HostRegion

    if layout.kind == "cuda":
        from fibray.workers.process.devmem import DeviceRegion

        return DeviceRegion.open(fd, layout.size, device)
    if layout.kind == "staged":
        from fibray.workers.process.devmem import StagedRegion

        return StagedRegion(HostRegion(fd, layout.size), device)
    return HostRegion(fd, layout.size)


def _replace(kept, region):
    """`region` as the one kept from job to job, the one kept before unmapped."""
    if kept is not None:
        kept.close()
    return region


def _health(torch, device, baseline: int, Health):
    """A canary kernel with a known answer, a synchronize, and memory against the baseline.
    Memory past the leak threshold may be held by reference cycles a candidate left: those are
    collected (only then: a full collection per job cost milliseconds) before it counts as a leak."""
    x = torch.arange(4096, device=device, dtype=torch.float32)
    value = float((x * 2 + 1).sum().item())
    allocated = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocated = torch.cuda.memory_allocated(device)
        if allocated - baseline >= LEAK_BYTES:
            gc.collect()
            allocated = torch.cuda.memory_allocated(device)
    return Health(canary_ok=value == 4096.0 * 4096.0, allocated=allocated, baseline=baseline)


if __name__ == "__main__":
    main(sys.argv[1:])
