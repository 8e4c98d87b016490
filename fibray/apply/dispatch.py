"""Per-definition dispatch: from a call's arguments to a verified solution, or to the fallback.

One Dispatcher per definition. Everything a call needs is precomputed into plain tuples
and a dict keyed by the argument shapes, so a call costs a few attribute reads and one
dict lookup (the generated hot path, fibray.apply.hotpath): no pydantic, no JSON, no
allocation beyond the outputs. Where the C++ hit path builds (fibray.apply.native), it
stands in front of that Python path and replays the table's plain decisions in one C call.
A substituted solution that raises or returns NaN/Inf never reaches the caller: that call
falls back, and the solution is switched off for the process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fibray.apply.hotpath import generate, make_probe
from fibray.apply.index import Key
from fibray.apply.native import hit_path_type
from fibray.apply.stages import StageMonitor, StagedCalls, all_finite as _all_finite
from fibray.evaluate.inputs import torch_dtype
from fibray.schema import Definition

HIT, BUCKETED, MISS = 0, 1, 2
"""Entry kinds: a measured key, an unseen key served by the nearest measured one, no substitution."""

Shapes = tuple[tuple[int, ...], ...]


class SolutionState:
    """A built solution as the hot path sees it, with its counters and circuit breaker."""

    __slots__ = ("artifact", "calls", "check_left", "disabled", "dps", "fn", "hash", "mode", "monitor", "name", "slow",
                 "stage")

    def __init__(self, name: str, solution_hash: str, fn: Callable[..., Any], dps: bool,
                 check_calls: int | None, *, monitor: StageMonitor | None = None, artifact: str | None = None,
                 stage: str | None = None) -> None:
        self.name = name
        self.hash = solution_hash
        self.fn = fn
        self.dps = dps
        self.monitor = monitor
        """Sampling and comparison of a shadow or canary artifact; None when it is served plainly."""
        self.mode = monitor.mode if monitor is not None else None
        """SHADOW, CANARY, or None (default, or no promotion required)."""
        self.slow = dps or self.mode is not None
        """Whether the hot path hands its calls to Dispatcher._call_slow."""
        self.artifact = artifact
        """Its artifact id when apply requires promotion."""
        self.stage = stage
        """Its promotion stage when apply requires promotion."""
        self.calls = 0
        """Substituted calls that returned its result (the C++ hit path's share is added when stats are read)."""
        self.check_left = -1 if check_calls is None else check_calls
        """Calls whose outputs are still checked for NaN/Inf (-1: every call)."""
        self.disabled: str | None = None
        """Why the circuit breaker switched it off; None while it is live."""


@dataclass(frozen=True, slots=True)
class Entry:
    """What to do for one argument signature."""

    state: SolutionState | None
    """The solution to call; None: call the fallback."""
    kind: int
    """HIT, BUCKETED or MISS."""
    outs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    """Shape and dtype of each output, for allocating destination-passing outputs."""
    rest: SolutionState | None = None
    """For a staged (shadow/canary) state: the default solution that answers the calls it does not."""


_MISS_ENTRY = Entry(None, MISS)


class Dispatcher(StagedCalls):
    """Routes the calls of one definition to its verified solutions.

    `dispatch(fallback, args, kwargs)` is the C++ hit path (fibray.apply.native) in front of
    the generated Python hot path (fibray.apply.hotpath), or that Python path alone; the
    methods here are their slow paths: first sight of a signature, keyword or
    destination-passing callers, misses, failures.
    """

    def __init__(
        self,
        definition: Definition,
        ranked: dict[Key, list[SolutionState]],
        failed: dict[Key, set[str]],
        *,
        on_failure: Callable[[SolutionState, str], None],
        nearest: bool,
        cuda: bool,
        cache_size: int,
        compiled: bool = True,
    ) -> None:
        self.name = definition.name
        self.definition = definition
        self.ranked = ranked
        # extrapolating to an unmeasured key is only for solutions that passed everywhere they were tried
        self._failed_somewhere: set[str] = set().union(*failed.values()) if failed else set()
        self._on_failure = on_failure
        self._nearest = nearest
        self._cuda = cuda
        self._cache_size = cache_size
        specs = list(definition.inputs.values())
        out_specs = list(definition.outputs.values())
        self._names = (*definition.inputs, *definition.outputs)
        self.n_in, self.n_out = len(specs), len(out_specs)
        self._n_all = self.n_in + self.n_out
        self._in_pos = tuple(i for i, s in enumerate(specs) if s.shape is not None)
        if not self._in_pos:
            raise ValueError(f"definition {definition.name!r} has no tensor inputs; apply cannot tell its device")
        all_pos = self._in_pos + tuple(self.n_in + j for j in range(self.n_out))
        dtypes = [torch_dtype(s.dtype) for s in specs] + [torch_dtype(s.dtype) for s in out_specs]
        self._out_dtypes = tuple(dtypes[self.n_in:])
        # where each var axis is read from: (index into the input signature, dimension)
        self._key_locs: list[tuple[str, int, int]] = []
        tensor_specs = [specs[i] for i in self._in_pos]
        for axis in definition.var_axes:
            locs = [(k, spec.shape.index(axis)) for k, spec in enumerate(tensor_specs) if axis in spec.shape]
            if not locs:
                raise ValueError(f"definition {definition.name!r}: var axis {axis!r} appears in no input shape")
            self._key_locs.append((axis, *locs[0]))
        self._first = self._in_pos[0]
        self.counts = [0, 0, 0]
        """Substituted calls by entry kind (HIT, BUCKETED), once `sync_counters` has run."""
        self._misses = self.fallbacks = 0
        self._box: list[dict[tuple, Entry]] = [{}]
        self._memo = 0
        self._probe_all = make_probe([(i, dtypes[i]) for i in all_pos], cuda)
        guard = [(i, dtypes[i]) for i in self._in_pos]
        python_dispatch = generate(
            self.n_in, guard, single_output=self.n_out == 1, cuda=cuda,
            env={"general": self._call_general, "miss": self._miss, "resolve": self._resolve,
                 "call_slow": self._call_slow, "normalize": self._normalize,
                 "outputs_ok": self._outputs_ok, "failed": self._failed, "raised": self._raised,
                 "box": self._box, "counts": self.counts},
        )
        hit_path = hit_path_type() if compiled else None
        self._hit_path = None if hit_path is None else hit_path(
            slow=python_dispatch, on_error=self._raised, normalize=self._normalize, n_in=self.n_in,
            guards=guard, cuda=cuda, single_output=self.n_out == 1)
        self.dispatch: Callable[[Callable[..., Any], tuple, dict[str, Any]], Any] = self._hit_path or python_dispatch
        """dispatch(fallback, args, kwargs): the call path decorated functions use."""
        self.compile()

    @property
    def compiled(self) -> bool:
        """Whether calls go through the C++ hit path first."""
        return self._hit_path is not None

    @property
    def hits(self) -> int:
        self.sync_counters()
        return self.counts[HIT]

    @property
    def bucketed(self) -> int:
        self.sync_counters()
        return self.counts[BUCKETED]

    @property
    def misses(self) -> int:
        self.sync_counters()
        return self._misses

    def sync_counters(self) -> None:
        """Add what the C++ hit path served since the last sync to the Python counters."""
        if self._hit_path is None:
            return
        for state, kind, calls in self._hit_path.drain():
            if kind == MISS:
                self._misses += calls
            else:
                self.counts[kind] += calls
                state.calls += calls

    @property
    def table(self) -> dict[tuple, Entry]:
        """Argument signature (shapes) -> entry: measured keys, then signatures resolved on first sight."""
        return self._box[0]

    def __call__(self, fallback: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.dispatch(fallback, args, kwargs)

    # -- tables --------------------------------------------------------------------------
    def compile(self) -> None:
        """(Re)build the exact-key table from the live candidates; forget resolved unseen keys."""
        table: dict[tuple, Entry] = {}
        for key, states in self.ranked.items():
            live, rest = _pick(states)
            if live is None:
                continue
            axes = dict(zip(self.definition.var_axes, key))
            ins, outs = self._shapes(axes)
            entry = Entry(live, HIT, tuple(zip(outs, self._out_dtypes)), rest)
            table[ins] = entry
            table[ins + outs] = entry
        self._box[0] = table  # one reference swap: a concurrent call sees the old table or the new one
        self._memo = 0
        self._mirror()

    def _mirror(self) -> None:
        """Hand the table's plain decisions to the C++ hit path, replacing what it had."""
        if self._hit_path is not None:
            self._hit_path.clear()
            for sig, entry in self._box[0].items():
                self._tell(sig, entry)

    def _tell(self, sig: tuple, entry: Entry) -> None:
        """One decision for the C++ hit path, if it is a plain one: call the fallback, or call a
        solution whose outputs need no more checks. The rest (output checks) stays Python's."""
        if self._hit_path is None or len(sig) != len(self._in_pos):  # inputs-then-outputs callers
            return
        state = entry.state
        if state is None:
            self._hit_path.put(sig, MISS, None, None)
        elif state.check_left == 0 and state.mode is None:  # staged calls stay on the Python side
            self._hit_path.put(sig, entry.kind, state.fn, state, entry.outs if state.dps else None)

    def _shapes(self, axes: dict[str, int]) -> tuple[Shapes, Shapes]:
        ins = self.definition.input_shapes(axes)
        outs = self.definition.output_shapes(axes)
        return tuple(s for s in ins.values() if s is not None), tuple(s or () for s in outs.values())

    def _nearest_state(self, key: Key) -> tuple[SolutionState | None, SolutionState | None]:
        """The fastest live solution (and its default runner-up, if it is staged) at the nearest
        measured key, among solutions that never failed a key."""
        for k in sorted(self.ranked, key=lambda k: (_distance(k, key), tuple(-v for v in k))):
            state, rest = _pick([s for s in self.ranked[k] if s.hash not in self._failed_somewhere])
            if state is not None:
                return state, rest
        return None, None

    def _resolve(self, table: dict[tuple, Entry], sig: tuple) -> Entry:
        """First sight of a signature: validate it against the definition, bucket it, remember it."""
        n = len(self._in_pos)
        ins = tuple(tuple(s) for s in sig[:n])
        axes: dict[str, int] = {}
        entry = _MISS_ENTRY
        try:
            for axis, k, dim in self._key_locs:
                axes[axis] = int(ins[k][dim])
            want_in, want_out = self._shapes(axes)
        except (IndexError, ValueError):
            want_in = want_out = None
        if want_in == ins and (len(sig) == n or tuple(tuple(s) for s in sig[n:]) == want_out):
            state, rest = (self._nearest_state(tuple(axes[a] for a in self.definition.var_axes)) if self._nearest
                           else (None, None))
            if state is not None:
                entry = Entry(state, BUCKETED, tuple(zip(want_out, self._out_dtypes)), rest)
        if self._memo < self._cache_size:
            table[sig] = entry
            self._memo += 1
            self._tell(sig, entry)
        return entry

    # -- slow paths of a call --------------------------------------------------------------
    def _miss(self, fallback: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
        self._misses += 1
        return fallback(*args, **(kwargs or {}))

    def _call_general(self, fallback: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Keyword arguments, or a destination-passing caller (inputs then outputs)."""
        call_args = self._bind(args, kwargs) if kwargs else args
        if call_args is not None and len(call_args) == self.n_in:
            return self.dispatch(lambda *_: fallback(*args, **kwargs), call_args, {})
        if call_args is None or len(call_args) != self._n_all:
            return self._miss(fallback, args, kwargs)
        try:
            sig = self._probe_all(call_args)
        except AttributeError:
            sig = None
        if sig is None:
            return self._miss(fallback, args, kwargs)
        table = self._box[0]
        entry = table.get(sig) or self._resolve(table, sig)
        state = entry.state
        if state is None:
            return self._miss(fallback, args, kwargs)
        outs = call_args[self.n_in:]
        if state.mode is not None:
            return self._general_staged(state, entry, fallback, args, kwargs, call_args)
        try:
            if state.dps:
                state.fn(*call_args)
                result: Any = outs
            else:
                result = self._normalize(state.fn(*call_args[: self.n_in]))
            ok = not state.check_left or self._outputs_ok(state, result)
            if ok and not state.dps:
                for out, value in zip(outs, (result,) if self.n_out == 1 else result):
                    out.copy_(value)
        except Exception as e:  # noqa: BLE001 - the safety net: a failing substitute never reaches the caller
            return self._raised(state, e, fallback, args, kwargs)
        if not ok:
            return self._failed(state, "returned non-finite outputs", fallback, args, kwargs)
        state.calls += 1
        self.counts[entry.kind] += 1
        return outs[0] if self.n_out == 1 else tuple(outs)

    def _call_slow(self, state: SolutionState, entry: Entry, fallback: Callable[..., Any], args: tuple) -> Any:
        """The hot path's branch for states that are not a plain value-returning hit."""
        if state.mode is None:
            return self._call_dps_winner(state, entry, fallback, args)
        return self._staged(state, entry, args, lambda: self._baseline(entry, fallback, args))

    def _call_dps_winner(self, state: SolutionState, entry: Entry, fallback: Callable[..., Any], args: tuple) -> Any:
        """A value-returning caller served by a destination-passing solution: allocate its outputs."""
        try:
            device = args[self._first].device
            outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in entry.outs]
            state.fn(*args, *outs)
            result: Any = outs[0] if self.n_out == 1 else tuple(outs)
            ok = not state.check_left or self._outputs_ok(state, result)
        except Exception as e:  # noqa: BLE001 - the safety net, as above
            return self._raised(state, e, fallback, args, {})
        if not ok:
            return self._failed(state, "returned non-finite outputs", fallback, args, {})
        state.calls += 1
        self.counts[entry.kind] += 1
        return result

    def _outputs_ok(self, state: SolutionState, result: Any) -> bool:
        """NaN/Inf check of a substituted call (while the solution's check budget lasts)."""
        if not _all_finite(result):
            return False
        if state.check_left > 0:
            state.check_left -= 1
            if state.check_left == 0:  # its calls need no more checks: the C++ hit path may serve them
                self._mirror()
        return True

    def _normalize(self, result: Any) -> Any:
        """A value-returning solution's result as the fallback would give it: a tensor, or a tuple."""
        if isinstance(result, dict):
            result = [result[n] for n in self._names[self.n_in:]]
        if isinstance(result, (list, tuple)):
            return result[0] if self.n_out == 1 else tuple(result)
        return result

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """Keyword arguments placed in definition order; None when they do not fit the definition."""
        names = self._names[len(args):]
        if set(kwargs) - set(names):
            return None
        bound = [kwargs[n] for n in names if n in kwargs]
        if len(bound) != len(kwargs) or names[: len(bound)] != tuple(n for n in names if n in kwargs):
            return None
        return (*args, *bound)

    def _failed(self, state: SolutionState, why: str, fallback: Callable[..., Any], args: tuple,
                kwargs: dict[str, Any]) -> Any:
        """The substitute failed this call: switch it off, answer with the fallback."""
        self.fallbacks += 1
        self._on_failure(state, why)
        return fallback(*args, **kwargs)

    def _raised(self, state: SolutionState, e: Exception, fallback: Callable[..., Any], args: tuple,
                kwargs: dict[str, Any]) -> Any:
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise e  # a capture cannot fall back; the caller's graph is already broken
        return self._failed(state, f"raised {type(e).__name__}: {e}", fallback, args, kwargs)


def _pick(states: list[SolutionState]) -> tuple[SolutionState | None, SolutionState | None]:
    """(the state that takes a key's calls, the default that answers the calls it does not).

    A staged (shadow or canary) solution goes first wherever it is verified, even when a default
    is faster there: it is being evaluated, and a slower one is demoted by its P99. Among the
    staged, and among the defaults, the fastest comes first.
    """
    live = [s for s in states if s.disabled is None]
    staged = next((s for s in live if s.mode is not None), None)
    plain = next((s for s in live if s.mode is None), None)
    return (staged, plain) if staged is not None else (plain, None)


def _distance(a: Key, b: Key) -> float:
    """Distance between two keys: sum over axes of |log2(1 + a) - log2(1 + b)|."""
    return sum(abs(math.log2(1 + x) - math.log2(1 + y)) for x, y in zip(a, b))
