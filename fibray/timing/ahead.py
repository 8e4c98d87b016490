"""How the GPU timer keeps the host ahead of the GPU (each chunk of timed calls queued behind a
GPU delay sized from the host's launch cost) and how it chooses between its two passes' figures.
Pure arithmetic: the timer (fibray.timing.timer) launches; this decides."""

from __future__ import annotations

import weakref
from typing import Any

HOST_MARGIN = 1.5
"""A chunk's delay is this many times the host's estimated time to launch it..."""
DELAY_PAD_US = 20.0
"""...plus this (the delay kernel's own launch, a scheduler hiccup)."""
DELAY_CAP_US = 20_000.0
"""The longest one delay may be: a chunk holds as many calls as fit it."""
CHUNK_CALLS = 32
"""The most calls of one chunk. With the flush, the input changes, two events and up to ~25
launches of the call itself, 32 calls stay below CUDA's ~1000 pending launches, past which the
host would block on a full queue while the GPU still sleeps."""
FIRST_CHUNK_CALLS = 8
"""The first chunk is short: its launch cost, measured, sizes the next chunks' delays."""
GIVE_UP_AFTER = 2
"""Chunks in a row the GPU reached before they were queued (a call that waits for the GPU
itself: .item(), a synchronise) after which delays stop: they could not help and would only
idle the GPU."""
DEVICE_WINS = (1.25, 0.005)
"""The device-wide figure (ms) is the one reported once it exceeds 1.25x the stream figure + 5 us
(work escaped the current stream)..."""
STREAM_WINS = (1.10, 0.002)
"""...and a callable that was given device_sync in this process keeps it until the device-wide
figure is back under 1.10x + 2 us (hysteresis: noise near one threshold does not flip the mode)."""


def sleep_us(host_us_per_call: float, calls: int) -> float:
    """The GPU delay in front of `calls` calls whose launch costs the host `host_us_per_call` each."""
    return min(DELAY_CAP_US, HOST_MARGIN * max(host_us_per_call, 0.0) * calls + DELAY_PAD_US)


def calls_per_chunk(host_us_per_call: float) -> int:
    """The most calls one chunk may hold: CHUNK_CALLS, fewer where their delay would pass the cap."""
    fit = int((DELAY_CAP_US - DELAY_PAD_US) / (HOST_MARGIN * max(host_us_per_call, 1e-3)))
    return max(1, min(CHUNK_CALLS, fit))


class QueuePlan:
    """The chunks of one stream pass: next_chunk() gives (calls, delay us) until `total` calls are
    planned; observe() feeds back the host's time to launch the chunk and whether the GPU had not
    yet reached the chunk's first call when its last call was queued (`ahead`: every call was
    queued before the GPU reached it). A chunk the GPU caught up with doubles the estimate for the
    next. A chunk's delay only makes up what the GPU's backlog does not already cover: the work
    queued before it (the previous chunk's delay and calls) keeps the GPU busy while the host
    launches, so back-to-back chunks pipeline instead of idling the GPU for every launch."""

    def __init__(self, total: int, host_us_per_call: float) -> None:
        self.total, self.host_us = total, max(host_us_per_call, 0.0)
        self.planned = self.queued = self.behind_in_a_row = 0
        self.delays = True
        self._stopped = False

    def next_chunk(self, backlog_us: float = 0.0) -> tuple[int, float] | None:
        """The next chunk's calls and delay; `backlog_us`: a lower estimate of the GPU work already
        queued and not yet done (0 where unknown: the whole delay)."""
        left = self.total - self.planned
        if left <= 0 or self._stopped:
            return None
        first = FIRST_CHUNK_CALLS if self.planned == 0 else CHUNK_CALLS
        calls = min(left, first, calls_per_chunk(self.host_us))
        self.planned += calls
        return calls, (max(0.0, sleep_us(self.host_us, calls) - max(backlog_us, 0.0)) if self.delays else 0.0)

    def observe(self, calls: int, host_s: float, ahead: bool) -> None:
        measured = host_s * 1e6 / max(calls, 1)
        if ahead:
            self.queued += calls
            self.behind_in_a_row = 0
            self.host_us = measured
        else:
            self.behind_in_a_row += 1
            self.host_us = min(max(2 * self.host_us, measured), DELAY_CAP_US)
            if self.behind_in_a_row >= GIVE_UP_AFTER:
                self.delays = False

    def stop(self) -> None:
        """No further chunks (adaptive timing has settled)."""
        self._stopped = True


BACKLOG_TRUST = 0.75
"""A finished chunk's GPU time per call, times this, is what each later call is assumed to take at
least (the backlog is a lower estimate: too low only lengthens a delay)."""


class Backlog:
    """A lower estimate of when (host clock, ns) the GPU will have done the work queued so far: a
    chunk's delay spins at least its length after whatever was queued before it, and its calls take
    at least what calls of a finished chunk took (BACKLOG_TRUST), learned only from a chunk that was
    queued ahead of the GPU (the calls of a chunk the GPU caught up with ran at the host's pace, not
    their own). A chunk the GPU caught up with leaves nothing known ahead (the GPU may be idle when
    its last call is queued) and forgets the learned calls, so the next chunk's delay is whole; the
    estimate then builds up again. Distrusting it for the rest of the pass instead (full delays after
    one early chunk the GPU caught up with) made the GPU spin 1.5x the host's launch time of every
    later call, on top of the calls: on an H100, 55 ms of spin in a 70 ms pass of 150 calls."""

    def __init__(self) -> None:
        self.free_at = 0
        self.per_call_us = 0.0
        self.first = 0
        """The first call of the last chunk queued (the timer's bookkeeping, for learn())."""
        self._ahead = [True, True]  # the chunk before the last one queued, and the last one

    def us(self, now_ns: int) -> float:
        """The GPU work still ahead at host time `now_ns` (us)."""
        return max(0.0, (self.free_at - now_ns) / 1e3)

    def queued(self, launched_ns: int, end_ns: int, delay_us: float, calls: int, ahead: bool) -> None:
        """A chunk was queued: its delay launched at `launched_ns`, its last call by `end_ns`."""
        self._ahead = [self._ahead[1], ahead]
        if not ahead:
            self.free_at, self.per_call_us = end_ns, 0.0
            return
        self.free_at = max(launched_ns, self.free_at) + int((delay_us + self.per_call_us * calls) * 1e3)

    def learn(self, span_ms: float, calls: int) -> None:
        """The chunk before the last one queued, `calls` calls, finished and spanned `span_ms` on the GPU
        (first start to last end); learned only if it was queued ahead of the GPU."""
        if self._ahead[0] and calls > 0 and span_ms > 0:
            self.per_call_us = BACKLOG_TRUST * span_ms * 1e3 / calls

    def idle(self, now_ns: int) -> None:
        """The host waited for the GPU: nothing is queued any more."""
        self.free_at = min(self.free_at, now_ns)


def choose_mode(stream_ms: float, device_ms: float, previous: str | None = None) -> str:
    """stream_events or device_sync from the two passes' medians; `previous` is the mode this
    callable was given last in this process, if any (the hysteresis band)."""
    factor, add = STREAM_WINS if previous == "device_sync" else DEVICE_WINS
    return "device_sync" if device_ms > factor * stream_ms + add else "stream_events"


_modes: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def previous_mode(fn: Any) -> str | None:
    """The mode `fn` was given last in this process (None: never timed, or not weak-referenceable)."""
    try:
        return _modes.get(fn)
    except TypeError:
        return None


def remember_mode(fn: Any, mode: str) -> None:
    try:
        _modes[fn] = mode
    except TypeError:
        pass
