"""Shared memory between a slot supervisor and one executor, for the tensors of its replies.

Light on purpose (torch loads on first use): a slot creates its executors' arenas before it
imports torch, so the executors warm up while it does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

from fibray.evaluate.shm import sealed_memfd

_ALIGN = 256
ARENA_BYTES = 2 << 30
"""Default arena size: address space only; pages cost memory once a reply touches them."""
_PIN_MIN = 64 << 20


class Arena:
    """A shared memory region (memfd) an executor writes its replies' tensor bytes into and its
    supervisor reads them from. Each process maps it once; on a GPU each pins (registers for
    DMA) the part replies have used so far, grown in powers of two, so copies run at full speed."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = None
        self.used = 0
        self._pinned = 0
        self._can_pin = True

    @classmethod
    def create(cls, size: int = ARENA_BYTES) -> "Arena":
        # close-on-exec: only the executor it is made for gets it (Popen's pass_fds), no other child;
        # sealed at its size: the executor holds it, and may not shrink it under the supervisor's reads
        return cls(sealed_memfd("fibray-arena", size), size)

    def take(self, nbytes: int) -> Optional[int]:
        """Offset of nbytes of room in this message, or None if the arena is full."""
        off = -(-self.used // _ALIGN) * _ALIGN
        if off + nbytes > self.size:
            return None
        self.used = off + nbytes
        return off

    @property
    def bytes(self):
        """The whole arena as a uint8 tensor (torch is imported only by the processes that send or read tensors)."""
        if self._bytes is None:
            import torch

            self._bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        return self._bytes

    def view(self, off: int, nbytes: int):
        return self.bytes[off:off + nbytes]

    def pin(self, end: int) -> None:
        """Register [0, end) (rounded up) with CUDA, if this process uses CUDA; pageable if refused."""
        if end <= self._pinned or not self._can_pin:
            return
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        cudart = torch.cuda.cudart()
        size = min(self.size, max(_PIN_MIN, 1 << (end - 1).bit_length()))
        ptr = self.bytes.data_ptr()
        if self._pinned:
            cudart.cudaHostUnregister(ptr)
            self._pinned = 0
        if int(cudart.cudaHostRegister(ptr, size, 1)) != 0:  # 1: portable
            self._can_pin = False
            _clear_cuda_error()
            return
        self._pinned = size

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self._pinned = 0
        self._bytes = None
        try:
            self.map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last one
            pass
        os.close(self.fd)


def _clear_cuda_error() -> None:
    """A refused registration leaves CUDA's last-error set, and torch would raise it at the next
    kernel launch check: read it off through the runtime library torch loaded."""
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart.so" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass
