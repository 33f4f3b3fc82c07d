"""How much memory is free on a device, and the error a run that does not fit raises.

The bottom of the package's sizing: ``models`` (placement, capture, building) and ``sizing`` (the estimates of
whole runs) both read the free memory here.
"""

from __future__ import annotations

import os
import pathlib

import torch

from .errors import SsmquantError

GIB = 2**30


class SizingError(SsmquantError, ValueError):
    """A run will not fit in memory; the message gives the estimate and what to lower."""


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes: CUDA's free memory, or for the CPU the host's available memory
    (MemAvailable, capped by a cgroup limit); None when it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_free_bytes()


def host_free_bytes() -> int | None:
    """The host's available memory in bytes (MemAvailable, capped by a cgroup limit); None when unreadable."""
    avail = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    limit = _cgroup_room()
    return avail if limit is None else min(avail, limit)


def _cgroup_room() -> int | None:
    """Bytes left under this process' cgroup memory limit (v2 or v1), None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = pathlib.Path(limit_file).read_text().strip()
            usage = int(pathlib.Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def format_bytes(n: float) -> str:
    """'12.3 GiB', '1.5 TiB', '640 MiB'."""
    if n >= 1024 * GIB:
        return f"{n / (1024 * GIB):.1f} TiB"
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"
