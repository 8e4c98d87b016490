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
import os
import pickle
import struct
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from fibray.workers.process.arena import ARENA_BYTES, Arena

__all__ = ["ARENA_BYTES", "Arena", "BadMessage", "ChannelClosed", "DeadlineExceeded", "Reply", "Request", "recv", "send"]


class ChannelClosed(Exception):
    """The executor's end of the channel is gone (it exited or was killed)."""


class BadMessage(ChannelClosed):
    """The executor sent something that is not a well-formed reply (only candidate code does that)."""


class DeadlineExceeded(Exception):
    """No answer within the deadline."""


@dataclass
class Request:
    """Supervisor -> executor: build | trial | prepare_time | time | recheck | finish | health | exit."""

    op: str
    job: Any = None
    trial: int = 0


@dataclass
class Reply:
    """Executor -> supervisor."""

    ok: bool
    value: Any = None
    error: str = ""
    status: str = ""
    reason: str = ""
    spent: dict = field(default_factory=dict)
    """Seconds the executor spent per part of the request (inputs, call, checks)."""


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
    ("fibray.evaluate.candidate", "TrialOutput"), ("fibray.evaluate.candidate", "CandidateFailure"),
    ("fibray.timing.timer", "Timing"), ("fibray.schema.reasons", "Reason"),
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


_MAX_OUT_OF_BAND = 64 << 30


def recv(conn: Connection, deadline: Optional[float], arena: Optional[Arena] = None, trusted: bool = False) -> Any:
    """Receive one message before `deadline` (time.monotonic); None means wait forever (executor side only).
    `arena`: the channel's shared memory, for tensors sent through it. Only `trusted` (the executor,
    hearing from its supervisor) unpickles any class; the supervisor takes only what a reply holds."""
    try:
        if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded()
        header = conn.recv_bytes()
        (n,) = struct.unpack_from("<I", header)
        sizes = struct.unpack_from(f"<{n}Q", header, 4)
        if sum(sizes) > _MAX_OUT_OF_BAND:
            raise BadMessage(f"a message announced {sum(sizes)} bytes of tensors")
        buffers = []
        for size in sizes:
            buf = bytearray(size)
            _read_into(conn, buf, deadline)
            buffers.append(buf)
    except (EOFError, ConnectionResetError, OSError, struct.error) as e:
        raise ChannelClosed(str(e) or "end of channel") from None
    try:
        return _Unpickler(memoryview(header)[4 + 8 * n:], buffers, arena, trusted).load()
    except Exception as e:  # whatever a forged message makes unpickling raise
        raise BadMessage(f"{type(e).__name__}: {e}") from None
