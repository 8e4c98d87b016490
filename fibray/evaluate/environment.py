"""The device a process evaluates on and the versions that make up its environment.

Light on purpose: apply() imports it to key artifacts without pulling in the judge, the
checks or the timer.
"""

from __future__ import annotations

import platform

import torch

from fibray import __version__
from fibray.schema import Environment


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def environment(device: torch.device) -> Environment:
    """Hardware name and library versions of this process."""
    import triton

    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    libs = {"fibray": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}
    if torch.version.cuda:
        libs["cuda"] = torch.version.cuda
    return Environment(hardware=hw, libs=libs)
