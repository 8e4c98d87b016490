"""Shared-memory files (memfd) that a supervisor maps and hands to an executor, sealed at their size.

The executor holds the file to map it, and so may ftruncate it: every other process that maps a file
cut shorter faults (SIGBUS) on its next touch of the part cut off. The supervisor reads outputs and
replies there, so a candidate that shrank them killed its slot's supervisor in the middle of a check
(`offender_truncates_shared_memory`). Sealed, the file keeps its size, and no further seal (a write
seal, which would stop the supervisor's own writes) can be added. Light on purpose: no torch.
"""

from __future__ import annotations

import fcntl
import os

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A close-on-exec memfd of `size` bytes that nobody can shrink, grow or seal further; an OSError
    naming it where the kernel refuses (memfd sealing needs Linux 3.17)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, f"shared memory {name!r} of {size} bytes cannot be sealed at its size "
                               f"(memfd sealing, Linux 3.17 or later): {e.strerror}") from None
    return fd
