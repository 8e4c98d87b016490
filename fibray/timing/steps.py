"""The executor's side of a stepped CPU timing: the supervisor's clock around every timed call.

On a CPU slot the supervisor reads its own clocks (the wall, the executor cgroup's CPU seconds)
around each timed call, not only around the whole timing request: an executor's report that its
calls took a fraction of what those readings show is a lie however fast the kernel is. Before
timed call i the executor waits for the supervisor's b"b", makes the call's input change and
buffers ready, writes b"r" and waits for b"g"; it makes the call and writes b"d". The supervisor
reads its clocks after b"r" (the executor blocked) and after b"d" (blocked again, until the next
b"b"), so what lies between them is the call and two system calls. While the executor waits for
b"g", the supervisor changes the call's inputs itself (the executor is sent no seeds) and, after
b"d", takes a DPS call's snapshot; the executor's CPU between calls (a value-returning call's copy
of its result, and whatever candidate code moves there) is read too, and what exceeds the stepping
and that copy counts as the calls' (fibray.timing.bound). Each call is held with the executor's CPU
after it: after the last call the executor waits for one more b"b", makes the last call's hand-over
(StepPipe.end), writes b"e" and waits for a last b"b", so that the supervisor reads its clocks with the
executor blocked once its calls and their hand-overs are over; it reads them again once the reply is
in, and what the executor spent between the two beyond an honest reply counts as the calls' too. A
timing reply with no b"e" before it is a bad report.

At the end step, while the executor waits, the supervisor copies a secret sample of the output buffers
it judges (fibray.evaluate.memory.final_copies): what the executor writes into them once it runs on, to
its reply and after, is never judged. A timing not stepped call by call (a GPU slot) makes that end step
alone, once its calls are over and the device synchronised, and is stopped while the copies are made.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

_read = os.read
_write = os.write
_close = os.close

BOOKKEEP, READY, GO, DONE, END = b"b", b"r", b"g", b"d", b"e"


class StepBroken(Exception):
    """The supervisor's side of the steps went away or answered out of order."""


class StepPipe:
    """The executor's ends of the two step pipes: `rfd` from the supervisor, `wfd` to it."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

    def _expect(self, byte: bytes) -> None:
        got = _read(self.rfd, 1)
        if got != byte:
            raise StepBroken(f"expected {byte!r} from the supervisor before a timed call, got {got!r}")

    def begin(self) -> None:
        """Before a timed call's input change and buffers."""
        self._expect(BOOKKEEP)

    def ready(self) -> None:
        """Right before the call: the supervisor starts its clocks and says go."""
        _write(self.wfd, READY)
        self._expect(GO)

    def done(self) -> None:
        """Right after the call."""
        _write(self.wfd, DONE)

    def end(self, after_last: Optional[Callable[[], None]] = None) -> None:
        """After the last call: its hand-over (`after_last`: the copy of its outputs where the supervisor
        reads them), then the end step, at which the supervisor reads its clocks with this process
        blocked; what follows (the reply) it reads again when the reply is in."""
        self._expect(BOOKKEEP)
        if after_last is not None:
            after_last()
        _write(self.wfd, END)
        self._expect(BOOKKEEP)

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            try:
                _close(fd)
            except OSError:
                pass
