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
    planned; observe() feeds back the host's time to launch the chunk and whether the GPU was
    still in the delay when the last call was queued (`ahead`: every call was queued before the
    GPU reached it). A chunk the GPU caught up with doubles the estimate for the next."""

    def __init__(self, total: int, host_us_per_call: float) -> None:
        self.total, self.host_us = total, max(host_us_per_call, 0.0)
        self.planned = self.queued = self.behind_in_a_row = 0
        self.delays = True
        self._stopped = False

    def next_chunk(self) -> tuple[int, float] | None:
        left = self.total - self.planned
        if left <= 0 or self._stopped:
            return None
        first = FIRST_CHUNK_CALLS if self.planned == 0 else CHUNK_CALLS
        calls = min(left, first, calls_per_chunk(self.host_us))
        self.planned += calls
        return calls, (sleep_us(self.host_us, calls) if self.delays else 0.0)

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
