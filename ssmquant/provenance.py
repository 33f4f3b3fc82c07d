"""Where a result was computed: software versions and hardware, for every report ssmquant writes."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from . import __version__

DEFAULT_PACKAGES = ("torch", "triton", "transformers")
# import name -> distribution name, where they differ (importlib.metadata.packages_distributions() would find
# it, but scans every installed package: ~0.5 s)
DISTRIBUTIONS = {"modelopt": "nvidia-modelopt"}


def package_version(name: str) -> str | None:
    """The version of an installed package, None when absent. Read from the loaded module when it is
    imported, else from its installed metadata: no import, so that naming transformers in a report of a
    run that never loads a checkpoint does not cost its import (about 0.4 s)."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "__version__"):
        return module.__version__
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str, *, packages=DEFAULT_PACKAGES, **extra) -> dict:
    """{ssmquant, python, <package versions>, device, gpu | cpu_threads, **extra} of this process."""
    device = torch.device(device)
    env = {"ssmquant": __version__, "python": platform.python_version()}
    for name in packages:
        env[name] = package_version(name)
    env["device"] = str(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_threads"] = torch.get_num_threads()
    env.update(extra)
    return env
