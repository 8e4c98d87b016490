"""`apply`: wrap a known-good implementation so that verified kernels can take its calls.

Decorator form: ``@apply("rmsnorm_h4096")`` or ``@apply(lambda x, w: f"rmsnorm_h{x.shape[-1]}")``.
Function form: ``apply("rmsnorm_h4096", args=(x, w), fallback=rmsnorm)``. With nothing
enabled the wrapped function is called directly, after a single flag test.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, TypeVar, Union, overload

from fibray.apply.hooks import HOOKS

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
Target = Union[str, Callable[..., str]]
"""A definition name, or a resolver called with the call's arguments that returns one."""

_resolver_errors: set[int] = set()


def _route(target: Target, fallback: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Trace the call if a tracer is active, then dispatch it if a runtime is active."""
    if isinstance(target, str):
        name: Optional[str] = target
    else:
        try:
            name = target(*args, **kwargs)
        except Exception as e:  # a broken resolver must not break a program that works without apply
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
    target: Target, *, args: tuple = ..., kwargs: Optional[dict[str, Any]] = ..., fallback: Callable[..., Any]
) -> Any: ...


def apply(
    target: Target,
    *,
    args: Optional[tuple] = None,
    kwargs: Optional[dict[str, Any]] = None,
    fallback: Optional[Callable[..., Any]] = None,
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
        hooks = HOOKS
        fixed = target if isinstance(target, str) else None

        @functools.wraps(fn)
        def wrapped(*call_args: Any, **call_kwargs: Any) -> Any:
            fast = hooks.fast
            if fast is not None and fixed is not None:  # apply on, no tracer, a named definition
                dispatch = fast.get(fixed)
                if dispatch is not None:
                    return dispatch(fn, call_args, call_kwargs)
            if not hooks.active:
                return fn(*call_args, **call_kwargs)
            return _route(target, fn, call_args, call_kwargs)

        wrapped.__fibray_target__ = target  # type: ignore[attr-defined]
        return wrapped  # type: ignore[return-value]

    return decorator
