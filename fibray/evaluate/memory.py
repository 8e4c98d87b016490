"""A job's memory: every input set and output buffer of one job in one region the supervisor
allocates and the candidate's process maps (host shared memory on a CPU, a CUDA VMM allocation
on a GPU). The supervisor writes inputs and poisons outputs before a request and verifies after it
on its own mapping; this module never takes a fact from the candidate's process.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from fibray.evaluate.inputs import poison_
from fibray.evaluate.shm import sealed_memfd

GUARD_BYTES = 4096
"""Bytes before and after every output buffer that must come back unchanged."""
GUARD_PATTERN = 0xA5
_ALIGN = 512
TIMING_BUDGET_BYTES = 1 << 30
"""Distinct input sets kept for timing: at most this many bytes..."""
TIMING_MAX_SETS = 16
"""...and this many sets; revisited sets are changed (InputChanges: dense, never repeating) before each timed call."""
TIMED_OUTPUT_BYTES = 1 << 30
"""Output buffers of timed calls: each timed call writes its own buffers while they fit in this (on a
CPU slot, whose supervisor steps every call, later calls share them: fibray.evaluate.memory.TimedSample)."""
TIMED_OUTPUT_BYTES_GPU = 16 << 30
"""On a GPU, where no step lets the supervisor copy a call's outputs as they are final, every timed call
writes buffers of its own, within this many bytes, 1/TIMED_OUTPUT_SHARE_GPU of the device's memory and a
quarter of what is free (timed_output_bytes); a job whose calls would not fit makes fewer (own_buffer_calls),
so that no timed call's outputs are overwritten unjudged (a candidate that reads its plan skips those:
tests/candidates_gpu)."""
TIMED_OUTPUT_SHARE_GPU = 8
"""At most 1/this of the device's memory for one job's timed output buffers."""
TIMED_REFS_CACHE_BYTES = 1 << 30
"""References of judged timed calls kept per workload for the next job's sample (beyond: computed per job)."""
WORKLOAD_CACHE_BYTES = 2 << 30
"""What a judge keeps of its workloads (inputs, references, the timed calls' replayed sets and masks), least
recently used first out, at least this many bytes..."""
WORKLOAD_CACHE_BYTES_GPU = 16 << 30
"""...and on a GPU up to this many, 1/WORKLOAD_CACHE_SHARE_GPU of the device's memory and a quarter of what is
free (workload_cache_bytes): a solution's jobs go through its definition's workloads (fibray.sweep.pool), so a
cache smaller than one definition's workloads made every workload again for every solution."""
WORKLOAD_CACHE_SHARE_GPU = 8
WRONG_ONE_IN = 8
"""A kernel wrong on one timed call in this many..."""
MISS_PROBABILITY = 1e-3
"""...passes a job with at most this probability (see sample_size)."""


def sample_size(n: int, one_in: int = WRONG_ONE_IN, miss: float = MISS_PROBABILITY) -> int:
    """Timed calls to judge out of n, drawn without replacement after the calls by the supervisor,
    so that a kernel wrong on w = max(1, n // one_in) of them is missed with probability <= miss:
    the smallest k with P(miss) = C(n - w, k) / C(n, k) = prod_{j<k} (n - w - j) / (n - j) <= miss.
    (For large n this is about ln(miss) / ln(1 - 1/one_in) = 52 calls for 1 in 8 and 1e-3.)"""
    if n <= 0:
        return 0
    w, p = max(1, n // one_in), 1.0
    for k in range(n):
        if p <= miss:
            return k
        p *= (n - w - k) / (n - k)
    return n


# --------------------------------------------------------------------------------------------
# layout: where each tensor of the job lies (sent to the executor; plain data)
# --------------------------------------------------------------------------------------------
class Place(BaseModel):
    """One tensor in the region."""

    model_config = ConfigDict(frozen=True)
    off: int
    """Byte offset of the first element."""
    nbytes: int
    dtype: str
    """torch dtype name without the `torch.` prefix."""
    shape: tuple[int, ...]


class Arg(BaseModel):
    """One input of a call: a tensor in the region, or a scalar passed by value."""

    place: Optional[Place] = None
    value: Any = None


class Layout(BaseModel):
    """Every input set and output buffer of one job, and which buffer each call writes."""

    size: int
    """Bytes of the region."""
    kind: str
    """host (shared memory the executor maps) | cuda (a CUDA VMM allocation it imports) | local (same process)."""
    device: str
    inputs: list[list[Arg]]
    """Input sets: the trials' first (set t is trial t's), then further timing sets."""
    outputs: list[list[Place]]
    """Output buffer sets, each output with GUARD_BYTES of guard on both sides."""
    trials: int
    dps: bool
    """Destination-passing style: the candidate writes the buffers; else the executor copies its result in."""
    recheck: int
    scratch: int
    """Buffers for warm-up calls (never judged)."""
    timed: list[int]
    """Output set of timed buffer b; timed call i writes buffer i % len(timed)."""
    snapshots: list[int]
    """Per timed buffer, where its outputs are copied as the call returns (CPU, DPS): a change after return shows."""

    @classmethod
    def bare(cls, size: int, kind: str, device: str) -> "Layout":
        """A region's size and kind alone, with nothing placed in it: what an executor needs to map a
        kept region before any job (Op.KEEP)."""
        return cls(size=size, kind=kind, device=device, inputs=[], outputs=[], trials=0, dps=False, recheck=0,
                   scratch=0, timed=[], snapshots=[])

    def trial_set(self, t: int) -> int:
        return t

    def call_bytes(self) -> int:
        """Bytes of one call's tensor inputs and outputs: what the executor's work between timed calls
        (the input change, the copy of the outputs) grows with."""
        return sum(a.place.nbytes for a in self.inputs[0] if a.place is not None) + self._output_bytes()

    def returned_bytes(self) -> Optional[int]:
        """Bytes of a value-returning call's results, which the executor copies into the region after the
        call; None for a DPS call (it writes the region itself)."""
        return None if self.dps else self._output_bytes()

    def _output_bytes(self) -> int:
        return sum(p.nbytes for p in self.outputs[self.scratch])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _place(off: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Place, int]:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return Place(off=off, nbytes=nbytes, dtype=str(dtype).removeprefix("torch."), shape=tuple(shape)), off + nbytes


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_LAYOUTS: "OrderedDict[tuple, Layout]" = OrderedDict()
_LAYOUTS_KEPT = 256
"""Layouts planned lately, by what they are made of (plan_layout): a workload's jobs of every solution share one."""
_LAYOUTS_LOCK = threading.Lock()


def _layout_key(kind: str, device: str, input_sets: list[list[Any]], out_specs: list[tuple[torch.dtype, tuple[int, ...]]],
                trials: int, dps: bool, timed_buffers: int, snapshots: bool) -> Optional[tuple]:
    """What a layout depends on: each input's dtype and shape, or a scalar's type and value (None where a value
    is not a plain scalar, whose layout is then planned anew)."""
    rows = []
    for args in input_sets:
        row = []
        for a in args:
            if isinstance(a, torch.Tensor):
                row.append((a.dtype, tuple(a.shape)))
            elif a is None or isinstance(a, (bool, int, float, str)):
                row.append((type(a), repr(a)))  # (repr: -0.0 is not 0.0, and a NaN is itself)
            else:
                return None
        rows.append(tuple(row))
    return (kind, device, tuple(rows), tuple((dt, tuple(shape)) for dt, shape in out_specs), trials, dps, timed_buffers,
            snapshots)


def plan_layout(kind: str, device: str, input_sets: list[list[Any]], out_specs: list[tuple[torch.dtype, tuple[int, ...]]],
                trials: int, dps: bool, timed_buffers: int, snapshots: bool) -> Layout:
    """Offsets for the input sets (values kept as scalars where they are not tensors) and the output sets.
    The same inputs' shapes and settings plan the same layout: it is planned once (~3 ms of a job's path on
    an H100 host for 16 sets and 150 buffers) and shared, never changed by its users (model_copy)."""
    key = _layout_key(kind, device, input_sets, out_specs, trials, dps, timed_buffers, snapshots)
    if key is not None:
        with _LAYOUTS_LOCK:
            known = _LAYOUTS.get(key)
            if known is not None:
                _LAYOUTS.move_to_end(key)
                return known
    layout = _plan_layout(kind, device, input_sets, out_specs, trials, dps, timed_buffers, snapshots)
    if key is not None:
        with _LAYOUTS_LOCK:
            _LAYOUTS[key] = layout
            while len(_LAYOUTS) > _LAYOUTS_KEPT:
                _LAYOUTS.popitem(last=False)
    return layout


def _plan_layout(kind: str, device: str, input_sets: list[list[Any]], out_specs: list[tuple[torch.dtype, tuple[int, ...]]],
                 trials: int, dps: bool, timed_buffers: int, snapshots: bool) -> Layout:
    off = 0
    inputs: list[list[Arg]] = []
    for args in input_sets:
        row = []
        for a in args:
            if isinstance(a, torch.Tensor):
                p, end = _place(off, a.dtype, tuple(a.shape))
                off = _up(end)
                row.append(Arg(place=p))
            else:
                row.append(Arg(value=a))
        inputs.append(row)
    n_sets = trials + 2 + timed_buffers * (2 if snapshots else 1)
    outputs: list[list[Place]] = []
    for _ in range(n_sets):
        row = []
        for dtype, shape in out_specs:
            p, end = _place(off + GUARD_BYTES, dtype, shape)
            off = _up(end + GUARD_BYTES)
            row.append(p)
        outputs.append(row)
    timed = list(range(trials + 2, trials + 2 + timed_buffers))
    snaps = list(range(trials + 2 + timed_buffers, n_sets)) if snapshots else []
    return Layout(size=max(off, mmap.PAGESIZE), kind=kind, device=device, inputs=inputs, outputs=outputs, trials=trials,
                  dps=dps, recheck=trials, scratch=trials + 1, timed=timed, snapshots=snaps)


def timed_output_bytes(device: torch.device) -> int:
    """Bytes one job's timed output buffers may take on `device` (TIMED_OUTPUT_BYTES, _GPU): on a GPU also at
    most a quarter of its memory free now (another process's, a candidate's), but never less than 1 GiB."""
    return _device_share(device, TIMED_OUTPUT_BYTES, TIMED_OUTPUT_BYTES_GPU, TIMED_OUTPUT_SHARE_GPU)


def _device_share(device: torch.device, least: int, most: int, share: int) -> int:
    """`least` bytes on a CPU; on a GPU up to `most`, 1/`share` of its memory and a quarter of what is free
    now, but never less than `least`."""
    if device.type != "cuda":
        return least
    free, total = _memory_info(device)
    return max(least, min(most, total // share, free // 4))


FREE_MEMORY_TTL_S = 1.0
"""How long a device's free memory, as last asked, stands for it (cudaMemGetInfo takes milliseconds)."""
_MEMORY_INFO: dict[int, tuple[float, tuple[int, int]]] = {}


def _memory_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a GPU, asked of the driver at most once per FREE_MEMORY_TTL_S."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    now = time.monotonic()
    known = _MEMORY_INFO.get(index)
    if known is None or now - known[0] > FREE_MEMORY_TTL_S:
        known = _MEMORY_INFO[index] = (now, torch.cuda.mem_get_info(index))
    return known[1]


def free_device_bytes(device: torch.device) -> int:
    """A GPU's free memory as last asked (at most FREE_MEMORY_TTL_S ago)."""
    return _memory_info(device)[0]


def workload_cache_bytes(device: torch.device) -> int:
    """Bytes a judge keeps of its workloads on `device` (WORKLOAD_CACHE_BYTES, _GPU)."""
    return _device_share(device, WORKLOAD_CACHE_BYTES, WORKLOAD_CACHE_BYTES_GPU, WORKLOAD_CACHE_SHARE_GPU)


def own_buffer_calls(fit: int, iterations: int, n_sets: int, min_sets: int,
                     calls_of: Callable[[int, int], int]) -> Optional[tuple[int, int]]:
    """The (iterations, input sets) at most as many as asked, most iterations first, whose timed calls
    (calls_of(iterations, sets), both passes) each get output buffers of their own among `fit`; None
    where even `min_sets` sets (the trials') called once each would not fit."""
    if calls_of(1, min_sets) > fit:
        return None
    while n_sets > min_sets and calls_of(1, n_sets) > fit:
        n_sets -= 1
    while iterations > 1 and calls_of(iterations, n_sets) > fit:
        iterations -= 1
    return iterations, n_sets


def judged_calls(called: list[int], buffers: int) -> dict[int, int]:
    """Timed buffer -> the timed call whose outputs it holds after the calls made (call i writes
    buffer i % buffers; a later call on the same buffer overwrites an earlier one)."""
    last: dict[int, int] = {}
    for i in called:
        last[i % buffers] = i
    return last


# --------------------------------------------------------------------------------------------
# regions: the bytes both processes see
# --------------------------------------------------------------------------------------------
class Region(Protocol):
    size: int

    def bytes(self) -> torch.Tensor:
        """The whole region as a uint8 tensor on its device, in this process."""
        ...

    def share(self) -> Optional[int]:
        """A file descriptor another process maps the region with (None: same process only)."""
        ...

    def close(self) -> None: ...


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostRegion:
    """Host shared memory (a memfd). Mapped with mmap(2) directly so that unmapping always
    happens, even while a tensor the candidate kept still points into it (that tensor then faults)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"cannot map a job region of {size} bytes: {os.strerror(err)}")
        self.addr = addr
        self._bytes: Optional[torch.Tensor] = torch.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> "HostRegion":
        return cls(sealed_memfd("fibray-job", size), size)  # the executor holds it: it may not shrink it

    def bytes(self) -> torch.Tensor:
        assert self._bytes is not None, "region closed"
        return self._bytes

    def share(self) -> Optional[int]:
        return self.fd

    def piece(self, off: int, nbytes: int) -> torch.Tensor:
        assert self._bytes is not None and 0 <= off and off + nbytes <= self.size, "outside the region"
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(self.addr + off), dtype=torch.uint8)

    def close(self) -> None:
        if self._bytes is None:
            return
        self._bytes = None
        _libc.munmap(self.addr, self.size)
        os.close(self.fd)


class LocalRegion:
    """Plain device memory for a supervisor and candidate runner in one process (Evaluator)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self._bytes = torch.empty(size, dtype=torch.uint8, device=device)

    def bytes(self) -> torch.Tensor:
        return self._bytes

    def share(self) -> Optional[int]:
        return None

    def close(self) -> None:
        pass


KEEP_REGION_BYTES = 256 << 20
"""An executor keeps its job region for its next job when the region is at most this large (KeptRegion)..."""
KEEP_REGION_BYTES_GPU = 4 << 30
"""...or this large on a GPU, where a job's timed outputs and input sets alone reach 2 GiB (TIMED_OUTPUT_BYTES,
TIMING_BUDGET_BYTES): a region made, mapped (on both sides) and closed per job cost ~10 ms of its path on an H100
(benchmarks/RESULTS.md, section 31); a slot's GPU holds one such region per lane."""


class KeptRegion:
    """One executor's job region, kept mapped on both sides from one of its jobs to the next: a
    region made, mapped and closed per job cost ~20 ms of a job's path on an H100 (VMM create, map
    and close on this side, import and map on the executor's), most of a short job's own time.
    Only that executor ever maps it, and it serves one solution and is retired with it
    (fibray.workers.process.sandbox.retire closes this), so nothing of another candidate's job is
    ever in it; every job writes all its inputs and guards and poisons all its outputs, as on a
    new region. A job that needs more than the region holds gets a larger one (the old one closed), at
    least `at_least` large (the largest its definition needed so far: the later, larger workloads of its
    solution then fit); one larger than `keep_bytes` is made for its job alone."""

    def __init__(self, make: Callable[[int], Region], keep_bytes: int = KEEP_REGION_BYTES) -> None:
        self.make, self.keep_bytes = make, keep_bytes
        self.region: Optional[Region] = None
        self.mapped = False
        """The executor has mapped `region` (set by whoever attached it there)."""
        self._lent = False

    def lend(self, size: int, at_least: int = 0) -> Region:
        """A region of at least `size` bytes for one job: the kept one where it can be (made at least
        `at_least` large, within keep_bytes, where one is made)."""
        if size > self.keep_bytes or self._lent:
            return self.make(size)
        if self.region is None or self.region.size < size:
            self.prepare(max(size, min(at_least, self.keep_bytes)))
        self._lent = True
        return LentRegion(self)

    def prepare(self, size: int) -> bool:
        """Make the region `size` bytes large ahead of any job (none made, or a smaller one), within
        keep_bytes; True if there is one at least that large now."""
        if size > self.keep_bytes or self._lent:
            return False
        if self.region is None or self.region.size < size:
            self.close()
            self.region = self.make(size)
        return True

    def lent(self, region: Region) -> bool:
        """`region` is this one's, as lent."""
        return isinstance(region, LentRegion) and region.kept is self

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.region, self.mapped, self._lent = None, False, False


class LentRegion:
    """A kept region as one job's (KeptRegion.lend): closing it gives it back."""

    def __init__(self, kept: KeptRegion) -> None:
        assert kept.region is not None
        self.kept, self._region = kept, kept.region
        self.size = kept.region.size

    def bytes(self) -> torch.Tensor:
        return self._region.bytes()

    def share(self) -> Optional[int]:
        return self._region.share()

    def piece(self, off: int, nbytes: int) -> torch.Tensor:
        return _piece(self._region, off, nbytes)

    def close(self) -> None:
        if self.kept.region is self._region:
            self.kept._lent = False


def view(region: Region, p: Place) -> torch.Tensor:
    """A tensor of the region as the supervisor sees it (a view of the whole region)."""
    return region.bytes()[p.off:p.off + p.nbytes].view(_dtype(p.dtype)).view(p.shape)


def _piece(region: Region, off: int, nbytes: int) -> torch.Tensor:
    """Bytes of the region as a tensor with a storage of its own, where the region can make one:
    the Triton interpreter copies each argument's whole storage around every launch."""
    make = getattr(region, "piece", None)
    return make(off, nbytes) if make is not None else region.bytes()[off:off + nbytes]


def args_of(region: Region, row: list[Arg]) -> list[Any]:
    """A call's inputs as the candidate gets them: each tensor on a storage of exactly its bytes."""
    return [_piece(region, a.place.off, a.place.nbytes).view(_dtype(a.place.dtype)).view(a.place.shape)
            if a.place is not None else a.value for a in row]


def outputs_of(region: Region, row: list[Place]) -> list[torch.Tensor]:
    """A call's output buffers as the candidate gets them: each on a storage that spans its guards."""
    out = []
    for p in row:
        raw = _piece(region, p.off - GUARD_BYTES, p.nbytes + 2 * GUARD_BYTES)
        out.append(raw[GUARD_BYTES:GUARD_BYTES + p.nbytes].view(_dtype(p.dtype)).view(p.shape))
    return out


# --------------------------------------------------------------------------------------------
# changing inputs between timed calls (both sides run this same code on their own copy)
# --------------------------------------------------------------------------------------------
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


FLIP_WEIGHT = 3
"""The mantissa bit an input change flips: the one worth 2**-FLIP_WEIGHT of its value's binade,
so a flipped value moves by 6-12.5% (25% in fp8 e5m2, whose mantissa is two bits): far outside any
tolerance, so an output computed on the previous values is wrong, yet in the same binade and sign."""


def set_span(row: list[Arg]) -> Optional[tuple[int, int]]:
    """Where an input set's tensors lie in the region: (offset, bytes) from its first tensor to the
    aligned end of its last (placed one after another, each at an _ALIGN boundary: the bytes between
    them belong to no tensor). None for a set of scalars only."""
    places = [a.place for a in row if a.place is not None]
    if not places:
        return None
    lo = min(p.off for p in places)
    return lo, _up(max(p.off + p.nbytes for p in places)) - lo


def inputs_copy(layout: "Layout", sets: list[list[Any]], device: torch.device) -> "LocalRegion":
    """The input sets in memory of this process, laid out as in the job's region (up to the end of
    the last set): where the supervisor changes them as the timed calls' inputs changed."""
    spans = [s for s in map(set_span, layout.inputs) if s is not None]
    copy = LocalRegion(max((lo + n for lo, n in spans), default=0), device)
    written = JobMemory(copy, layout)
    for i, values in enumerate(sets):
        written.write_inputs(i, values)
    return copy


@functools.lru_cache(maxsize=None)
def flip_rule(dtype: torch.dtype) -> tuple[torch.dtype, int, int, int]:
    """How InputChanges flips a float dtype's values, as integers on its bits: (the bits' dtype, the
    flip bit FLIP_WEIGHT below the leading mantissa bit, the mask of every bit but the sign, and the
    limit). A value may change where its magnitude's bits are above 0 (not a zero) and below the limit:
    the limit is the first pattern whose value or whose flip is not finite (an infinity's bits, a
    NaN's; fp8 e4m3's largest, whose flip is its NaN); every pattern below it and its flip are finite
    (tests/test_memory.py checks every pattern of every 8- and 16-bit float against the values)."""
    info = torch.finfo(dtype)
    bits = _BITS[info.bits // 8]
    sign = 1 << 7 if bits == torch.uint8 else -(1 << (info.bits - 1))  # the sign bit alone: a zero, or a NaN
    if torch.tensor(sign, dtype=torch.int64).to(bits).view(dtype).to(torch.float64).isnan():  # (the fnuz fp8s)
        raise ValueError(f"input changes have no rule for {dtype}: its negative zero's bits are a NaN")
    mantissa = round(-math.log2(info.eps))
    flip = 1 << max(0, mantissa - FLIP_WEIGHT)
    largest = torch.tensor(info.max, dtype=torch.float64).to(dtype)
    top = int(largest.view(bits).item())
    flipped = torch.tensor(top ^ flip, dtype=torch.int64).to(bits).view(dtype)
    limit = top + 1 if bool(flipped.to(torch.float64).isfinite()) else top
    return bits, flip, (1 << (info.bits - 1)) - 1, limit


def flip_mask(a: torch.Tensor, out: torch.Tensor) -> None:
    """Write into `out` (bytes laid out as `a`) the flip bit of flip_rule(a.dtype) where a's value may
    change, zero elsewhere: integer operations on its bits (no float copy of it, no isfinite)."""
    bits_dtype, flip, magnitude, limit = flip_rule(a.dtype)
    bits = a.view(bits_dtype)
    mag = torch.bitwise_and(bits, magnitude)
    keep = mag > 0
    keep &= mag < limit
    out = out.view(bits_dtype).view(bits.shape)
    out.copy_(keep)
    out.mul_(flip)  # (a multiply of the bools into `out` cast through int64: 8x slower on a CPU)


class InputChanges:
    """The change made to one input set before each of its timed calls: in every floating-point
    input, one mantissa bit (FLIP_WEIGHT) of a random half of the elements flips (an XOR), the half
    drawn from the call's secret seed. Every row changes, densely and without structure, by far more
    than a tolerance: a candidate that returns an earlier answer, caches by a fingerprint, or
    patches its last answer for what changed is wrong or computes in full. Values keep their sign
    and binade, and a set never comes back to a state it held in practice (2**(n/2) states).
    Zeros, infinities, NaNs and values whose flip would leave the finite range (fp8 e4m3's
    largest) never change; integer inputs never do. Both sides run this same code on a region of
    the same layout: the executor on the candidate's, the supervisor on its own mapping of it or on
    a copy of its inputs (Judge._timed).

    The change is made to the set's whole span of bytes at once, as 64-bit words: the XOR of a mask
    (each element's flip bit where it may change, nothing elsewhere) ANDed with a window of a pool
    of random words (POOL_SPAN words longer than the span, drawn once from the first seed applied;
    each call's seed picks the window's offset). Three operations a set, however many inputs it has:
    on a GPU each is a launch of ~5 us of host time, which a timed call's host work (issue 15) carries;
    two per input (and the window's slice and view) cost 50-75 us before a 2-input call on an H100
    (RESULTS.md section 26). Against a random draw
    per element: on a CPU a draw cost several times an rmsnorm of the same input, and its time, in
    the supervisor's window but not in any honest report, was judged a lie (timing_below_observed)."""

    @classmethod
    def of_layout(cls, layout: "Layout", region: Region,
                  masks: Optional[dict[tuple, Optional[torch.Tensor]]] = None) -> list["InputChanges"]:
        """One per input set of the region, sharing one pool and scratch per span length. `masks`: the
        sets' flip masks by (set, its tensors' places within the span), kept by a caller whose regions
        hold the same sets in that state again (the supervisor's copies of a workload's sets: Judge._timed)."""
        shared: dict[tuple, list] = {}
        into = None
        if masks is None:  # every set's mask in one allocation: a fresh process's caching allocator asks the
            spans = [s for s in map(set_span, layout.inputs) if s is not None]  # driver once, not once a set
            into = _MaskArena(sum(n for _, n in spans), region.bytes().device)
        return [cls(region, row, shared, masks, i, into) for i, row in enumerate(layout.inputs)]

    def __init__(self, region: Region, row: list[Arg], shared: Optional[dict[tuple, list]] = None,
                 masks: Optional[dict[tuple, Optional[torch.Tensor]]] = None, index: int = 0,
                 into: Optional["_MaskArena"] = None) -> None:
        shared = {} if shared is None else shared
        span = set_span(row)
        self._words: Optional[torch.Tensor] = None
        if span is None:
            return
        lo, nbytes = span
        if masks is None:
            flips = self._mask(region, row, lo, nbytes, into)
        else:
            known = (index, tuple((a.place.off - lo, a.place.dtype, a.place.shape) for a in row if a.place is not None))
            if known not in masks:
                masks[known] = self._mask(region, row, lo, nbytes)
            flips = masks[known]
        if flips is None:
            return
        self._words = _piece(region, lo, nbytes).view(torch.int64)
        self._flips = flips
        key = (self._words.numel(), str(self._words.device))
        if key not in shared:  # [pool (allocated now, drawn at the first change), scratch, pool drawn]
            words = self._words.numel()
            shared[key] = [torch.empty(words + POOL_SPAN, dtype=torch.int64, device=self._words.device),
                           torch.empty_like(self._words), False]
        self._pool_scratch = shared[key]

    @staticmethod
    def _mask(region: Region, row: list[Arg], lo: int, nbytes: int,
              into: Optional["_MaskArena"] = None) -> Optional[torch.Tensor]:
        """The set's flip mask as 64-bit words over its span (flip_mask of each float input), or None
        where no input may change. `into`: the mask is a zeroed piece of it rather than an allocation of its own."""
        device = region.bytes().device
        mask = into.take(nbytes) if into is not None else torch.zeros(nbytes, dtype=torch.uint8, device=device)
        floats = False
        for arg, a in zip(row, args_of(region, row)):
            if arg.place is None or not a.is_floating_point() or not a.numel():
                continue
            floats = True
            p = arg.place
            flip_mask(a, mask[p.off - lo:p.off - lo + p.nbytes])
        return mask.view(torch.int64) if floats else None  # (not mask.any(): a read back, on a GPU a synchronise)

    def apply(self, seed: int) -> None:
        words = self._words
        if words is None:
            return
        pool, scratch, drawn = self._pool_scratch
        if not drawn:
            gen = torch.Generator(device=words.device)
            gen.manual_seed(seed ^ _POOL_SALT)
            pool.random_(generator=gen)
            self._pool_scratch[2] = True
        at = seed % POOL_SPAN
        torch.bitwise_and(pool[at:at + words.numel()], self._flips, out=scratch)
        words.bitwise_xor_(scratch)


class _MaskArena:
    """One zeroed allocation that a layout's flip masks are cut from, in order (InputChanges.of_layout)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._at = 0

    def take(self, nbytes: int) -> torch.Tensor:
        piece = self._bytes[self._at:self._at + nbytes]
        assert piece.numel() == nbytes, "the mask arena was sized for fewer bytes"
        self._at += nbytes
        return piece


POOL_SPAN = 1 << 14
"""Offsets a change's window of random bits may take in its pool (InputChanges)."""
_POOL_SALT = 0x5EED_F00D_CAFE
"""Keeps the pool's draw apart from the offset the same seed picks."""


def draw_seeds(n: int) -> list[int]:
    """Secret seeds of the input changes of n timed calls, drawn by the supervisor and sent only when timing starts."""
    return [secrets.randbits(63) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# the supervisor's side
# --------------------------------------------------------------------------------------------
class SupervisorSteps:
    """The supervisor's work between the calls of a stepped CPU timing (fibray.timing.steps), done on its
    own mapping of the job's region while the executor is blocked: before timed call i, its input set's
    change (InputChanges, from `seeds[i]`, which the executor is never sent, so it cannot work out a
    call's inputs ahead); right after call i returned, on a DPS call, the copy of its output buffers into
    their snapshot (what existed at the end mark). The executor then does nothing between calls but
    a value-returning call's copy of its result, and the supervisor holds what else it does there
    against the calls (fibray.timing.bound, the steps' check)."""

    def __init__(self, layout: Layout, region: Region, seeds: list[int]) -> None:
        self.changes, self.n_sets, self.seeds = InputChanges.of_layout(layout, region), len(layout.inputs), list(seeds)
        self.outs = [outputs_of(region, layout.outputs[k]) for k in layout.timed]
        self.snaps = [outputs_of(region, layout.outputs[k]) for k in layout.snapshots]
        self.dps = layout.dps
        self.sample = TimedSample(self.outs, len(self.seeds))
        """A secret sample of the timed calls' outputs, taken as each call's outputs are final (a DPS call's
        as it returns; a value-returning call's once it is handed over): where the calls outnumber their
        buffers, the calls whose buffers are written again are judged there."""
        self.final: Optional[dict[int, list[torch.Tensor]]] = None
        """The judged buffers' copies at the end step (final_copies)."""
        self._made = 0

    def calls(self) -> int:
        return len(self.seeds)

    def before(self, i: int) -> None:
        self.changes[i % self.n_sets].apply(self.seeds[i])
        if not self.dps and i:  # call i - 1 was handed over, into its buffer, before this call
            self.sample.take(i - 1)

    def after(self, i: int) -> None:
        self._made = i + 1
        if self.snaps:
            b = i % len(self.outs)
            for src, dst in zip(self.outs[b], self.snaps[b]):
                dst.copy_(src)
        if self.dps:
            self.sample.take(i)

    def end(self) -> None:
        """At the end step: the last call is handed over; the final copies (`final`) are taken."""
        if not self.dps and self._made:
            self.sample.take(self._made - 1)
        self.final = final_copies(self.outs, self._made)


def final_copies(outs: list[list[torch.Tensor]], calls: int) -> dict[int, list[torch.Tensor]]:
    """Timed buffer -> this side's copy of its outputs, for a secret sample (sample_size, drawn now) of
    the buffers that `calls` timed calls wrote, copied at a timing's end step while the executor waits
    (fibray.timing.steps): the judge reads these, not the buffers, so what the executor writes into them
    once it runs on to its reply, outside every clock, is never judged (Judge.check_timed)."""
    written = range(min(calls, len(outs)))
    chosen = secrets.SystemRandom().sample(written, sample_size(len(written)))
    copies = {b: [t.clone() for t in outs[b]] for b in sorted(chosen)}
    if outs and outs[0] and outs[0][0].is_cuda:
        torch.cuda.synchronize(outs[0][0].device)  # the copies are made before the executor runs again
    return copies


class TimedSample:
    """Where a timing's calls outnumber the output buffers kept for them (TIMED_OUTPUT_BYTES), a call's
    outputs are written over by a later call on the same buffer, and only the last call on each buffer
    could be judged, which a candidate can work out from its own plan: it could skip every other call.
    So the supervisor keeps copies of its own of a uniform random sample of the calls (reservoir
    sampling, drawn from the system's secret source), up to sample_size(calls) of them and as many as
    fit in TIMED_OUTPUT_BYTES, taken while the executor is blocked. Every call costs the same copy,
    kept or not (into a scratch), so the executor cannot tell from its waits which calls were kept."""

    def __init__(self, outs: list[list[torch.Tensor]], calls: int) -> None:
        self.kept: dict[int, list[torch.Tensor]] = {}
        """Call -> this side's copy of its outputs."""
        self._slots: list[list[torch.Tensor]] = []
        self._outs = outs
        if not outs or calls <= len(outs):
            return
        nbytes = sum(t.numel() * t.element_size() for t in outs[0]) or 1
        size = max(1, min(sample_size(calls), TIMED_OUTPUT_BYTES // nbytes))
        self._slots = [[torch.empty_like(t) for t in outs[0]] for _ in range(size + 1)]  # the last: scratch
        self._owner: list[Optional[int]] = [None] * size
        self._rng = secrets.SystemRandom()

    def take(self, i: int) -> None:
        """Call i's outputs are final in their buffer: into the sample, or (the same copy) the scratch."""
        if not self._slots:
            return
        size = len(self._owner)
        slot = i if i < size else self._rng.randrange(i + 1)
        if slot >= size:
            slot = size  # the scratch
        elif self._owner[slot] is not None:
            self.kept.pop(self._owner[slot], None)
        for src, dst in zip(self._outs[i % len(self._outs)], self._slots[slot]):
            dst.copy_(src)
        if slot < size:
            self._owner[slot] = i
            self.kept[i] = self._slots[slot]


def _poisoned_fully(p: Place) -> bool:
    """Whether poison_ writes every byte of the buffer (not fp8, which it leaves as it is)."""
    dtype = _dtype(p.dtype)
    return not dtype.is_floating_point or torch.empty((), dtype=dtype).element_size() >= 2


def _guard(region: Region, p: Place) -> tuple[torch.Tensor, torch.Tensor]:
    raw = region.bytes()
    return raw[p.off - GUARD_BYTES:p.off], raw[p.off + p.nbytes:p.off + p.nbytes + GUARD_BYTES]


class JobMemory:
    """The supervisor's handle on a job's region: it writes, poisons and verifies; it never runs candidate code."""

    def __init__(self, region: Region, layout: Layout, device: Optional[torch.device] = None) -> None:
        self.region, self.layout = region, layout
        self.device = device
        """Where outputs are judged (the references' device), when the region is elsewhere (staged)."""

    def inputs(self, s: int) -> list[Any]:
        return args_of(self.region, self.layout.inputs[s])

    def outputs(self, k: int) -> list[torch.Tensor]:
        outs = [view(self.region, p) for p in self.layout.outputs[k]]
        if self.device is not None and outs and outs[0].device != self.device:
            outs = [o.to(self.device) for o in outs]
        return outs

    def write_inputs(self, s: int, values: list[Any]) -> None:
        for arg, v in zip(self.layout.inputs[s], values):
            if arg.place is not None:
                view(self.region, arg.place).copy_(v)

    def prepare_outputs(self, sets: list[int]) -> None:
        """Guard bytes set and bodies poisoned (NaN, True or the max int). Every output set has the same
        layout from its first guard to its last, so the first set prepared is copied over the others: one
        copy per run of equally spaced sets (the timed buffers), where there were three fills a buffer."""
        if not sets:
            return
        self._prepare_one(sets[0])
        rest, first = sets[1:], self.layout.outputs[sets[0]]
        if not rest or not first or not all(map(_poisoned_fully, first)):
            for k in rest:  # an fp8 body is not poisoned: each set keeps its own bytes, as it always did
                self._prepare_one(k)
            return
        raw = self.region.bytes()
        lo, hi = self._span(sets[0])
        size, template = hi - lo, raw[lo:hi]
        starts = [self._span(k)[0] for k in rest]
        i = 0
        while i < len(rest):  # runs of sets equally spaced, at least a set's size apart: one copy each
            j, stride = i + 1, 0
            if j < len(rest) and starts[j] - starts[i] >= size:
                stride = starts[j] - starts[i]
                while j < len(rest) and starts[j] - starts[j - 1] == stride:
                    j += 1
            if j - i == 1:
                raw[starts[i]:starts[i] + size].copy_(template)
            else:
                raw[starts[i]:].as_strided((j - i, size), (stride, 1)).copy_(template.expand(j - i, size))
            i = j

    def _prepare_one(self, k: int) -> None:
        for p in self.layout.outputs[k]:
            before, after = _guard(self.region, p)
            before.fill_(GUARD_PATTERN)
            after.fill_(GUARD_PATTERN)
            poison_(view(self.region, p))

    def _span(self, k: int) -> tuple[int, int]:
        """Bytes of output set k, from its first buffer's leading guard to its last buffer's trailing one."""
        row = self.layout.outputs[k]
        return row[0].off - GUARD_BYTES, row[-1].off + row[-1].nbytes + GUARD_BYTES

    def guards_intact(self, k: int) -> bool:
        return self.guards_intact_many([k])[0]

    def guards_intact_many(self, sets: list[int]) -> list[bool]:
        """For each output set, whether the guard bytes around all its buffers hold the pattern:
        every guard of every set compared at once, read back once."""
        guards = [(i, g) for i, k in enumerate(sets) for p in self.layout.outputs[k] for g in _guard(self.region, p)]
        intact = [True] * len(sets)
        if guards:
            held = (torch.stack([g for _, g in guards]) == GUARD_PATTERN).all(1).tolist()
            for (i, _), ok in zip(guards, held):
                intact[i] = intact[i] and ok
        return intact

    def changed_input(self, s: int, expected: list[Any]) -> Optional[int]:
        """Index of the first tensor input of set s whose bytes differ from `expected`, else None."""
        first = self.changed_inputs({s: expected})
        return None if first is None else first[1]

    def changed_inputs(self, expected: dict[int, list[Any]]) -> Optional[tuple[int, int]]:
        """(set, input) of the first tensor input, in set order, whose bytes differ from what `expected`
        (set -> values) says, else None: every input compared on the device at once and read back once
        (a comparison a read back cost ~18 ms of a GPU supervisor's time a job, over up to 16 sets)."""
        where: list[tuple[int, int]] = []
        differ: list[torch.Tensor] = []
        for s, values in sorted(expected.items()):
            for i, (arg, want) in enumerate(zip(self.layout.inputs[s], values)):
                if arg.place is None:
                    continue
                got = view(self.region, arg.place).reshape(-1).view(torch.uint8)
                want = (want if want.device == got.device else want.to(got.device)).reshape(-1).contiguous().view(torch.uint8)
                where.append((s, i))
                differ.append(torch.ne(got, want).any() if got.numel() == want.numel()
                              else torch.ones((), dtype=torch.bool, device=got.device))
        if not differ:
            return None
        return next((w for w, bad in zip(where, torch.stack(differ).tolist()) if bad), None)

    def settle(self) -> None:
        """Wait for this process's writes to the region (a GPU's are queued): the executor reads next."""
        raw = self.region.bytes()
        if raw.device.type == "cuda":
            torch.cuda.synchronize(raw.device)

    def close(self) -> None:
        self.region.close()
