"""A slot's fork server: one process that imports torch, Triton and fibray's candidate runner once
and forks every executor of the slot from that warm image (`python -m fibray.workers.process.forkserver`).

An executor serves one solution, so a sweep starts one per solution; started from a bare interpreter
each paid about 4 s of imports and 2 s of Triton's driver build (benchmarks/executor_start.py). Forked,
it pays only its own device context. What keeps that honest:

- The server runs with the supervisor's uid, single-threaded, and never creates a CUDA context
  (torch's NVML availability check), so a fork of it is a clean process; it refuses to start
  (and the slot falls back to the launcher) if its warm-up left a thread or a context behind.
- A forked child first closes every descriptor but the ones its request passed (the server's
  socket above all: with it, a candidate could take other executors' spawn requests and their
  channels), starts a session of its own, takes the environment and directory its request names,
  then puts the same sandbox in force as the launcher (`launch.apply`: namespaces, limits, its own
  uid) before any candidate code runs. A server started for uids of their own refuses a request
  that names none.
- Its memory holds imported modules only: the server never sees a job, a reference or a secret.

The supervisor side (`ForkServer`) hands out `ForkedProcess` objects that stand in for
`subprocess.Popen`: the server reports each child's end, since only it can collect it. If the
server dies, its children re-parent to the supervisor (a subreaper), which collects them itself.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

_MAX_MESSAGE = 1 << 20
_MAX_FDS = 8
ROLES = ("stdout", "channel", "quiesce", "arena")
"""The descriptors a spawn request passes, in this order (arena only when there is one)."""


class ForkServerGone(RuntimeError):
    """The fork server ended, refused to warm up, or did not answer: start executors another way."""


class ForkedProcess:
    """An executor the fork server forked, with the part of subprocess.Popen's interface a slot uses."""

    def __init__(self, pid: int, stdout, server: "ForkServer") -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None
        self._ended = threading.Event()
        self._server = server

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def _collect_orphan(self) -> None:
        """The server is gone: this process re-parented to us (a subreaper); collect it ourselves."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not ours (yet), or already collected by a stray reap
            if not os.path.exists(f"/proc/{self.pid}"):
                self._end(-signal.SIGKILL)
            return
        if pid:
            self._end(os.waitstatus_to_exitcode(status))

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._server.lost:
            self._collect_orphan()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked executor {self.pid}", timeout)
            self._ended.wait(min(left, 0.05 if self._server.lost else 0.5))
        return self.returncode


class ForkServer:
    """The supervisor's end of one fork server (one per slot and device)."""

    def __init__(self, device: str, env: dict[str, str], cwd: Path, require_uid: bool) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "fibray.workers.process.forkserver", "--fd", str(theirs.fileno()),
                "--device", device, *(["--require-uid"] if require_uid else [])]
        try:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._replies: dict[int, dict] = {}
        self._replied = threading.Condition(self._lock)
        self._children: dict[int, ForkedProcess] = {}
        self._next = 0
        self.ready = threading.Event()
        self.lost = False
        self.why = ""
        """Why the server is gone (its last words, or how it ended)."""
        self._reader = threading.Thread(target=self._read, name="fibray-forkserver", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._lock:
                if msg["op"] == "ready":
                    self.ready.set()
                elif msg["op"] == "exited":
                    child = self._children.pop(msg["pid"], None)
                    if child is not None:
                        child._end(msg["code"])
                else:  # spawned (listed before any notice of its end can arrive) or refused
                    if msg["op"] == "refused":
                        self.why = msg["error"]
                    if msg.get("id") is not None:  # none: the warm-up's refusal, the server ends next
                        self._replies[msg["id"]] = msg
                    self._replied.notify_all()
        with self._lock:
            self.lost = True
            code = self.proc.poll()
            self.why = self.why or ("the fork server closed its socket" if code is None else f"the fork server ended with status {code}")
            self._replied.notify_all()
        self.ready.set()

    def spawn(self, request: dict, fds: dict[str, int], stdout, deadline_s: float) -> ForkedProcess:
        """Fork an executor: `request` (sandbox, env, cwd, executor arguments) and the descriptors
        by role (ROLES). Raises ForkServerGone when the server cannot do it."""
        with self._lock:
            if self.lost:
                raise ForkServerGone(self.why)
            self._next += 1
            ident = self._next
        passed = [fds[r] for r in ROLES if r in fds]
        message = json.dumps({**request, "op": "spawn", "id": ident, "fds": [r for r in ROLES if r in fds]}).encode()
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [message], passed)
        except OSError as e:
            raise ForkServerGone(f"the fork server took no request ({e})") from None
        deadline = time.monotonic() + deadline_s
        with self._lock:
            while ident not in self._replies and not self.lost:
                if not self._replied.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    break
            reply = self._replies.pop(ident, None)
            if reply is None or reply["op"] != "spawned":
                raise ForkServerGone(reply["error"] if reply else self.why or f"the fork server did not answer in {deadline_s:.0f}s")
            child = self._children[reply["pid"]] = ForkedProcess(reply["pid"], stdout, self)
        return child

    def close(self, wait_s: float = 5.0) -> None:
        """End the server (its own children were retired first; any it still has die with it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(wait_s)
        self._sock.close()


# -- the server ---------------------------------------------------------------------------------
def _native_threads() -> list[str]:
    """Names of this process's threads other than the main one (/proc: Python's and native ones)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                continue
    return names


def _driver_initialised() -> bool:
    """Whether the CUDA driver was initialised in this process (cuInit): cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED (3) before it, success after. A fork after cuInit cannot use CUDA."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(count)) != 3


def _release_nvml() -> int:
    """Shut NVML down as often as it was initialised; returns how often. torch's NVML-based
    availability check (PYTORCH_NVML_BASED_CUDA_CHECK, which keeps CUDA uninitialised here) leaves
    NVML initialised, holding descriptors that every child closes: a child's own nvmlInit then
    failed (seen on the H200: the caching allocator's INTERNAL ASSERT on nvmlInit_v2 instead of an
    out-of-memory error). Shut down here, each child initialises NVML afresh when it needs it."""
    import ctypes

    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    n = 0
    while n < 256 and lib.nvmlShutdown() == 0:  # NVML_SUCCESS while its count was above zero
        n += 1
    return n


def _warm(device: str) -> None:
    """Everything an executor would import before its first job; on a GPU also Triton's driver
    helpers (a host-compiled module: loaded here, inherited by every child). No CUDA context."""
    from fibray.compile import prepare_triton

    prepare_triton(device)
    import torch  # noqa: F401
    import triton  # noqa: F401

    import fibray.evaluate.candidate  # noqa: F401
    import fibray.workers.process.executor  # noqa: F401
    from fibray.workers.process import channel  # noqa: F401

    if device.startswith("cuda"):
        import fibray.timing.timer  # noqa: F401
        from fibray.workers.process import devmem  # noqa: F401

        try:
            from triton.runtime import driver

            driver.active.utils  # noqa: B018  (builds or loads cuda_utils: no device call)
        except Exception as e:  # noqa: BLE001  (each executor will then build it itself)
            print(f"fibray fork server: Triton's driver helpers not warmed ({type(e).__name__}: {e})", flush=True)
        if torch.cuda.is_initialized() or _driver_initialised():
            raise RuntimeError("the warm-up initialised CUDA: a fork of this process could not use the GPU")
        _release_nvml()
    import gc

    gc.collect()
    gc.freeze()


def _child(sock: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: shed everything of the server, enter the sandbox, become the executor. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        by_role = dict(zip(request["fds"], fds))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(by_role["stdout"], 1)
        os.dup2(by_role["stdout"], 2)
        sock.detach()  # closed below with the rest; its object must never close a reused number later
        keep = sorted({0, 1, 2, *(fd for role, fd in by_role.items() if role != "stdout")})
        low = 0
        for fd in [*keep, max(os.sysconf("SC_OPEN_MAX"), keep[-1] + 1)]:  # the server's socket and pipes too
            if fd > low:  # closerange(n, n) would close everything from n up (close_range's last = -1)
                os.closerange(low, fd)
            low = fd + 1
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import tempfile

        tempfile.tempdir = None
        from fibray.workers.process import launch

        launch.apply({**request["sandbox"], "parent": os.getppid()})
        random.seed()
        import torch

        torch.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
        from fibray.workers.process import executor

        argv = executor.arguments(channel_fd=by_role["channel"], device=request["device"], workdir=request["workdir"],
                                  quiesce_fd=by_role["quiesce"], arena_fd=by_role.get("arena"),
                                  arena_bytes=request["arena_bytes"])
        sys.argv = ["fibray.workers.process.executor", *argv]
        executor.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  (the executor's start failed: the supervisor reads why)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int, device: str, require_uid: bool) -> None:
    sock = socket.socket(fileno=fd)

    def say(**msg) -> None:
        sock.send(json.dumps(msg).encode())

    try:
        _warm(device)
        import threading

        if threading.active_count() != 1:  # a Python thread may hold the GIL's or a module's lock at the fork
            raise RuntimeError(f"the warm-up left Python threads running: {[t.name for t in threading.enumerate()]}")
        native = _native_threads()
        if native:  # idle native threads (the CUDA driver's on a GPU host): said once, for whoever reads the log
            print(f"fibray fork server: forking with {len(native)} idle native thread(s): {sorted(set(native))}",
                  file=sys.stderr, flush=True)
            import warnings

            warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
    except Exception as e:  # noqa: BLE001
        say(op="refused", error=f"the fork server could not warm up: {type(e).__name__}: {e}")
        return
    import select

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    say(op="ready")
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in readable:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                children.discard(pid)
                say(op="exited", pid=pid, code=os.waitstatus_to_exitcode(status))
            if sock not in readable:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            if not data:
                return  # the supervisor is gone
            request = json.loads(data)
            if require_uid and request["sandbox"].get("uid") is None:
                for f in fds:
                    os.close(f)
                say(op="refused", id=request.get("id"), error="a request without a uid of its own (privileges are dropped here)")
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(sock, request, fds)
            children.add(pid)
            for f in fds:
                os.close(f)
            say(op="spawned", id=request["id"], pid=pid)
    finally:
        for pid in children:  # what the supervisor did not retire ends with the server
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="fibray.workers.process.forkserver")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--require-uid", action="store_true", help="refuse requests that keep the server's uid")
    args = parser.parse_args(argv)
    try:
        serve(args.fd, args.device, args.require_uid)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: torch's and Triton's bindings complain of "leaks" at exit


if __name__ == "__main__":
    main(sys.argv[1:])
