"""The run sizes `analyze`, `eval` and `calibrate` take when the user names none: GPU-sized on a CUDA device,
CPU-sized otherwise (the GPU defaults take > 15 minutes for the shipped tiny model on 2 CPU cores). No torch
import: the command line reads these for its --help."""

from __future__ import annotations

# GPU: the sizes of the published studies. CPU: the README's main command.
GPU_DEFAULTS = {
    "analyze": {"steps": 4096, "batch": 8},
    "eval": {"steps": 512, "batch": 4},
    "calibrate": {"horizon": 4096, "batch": 4},
}
CPU_DEFAULTS = {
    "analyze": {"steps": 512, "batch": 4},
    "eval": {"steps": 256, "batch": 4},
    "calibrate": {"horizon": 512, "batch": 2},
}


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def default_sizes(command: str, device) -> dict[str, int]:
    """The default sizes of ``command`` ("analyze" | "eval" | "calibrate") for a run on ``device``."""
    table = GPU_DEFAULTS if _is_cuda(device) else CPU_DEFAULTS
    if command not in table:
        raise ValueError(f"unknown command {command!r}; accepted: {', '.join(table)}")
    return dict(table[command])


def describe_defaults(command: str, device, used: dict[str, int]) -> str:
    """One line naming the defaults taken on ``device`` and those of the other device type."""
    cuda = _is_cuda(device)
    other = CPU_DEFAULTS if cuda else GPU_DEFAULTS
    flags = lambda d: " ".join(f"--{k} {v}" for k, v in d.items())  # noqa: E731
    where = "a CUDA GPU" if cuda else "the CPU (no GPU in use)"
    there = "on CPU" if cuda else "on a GPU"
    return f"defaults for {where}: {flags(used)} ({there}: {flags(other[command])}; pass them to choose)"
