"""Writing the agent's own files whole: a reader sees the old contents or the new, never a part.

Every file the agent rewrites in place (the memory-cap checkpoint, the record of carried-out
assignments, held GPU faults, clear requests, the staged interposer, a region's ld.so.preload) goes
through write_atomically: the data is written and fsynced into ``.<name>.<pid>.tmp`` beside the
file, then renamed over it. A temporary file a killed agent left behind has that name, which is how
gpunode.node.memcap.checkpoint.remove_stale_temp_files recognises it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def temp_path(path: Path) -> Path:
    """Where write_atomically stages `path`: ``.<name>.<pid>.tmp`` in the same directory."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomically(
    path: Path, data: str | bytes, *, mode: int | None = None, sync_dir: bool = False
) -> None:
    """Replace `path` with `data` (str as UTF-8) in one rename, with `mode` if given; the temporary file
    is removed when anything fails. With sync_dir the directory is fsynced too, so the rename survives
    a power loss. Raises OSError."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
