"""Builders: turn a Solution into a Runnable, cached by content hash."""

from fibray.build import python as _python  # noqa: F401  (registers python and triton)
from fibray.build.base import BuildCache, BuildError, Runnable, builder_for, register_builder
from fibray.build.python import build_reference
from fibray.build.triton_interp import patch_interpreter_casts, prepare_triton
from fibray.build.cuda import DeviceRequired, bind  # registers cuda and cpp

__all__ = [
    "BuildCache", "BuildError", "Runnable", "build_reference", "builder_for",
    "patch_interpreter_casts", "prepare_triton", "register_builder",
    "DeviceRequired", "bind",
]
