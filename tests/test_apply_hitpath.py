"""apply's compiled hit path: it builds, it routes every call as the Python dispatch does, its
counters stay exact, and where it cannot be built apply keeps working on the Python path.

No sweep here: Dispatchers are built straight from a definition and plain Python solutions
(tests/test_apply.py covers the same paths end to end, from a real store).
"""

from __future__ import annotations

import inspect
import logging
import shutil
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fibray.apply import apply, native
from fibray.apply.dispatch import Dispatcher, SolutionState
from fibray.apply.hooks import set_runtime
from fibray.schema import Definition

H = 4
MEASURED_N = 2
DEFINITION = Definition.model_validate({
    "name": "hitpath_scale_h4", "op_type": "scale", "description": "y = x * w (hit path tests).",
    "axes": {"n": {"type": "var"}, "h": {"type": "const", "value": H}},
    "inputs": {"x": {"shape": ["n", "h"], "dtype": "float32"}, "w": {"shape": ["h"], "dtype": "float32"}},
    "outputs": {"y": {"shape": ["n", "h"], "dtype": "float32"}},
    "reference": "import torch\n\ndef run(x, w):\n    return x * w\n",
})


class Served:
    """Which function answered each call."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def value(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 100:
            raise ValueError("range not supported")
        self.log.append("solution")
        return x * w

    def into(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        self.log.append("solution")
        torch.mul(x, w, out=y)

    def fallback(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.log.append("fallback")
        return torch.mul(x, w, out=y) if y is not None else x * w


def dispatcher(served: Served, *, compiled: bool, dps: bool = False, check_calls: int | None = 0) -> Dispatcher:
    """One definition, one solution measured at n=MEASURED_N; a failure switches it off as the runtime does."""
    state = SolutionState("sol", "hash", served.into if dps else served.value, dps, check_calls)

    def switch_off(s: SolutionState, why: str) -> None:
        s.disabled = why
        d.compile()

    d = Dispatcher(DEFINITION, {(MEASURED_N,): [state]}, {}, on_failure=switch_off, nearest=True, cuda=False,
                   cache_size=64, compiled=compiled)
    return d


def counters(d: Dispatcher) -> tuple[int, ...]:
    d.sync_counters()
    state = d.ranked[(MEASURED_N,)][0]
    return d.hits, d.bucketed, d.misses, d.fallbacks, state.calls


class Subclass(torch.Tensor):
    """A tensor subclass: the compiled path leaves it to the Python path."""


def x_(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, H, dtype=dtype)


W = torch.randn(H)
CALLS: dict[str, Callable[[Dispatcher, Callable[..., Any]], Any]] = {
    "hit": lambda d, fb: d(fb, (x_(MEASURED_N), W), {}),
    "bucketed": lambda d, fb: d(fb, (x_(MEASURED_N + 1), W), {}),
    "wrong const axis": lambda d, fb: d(fb, (torch.randn(MEASURED_N, H + 1), torch.randn(H + 1)), {}),
    "other dtype": lambda d, fb: d(fb, (x_(MEASURED_N, torch.float64), W.double()), {}),
    "non-contiguous": lambda d, fb: d(fb, (torch.randn(H, MEASURED_N).t(), W), {}),
    "not a tensor": lambda d, fb: d(fb, (x_(MEASURED_N), 2.0), {}),
    "keyword": lambda d, fb: d(fb, (x_(MEASURED_N),), {"w": W}),
    "caller's outputs": lambda d, fb: d(fb, (x_(MEASURED_N), W, torch.empty(MEASURED_N, H)), {}),
    "parameter": lambda d, fb: d(fb, (x_(MEASURED_N), torch.nn.Parameter(W.clone(), requires_grad=False)), {}),
    "tensor subclass": lambda d, fb: d(fb, (x_(MEASURED_N).as_subclass(Subclass), W), {}),
    "requires grad, no_grad": lambda d, fb: d(fb, (x_(MEASURED_N).requires_grad_(), W), {}),
    "requires grad, autograd on": lambda d, fb: with_grad(lambda: d(fb, (x_(MEASURED_N).requires_grad_(), W), {})),
}
"""Calls of every kind a dispatcher must tell apart, all made under no_grad unless they say otherwise."""


def with_grad(call: Callable[[], Any]) -> Any:
    with torch.enable_grad():
        return call()


def route_all(d: Dispatcher, served: Served) -> list[str]:
    """Who answered each of CALLS."""
    routes = []
    for call in CALLS.values():
        before = len(served.log)
        with torch.no_grad():
            call(d, served.fallback)
        routes.append(served.log[before])
    return routes


requires_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler on this host")


@pytest.mark.slow
@requires_compiler
def test_compiled_hit_path_builds_where_a_compiler_is():
    assert native.hit_path_type() is not None


@pytest.mark.slow
@requires_compiler
@pytest.mark.parametrize("dps", [False, True], ids=["value-returning", "destination-passing"])
def test_compiled_and_python_dispatch_route_every_call_alike(dps):
    routes, stats = {}, {}
    for compiled in (True, False):
        served = Served()
        d = dispatcher(served, compiled=compiled, dps=dps)
        assert d.compiled is compiled
        routes[compiled], stats[compiled] = route_all(d, served), counters(d)
    expected = ["solution", "solution", "fallback", "fallback", "fallback", "fallback", "solution", "solution",
                "solution", "solution", "solution", "fallback"]
    assert routes[True] == routes[False] == expected
    hits = expected.count("solution") - 1
    assert stats[True] == stats[False] == (hits, 1, len(expected) - hits - 1, 0, hits + 1)


@pytest.mark.slow
@requires_compiler
def test_compiled_path_outputs_match_the_python_path():
    served = Served()
    x = x_(MEASURED_N)
    for dps in (False, True):
        compiled, python = dispatcher(served, compiled=True, dps=dps), dispatcher(served, compiled=False, dps=dps)
        y_compiled, y_python = compiled(served.fallback, (x, W), {}), python(served.fallback, (x, W), {})
        assert torch.equal(y_compiled, x * W) and torch.equal(y_python, x * W)
        assert y_compiled.dtype == torch.float32 and y_compiled.shape == (MEASURED_N, H)


@pytest.mark.slow
@requires_compiler
def test_counters_stay_exact_across_a_breaker_trip_on_the_compiled_path():
    served = Served()
    d = dispatcher(served, compiled=True)
    for _ in range(5):
        d(served.fallback, (x_(MEASURED_N), W), {})
    y = d(served.fallback, (x_(MEASURED_N) * 1000, W), {})   # the solution raises: fallback, switched off
    assert served.log[-1] == "fallback" and torch.isfinite(y).all()
    for _ in range(3):
        d(served.fallback, (x_(MEASURED_N), W), {})            # no live solution left: misses
    assert counters(d) == (5, 0, 3, 1, 5)
    assert d.ranked[(MEASURED_N,)][0].disabled.startswith("raised ValueError")


@pytest.mark.slow
@requires_compiler
def test_counters_stay_exact_when_the_output_check_budget_hands_calls_to_the_compiled_path():
    served = Served()
    d = dispatcher(served, compiled=True, check_calls=2)
    for _ in range(6):
        d(served.fallback, (x_(MEASURED_N), W), {})
    state = d.ranked[(MEASURED_N,)][0]
    assert state.check_left == 0 and counters(d) == (6, 0, 0, 0, 6)


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_apply_uses_the_python_dispatch_when_the_hit_path_cannot_be_built(compiler, monkeypatch, tmp_path, caplog):
    cxx = str(tmp_path / "no-such-compiler") if compiler == "missing" else shutil.which("false") or "/bin/false"
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    native.hit_path_type.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fibray.apply.native"):
            served = Served()
            d = dispatcher(served, compiled=True)
        assert not d.compiled
        assert "compiled hit path is unavailable" in caplog.text and cxx in caplog.text
        d(served.fallback, (x_(MEASURED_N), W), {})
        assert served.log == ["solution"] and counters(d) == (1, 0, 0, 0, 1)
    finally:
        native.hit_path_type.cache_clear()  # later tests load the real build again


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_decorated_function_keeps_its_signature_keywords_and_defaults(compiled):
    served = Served()
    d = dispatcher(served, compiled=compiled and native.hit_path_type() is not None)

    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return served.fallback(x, w)

    def scale_with_default(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return served.fallback(x, w, y)

    f, g = apply(DEFINITION.name)(scale), apply(DEFINITION.name)(scale_with_default)
    assert list(inspect.signature(f, follow_wrapped=False).parameters) == ["x", "w"]
    set_runtime(SimpleNamespace(dispatch_functions={DEFINITION.name: d.dispatch}, dispatchers={DEFINITION.name: d}))
    try:
        x = x_(MEASURED_N)
        assert torch.equal(f(x, w=W), x * W) and torch.equal(g(x, W), x * W)   # defaults left unpassed
        assert served.log == ["solution", "solution"]
        g(x, W, torch.empty(MEASURED_N, H))                                       # inputs then outputs
        assert served.log == ["solution"] * 3
    finally:
        set_runtime(None)
    f(x, W)
    assert served.log[-1] == "fallback"
