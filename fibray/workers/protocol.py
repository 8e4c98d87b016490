"""Messages between a slot supervisor and its executor, over one socket, with deadlines.

Everything travels by value: CUDA tensors are copied to host memory and rebuilt on the
receiver's device. (CUDA IPC handles would avoid the copy, but an executor runs as another
user, and IPC mappings across users fail on some hosts: seen on the H200 machine.)
Every receive has a deadline: a silent executor is a hung executor.
"""

from __future__ import annotations

import io
import pickle
import time
from dataclasses import dataclass
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


def _on_device(host: torch.Tensor, device: str) -> torch.Tensor:
    return host.to(device) if torch.cuda.is_available() else host


def _from_bytes(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    return raw.view(getattr(torch, dtype))


# torch cannot unpickle fp8 tensors ("UntypedStorage has no attribute dtype"): send their bytes
_BYTE_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return _on_device, (obj.detach().to("cpu"), str(obj.device))
        if isinstance(obj, torch.Tensor) and obj.dtype in _BYTE_DTYPES:
            return _from_bytes, (obj.detach().contiguous().view(torch.uint8), str(obj.dtype).removeprefix("torch."))
        return NotImplemented


def send(conn: Connection, obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    try:
        conn.send_bytes(buf.getbuffer())
    except (BrokenPipeError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e)) from None


def recv(conn: Connection, deadline: Optional[float]) -> Any:
    """Receive one message before `deadline` (time.monotonic); None means wait forever (executor side only)."""
    try:
        if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded()
        data = conn.recv_bytes()
    except (EOFError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e) or "end of channel") from None
    return pickle.loads(data)
