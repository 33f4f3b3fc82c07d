"""Where a result was computed: software versions and hardware, for every report ssmquant writes."""

from __future__ import annotations

import importlib
import platform

import torch

from . import __version__

DEFAULT_PACKAGES = ("torch", "triton", "transformers")


def environment(device: torch.device | str, *, packages=DEFAULT_PACKAGES, **extra) -> dict:
    """{ssmquant, python, <package versions>, device, gpu | cpu_threads, **extra} of this process."""
    device = torch.device(device)
    env = {"ssmquant": __version__, "python": platform.python_version()}
    for name in packages:
        try:
            env[name] = importlib.import_module(name).__version__
        except ImportError:
            env[name] = None
    env["device"] = str(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_threads"] = torch.get_num_threads()
    env.update(extra)
    return env
