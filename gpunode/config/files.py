"""Opening the files gpunode reads at run time without ever blocking on them.

A file that someone else can replace or hold (a web configuration, a TLS
certificate, a configuration file on SIGHUP, a tenant's usage file) must not
stall the reader: a FIFO put in its place blocks open() until a writer comes,
and a file lease (fcntl F_SETLEASE) taken by its owner blocks open() for the
kernel's lease-break time (45 s). So every such file is opened here with
O_NONBLOCK (a leased file then fails at once with EWOULDBLOCK, a FIFO opens
without waiting for a writer) and refused unless fstat says it is a regular
file. O_NONBLOCK changes nothing for reads of a regular file.

open_regular() returns a descriptor; read_regular() the contents, bounded.
Both raise OSError (errno and strerror set) so callers keep their one-line
messages: a non-regular file is EINVAL with strerror "not a regular file (a
FIFO)", a leased one EWOULDBLOCK with strerror "held by a file lease (another
process is using it)". This module reads nothing by itself and imports
nothing of gpunode.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["open_regular", "read_regular", "regular_path"]

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a plain file"


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file `path`, opened without blocking (see the module)."""
    try:
        fd = os.open(path, _FLAGS)
    except BlockingIOError:
        raise OSError(
            errno.EWOULDBLOCK, "held by a file lease (another process is using it)", os.fspath(path)
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({_kind(mode)})", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], limit_bytes: int) -> bytes:
    """At most `limit_bytes` + 1 bytes of the regular file `path` (one more tells a file over the limit)."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        left = limit_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def regular_path(fd: int) -> str:
    """A path that opens the same file as the descriptor `fd` (for APIs that take only a path)."""
    return f"/proc/self/fd/{fd}"
