"""File modes as the user's umask gives them: outputs are written in temporary directories (0700) and by libraries
that write 0600 (safetensors), which would hide results from colleagues on a shared machine."""

from __future__ import annotations

import os
import pathlib


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(root: pathlib.Path) -> None:
    """Give ``root`` and everything under it the modes a plain mkdir / open would: 0777 / 0666 (0777 for
    executables) less the umask. Temporary directories are created 0700 and safetensors files 0600,
    which would hide results from colleagues on a shared machine."""
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        full = 0o777 if (path.is_dir() or mode & 0o111) else 0o666
        path.chmod(full & ~mask)


__all__ = ["current_umask", "follow_umask"]
