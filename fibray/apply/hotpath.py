"""The generated per-definition call path: guards, signature, table lookup, call, all in one function.

A generic loop over a definition's inputs costs more than the attribute reads it makes, so
the hot path is generated once per definition with the inputs unrolled, the way
`dataclasses` generates `__init__`. Only the common case lives here (positional inputs,
value-returning caller); everything else calls back into the Dispatcher's plain methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_TEMPLATE = '''\
def dispatch(fallback, args, kwargs):
    if kwargs or len(args) != {n_in}:
        return general(fallback, args, kwargs)
    {unpack} = args
    try:
        if {guards}:
            return miss(fallback, args)
        sig = ({shapes},)
    except AttributeError:  # a tensor input given as something else
        return miss(fallback, args)
    if grad_enabled() and ({grads}):  # a kernel has no backward: never substitute under autograd
        return miss(fallback, args)
    table = box[0]
    entry = table.get(sig)
    if entry is None:
        entry = resolve(table, sig)
    state = entry.state
    if state is None:
        return miss(fallback, args)
    if state.slow:  # destination-passing, or staged (shadow / canary): never a default hit
        return call_slow(state, entry, fallback, args)
    try:
        result = state.fn(*args)
        if {normalize_if}:
            result = normalize(result)
        if state.check_left and not outputs_ok(state, result):
            return failed(state, "returned non-finite outputs", fallback, args, kwargs)
    except Exception as e:  # the safety net: a failing substitute never reaches the caller
        return raised(state, e, fallback, args, kwargs)
    state.calls += 1
    counts[entry.kind] += 1
    return result
'''


def _guard_conditions(tensors: list[str], cuda: bool) -> list[str]:
    """Source of the conditions under which a call misses: tensor k (named tensors[k]) is not of
    dtype Dk or not contiguous, or (on CUDA) the first is not on the GPU."""
    conds = [f"{a}.dtype is not D{k}" for k, a in enumerate(tensors)] + [f"not {a}.is_contiguous()" for a in tensors]
    if cuda:
        conds.append(f"not {tensors[0]}.is_cuda")
    return conds


def generate(
    n_in: int,
    guard: list[tuple[int, torch.dtype]],
    *,
    single_output: bool,
    cuda: bool,
    env: dict[str, Any],
) -> Callable[[Callable[..., Any], tuple, dict[str, Any]], Any]:
    """The dispatch function of one definition.

    guard: (input position, dtype) of every tensor input. env: the callables and state the
    function uses (general, miss, resolve, call_slow, normalize, outputs_ok, failed,
    raised, box, counts). For inputs (x: float32, w: float32) the guards read:

        if a0.dtype is not D0 or a1.dtype is not D1 or not a0.is_contiguous() or not a1.is_contiguous():
    """
    names = [f"a{i}" for i in range(n_in)]
    tensors = [names[i] for i, _ in guard]
    conds = _guard_conditions(tensors, cuda)
    source = _TEMPLATE.format(
        n_in=n_in,
        unpack=", ".join(names) + ("," if n_in == 1 else ""),
        guards=" or ".join(conds),
        shapes=", ".join(f"{a}.shape" for a in tensors),
        grads=" or ".join(f"{a}.requires_grad" for a in tensors),
        normalize_if="type(result) is not Tensor" if single_output else "True",
    )
    scope = {**env, "grad_enabled": torch.is_grad_enabled, "Tensor": torch.Tensor,
             **{f"D{k}": dtype for k, (_, dtype) in enumerate(guard)}}
    exec(compile(source, f"<fibray.apply dispatch of {n_in} inputs>", "exec"), scope)  # noqa: S102 - our template
    return scope["dispatch"]


def make_probe(guard: list[tuple[int, torch.dtype]], cuda: bool) -> Callable[[tuple], Any]:
    """For the slower paths (destination-passing callers): the shapes of `args`, or None when a guard fails."""
    names = [f"a{k}" for k in range(len(guard))]
    conds = _guard_conditions(names, cuda)
    source = "\n".join([
        "def probe(args):",
        "    " + "; ".join(f"{a} = args[{i}]" for a, (i, _) in zip(names, guard)),
        f"    if {' or '.join(conds)}:",
        "        return None",
        f"    if grad_enabled() and ({' or '.join(f'{a}.requires_grad' for a in names)}):",
        "        return None",
        f"    return ({''.join(f'{a}.shape, ' for a in names)})",
    ])
    scope: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled, **{f"D{k}": d for k, (_, d) in enumerate(guard)}}
    exec(compile(source, f"<fibray.apply probe of {len(guard)} tensors>", "exec"), scope)  # noqa: S102 - our template
    return scope["probe"]
