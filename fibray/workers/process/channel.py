"""Messages between a slot supervisor and its executor, over one socket, with deadlines.

Everything travels by value. A tensor in an executor's reply is copied straight into that
executor's `Arena` (shared memory the supervisor maps too, pinned for DMA on a GPU) and
travels as an offset; the supervisor copies it out (onto its device) as it unpickles, before
it sends its next request, so the executor can reuse the arena. A tensor that does not fit,
or one on a channel without an arena, travels as raw bytes beside the pickle on the socket.
(CUDA IPC handles would avoid the host copy, but an executor runs as another user, and IPC
mappings across users fail on some hosts: seen on the H200 machine.)
Every receive has a deadline: a silent executor is a hung executor.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import pickle
import socket
import struct
import time
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from fibray.evaluate.candidate import FAILING_STATUSES, REASONS, TimingPlan
from fibray.evaluate.memory import Layout
from fibray.schema import Job
from fibray.workers.process.arena import ARENA_BYTES, Arena

__all__ = ["ARENA_BYTES", "Arena", "BadMessage", "ChannelClosed", "DeadlineExceeded", "Health", "Hello", "Op", "Reply",
           "Request", "expect", "recv", "recv_fds", "send", "send_fds"]


class ChannelClosed(Exception):
    """The executor's end of the channel is gone (it exited or was killed)."""


class BadMessage(ChannelClosed):
    """The executor sent something that is not a well-formed reply (only candidate code does that)."""


class DeadlineExceeded(Exception):
    """No answer within the deadline."""


class Op(StrEnum):
    """What the supervisor asks of its executor."""

    BUILD = "build"
    """Build (import or compile) the job's solution."""
    ATTACH = "attach"
    """Map the job's region (its file descriptor follows the request on the socket), or take the one
    kept from an earlier job (Request.region)."""
    TRIAL = "trial"
    """Call the candidate on trial `trial`'s input set, into that trial's output buffers."""
    PREPARE_TIME = "prepare_time"
    """Make the timed calls' views (carries the TimingPlan)."""
    TIME = "time"
    """Run the timed calls (carries their seeds)."""
    WARM = "warm"
    """Build the solution and call it once on inputs of the executor's own drawing (judged by nobody):
    its first-call costs paid before its job is sent (fibray.workers.slot.GpuSlot.prewarm)."""
    RECHECK = "recheck"
    """Call again on the first input set, which the supervisor rewrote in place."""
    FINISH = "finish"
    """Drop the job and unmap its region, unless it is the one kept."""
    KEEP = "keep"
    """Map the region whose descriptor follows and keep it for later jobs (unmapping the one kept
    before), ahead of any job of it: their ATTACH then names it ("kept"). Request.layout gives its size."""
    HEALTH = "health"
    """The canary and the memory baseline."""
    EXIT = "exit"


class Request(BaseModel):
    """Supervisor -> executor."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    op: Op
    job: Optional[Job] = None
    trial: int = 0
    layout: Optional[Layout] = None
    """With ATTACH: where everything of the job lies in its region."""
    region: Literal["job", "keep", "kept"] = "job"
    """With ATTACH: "job", map the descriptor that follows for this job alone (unmapped at FINISH);
    "keep", map it and keep it mapped for later jobs (unmapping the one kept before); "kept", the
    region kept from an earlier job (no descriptor follows). fibray.evaluate.memory.KeptRegion."""
    timing: Optional[TimingPlan] = None
    """With PREPARE_TIME."""
    seeds: Optional[list[int]] = None
    """With TIME: the secret seed of each timed call's input change."""
    step: bool = False
    """With TIME: two pipe descriptors follow, for the supervisor to clock every timed call
    (fibray.timing.steps)."""
    end_step: bool = False
    """With TIME: two pipe descriptors follow, for the end step alone, once the calls are over (a timing
    not stepped call by call: the supervisor copies the outputs it judges there)."""

    def __init__(self, op: Op | str, job: Optional[Job] = None, trial: int = 0, **kw: Any) -> None:
        super().__init__(op=op, job=job, trial=trial, **kw)


class Hello(BaseModel):
    """An executor's first message, once it is warm."""

    pid: int
    uid: int


class Health(BaseModel):
    """The answer to HEALTH."""

    canary_ok: bool
    allocated: int
    """CUDA bytes allocated now (0 on a CPU)."""
    baseline: int
    """CUDA bytes allocated when the executor was warm."""


class Reply(BaseModel):
    """Executor -> supervisor. `value` is one of the models above or of fibray.evaluate.candidate."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    ok: StrictBool
    value: Any = None
    error: str = ""
    status: str = ""
    """With ok false, the failing status the executor gives its candidate (or empty)."""
    reason: str = ""
    """With ok false, the catalogue's reason (or empty)."""
    spent: dict[str, float] = {}
    """Seconds the executor spent per part of the request (inputs, call, checks)."""

    def __init__(self, ok: bool, value: Any = None, **kw: Any) -> None:
        super().__init__(ok=ok, value=value, **kw)


def checked(reply: Any) -> Reply:
    """An executor's reply with its own fields validated (unpickling sets them unchecked; `expect`
    checks its value), or BadMessage: an executor may fail its candidate, never pass it or make
    the supervisor trip on a field of the wrong kind."""
    if not isinstance(reply, Reply):
        raise BadMessage(f"not a reply: {type(reply).__name__}")
    try:
        r = Reply.model_validate(dict(reply.__dict__))
    except (ValidationError, TypeError) as e:
        raise BadMessage(f"malformed reply: {e}") from None
    if r.status and r.status not in FAILING_STATUSES or r.reason and r.reason not in REASONS:
        raise BadMessage(f"a reply giving status {r.status[:40]!r} and reason {r.reason[:40]!r}")
    if not all(math.isfinite(v) and v >= 0 for v in r.spent.values()):
        raise BadMessage("a reply's spent seconds are not finite and non-negative")
    return r


def expect(reply: Any, kind: type[BaseModel]) -> Any:
    """A reply's value as `kind`, validated again (unpickling sets a model's fields without checking
    them), or BadMessage: a reply that is not what the request asks for comes from candidate code."""
    reply = checked(reply)
    if not isinstance(reply.value, kind):
        raise BadMessage(f"expected a reply holding {kind.__name__}, got {type(reply.value).__name__}")
    try:
        return kind.model_validate(dict(reply.value.__dict__))
    except (ValidationError, TypeError) as e:
        raise BadMessage(f"malformed {kind.__name__}: {e}") from None


def send_fds(conn: Connection, fds: list[int]) -> None:
    """File descriptors to the other end (SCM_RIGHTS), right after a message that announces them."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        socket.send_fds(sock, [b"F"], fds)
    except OSError as e:
        raise ChannelClosed(str(e)) from None
    finally:
        sock.close()


def recv_fds(conn: Connection, n: int) -> list[int]:
    """The descriptors send_fds sent (the executor reads them right after the request)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        _, fds, _, _ = socket.recv_fds(sock, 1, n)
    finally:
        sock.close()
    if len(fds) != n:
        raise ChannelClosed(f"expected {n} file descriptors, got {len(fds)}")
    return fds


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a tensor dtype: {name!r}")
    return dtype


def _receive(host: torch.Tensor, device: str, copy: bool) -> torch.Tensor:
    """The tensor on the receiver's device when it has one (the sender's is a CUDA one); a host
    tensor is copied when `copy` (its bytes are shared memory the sender will reuse)."""
    if device != "cpu" and torch.cuda.is_available():
        return host.to(device)
    return host.clone() if copy else host


def _tensor(raw: memoryview, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """Rebuild a tensor from its bytes (received out of band, owned by the receiver)."""
    flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return _receive(flat.view(_dtype(dtype)).reshape(shape), device, copy=False)


def _describe(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), "cpu" if t.device.type == "cpu" else str(t.device)


class _Pickler(pickle.Pickler):
    """Tensors go into the sender's arena when it has one and room (travelling as an offset),
    else as raw bytes beside the pickle (protocol 5 out-of-band buffers). Either way their
    contents are never pickled; any dtype, fp8 included, goes as bytes."""

    def __init__(self, file: io.BytesIO, buffers: list[pickle.PickleBuffer], arena: Optional[Arena]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.arena = arena
        self.keep: list[torch.Tensor] = []
        """Host copies whose bytes the buffers point at: alive until the message is sent."""

    def persistent_id(self, obj: Any):
        if self.arena is None or not isinstance(obj, torch.Tensor):
            return None
        src = obj.detach()
        nbytes = src.numel() * src.element_size()
        off = self.arena.take(nbytes)
        if off is None:
            return None  # too big for what is left: the socket carries it
        if nbytes:
            if src.device.type == "cuda":
                self.arena.pin(off + nbytes)
            self.arena.view(off, nbytes).copy_(src.contiguous().reshape(-1).view(torch.uint8))
        return ("arena", off, nbytes, *_describe(src))

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            host = obj.detach().to("cpu").contiguous()
            raw = host.reshape(-1).view(torch.uint8)
            self.keep.append(raw)
            buf = (ctypes.c_char * raw.numel()).from_address(raw.data_ptr()) if raw.numel() else b""
            return _tensor, (pickle.PickleBuffer(buf), *_describe(obj))
        return NotImplemented


_TRUSTED_GLOBALS = {
    ("fibray.workers.process.channel", "Reply"), ("fibray.workers.process.channel", "_tensor"),
    ("fibray.workers.process.channel", "Hello"), ("fibray.workers.process.channel", "Health"),
    ("fibray.evaluate.candidate", "TrialOutput"), ("fibray.evaluate.candidate", "CandidateFailure"),
    ("fibray.evaluate.candidate", "TimeResult"), ("fibray.schema.reasons", "Reason"),
}
"""All an executor's reply may name. The executor runs candidate code, which can send anything
down the channel: unpickling any other global in the supervisor would run the candidate's code there."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: memoryview, buffers: list, arena: Optional[Arena], trusted: bool) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self.arena, self.trusted = arena, trusted

    def find_class(self, module: str, name: str) -> Any:
        if self.trusted or (module, name) in _TRUSTED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an executor's message names {module}.{name}, which a reply never holds")

    def persistent_load(self, pid: Any) -> torch.Tensor:
        arena = self.arena
        try:
            kind, off, nbytes, dtype, shape, device = pid
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise pickle.UnpicklingError(f"malformed tensor reference {pid!r}") from None
        if kind != "arena" or arena is None or not (0 <= off and 0 <= nbytes and off + nbytes <= arena.size):
            raise pickle.UnpicklingError(f"tensor reference outside this channel's arena: {pid!r}")
        if device != "cpu":
            arena.pin(off + nbytes)
        return _receive(arena.view(off, nbytes).view(_dtype(dtype)).reshape(shape), device, copy=True)


def send(conn: Connection, obj: Any, arena: Optional[Arena] = None) -> None:
    """One message: a header (buffer sizes, then the pickle), then each tensor's bytes that are not in `arena`."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    if arena is not None:
        arena.used = 0  # the receiver copied the previous message out before it sent the request this answers
    pickler = _Pickler(out, buffers, arena)  # a local: its host copies live until every byte is written
    pickler.dump(obj)
    views = [b.raw() for b in buffers]
    header = struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views)) + out.getbuffer()
    try:
        conn.send_bytes(header)
        fd = conn.fileno()
        for v in views:  # unframed: the header gave their sizes
            v = v.cast("B")
            while v.nbytes:
                v = v[os.write(fd, v):]
    except (BrokenPipeError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e)) from None


def _read_into(conn: Connection, buf: bytearray, deadline: Optional[float]) -> None:
    """Fill buf straight from the socket (no intermediate copies), before the deadline."""
    view, fd = memoryview(buf), conn.fileno()
    while view.nbytes:
        if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded()
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError
        view = view[n:]


MAX_REPLY_BYTES = 1 << 30
"""The most an executor's message may hold outside the arena, its pickle included: replies hold
verdict data and logs (bounded by the executor), their tensors go through the arena. A candidate
can write anything on the channel; without this bound it could make its supervisor allocate as
much as it announced."""


def _read_exact(conn: Connection, n: int, deadline: Optional[float]) -> bytearray:
    buf = bytearray(n)
    _read_into(conn, buf, deadline)
    return buf


def _frame(conn: Connection, deadline: Optional[float], limit: Optional[int]) -> bytearray:
    """One frame as Connection.send_bytes writes it (a big-endian length, -1 then a 64-bit one for
    large frames), read before `deadline` to its last byte: a sender that stops mid-frame cannot
    hold its reader past it."""
    (size,) = struct.unpack("!i", _read_exact(conn, 4, deadline))
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exact(conn, 8, deadline))
    if size < 4 or (limit is not None and size > limit):
        raise BadMessage(f"a message of {size} bytes announced (at most {limit})")
    return _read_exact(conn, size, deadline)


def recv(conn: Connection, deadline: Optional[float], arena: Optional[Arena] = None, trusted: bool = False) -> Any:
    """Receive one message, all of it before `deadline` (time.monotonic); None means wait forever
    (executor side only). `arena`: the channel's shared memory, for tensors sent through it. Only
    `trusted` (the executor, hearing from its supervisor) unpickles any class and may be sent more
    than MAX_REPLY_BYTES; the supervisor takes only what a reply holds."""
    limit = None if trusted else MAX_REPLY_BYTES
    try:
        if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded()
        header = _frame(conn, deadline, limit)
        (n,) = struct.unpack_from("<I", header)
        sizes = struct.unpack_from(f"<{n}Q", header, 4)
        if limit is not None and sum(sizes) + len(header) > limit:
            raise BadMessage(f"a message announced {sum(sizes)} bytes of tensors (at most {limit} in all)")
        buffers = [_read_exact(conn, size, deadline) for size in sizes]
    except struct.error as e:
        raise BadMessage(f"a malformed message header: {e}") from None
    except (EOFError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e) or "end of channel") from None
    try:
        return _Unpickler(memoryview(header)[4 + 8 * n:], buffers, arena, trusted).load()
    except Exception as e:  # whatever a forged message makes unpickling raise
        raise BadMessage(f"{type(e).__name__}: {e}") from None
