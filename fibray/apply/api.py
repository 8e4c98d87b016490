"""`apply`: wrap a known-good implementation so that verified kernels can take its calls.

Decorator form: ``@apply("rmsnorm_h4096")`` or ``@apply(lambda x, w: f"rmsnorm_h{x.shape[-1]}")``.
Function form: ``apply("rmsnorm_h4096", args=(x, w), fallback=rmsnorm)``. With nothing
enabled the wrapped function is called directly, after a slot read and a flag test.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar, overload

from fibray.apply.hooks import HOOKS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
Target = str | Callable[..., str]
"""A definition name, or a resolver called with the call's arguments that returns one."""

_resolver_errors: set[int] = set()

_NO_KWARGS: dict[str, Any] = {}
"""The kwargs of every call through a plain-signature wrapper; dispatch only reads it."""

_WRAPPER = '''\
def make(_fibray_fn, _fibray_slot, _fibray_hooks, _fibray_route, _fibray_target, _fibray_no_kwargs):
    def wrapped({params}):
        _fibray_dispatch = _fibray_slot[0]
        if _fibray_dispatch is not None:  # a runtime serves this definition and no tracer is on
            return _fibray_dispatch(_fibray_fn, {args}, {kwargs})
        if _fibray_hooks.active:
            return _fibray_route(_fibray_target, _fibray_fn, {args}, {route_kwargs})
        return _fibray_fn({call})
    return wrapped
'''
_PLAIN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _plain_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """fn's signature without annotations when the wrapper can copy it (every parameter
    positional and without a default, so every call passes all of them, in order); else None."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or a callable without a readable signature
        return None
    params = list(sig.parameters.values())
    if any(p.kind not in _PLAIN or p.default is not p.empty or p.name.startswith("_fibray_") for p in params):
        return None
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in params], return_annotation=sig.empty)


def _wrapper(fn: Callable[..., Any], target: Target) -> Callable[..., Any]:
    """The decorated function. It takes fn's own parameters where it can, so that a call packs
    no *args/**kwargs (on a hit that packing would cost as much as the dispatch itself), reads
    its definition's slot, and hands the call to that dispatch, to the route, or to fn."""
    sig = _plain_signature(fn)
    if sig is None:
        fields = {"params": "*args, **kwargs", "args": "args", "kwargs": "kwargs", "route_kwargs": "kwargs",
                  "call": "*args, **kwargs"}
    else:
        names = list(sig.parameters)
        fields = {"params": str(sig)[1:-1], "args": f"({''.join(n + ', ' for n in names)})",
                  "kwargs": "_fibray_no_kwargs", "route_kwargs": "{}", "call": ", ".join(names)}
    scope: dict[str, Any] = {}
    # the source is our template and parameter names that inspect read: no caller-supplied text
    exec(compile(_WRAPPER.format(**fields), f"<fibray.apply wrapper of {fn!r}>", "exec"), scope)  # noqa: S102
    slot = HOOKS.slot(target) if isinstance(target, str) else [None]  # a resolver: every call routes
    return scope["make"](fn, slot, HOOKS, _route, target, _NO_KWARGS)


def _route(target: Target, fallback: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Trace the call if a tracer is active, then dispatch it if a runtime is active."""
    if isinstance(target, str):
        name: str | None = target
    else:
        try:
            name = target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a broken resolver must not break a program that works without apply
            if id(target) not in _resolver_errors:
                _resolver_errors.add(id(target))
                log.warning("apply: resolver %r raised %s: %s; its calls use the fallback", target, type(e).__name__, e)
            name = None
    tracer = HOOKS.tracer
    if tracer is not None and name is not None:
        tracer.collect(name, args, kwargs)
    runtime = HOOKS.runtime
    if runtime is None or name is None:
        return fallback(*args, **kwargs)
    dispatcher = runtime.dispatchers.get(name)
    if dispatcher is None:
        runtime.count_unknown(name)
        return fallback(*args, **kwargs)
    return dispatcher.dispatch(fallback, args, kwargs)


@overload
def apply(target: Target) -> Callable[[F], F]: ...


@overload
def apply(
    target: Target, *, args: tuple = ..., kwargs: dict[str, Any] | None = ..., fallback: Callable[..., Any]
) -> Any: ...


def apply(
    target: Target,
    *,
    args: tuple | None = None,
    kwargs: dict[str, Any] | None = None,
    fallback: Callable[..., Any] | None = None,
) -> Any:
    """Route calls to the fastest verified solution of a definition, or to the known-good function.

    The wrapped function must take the definition's inputs in order (value-returning) or its
    inputs then its outputs (destination-passing); it is the fallback on a miss, when apply is
    disabled, and whenever a substituted solution fails.
    """
    if args is not None or kwargs is not None or fallback is not None:
        if fallback is None:
            raise TypeError("apply(): the function form needs fallback=, the known-good implementation")
        return _route(target, fallback, tuple(args or ()), dict(kwargs or {}))

    def decorator(fn: F) -> F:
        wrapped = functools.update_wrapper(_wrapper(fn, target), fn)
        wrapped.__fibray_target__ = target  # type: ignore[attr-defined]
        return wrapped  # type: ignore[return-value]

    return decorator
