"""Messages between a slot supervisor and its executor, over one socket, with deadlines.

Everything travels by value: tensors are copied to host memory, sent as raw bytes beside
the pickle (no pickling of their contents) and rebuilt on the receiver's device. (CUDA IPC
handles would avoid the copy, but an executor runs as another user, and IPC mappings
across users fail on some hosts: seen on the H200 machine.)
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


class ChannelClosed(Exception):
    """The executor's end of the channel is gone (it exited or was killed)."""


class DeadlineExceeded(Exception):
    """No answer within the deadline."""


@dataclass
class Request:
    """Supervisor -> executor: build | trial | time | recheck | finish | health | exit."""

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


def _tensor(raw: memoryview, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """Rebuild a tensor from its bytes (received out of band) on the receiver's side."""
    flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    host = flat.view(getattr(torch, dtype)).reshape(shape)
    return host.to(device) if device != "cpu" and torch.cuda.is_available() else host


class _Pickler(pickle.Pickler):
    """Tensors travel as raw bytes beside the pickle (protocol 5 out-of-band buffers): one copy
    to host memory, none in pickling. Any dtype, fp8 included, goes as bytes."""

    def __init__(self, file: io.BytesIO, buffers: list[pickle.PickleBuffer]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.keep: list[torch.Tensor] = []
        """Host copies whose bytes the buffers point at: alive until the message is sent."""

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            host = obj.detach().to("cpu").contiguous()
            raw = host.reshape(-1).view(torch.uint8)
            self.keep.append(raw)
            buf = (ctypes.c_char * raw.numel()).from_address(raw.data_ptr()) if raw.numel() else b""
            return _tensor, (pickle.PickleBuffer(buf), str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                             "cpu" if obj.device.type == "cpu" else str(obj.device))
        return NotImplemented


def send(conn: Connection, obj: Any) -> None:
    """One message: a header (buffer sizes, then the pickle), then each tensor's bytes."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = _Pickler(out, buffers)  # a local: its host copies live until every byte is written
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


def recv(conn: Connection, deadline: Optional[float]) -> Any:
    """Receive one message before `deadline` (time.monotonic); None means wait forever (executor side only)."""
    try:
        if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded()
        header = conn.recv_bytes()
        (n,) = struct.unpack_from("<I", header)
        sizes = struct.unpack_from(f"<{n}Q", header, 4)
        buffers = []
        for size in sizes:
            buf = bytearray(size)
            _read_into(conn, buf, deadline)
            buffers.append(buf)
    except (EOFError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e) or "end of channel") from None
    return pickle.loads(memoryview(header)[4 + 8 * n:], buffers=buffers)
