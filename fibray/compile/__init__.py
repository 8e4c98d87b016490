"""Builders: turn a Solution into a Runnable, cached by content hash."""

from fibray.compile import python as _python  # noqa: F401  (registers python and triton)
from fibray.compile.base import (BuildCache, BuildError, Runnable, bound_log, builder_for, format_raised,
                                 raised_type, register_builder)
from fibray.compile.python import build_reference
from fibray.compile.triton_interp import patch_interpreter_casts, prepare_triton
from fibray.compile.cuda import DeviceRequired, bind  # registers cuda and cpp

__all__ = [
    "BuildCache", "BuildError", "Runnable", "bound_log", "build_reference", "builder_for", "format_raised", "raised_type",
    "patch_interpreter_casts", "prepare_triton", "register_builder",
    "DeviceRequired", "bind",
]
